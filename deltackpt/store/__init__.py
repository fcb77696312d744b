"""A store of snapshots: the only code that knows the store's layout and touches its bytes.

From the bottom up:

- ``storage.py``: the :class:`Storage` seam (every operation the store asks of storage) and the
  store's keys; ``durable.py``: local fsync, atomic publish and the flock store lock;
  ``local.py``: :class:`LocalStorage`, a store in a local directory; ``objstore.py``:
  :class:`FsspecStorage`, a store in an object store (``s3://``, ``gs://``, ``az://``, ``memory://``),
  whose calls run under deadlines (``objcalls.py``, :class:`StoreTimeouts`); ``objreads.py``
  and ``uploads.py`` are its ranged reads and pack uploads.
- ``packs.py``: pack objects (PackWriter, PackReaders, ``<id>.pack`` names, PACK_ALIGN);
  ``chunks.py``: read, decode and verify chunks.
- ``config.py`` (STORE.json), ``location.py`` (what ``open_store``'s path names),
  ``snapshot.py`` (names, SnapshotInfo), ``store.py`` (Store, open_store, manifests, commit).
- ``lifecycle.py`` (list, delete, gc) and ``verify.py`` (verify).
"""

from __future__ import annotations

from deltackpt.store.local import LocalStorage
from deltackpt.store.objcalls import StoreTimeouts
from deltackpt.store.objstore import FsspecStorage, NoLockError
from deltackpt.store.storage import Storage
from deltackpt.store.store import SnapshotInfo, Store, open_store

__all__ = [
    "FsspecStorage",
    "LocalStorage",
    "NoLockError",
    "SnapshotInfo",
    "Storage",
    "Store",
    "StoreTimeouts",
    "open_store",
]

"""A directory of snapshots: the only code that knows the store's file names and layout.

``store.py`` (Store, open_store, STORE.json, manifests), ``packs.py`` (pack files),
``chunks.py`` (read, decode and verify chunks), ``durable.py`` (fsync, atomic publish, locks),
``lifecycle.py`` (list, delete, gc, verify).
"""

from __future__ import annotations

from deltackpt.store.store import SnapshotInfo, Store, open_store

__all__ = ["SnapshotInfo", "Store", "open_store"]

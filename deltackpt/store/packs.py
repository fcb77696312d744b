"""Pack files: large append-only objects holding chunk payloads, and their names.

A pack starts with the 8-byte magic ``DCKPACK\\x01`` padded to ``PACK_ALIGN``; every payload starts
at a multiple of ``PACK_ALIGN`` and is followed by zero padding. Packs carry no index of their own:
the manifests say which (offset, length) of which pack holds which chunk. A save writes one pack per
writer thread, so a save creates O(threads) objects, not O(tensors). Packs are never modified after
the save that wrote them; gc deletes or rewrites whole packs.

Pack ids come from manifests, which are untrusted: :func:`pack_name` (the one place a pack's name
``<id>.pack`` is built) refuses anything but a pack id, so a key stays in ``packs/``. Bytes go
through a :class:`~deltackpt.store.storage.Storage`; a local ``packs/`` directory may still be
passed as a ``Path``.
"""

from __future__ import annotations

import contextlib
import os
import threading
import uuid
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from deltackpt.errors import StoreError, UnsafePathError
from deltackpt.format.manifest import PACK_ID_RE
from deltackpt.store.local import LocalStorage
from deltackpt.store.storage import PACKS, RangeReader, Storage

PACK_ALIGN = 4096  # chunk payloads start at multiples of this (O_DIRECT-friendly)
PACK_MAGIC = b"DCKPACK\x01"
PACK_SUFFIX = ".pack"
_ZEROS = bytes(PACK_ALIGN)


def new_pack_id() -> str:
    return uuid.uuid4().hex[:20]


def pack_name(pack_id: str) -> str:
    """``<id>.pack``, the name of pack ``pack_id`` under ``packs/``. Refuses (UnsafePathError) an
    id that is not a pack id: ids come from manifests and must never leave ``packs/``."""
    if not isinstance(pack_id, str) or not PACK_ID_RE.match(pack_id):
        raise UnsafePathError(
            f"pack id {str(pack_id)[:80]!r} is not a pack id; refusing to build a path from it"
        )
    return f"{pack_id}{PACK_SUFFIX}"


def pack_key(pack_id: str) -> str:
    """The storage key of pack ``pack_id``: ``packs/<id>.pack``."""
    return f"{PACKS}/{pack_name(pack_id)}"


def pack_id_of(name: str) -> str | None:
    """The pack id of a name listed under ``packs/``, or None if no save writes that name."""
    pack = name.removesuffix(PACK_SUFFIX)
    return pack if name.endswith(PACK_SUFFIX) and PACK_ID_RE.match(pack) else None


def _locate(where: Storage | str | os.PathLike[str]) -> tuple[Storage, str]:
    """(storage, prefix of the packs): a Storage holds them under ``packs/``; a local path is
    the packs directory itself."""
    if isinstance(where, (str, os.PathLike)):
        p = Path(where)
        return LocalStorage(p.parent), p.name
    return where, PACKS


class PackWriter:
    """Appends payloads to one new pack. One writer per thread; not thread-safe itself."""

    def __init__(
        self,
        storage: Storage | str | os.PathLike[str],
        fsync: bool = True,
        pack_id: str | None = None,
    ) -> None:
        self.storage, prefix = _locate(storage)
        self.pack_id = pack_id or new_pack_id()
        self.key = f"{prefix}/{pack_name(self.pack_id)}"
        self._fsync = fsync
        self._out = self.storage.create(self.key)
        try:
            self._out.write(
                [memoryview(PACK_MAGIC), memoryview(_ZEROS)[: PACK_ALIGN - len(PACK_MAGIC)]]
            )
        except BaseException:  # e.g. ENOSPC: the caller never gets a writer to abort
            self._out.abort()
            self.storage.delete(self.key)
            raise
        self.pos = PACK_ALIGN

    @property
    def path(self) -> Path:
        """The pack's file (local storage only: prefer :meth:`discard` to remove it)."""
        where = self.storage.where(self.key)
        if "://" in where:
            raise StoreError(f"pack {where} is in an object store: it has no local path")
        return Path(where)

    def append(self, payload: memoryview) -> tuple[int, int]:
        """Write ``payload`` at the next aligned offset; return ``(offset, length)``."""
        offset, n = self.pos, len(payload)
        pad = -n % PACK_ALIGN
        self._out.write([payload, memoryview(_ZEROS)[:pad]] if pad else [payload])
        self.pos += n + pad
        return offset, n

    def finish(self) -> int:
        """Complete (fsync unless the writer was made with ``fsync=False``); return the pack's
        size in bytes. The pack's *name* is durable after ``storage.sync("packs")``."""
        self._out.finish(self._fsync)
        return self.pos

    def abort(self) -> None:
        """Stop writing; the partial pack stays until :meth:`discard` (or gc) removes it."""
        self._out.abort()

    def discard(self) -> None:
        """Abort and remove the partial pack (an already removed one is fine)."""
        self.abort()
        with contextlib.suppress(FileNotFoundError):
            self.storage.delete(self.key)


class PackReaders:
    """Open packs shared by a load's reader threads: each pack is opened once, on first use,
    through the storage's ranged reader (the local one copies out of a memory map)."""

    def __init__(self, storage: Storage | str | os.PathLike[str]) -> None:
        self._storage, self._prefix = _locate(storage)
        self._readers: dict[str, RangeReader] = {}
        self._lock = threading.Lock()

    def reader(self, pack: str) -> RangeReader:
        """The open reader of ``pack``. FileNotFoundError when it is missing; UnsafePathError
        when the id is not a pack id, or the pack is a symlink or not a regular file."""
        r = self._readers.get(pack)
        if r is None:
            with self._lock:
                r = self._readers.get(pack)
                if r is None:
                    r = self._storage.open_reader(f"{self._prefix}/{pack_name(pack)}")
                    self._readers[pack] = r
        return r

    def read_into(self, pack: str, offset: int, out: np.ndarray) -> int:
        """Fill ``out`` (uint8, contiguous) from ``pack`` at ``offset``; return bytes read."""
        return self.reader(pack).read_into(offset, [memoryview(out).cast("B")])

    def readv_into(self, pack: str, offset: int, bufs: Sequence[memoryview]) -> int:
        """Fill ``bufs`` (byte memoryviews) in order from ``pack`` at ``offset``; return bytes
        read (less than their total only at the end of the pack)."""
        return self.reader(pack).read_into(offset, bufs)

    def view(self, pack: str, offset: int, n: int) -> np.ndarray | None:
        """``n`` bytes of ``pack`` at ``offset`` without a copy (a read-only array over the
        local pack's memory map, alive after :meth:`close` while it is held), or None where
        that cannot be had (an object store, a pack that cannot be opened or mapped, or that
        ends first): the caller reads the bytes instead, and that read reports any damage."""
        try:
            fn = getattr(self.reader(pack), "view", None)
        except (OSError, UnsafePathError):
            return None
        return fn(offset, n) if fn is not None else None

    def close(self) -> None:
        with self._lock:
            for r in self._readers.values():
                r.close()
            self._readers.clear()

    def __enter__(self) -> PackReaders:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

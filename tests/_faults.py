"""Storage faults for tests, injected through the store's seam, never by patching module paths.

A store opened with ``open_store(path, storage=...)`` sends every byte through that storage, so a
test opens one whose steps fail (or report) and saves into it::

    st = faulty_store(path, on_write=fail_after(3))           # pack payload writes fail
    st = faulty_store(path, ops=DurableOps(publish=eio))       # the manifest commit fails
    deltackpt.save(state, st, "name")

:class:`FaultyStorage` is a :class:`~deltackpt.store.local.LocalStorage` whose new objects (packs)
call ``on_write(key, n)`` before their ``n``-th write (0 is a pack's header) and
``on_finish(key)`` before they are finished (the pack fsync); either may raise. ``ops`` replaces
the two steps of a commit (:class:`~deltackpt.store.local.DurableOps`).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path

import deltackpt
from deltackpt.store.local import DurableOps, LocalStorage
from deltackpt.store.storage import ObjectWriter
from deltackpt.store.store import Store

OnWrite = Callable[[str, int], None]
OnFinish = Callable[[str], None]


class FaultyStorage(LocalStorage):
    """A LocalStorage that runs ``on_write`` / ``on_finish`` before those steps of every object
    it creates (see the module docstring)."""

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        ops: DurableOps | None = None,
        on_write: OnWrite | None = None,
        on_finish: OnFinish | None = None,
    ) -> None:
        super().__init__(root, ops=ops)
        self.on_write = on_write
        self.on_finish = on_finish

    def create(self, key: str) -> ObjectWriter:  # type: ignore[override]
        return _FaultyWriter(super().create(key), key, self)


class _FaultyWriter:
    def __init__(self, inner: ObjectWriter, key: str, storage: FaultyStorage) -> None:
        self.inner, self.key, self.storage = inner, key, storage
        self.writes = 0

    def write(self, bufs: Sequence[memoryview]) -> None:
        n, self.writes = self.writes, self.writes + 1
        if self.storage.on_write is not None:
            self.storage.on_write(self.key, n)
        self.inner.write(bufs)

    def finish(self, durable: bool) -> None:
        if self.storage.on_finish is not None:
            self.storage.on_finish(self.key)
        self.inner.finish(durable)

    def abort(self) -> None:
        self.inner.abort()


def faulty_store(
    path: str | os.PathLike[str],
    *,
    ops: DurableOps | None = None,
    on_write: OnWrite | None = None,
    on_finish: OnFinish | None = None,
) -> Store:
    """The store at ``path`` through a :class:`FaultyStorage` (a Store of its own: the shared
    ``open_store(path)`` is untouched). Close its save engine with :func:`close_store`."""
    storage = FaultyStorage(path, ops=ops, on_write=on_write, on_finish=on_finish)
    return deltackpt.open_store(Path(path), storage=storage)


def close_store(st: Store) -> None:
    """Stop the save engine (threads, staging buffers) of a store opened with its own storage."""
    from deltackpt.saving.engine import saver_for

    saver_for(st).close()


def flip_chunk_bytes(store: str | Path, name: str | None = None, xor: int = 0xFF) -> None:
    """Damage every chunk of snapshot ``name`` (None: of every snapshot): one byte in the
    middle of each, XORed with ``xor``, in its pack file (as bit rot on disk would)."""
    st = deltackpt.open_store(store, create=False)
    names = [name] if name is not None else [i.name for i in deltackpt.snapshots(st)]
    for n in names:
        for rec in st.manifest(n).chunks.values():
            p = st.pack_path(rec.pack)
            p.chmod(0o644)
            with open(p, "r+b") as f:
                f.seek(rec.offset + rec.length // 2)
                b = f.read(1)
                f.seek(rec.offset + rec.length // 2)
                f.write(bytes([b[0] ^ xor]))

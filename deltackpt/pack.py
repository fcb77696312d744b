"""Pack files: large append-only files holding chunk payloads.

A pack starts with the 8-byte magic ``DCKPACK\\x01`` padded to ``PACK_ALIGN``; every payload starts
at a multiple of ``PACK_ALIGN`` and is followed by zero padding. Packs carry no index of their own:
the manifests say which (offset, length) of which pack holds which chunk. A save writes one pack per
writer thread, so a save creates O(threads) files, not O(tensors). Packs are never modified after
the save that wrote them; gc deletes or rewrites whole packs.
"""

from __future__ import annotations

import os
import threading
import uuid
from pathlib import Path

import numpy as np

from deltackpt.store import PACK_ALIGN, PACK_MAGIC

_ZEROS = bytes(PACK_ALIGN)


def new_pack_id() -> str:
    return uuid.uuid4().hex[:20]


def _write_all(fd: int, bufs: list[memoryview]) -> None:
    # os.writev releases the GIL; loop because it may write less than asked.
    total = sum(len(b) for b in bufs)
    done = 0
    while done < total:
        n = os.writev(fd, bufs)
        done += n
        if done < total:
            bufs = _advance(bufs, n)


def _advance(bufs: list[memoryview], n: int) -> list[memoryview]:
    out = []
    for b in bufs:
        if n >= len(b):
            n -= len(b)
            continue
        out.append(b[n:])
        n = 0
    return out


class PackWriter:
    """Appends payloads to one new pack file. One writer per thread; not thread-safe itself."""

    def __init__(self, packs_dir: Path, fsync: bool = True, pack_id: str | None = None) -> None:
        self.pack_id = pack_id or new_pack_id()
        self.path = packs_dir / f"{self.pack_id}.pack"
        self._fsync = fsync
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            _write_all(
                self._fd,
                [memoryview(PACK_MAGIC), memoryview(_ZEROS)[: PACK_ALIGN - len(PACK_MAGIC)]],
            )
        except BaseException:  # e.g. ENOSPC: the caller never gets a writer to abort
            os.close(self._fd)
            os.unlink(self.path)
            raise
        self.pos = PACK_ALIGN

    def append(self, payload: memoryview) -> tuple[int, int]:
        """Write ``payload`` at the next aligned offset; return ``(offset, length)``."""
        offset, n = self.pos, len(payload)
        pad = -n % PACK_ALIGN
        _write_all(self._fd, [payload, memoryview(_ZEROS)[:pad]] if pad else [payload])
        self.pos += n + pad
        return offset, n

    def finish(self) -> int:
        """fsync and close; return the pack's size in bytes."""
        if self._fsync:
            os.fsync(self._fd)
        os.close(self._fd)
        self._fd = -1
        return self.pos

    def abort(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


class PackReaders:
    """Open pack file descriptors shared by a load's reader threads (pread is thread-safe)."""

    def __init__(self, packs_dir: Path) -> None:
        self._dir = packs_dir
        self._fds: dict[str, int] = {}
        self._lock = threading.Lock()

    def fd(self, pack: str) -> int:
        with self._lock:
            fd = self._fds.get(pack)
            if fd is None:
                fd = os.open(self._dir / f"{pack}.pack", os.O_RDONLY)
                self._fds[pack] = fd
            return fd

    def read_into(self, pack: str, offset: int, out: np.ndarray) -> int:
        """Fill ``out`` (uint8, contiguous) from ``pack`` at ``offset``; return bytes read."""
        fd = self.fd(pack)
        view = memoryview(out).cast("B")
        done = 0
        while done < len(view):
            n = os.preadv(fd, [view[done:]], offset + done)
            if n == 0:
                break
            done += n
        return done

    def close(self) -> None:
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()

    def __enter__(self) -> PackReaders:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

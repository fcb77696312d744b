"""Ranged reads of an object in an object store (:meth:`FsspecStorage.open_reader`), split into
parallel GETs of ``part_bytes`` and copied into the caller's buffers; each GET runs under the
storage's deadlines (:mod:`deltackpt.store.objcalls`)."""

from __future__ import annotations

import errno
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from deltackpt.errors import StoreIOError

if TYPE_CHECKING:
    from deltackpt.store.objstore import FsspecStorage


class FsspecReader:
    """Ranged reads of one object, shared by a load's threads; large reads go out in parallel."""

    def __init__(self, storage: FsspecStorage, key: str, size: int) -> None:
        self._s = storage
        self._key = key
        self._path = storage.path(key)
        self.size = size

    def read_into(self, offset: int, bufs: Sequence[memoryview]) -> int:
        total = sum(len(b) for b in bufs)
        end = min(offset + total, self.size)
        if end <= offset:
            return 0
        step = self._s.part_bytes
        starts = list(range(offset, end, step))
        ends = [min(s + step, end) for s in starts]
        with self._s._io("reading", self._key):
            if len(starts) == 1:
                pieces = [self._s.call("cat_file", self._path, start=offset, end=end)]
            else:
                paths = [self._path] * len(starts)
                pieces = self._s.call("cat_ranges", paths, starts, ends, on_error="return")
        for p in pieces:
            if isinstance(p, BaseException):
                if isinstance(p, OSError):
                    raise p
                raise StoreIOError(errno.EIO, f"reading {self._s.where(self._key)}: {p}") from p
        return _scatter(pieces, bufs)

    def close(self) -> None:
        pass


def _scatter(pieces: Sequence[bytes], bufs: Sequence[memoryview]) -> int:
    """Copy ``pieces`` (consecutive bytes) into ``bufs`` in order; return the bytes copied."""
    done = 0
    bi, bpos = 0, 0
    for p in pieces:
        src = np.frombuffer(p, dtype=np.uint8)
        spos = 0
        while spos < src.size and bi < len(bufs):
            b = bufs[bi]
            n = min(len(b) - bpos, src.size - spos)
            np.asarray(b)[bpos : bpos + n] = src[spos : spos + n]
            spos += n
            bpos += n
            done += n
            if bpos == len(b):
                bi, bpos = bi + 1, 0
        if len(p) == 0:
            break
    return done

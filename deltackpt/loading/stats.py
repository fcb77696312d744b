"""What one load read: ``deltackpt.load(..., stats=LoadStats())`` fills the object it is given.

The numbers are counted where the bytes are read (the pack readers a load opens), not estimated
from the manifest, so a test or a benchmark can assert that an incremental load
(``since=``) did not read what it skipped, and compare it with a full load of the same snapshot.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from deltackpt.store.packs import PackReaders
from deltackpt.store.store import Store


@dataclass
class LoadStats:
    """Counters of one load (of this process; with a process group, of this rank).

    ``bytes_read``: bytes read from the store's packs (stored payloads, encoded as they are on
    disk, plus any alignment padding a coalesced read spans). ``chunks_read``: chunks read whole
    (decoded down their xor chains). With ``since=``: ``chunks_unchanged`` were not read (``into``
    already held them), ``chunks_patched`` were xor deltas applied to the bytes ``into`` held
    (``bytes_patched`` raw bytes rewritten), and ``bytes_checked`` bytes of ``into`` were hashed
    to check it holds the ``since=`` snapshot."""

    bytes_read: int = 0
    chunks_read: int = 0
    chunks_unchanged: int = 0
    chunks_patched: int = 0
    bytes_patched: int = 0
    bytes_checked: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add_read(self, n: int) -> None:
        """Count ``n`` bytes read (called from reader threads)."""
        with self._lock:
            self.bytes_read += n


class CountingPackReaders(PackReaders):
    """Pack readers that add every byte they read to a :class:`LoadStats`."""

    def __init__(self, store: Store, stats: LoadStats) -> None:
        super().__init__(store.storage)
        self.stats = stats

    def read_into(self, pack: str, offset: int, out: np.ndarray) -> int:
        n = super().read_into(pack, offset, out)
        self.stats.add_read(n)
        return n

    def readv_into(self, pack: str, offset: int, bufs: Sequence[memoryview]) -> int:
        n = super().readv_into(pack, offset, bufs)
        self.stats.add_read(n)
        return n

    def view(self, pack: str, offset: int, n: int) -> np.ndarray | None:
        got = super().view(pack, offset, n)
        if got is not None:  # its bytes are read where they lie (hashed, then copied out)
            self.stats.add_read(n)
        return got


def pack_readers(store: Store, stats: LoadStats | None) -> PackReaders:
    """The pack readers of one load: counting into ``stats`` when the caller asked for them."""
    return store.pack_readers() if stats is None else CountingPackReaders(store, stats)

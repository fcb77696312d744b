"""The commit vote must never commit a round another rank rejected, whatever the
interleaving: a rejecting rank writes the abort key, then its vote; a rank waiting for the vote
must read the votes before the abort key (reading "no abort", then every vote, would commit).

The interleaving is scripted with an in-memory store: the other rank rejects right after this
rank's first look at the abort key.
"""

from __future__ import annotations

from typing import Any

from deltackpt.sync.group import SyncGroup


class ScriptedStore:
    """A TCPStore stand-in: rank 1 rejects round ``seq`` (abort key, then its vote) just after
    rank 0 first checks the abort key."""

    def __init__(self, seq: int) -> None:
        self.keys: dict[str, bytes] = {}
        self.seq = seq
        self.rejected = False

    def _after(self, keys: list[str]) -> None:
        if not self.rejected and f"r/{self.seq}/abort" in keys:
            self.rejected = True
            self.keys[f"r/{self.seq}/abort"] = b"rank 1: digest mismatch"
            self.keys[f"r/{self.seq}/v/1"] = b"1"

    def set(self, key: str, value: Any) -> None:
        self.keys[key] = value.encode() if isinstance(value, str) else bytes(value)

    def check(self, keys: list[str]) -> bool:
        found = all(k in self.keys for k in keys)
        self._after(keys)
        return found

    def get(self, key: str) -> bytes:
        return self.keys[key]

    def compare_set(self, key: str, expected: str, value: str) -> bytes:
        self.keys.setdefault(key, value.encode())
        return self.keys[key]


def _group(store: ScriptedStore) -> SyncGroup:
    g = SyncGroup.__new__(SyncGroup)  # no sockets: only the vote's store logic is under test
    g.rank, g.world_size, g.trainers = 0, 2, (0,)
    g.timeout, g.beat, g.dead_after = 5.0, 1e9, 1e9
    g._broken = None
    g.store = store  # type: ignore[assignment]
    return g


def test_a_rejection_written_between_the_two_reads_is_never_committed() -> None:
    store = ScriptedStore(seq=7)
    reason = _group(store).vote(7, None)
    assert store.rejected
    assert reason == "rank 1: digest mismatch"


def test_a_round_every_rank_accepts_commits() -> None:
    store = ScriptedStore(seq=7)
    store.rejected = True  # nobody rejects
    store.keys["r/7/v/1"] = b"1"
    assert _group(store).vote(7, None) is None

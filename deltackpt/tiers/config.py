"""``Tiers``: where each tier lives, how many peer replicas, how often to persist, how much to keep.

Layout of one node's local tier (``Tiers.local``, e.g. ``/dev/shm/run`` or node-local NVMe; each
rank of the node passes the same directory)::

    <local>/rank-00003/                 rank 3's own snapshots (a store of one process)
    <local>/replica-00001-on-00003/     rank 1's snapshots, replicated to rank 3 (a store)

Every local snapshot is named ``step-<step:08d>`` and carries ``metadata["deltackpt.tiers"] =
{"step", "rank", "world"}``: restore uses only snapshots whose marker matches the rank they
stand for, the step of their name and the current world size (anything else is stale).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from deltackpt.errors import InvalidArgumentError

TIER_KEY = "deltackpt.tiers"


def local_name(step: int) -> str:
    return f"step-{step:08d}"


def _int(name: str, value: Any, lo: int, example: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < lo:
        raise InvalidArgumentError(
            f"Tiers({name}={value!r}) is invalid: expected an int >= {lo}. Pass e.g. {example}"
        )


@dataclass(frozen=True)
class Tiers:
    """The tiers of a :class:`~deltackpt.tiers.TieredCheckpointer`.

    ``local``: this node's fast directory (RAM disk or NVMe); every rank of a node passes the
    same one. ``durable``: a directory or object-store URL every rank can reach (None: no
    durable tier). ``replicas``: how many peers hold a copy of each rank's local snapshots (0:
    none). ``ranks_per_node``: the replication jump; rank ``r``'s replica ``i`` goes to rank
    ``(r + i * ranks_per_node) % world``, so with ranks numbered node by node every copy lands
    on another node (default: counted from the ranks' host names, which must then number the
    ranks node by node, as torchrun does).
    ``persist_every``: a version goes to the durable tier after steps ``persist_every - 1``,
    ``2 * persist_every - 1``, ... (None: only on :meth:`TieredCheckpointer.flush`).
    ``keep_last``: local snapshots each rank keeps, and replica snapshots each holder keeps per
    peer. ``durable_keep_last``: durable versions kept (None: all).
    """

    local: str | os.PathLike[str]
    durable: str | os.PathLike[str] | None = None
    replicas: int = 1
    persist_every: int | None = None
    ranks_per_node: int | None = None
    keep_last: int = 2
    durable_keep_last: int | None = None
    storage_options: dict[str, Any] | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.local, (str, os.PathLike)) or "://" in os.fspath(self.local):
            raise InvalidArgumentError(
                f"Tiers(local={self.local!r}) is invalid: expected a local directory path (a "
                "RAM disk such as '/dev/shm/run' or node-local NVMe); object stores belong in "
                "durable="
            )
        _int("replicas", self.replicas, 0, "replicas=1 (one copy on another node)")
        _int("keep_last", self.keep_last, 1, "keep_last=2")
        if self.persist_every is not None:
            _int("persist_every", self.persist_every, 1, "persist_every=1000")
            if self.durable is None:
                raise InvalidArgumentError(
                    f"Tiers(persist_every={self.persist_every}) needs durable=<dir or s3://...>;"
                    " pass durable=, or drop persist_every"
                )
        if self.durable_keep_last is not None:
            _int("durable_keep_last", self.durable_keep_last, 1, "durable_keep_last=3")
        if self.ranks_per_node is not None:
            _int("ranks_per_node", self.ranks_per_node, 1, "ranks_per_node=8")

    @property
    def root(self) -> Path:
        return Path(os.fspath(self.local)).expanduser()

    def peers(self, rank: int, world: int, jump: int) -> list[int]:
        """The ranks holding ``rank``'s replicas, in replica order."""
        return [(rank + i * jump) % world for i in range(1, self.replicas + 1)]

    def check_world(self, world: int, jump: int) -> None:
        """Every replica of a rank must land on another rank, each on a different one."""
        holders = [(i * jump) % world for i in range(1, self.replicas + 1)]
        if 0 in holders or len(set(holders)) != len(holders):
            raise InvalidArgumentError(
                f"Tiers(replicas={self.replicas}) with {jump} rank(s) per node cannot place "
                f"replicas in a world of {world} ranks: replica i of rank r goes to rank (r + i "
                f"* {jump}) % {world}, which must differ from r and from the other replicas "
                "(another node). Pass fewer replicas (replicas * ranks_per_node < world), "
                "replicas=0, or the real ranks_per_node="
            )

    def own_dir(self, rank: int) -> Path:
        return self.root / f"rank-{rank:05d}"

    def replica_dir(self, of: int, on: int) -> Path:
        return self.root / f"replica-{of:05d}-on-{on:05d}"

"""Replicas among the trainers, compared at full rounds (docs/sync.md, "Replicas").

Boxes that several trainer ranks hold (plain tensors under data parallelism, ``Replicate``
placements, HSDP's replicated shards) are sent to each receiver by one of the holders
(``schedule.py``: ``holders[receiver position % len(holders)]``), so the schedule trusts them
to be equal. A tensor a rank holds its *own* part or copy of under a shared name breaks that
silently: expert-parallel ranks' local experts, or a tensor-parallel shard kept as a plain
tensor of the same shape on every rank, would reach every receiver as one rank's bytes ("the
checkpoint holds rank 0's experts tiled ep_size times", miles#2488), and receivers served by
different holders would hold different weights.

So at every full round (the first, ``full=True``, anchors, the round after a failure) each
trainer rank digests the local tensors of its replicated boxes (:func:`replica_digests`: xxh3-128
of host bytes in place, the device fingerprint of CUDA ones) and carries them in its commit
vote (:func:`vote_value`); every rank reads the trainers' votes anyway (their versions must
agree) and fails the round when two holders of a box differ (:func:`replicas_differ`), naming
the tensors, the ranks and the fix. Cost: one hash of the replicated bytes per full round on
each holder (a full round copies them anyway), no extra store round trip. Delta rounds are
not checked: a replica that drifts apart later is found at the next full round
(``WeightSender(full_every=)``). ``WeightSender(replicas="trust")`` skips the check.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence

import torch

from deltackpt import cuda
from deltackpt.sync.schedule import Schedule
from deltackpt.sync.wire import hash_tensor

__all__ = [
    "REPLICAS",
    "replica_digests",
    "replica_names",
    "replicas_differ",
    "versions_of",
    "vote_value",
]

REPLICAS = ("check", "trust")


def replica_names(sched: Schedule, rank: int) -> dict[str, str]:
    """The tensors of which trainer ``rank`` holds a box that other trainers hold too, each
    with the key its digest goes under: the name, and the box's offset when the tensor has
    several boxes (HSDP: each shard replicated over its own group of ranks)."""
    out = {}
    for t in sched.tensors:
        for box, hs in zip(t.boxes, t.holders, strict=True):
            if len(hs) > 1 and rank in hs:
                where = "" if len(t.boxes) == 1 else f" at {list(box.offset)}"
                out[t.name] = f"{t.name}{where}"
    return out


def _digest(t: torch.Tensor) -> str:
    """``x:`` xxh3-128 of a host tensor's bytes, ``f:`` the device fingerprint of a CUDA
    tensor's (the same function on every device, but not the same as xxh3: only digests of one
    kind are compared)."""
    flat = t.detach().contiguous().reshape(-1)
    if cuda.is_device(flat):
        from deltackpt.sync.device_digest import piece_digest

        a, b = piece_digest(flat.view(torch.uint8))
        return f"f:{a:016x}{b:016x}"
    a, b = hash_tensor(flat)
    return f"x:{a:016x}{b:016x}"


def replica_digests(local: Mapping[str, torch.Tensor], names: Mapping[str, str]) -> dict[str, str]:
    """This rank's digest of each of its replicated tensors (``names``: tensor -> key)."""
    return {key: _digest(local[n]) for n, key in names.items() if n in local}


def vote_value(version: int | None, digests: Mapping[str, str] | None) -> str:
    """A rank's commit vote: its version (``-``: a receiver), then, from a trainer at a full
    round, its replicas' digests."""
    mine = "-" if version is None else str(int(version))
    if digests:
        mine += "\n" + json.dumps(dict(digests), sort_keys=True)
    return mine


def _parse(raw: str) -> tuple[str, dict[str, str] | None]:
    """(version, replica digests); None for digests that are not a JSON object of strings."""
    version, _, rest = raw.partition("\n")
    if not rest:
        return version, {}
    try:
        got = json.loads(rest)
    except ValueError:
        return version, None
    if not isinstance(got, dict) or not all(isinstance(v, str) for v in got.values()):
        return version, None
    return version, got


def versions_of(raws: Sequence[str]) -> list[str]:
    """The versions of the trainers' votes ``raws``."""
    return [_parse(r)[0] for r in raws]


def replicas_differ(trainers: Sequence[int], raws: Sequence[str]) -> str | None:
    """The abort reason when two trainers' votes ``raws`` (in ``trainers`` order) carry
    different digests of one tensor (of the same kind), else None. Every rank reads the same
    votes, so every rank decides the same."""
    seen: dict[str, dict[str, list[int]]] = {}  # name -> digest -> ranks
    for rank, raw in zip(trainers, raws, strict=True):
        digests = _parse(raw)[1]
        if digests is None:
            return f"trainer rank {rank}'s vote carries malformed replica digests: {raw[:80]!r}"
        for name, d in digests.items():
            seen.setdefault(name, {}).setdefault(d, []).append(rank)
    bad = []
    for name in sorted(seen):
        by_kind: dict[str, list[list[int]]] = {}
        for d, ranks in seen[name].items():
            by_kind.setdefault(d[:2], []).append(ranks)
        groups = max(by_kind.values(), key=len)
        if len(groups) > 1:
            bad.append(f"{name!r} (" + " vs ".join(_ranks(g) for g in groups) + ")")
    if not bad:
        return None
    more = f" and {len(bad) - 5} more" if len(bad) > 5 else ""
    return (
        f"trainer ranks hold different bytes for tensors they declared as replicas: "
        f"{', '.join(bad[:5])}{more}; a receiver would get one rank's copy as everyone's. A "
        "tensor each rank holds its own part of (expert-parallel experts, a tensor-parallel "
        "shard kept as a plain tensor) must be declared as that part: a DTensor, or "
        "sync.LocalShard(tensor, offset, global shape). Replicas meant to be equal have "
        "drifted apart: find why (WeightSender(replicas='trust') skips this check)"
    )


def _ranks(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ",".join(str(r) for r in sorted(ranks))

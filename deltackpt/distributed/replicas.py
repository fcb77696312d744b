"""Save step 3, part of agree: plain values that the ranks hold differently (pure except
:func:`detail`, which reads this rank's bytes).

A distributed save stores one copy of every plain (non-DTensor) value: rank 0's, as
torch.distributed.checkpoint does. That is right only when the value is replicated. A value the
ranks hold differently (a Megatron-style tensor-parallel shard kept as a plain tensor, a
per-rank data-loader state, a rank number) would come back on every rank as rank 0's, with no
error. So rank 0 compares what it already has, by default (``SaveOptions(replicated="check")``):

1. every rank's message carries one digest of its inline (non-tensor) values
   (:func:`values_digest`), and rank 0 holds every rank's chunk digests anyway;
2. rank 0 finds the plain tensors whose chunk digests differ from its own (exact for tensors cut
   into chunks of their own; for small tensors packed into a shared group chunk, a differing
   group names candidates), and whether some rank's inline values differ
   (:func:`suspects`);
3. only then (a save that is about to fail) it asks every rank for per-key hashes of the
   suspects (:class:`Compare` -> :func:`detail`), and every rank raises
   :class:`~deltackpt.errors.ReplicaMismatchError` naming each key and the ranks that differ
   (:func:`mismatch_failure`).

Cost when the values agree: one 16-character digest per rank per save, and a comparison of the
digest lists rank 0 already merges. ``replicated="rank0"`` skips the check (rank 0's copy is
meant: DCP's semantics, which the DCP plug-in keeps).
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass

import xxhash

from deltackpt.distributed.save_plan import Layout
from deltackpt.errors import RankFailure
from deltackpt.format.hashing import digest
from deltackpt.format.tree import Node, value_leaves
from deltackpt.saving.plan import SavePlan

__all__ = ["Compare", "detail", "mismatch_failure", "suspects", "values_digest"]

VALUES = "<inline values>"  # a suspect that stands for every non-tensor leaf


@dataclass(frozen=True)
class Compare:
    """Rank 0's request to every rank: per-key hashes of these keys (tensor paths, or
    :data:`VALUES` for every inline value)."""

    keys: tuple[str, ...]


def values_digest(tree: Node) -> str:
    """One digest of every inline value of a rank's state tree (tensor leaves are indices, the
    same on every rank whose layout matches)."""
    return xxhash.xxh3_64_hexdigest(json.dumps(tree, sort_keys=True).encode())


def _tensor_sources(layout: Layout) -> dict[str, int]:
    """Plain (non-DTensor) tensor path -> the source holding its bytes."""
    out: dict[str, int] = {}
    for e in layout.entries:
        if e.shards is not None:
            continue
        if e.source is not None:
            out[e.path] = e.source
        elif e.storage is not None:
            out[e.path] = layout.storage_sources[e.storage[0]]
    return out


def _exclusive(layout: Layout) -> list[bool]:
    """Per source: whether its chunks hold its bytes alone (a small tensor shares a group
    chunk with others, so a differing digest there does not say which member differs)."""
    users = Counter(ci for slices in layout.source_slices for ci, _, _ in slices)
    return [all(users[ci] == 1 for ci, _, _ in slices) for slices in layout.source_slices]


def suspects(
    resolved: list[tuple[Layout, list[str]]], values: list[str]
) -> tuple[dict[str, list[int]], tuple[str, ...]]:
    """Rank 0: ``(differ, unsure)``. ``differ``: plain tensor path -> the ranks whose bytes
    differ from rank 0's (chunks of its own whose digests differ). ``unsure``: keys to ask every
    rank about (small tensors whose shared group chunk differs, or :data:`VALUES` when some
    rank's inline values differ)."""
    base, base_digests = resolved[0]
    base_src, base_own = _tensor_sources(base), _exclusive(base)
    base_where = [(e.source, e.storage) for e in base.entries]
    plain = sorted({ci for si in base_src.values() for ci, _, _ in base.source_slices[si]})
    differ: dict[str, list[int]] = {}
    unsure: dict[str, None] = {}
    for r, (layout, digests) in enumerate(resolved[1:], start=1):
        if values[r] != values[0]:
            unsure[VALUES] = None
        if (  # the common case, cheaply: same layout, the same digests of every plain chunk
            layout.source_slices == base.source_slices
            and [(e.source, e.storage) for e in layout.entries] == base_where
            and all(digests[ci] == base_digests[ci] for ci in plain)
        ):
            continue
        src, own = _tensor_sources(layout), _exclusive(layout)
        for path, si0 in base_src.items():
            si = src.get(path)
            if si is None:
                continue
            mine = [(base_digests[ci], a, n) for ci, a, n in base.source_slices[si0]]
            theirs = [(digests[ci], a, n) for ci, a, n in layout.source_slices[si]]
            if mine == theirs:
                continue
            if base_own[si0] and own[si]:
                differ.setdefault(path, []).append(r)
            else:
                unsure[path] = None
    return differ, tuple(unsure)


def detail(plan: SavePlan, keys: tuple[str, ...]) -> dict[str, str]:
    """This rank's hashes of ``keys`` (every rank, when rank 0 asks: a save about to fail)."""
    out: dict[str, str] = {}
    by_path = {e.path: e for e in plan.entries}
    for key in keys:
        if key == VALUES:
            for path, node in value_leaves(plan.tree):
                doc = json.dumps(node, sort_keys=True).encode()
                out[f"value:{path}"] = xxhash.xxh3_64_hexdigest(doc)
            continue
        e = by_path.get(key)
        if e is None or e.shards is not None:
            continue
        if e.source is not None:
            si = e.source
        elif e.storage is not None:
            si = plan.storage_sources[e.storage[0]]
        else:
            continue
        out[f"tensor:{key}"] = digest(plan.sources[si].data.cpu().numpy())
    return out


def mismatch_failure(
    differ: dict[str, list[int]], details: list[dict[str, str]] | None
) -> RankFailure | None:
    """Rank 0: the failure naming every key whose value differs between ranks, or None."""
    found: dict[str, set[int]] = {f"tensor:{p}": set(rs) for p, rs in differ.items()}
    if details:
        base = details[0]
        for r, d in enumerate(details[1:], start=1):
            for k in set(base) | set(d):
                if base.get(k) != d.get(k):
                    found.setdefault(k, set()).add(r)
    if not found:
        return None
    lines = []
    for k in sorted(found)[:10]:
        kind, _, path = k.partition(":")
        ranks = ", ".join(str(r) for r in sorted(found[k]))
        lines.append(f"{kind} {path!r} on rank(s) {ranks}")
    more = f" (and {len(found) - 10} more)" if len(found) > 10 else ""
    message = (
        f"plain values differ between ranks, and a distributed save keeps one copy of a plain "
        f"value (rank 0's): {'; '.join(lines)}{more} differ from rank 0's. Nothing was "
        "written. Make a per-rank value a DTensor (its shards are saved from every rank), key "
        "it per rank (e.g. state[f'rank{rank}'] = ...), or pass replicated='rank0' to save "
        "rank 0's copy on purpose (torch.distributed.checkpoint's behaviour)"
    )
    return RankFailure(0, "plan", "ReplicaMismatchError", message)

"""Distributed save planning (pure, no I/O, no collectives): what ranks send and what rank 0 decides.

Each rank sends a :class:`RankMsg`. The first time (or when the rank's structure, i.e. keys,
shapes, shard boxes and chunk layout, changed) it carries the rank's whole layout and digests;
afterwards only the digests that changed since the last committed save. Planning bytes therefore
scale with what changed, not with tensors x ranks. Rank 0 keeps every rank's last layout in a
:class:`PlanCache`, merges them into one manifest layout and assigns every new digest to exactly
one rank that holds it (chosen by the digest, so replicated data is spread over its holders).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import xxhash

from deltackpt.saving.plan import EntryPlan, SavePlan
from deltackpt.errors import DistributedError


@dataclass
class Layout:
    """A rank's save layout without data: enough for rank 0 to build the manifest."""

    entries: list[EntryPlan]
    storage_sources: list[int]
    source_slices: list[list[tuple[int, int, int]]]
    nbytes: list[int]  # per source

    def key(self) -> str:
        doc = [
            [(e.path, e.dtype, e.shape, e.source, e.storage, e.shards) for e in self.entries],
            self.storage_sources,
            self.source_slices,
            self.nbytes,
        ]
        return xxhash.xxh3_64_hexdigest(json.dumps(doc, default=list).encode())

    @staticmethod
    def of(plan: SavePlan) -> Layout:
        return Layout(
            plan.entries, plan.storage_sources, plan.source_slices, [s.nbytes for s in plan.sources]
        )


@dataclass
class RankMsg:
    rank: int
    structure: str
    layout: Layout | None = None  # sent when the structure is new
    digests: list[str] | None = None  # all digests, with layout
    changed: dict[int, str] | None = None  # chunk index -> digest, when the structure is known
    error: str | None = None


@dataclass
class PlanCache:
    """Per store and process group: this rank's last committed structure and digests; on rank 0
    also every rank's layout and digests."""

    structure: str | None = None
    digests: list[str] = field(default_factory=list)
    ranks: dict[int, tuple[str, Layout, list[str]]] = field(default_factory=dict)


def rank_message(rank: int, layout: Layout, digests: list[str], cache: PlanCache) -> RankMsg:
    key = layout.key()
    if cache.structure == key and len(cache.digests) == len(digests):
        changed = {
            i: d for i, (d, old) in enumerate(zip(digests, cache.digests, strict=True)) if d != old
        }
        return RankMsg(rank, key, changed=changed)
    return RankMsg(rank, key, layout=layout, digests=list(digests))


def resolve(msgs: list[RankMsg], cache: PlanCache) -> list[tuple[Layout, list[str]]]:
    """Rank 0: every rank's (layout, digests) from full or delta messages and the cache."""
    out = []
    for m in msgs:
        if m.layout is not None and m.digests is not None:
            out.append((m.layout, m.digests))
            continue
        prev = cache.ranks.get(m.rank)
        if prev is None or prev[0] != m.structure:
            raise DistributedError(
                f"rank {m.rank} sent only changes against a save that rank 0 does not remember "
                "(was rank 0 restarted alone?); the next save resends full plans. Restart every "
                "rank together, or save again"
            )
        digests = list(prev[2])
        for i, d in (m.changed or {}).items():
            digests[i] = d
        out.append((prev[1], digests))
    return out


def remember(cache: PlanCache, rank: int, layout: Layout, digests: list[str]) -> None:
    cache.structure = layout.key()
    cache.digests = list(digests)


def remember_all(
    cache: PlanCache, msgs: list[RankMsg], resolved: list[tuple[Layout, list[str]]]
) -> None:
    for m, (layout, digests) in zip(msgs, resolved, strict=True):
        cache.ranks[m.rank] = (m.structure, layout, digests)


@dataclass
class Merged:
    """Rank 0's merged view: per tensor entry, which rank's source supplies each piece."""

    # per entry of rank 0: ("data"|"storage", rank, source) or ("shards", [(offsets, shape, rank, source)])
    pieces: list[Any]
    needed: set[str]


def merge(resolved: list[tuple[Layout, list[str]]]) -> Merged:
    """Combine the ranks' layouts: shards of one global tensor from every rank (each box once),
    everything else (replicated by convention, as in torch.distributed.checkpoint) from rank 0."""
    base = resolved[0][0]
    for r, (layout, _) in enumerate(resolved[1:], start=1):
        if [(e.path, e.dtype, e.shape) for e in layout.entries] != [
            (e.path, e.dtype, e.shape) for e in base.entries
        ]:
            a = {(e.path, e.dtype, e.shape) for e in base.entries}
            b = {(e.path, e.dtype, e.shape) for e in layout.entries}
            raise DistributedError(
                f"rank {r} saves a different state than rank 0: only on rank 0 {sorted(a - b)[:5]}, "
                f"only on rank {r} {sorted(b - a)[:5]}. Every rank must pass the same keys with "
                "the same global shapes and dtypes"
            )
    pieces: list[Any] = []
    needed: set[str] = set()

    def use(rank: int, source: int) -> None:
        layout, digests = resolved[rank]
        needed.update(digests[ci] for ci, _, _ in layout.source_slices[source])

    for i, e in enumerate(base.entries):
        if e.shards is not None:
            seen: dict[tuple[int, ...], tuple[tuple[int, ...], tuple[int, ...], int, int]] = {}
            for r, (layout, _) in enumerate(resolved):
                for offsets, shape, si in layout.entries[i].shards or ():
                    if offsets not in seen:
                        seen[offsets] = (offsets, shape, r, si)
                        use(r, si)
            pieces.append(("shards", [seen[k] for k in sorted(seen)]))
        elif e.storage is not None:
            pieces.append(("storage", 0, e.storage[0]))
        else:
            pieces.append(("data", 0, e.source))
            if e.source is not None:
                use(0, e.source)
    for sid in range(len(base.storage_sources)):
        use(0, base.storage_sources[sid])
    return Merged(pieces, needed)


def assign(
    resolved: list[tuple[Layout, list[str]]], needed: set[str], stored: set[str]
) -> list[set[int]]:
    """For every needed digest the store lacks, pick one rank holding it; return per-rank chunk
    indices to write. The pick hashes the digest, spreading replicated data over its holders."""
    holders: dict[str, list[tuple[int, int]]] = {}
    for r, (_, digests) in enumerate(resolved):
        seen: set[str] = set()
        for ci, d in enumerate(digests):
            if d in needed and d not in stored and d not in seen:
                seen.add(d)
                holders.setdefault(d, []).append((r, ci))
    out: list[set[int]] = [set() for _ in resolved]
    for d, hs in holders.items():
        r, ci = hs[int(d[:8], 16) % len(hs)]
        out[r].add(ci)
    missing = needed - stored - set(holders)
    if missing:
        raise DistributedError(
            f"no rank holds {len(missing)} chunk(s) the manifest needs; a rank's plan is inconsistent"
        )
    return out

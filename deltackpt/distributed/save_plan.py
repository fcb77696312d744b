"""Save step 3, agree (pure: no I/O, no collectives): what each rank sends, what rank 0 decides.

Every save runs it, a world of one included (deltackpt/distributed/save.py runs the collectives).

* Every rank builds a :class:`RankMsg` (:func:`rank_message`). The first time (or when the
  rank's structure, i.e. keys, shapes, shard boxes and chunk layout, changed) it carries the
  rank's whole layout and digests; afterwards only the digests that changed since the last
  committed save, so planning bytes scale with what changed, not with tensors x ranks. A delta
  names the digests it applies to (``base``); if rank 0 holds other ones for that rank (a save
  that failed on some ranks only), it answers :class:`Resend` and every rank sends its full
  plan again in the same save, so the caches cannot drift apart.
* Rank 0 (:func:`plan_globally`) rebuilds every rank's plan from the messages and its
  :class:`PlanCache`, merges them into one manifest layout and assigns every new digest to
  exactly one rank that holds it (chosen by the digest, so replicated data is spread over its
  holders; a chunk the rank already staged is preferred). It refuses, before anything is
  written, ranks that disagree: other keys, shapes or dtypes, a key that is a DTensor on some
  ranks only, or DTensor boxes that do not tile the tensor exactly once (the loader's own rule,
  format/boxes.py). At commit, :func:`snapshot_parts`
  turns the merged plans and the ranks' written chunks into the plain inputs of the manifest
  builder (saving/commit.py).

A world of one keeps no cache (it sends nothing) and merges its own plan like any other.
"""

from __future__ import annotations

import json
from collections.abc import Container, Mapping
from dataclasses import dataclass, field
from typing import Any

import xxhash

from deltackpt.errors import DistributedError, RankFailure
from deltackpt.format.boxes import Box, tiling_problem
from deltackpt.format.manifest import ChunkRecord, Shard, Slice, StorageView, TensorEntry
from deltackpt.saving.commit import SnapshotParts
from deltackpt.saving.plan import EntryPlan, SavePlan


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
    base: str = ""  # with ``changed``: digests_key() of the digests the changes apply to
    error: RankFailure | None = None  # the rank could not plan: why (nothing else is set)
    values: str = ""  # digest of the rank's inline values (distributed/replicas.py)


@dataclass(frozen=True)
class Resend:
    """Rank 0's answer, to every rank, when some rank sent only changes against a save rank 0
    does not remember as that rank does (a save that failed on some ranks only, a restarted
    rank): every rank sends its full plan again, in the same save."""


@dataclass
class PlanCache:
    """Per store and process group: this rank's last committed structure and digests; on rank 0
    also every rank's layout and digests."""

    structure: str | None = None
    digests: list[str] = field(default_factory=list)
    base: str = ""  # digests_key(digests)
    ranks: dict[int, tuple[str, Layout, list[str], str]] = field(default_factory=dict)


def digests_key(digests: list[str]) -> str:
    """Names one list of digests: a delta message says which list its changes apply to."""
    return xxhash.xxh3_64_hexdigest("\n".join(digests).encode())


def rank_message(
    rank: int, layout: Layout, digests: list[str], cache: PlanCache | None, full: bool = False
) -> RankMsg:
    """This rank's plan: only the changed digests if ``cache`` knows its structure (and not
    ``full``), else the whole plan (always whole without a cache: a world of one sends nothing
    anyway)."""
    if cache is None:
        return RankMsg(rank, "", layout=layout, digests=list(digests))
    key = layout.key()
    if not full and cache.structure == key and len(cache.digests) == len(digests):
        changed = {
            i: d for i, (d, old) in enumerate(zip(digests, cache.digests, strict=True)) if d != old
        }
        return RankMsg(rank, key, changed=changed, base=cache.base)
    return RankMsg(rank, key, layout=layout, digests=list(digests))


def stale_ranks(msgs: list[RankMsg], cache: PlanCache | None) -> list[int]:
    """Rank 0: the ranks that sent changes against digests rank 0 does not hold for them (rank 0
    then answers :class:`Resend`). Checked by content, not by save: whatever made the caches
    drift (a save that failed on some ranks only), a rank's changes are applied only to the very
    digests it computed them against."""
    out = []
    for m in msgs:
        if m.layout is not None or m.error is not None:
            continue
        prev = cache.ranks.get(m.rank) if cache is not None else None
        if prev is None or prev[0] != m.structure or prev[3] != m.base:
            out.append(m.rank)
    return out


def resolve(msgs: list[RankMsg], cache: PlanCache | None) -> list[tuple[Layout, list[str]]]:
    """Rank 0: every rank's (layout, digests) from full or delta messages and the cache."""
    out = []
    for m in msgs:
        if m.layout is not None and m.digests is not None:
            out.append((m.layout, m.digests))
            continue
        prev = cache.ranks.get(m.rank) if cache is not None else None
        if prev is None or prev[0] != m.structure or prev[3] != m.base:
            raise DistributedError(
                f"rank {m.rank} sent only changes against digests rank 0 does not hold for it, "
                "even after rank 0 asked every rank for its full plan; nothing was committed and "
                "the next save sends full plans. Save again (and report this as a bug)"
            )
        digests = list(prev[2])
        for i, d in (m.changed or {}).items():
            digests[i] = d
        out.append((prev[1], digests))
    return out


def remember(cache: PlanCache, layout: Layout, digests: list[str]) -> None:
    cache.structure = layout.key()
    cache.digests = list(digests)
    cache.base = digests_key(cache.digests)


def remember_all(
    cache: PlanCache, msgs: list[RankMsg], resolved: list[tuple[Layout, list[str]]]
) -> None:
    for m, (layout, digests) in zip(msgs, resolved, strict=True):
        cache.ranks[m.rank] = (m.structure, layout, digests, digests_key(digests))


@dataclass(frozen=True)
class ShardPiece:
    """One box of a sharded tensor, as ``rank``'s source ``source`` holds it."""

    offsets: tuple[int, ...]
    shape: tuple[int, ...]
    rank: int
    source: int


@dataclass
class Merged:
    """Rank 0's merged view: per entry of rank 0, the boxes of a sharded tensor from every rank
    (each box once, by offsets), or None where rank 0's own entry is used (whole tensors and
    shared-storage views; replicated by convention). ``needed``: every digest referenced."""

    shards: list[tuple[ShardPiece, ...] | None]
    needed: set[str]


def merge(resolved: list[tuple[Layout, list[str]]]) -> Merged:
    """Combine the ranks' layouts: shards of one global tensor from every rank (each box once),
    everything else (replicated: distributed/replicas.py checks that it is) from rank 0."""
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
    shards: list[tuple[ShardPiece, ...] | None] = []
    needed: set[str] = set()

    def use(rank: int, source: int) -> None:
        layout, digests = resolved[rank]
        needed.update(digests[ci] for ci, _, _ in layout.source_slices[source])

    for i, e in enumerate(base.entries):
        _check_kinds(resolved, i)
        if e.shards is not None:
            seen: dict[Box, ShardPiece] = {}  # a box several ranks hold (replicas) is kept once
            for r, (layout, _) in enumerate(resolved):
                for offsets, shape, si in layout.entries[i].shards or ():
                    if (offsets, shape) not in seen:
                        seen[(offsets, shape)] = ShardPiece(offsets, shape, r, si)
                        use(r, si)
            pieces = tuple(seen[k] for k in sorted(seen))
            _check_tiling(e, pieces)
            shards.append(pieces)
            continue
        shards.append(None)
        if e.storage is None and e.source is not None:
            use(0, e.source)
    for sid in range(len(base.storage_sources)):
        use(0, base.storage_sources[sid])
    return Merged(shards, needed)


def _check_kinds(resolved: list[tuple[Layout, list[str]]], i: int) -> None:
    """Entry ``i`` is a DTensor (saved shards) on every rank or on none: a key sharded on some
    ranks and plain on others would be saved from the shards alone, which do not cover it."""
    sharded = [layout.entries[i].shards is not None for layout, _ in resolved]
    if all(sharded) or not any(sharded):
        return
    e = resolved[0][0].entries[i]
    on = [r for r, s in enumerate(sharded) if s]
    off = [r for r, s in enumerate(sharded) if not s]
    raise DistributedError(
        f"key {e.path!r} ({e.dtype}{list(e.shape)}) is a DTensor on rank(s) {on} but a plain "
        f"tensor on rank(s) {off}: expected the same kind of value on every rank. Pass a DTensor "
        "with the same mesh and placements on every rank, or a plain (replicated) tensor on every "
        "rank (dtensor.full_tensor())"
    )


def _check_tiling(e: EntryPlan, pieces: tuple[ShardPiece, ...]) -> None:
    """The ranks' boxes of a DTensor tile its global shape exactly once: the check the loader
    makes (format/boxes.py), made before anything is committed."""
    problem = tiling_problem(e.shape, [(p.offsets, p.shape) for p in pieces])
    if problem is None:
        return
    reason, a, b = problem

    def held(p: ShardPiece) -> str:
        return f"rank {p.rank} holds offsets {list(p.offsets)} shape {list(p.shape)}"

    if a >= 0:
        detail = f"{held(pieces[a])}, {held(pieces[b])}"
    else:
        detail = "; ".join(held(p) for p in pieces[:8])
    raise DistributedError(
        f"key {e.path!r} ({e.dtype}{list(e.shape)}): the ranks' shards do not tile the tensor "
        f"exactly once ({reason}: {detail}); a snapshot of them could not be loaded. Expected "
        "every rank to pass this key with the same device mesh and placements (e.g. Shard(0) "
        "on every rank); check the DTensor placements each rank passes"
    )


def assign(
    resolved: list[tuple[Layout, list[str]]],
    needed: set[str],
    stored: Container[str],
    prefer: Mapping[int, set[int]] | None = None,
) -> list[set[int]]:
    """For every needed digest the store lacks, pick one rank holding it; return per-rank chunk
    indices to write. The pick hashes the digest, spreading replicated data over its holders.
    A rank holding a digest in several chunks offers the first, or the one it already staged
    (``prefer``: rank -> chunk indices), so nothing is copied twice."""
    holders: dict[str, list[tuple[int, int]]] = {}
    for r, (_, digests) in enumerate(resolved):
        staged = prefer.get(r, set()) if prefer else set()
        mine: dict[str, int] = {}
        for ci, d in enumerate(digests):
            if d not in needed or d in stored:
                continue
            if d not in mine or (ci in staged and mine[d] not in staged):
                mine[d] = ci
        for d, ci in mine.items():
            holders.setdefault(d, []).append((r, ci))
    out: list[set[int]] = [set() for _ in resolved]
    for d, hs in holders.items():
        r, ci = hs[int(d[:8], 16) % len(hs)]
        out[r].add(ci)
    missing = {d for d in needed if d not in stored and d not in holders}
    if missing:
        raise DistributedError(
            f"no rank holds {len(missing)} chunk(s) the manifest needs; a rank's plan is inconsistent"
        )
    return out


@dataclass
class GlobalPlan:
    """Rank 0's decision for one save: who writes what, and what the manifest is made of."""

    msgs: list[RankMsg]
    resolved: list[tuple[Layout, list[str]]]
    merged: Merged
    owned: list[set[int]]  # per rank: the chunk indices it writes
    index: Mapping[str, ChunkRecord]  # the store's committed chunks this decision deduped against


def plan_globally(
    msgs: list[RankMsg],
    cache: PlanCache | None,
    index: Mapping[str, ChunkRecord],
    prefer: Mapping[int, set[int]] | None = None,
) -> GlobalPlan:
    """Rank 0: resolve, merge and assign the ranks' plans (raises DistributedError if they
    do not fit together)."""
    resolved = resolve(msgs, cache)
    merged = merge(resolved)
    return GlobalPlan(msgs, resolved, merged, assign(resolved, merged.needed, index, prefer), index)


def snapshot_parts(
    name: str,
    plan0: SavePlan,
    resolved: list[tuple[Layout, list[str]]],
    merged: Merged,
    written: Mapping[str, ChunkRecord],
    pack_bytes: int,
    metadata: dict[str, Any],
    dist: dict[str, Any] | None,
) -> SnapshotParts:
    """The manifest builder's inputs from the merged plans: rank 0's tree and entries (``plan0``,
    its plan of this save), each slice naming the digest of the rank that supplies it."""

    def slices(rank: int, source: int) -> tuple[Slice, ...]:
        layout, digests = resolved[rank]
        return tuple((digests[ci], s, n) for ci, s, n in layout.source_slices[source])

    tensors = []
    for e, boxes in zip(plan0.entries, merged.shards, strict=True):
        kw: dict[str, Any] = {}
        if boxes is not None:
            kw["shards"] = tuple(Shard(b.offsets, b.shape, slices(b.rank, b.source)) for b in boxes)
        elif e.storage is not None:
            kw["storage"] = StorageView(*e.storage)
        else:
            kw["data"] = slices(0, e.source) if e.source is not None else ()
        tensors.append(
            TensorEntry(
                e.path, e.dtype, e.shape, parameter=e.parameter, requires_grad=e.requires_grad, **kw
            )
        )
    base = resolved[0][0]
    storages = tuple((base.nbytes[si], slices(0, si)) for si in plan0.storage_sources)
    return SnapshotParts(
        name, plan0.tree, tuple(tensors), storages, written, pack_bytes, metadata, dist
    )

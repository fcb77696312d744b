"""Distributed save over torch.distributed: every rank writes its own packs, rank 0 commits.

Call order (every rank calls :func:`dist_save`; collectives on ``process_group``):

1. every rank: wait for its previous save, take the store lock (shared), plan and stage its local
   state (DTensor shards and replicated values), hash its chunks;
2. ``gather_object`` → rank 0: each rank's plan message (full, or only changed digests);
3. rank 0 merges the plans, checks the store index and assigns every new chunk to one holder;
   ``scatter_object_list`` → each rank its assignment (or an abort naming the failed rank);
4. every rank writes and fsyncs its assigned chunks into its own pack files;
5. ``gather_object`` → rank 0: the records of the written chunks (or the rank's error);
6. rank 0 builds the manifest and commits it only if every rank succeeded;
   ``broadcast_object_list``: the outcome, so every rank returns the same SnapshotInfo or raises.

A rank that fails locally still takes part in the next collective with its error, so the others
raise :class:`DistributedError` at once; a rank that dies makes the collectives fail after the
process group's timeout. Either way nothing is committed and earlier snapshots are untouched.
"""

from __future__ import annotations

import pickle
import time
from dataclasses import dataclass
from typing import Any

from deltackpt._async import saver_for
from deltackpt._dist_plan import (
    Layout,
    Merged,
    PlanCache,
    RankMsg,
    assign,
    merge,
    rank_message,
    remember,
    remember_all,
    resolve,
)
from deltackpt._save import closure, hash_chunks, write_chunks
from deltackpt.errors import DistributedError
from deltackpt.manifest import ChunkRecord, Manifest, Shard, Slice, Stats, StorageView, TensorEntry
from deltackpt.options import SaveOptions
from deltackpt.store import SnapshotInfo, Store

_CACHES: dict[tuple[str, int], PlanCache] = {}


@dataclass
class _Written:
    records: dict[str, ChunkRecord]
    pack_bytes: int
    error: str | None = None


def _cache(st: Store, pg: Any) -> PlanCache:
    return _CACHES.setdefault((str(st.root), id(pg)), PlanCache())


def dist_save(
    state: Any, st: Store, name: str, opts: SaveOptions, meta: dict[str, Any], pg: Any, t0: float
) -> SnapshotInfo:
    import torch.distributed as dist

    rank, world = dist.get_rank(pg), dist.get_world_size(pg)
    cache = _cache(st, pg)
    saver = saver_for(st)
    prepared = None
    plan_bytes = 0
    try:
        # 1-2: plan, stage, hash; send the plan message
        try:
            prepared = saver.prepare(state, name, opts, t0, background=False)
            pool = saver.pool(opts.threads)
            group_bufs: dict[int, Any] = {}
            arrays = prepared.staged.arrays
            digests = hash_chunks(prepared.plan, arrays.__getitem__, pool, group_bufs)
            layout = Layout.of(prepared.plan)
            msg = rank_message(rank, layout, digests, cache)
        except Exception as e:
            msg = RankMsg(rank, "", error=f"{type(e).__name__}: {e}")
            local_error: Exception | None = e
        else:
            local_error = None
        gathered: list[RankMsg] | None = [None] * world if rank == 0 else None  # type: ignore[list-item]
        dist.gather_object(msg, gathered, dst=0, group=pg)

        # 3: rank 0 decides who writes what
        assignment: list[Any] = [None]
        if rank == 0:
            assert gathered is not None
            plan_bytes = sum(len(pickle.dumps(m)) for m in gathered)
            decision = _decide(st, gathered, cache)
            scatter_in = decision[0] if isinstance(decision[0], list) else [decision[0]] * world
        else:
            scatter_in = None
        dist.scatter_object_list(assignment, scatter_in, src=0, group=pg)
        mine = assignment[0]
        if isinstance(mine, str):
            cache.structure = None
            raise DistributedError(mine) from local_error

        # 4-5: write the assigned chunks, report their records
        assert prepared is not None
        try:
            wr = write_chunks(
                st, prepared.plan, arrays.__getitem__, opts, pool, {}, st.delta_refs if prepared.use_refs else None,
                digests=digests, owned=mine, group_bufs=group_bufs,
            )  # fmt: skip
            written = _Written(wr.records, wr.pack_bytes)
        except Exception as e:
            wr = None
            written = _Written({}, 0, f"rank {rank}: {type(e).__name__}: {e}")
        results: list[_Written] | None = [None] * world if rank == 0 else None  # type: ignore[list-item]
        dist.gather_object(written, results, dst=0, group=pg)

        # 6: rank 0 commits; everyone learns the outcome
        outcome: list[Any] = [None]
        if rank == 0:
            assert results is not None
            outcome[0] = _commit(
                st, name, prepared, decision, results, opts, meta, t0, plan_bytes, world
            )
        dist.broadcast_object_list(outcome, src=0, group=pg)
        result = outcome[0]
        if isinstance(result, str):
            cache.structure = None
            raise DistributedError(result)
        remember(cache, rank, layout, digests)
        if rank == 0:
            remember_all(cache, decision[1], decision[2])
        if prepared.use_refs and wr is not None:
            st.delta_refs = wr.refs
            saver._ref_arena = prepared.arena_idx
        return result
    except DistributedError:
        raise
    except Exception as e:  # a collective failed: a peer died or timed out
        cache.structure = None
        raise DistributedError(
            f"distributed save of {name!r} failed on rank {rank} of {world}: {type(e).__name__}: {e}. "
            "No snapshot was committed; earlier snapshots are intact"
        ) from e
    finally:
        if prepared is not None:
            prepared.locks.close()


def _decide(st: Store, msgs: list[RankMsg], cache: PlanCache) -> tuple[Any, Any, Any, Any]:
    """Rank 0: per-rank assignments (or an abort message), plus what the commit needs."""
    errors = [m.error for m in msgs if m.error]
    if errors:
        return (
            f"distributed save aborted before writing: {'; '.join(f'rank {m.rank}: {m.error}' for m in msgs if m.error)}",
            msgs,
            None,
            None,
        )
    try:
        resolved = resolve(msgs, cache)
        merged = merge(resolved)
        index = st.chunk_index()
        owned = assign(resolved, merged.needed, set(index))
    except DistributedError as e:
        return (f"distributed save aborted: {e}", msgs, None, None)
    return (owned, msgs, resolved, (merged, index))


def _commit(
    st: Store,
    name: str,
    prepared: Any,
    decision: tuple[Any, Any, Any, Any],
    results: list[_Written],
    opts: SaveOptions,
    meta: dict[str, Any],
    t0: float,
    plan_bytes: int,
    world: int,
) -> SnapshotInfo | str:
    errors = [w.error for w in results if w.error]
    if errors:
        return "distributed save failed while writing, nothing committed: " + "; ".join(errors)
    if isinstance(decision[0], str):
        return decision[0]
    try:
        _, _, resolved, (merged, index) = decision
        new: dict[str, ChunkRecord] = {}
        for w in results:
            new.update(w.records)
        m = build_dist_manifest(
            name, prepared.plan, resolved, merged, closure(merged.needed, new, index)
        )
        stats = Stats(
            logical_bytes=sum(e.nbytes for e in m.tensors) + sum(n for n, _ in m.storages),
            pack_bytes=sum(w.pack_bytes for w in results),
            chunks_new=len(new),
            chunks_reused=len(merged.needed) - len(new),
            seconds=time.perf_counter() - t0,
            blocked_seconds=time.perf_counter() - t0,
            waited_seconds=prepared.waited,
        )
        m = Manifest(m.name, time.time_ns(), m.tree, m.tensors, m.storages, m.chunks, stats, meta,
                     dist={"world_size": world, "plan_bytes": plan_bytes})  # fmt: skip
        size = st.write_manifest(m, overwrite=opts.overwrite)
        return SnapshotInfo.from_manifest(m, size)
    except Exception as e:
        return f"rank 0 could not commit {name!r}: {type(e).__name__}: {e}"


def build_dist_manifest(
    name: str,
    plan0: Any,
    resolved: list[tuple[Layout, list[str]]],
    merged: Merged,
    records: dict[str, ChunkRecord],
) -> Manifest:
    def slices(rank: int, source: int) -> tuple[Slice, ...]:
        layout, digests = resolved[rank]
        return tuple((digests[ci], s, n) for ci, s, n in layout.source_slices[source])

    tensors = []
    for e, piece in zip(plan0.entries, merged.pieces, strict=True):
        kw: dict[str, Any] = {}
        if piece[0] == "shards":
            kw["shards"] = tuple(Shard(o, sh, slices(r, si)) for o, sh, r, si in piece[1])
        elif piece[0] == "storage":
            kw["storage"] = StorageView(*e.storage)
        else:
            kw["data"] = slices(0, e.source) if e.source is not None else ()
        tensors.append(
            TensorEntry(
                e.path, e.dtype, e.shape, parameter=e.parameter, requires_grad=e.requires_grad, **kw
            )
        )
    storages = tuple((resolved[0][0].nbytes[si], slices(0, si)) for si in plan0.storage_sources)
    return Manifest(name, 0, plan0.tree, tuple(tensors), storages, records)

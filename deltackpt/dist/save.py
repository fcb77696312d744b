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

import json
import os
import pickle
import time
from dataclasses import dataclass
from typing import Any

from deltackpt.saving.engine import SaveHandle, saver_for
from deltackpt.dist.save_plan import (
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
from deltackpt.store.durable import write_durable
from deltackpt.saving.write import closure, hash_chunks, next_refs, write_chunks
from deltackpt.errors import DistributedError
from deltackpt.format.manifest import ChunkRecord, Manifest, Shard, Slice, Stats, StorageView, TensorEntry
from deltackpt.options import SaveOptions
from deltackpt.store.store import SnapshotInfo, Store

_CACHES: dict[tuple[str, int], PlanCache] = {}


@dataclass
class _Written:
    records: dict[str, ChunkRecord]
    pack_bytes: int
    error: str | None = None


def _cache(st: Store, pg: Any) -> PlanCache:
    return _CACHES.setdefault((str(st.root), id(pg)), PlanCache())


class _DistSave:
    """One distributed save on one rank; phases in call order (see the module docstring)."""

    def __init__(
        self, st: Store, name: str, opts: SaveOptions, meta: dict[str, Any], pg: Any, t0: float
    ) -> None:
        import torch.distributed as dist

        self.dist = dist
        self.st, self.name, self.opts, self.meta, self.pg, self.t0 = st, name, opts, meta, pg, t0
        self.rank, self.world = dist.get_rank(pg), dist.get_world_size(pg)
        self.cache = _cache(st, pg)
        self.saver = saver_for(st)
        self.prepared: Any = None
        self.plan_bytes = 0
        self.decision: Any = None
        self.wr: Any = None
        self.blocked: float | None = None  # async: seconds the caller was blocked
        self.epoch = 0
        self.refs_before: dict[str, Any] = {}

    def plan(self, state: Any, background: bool) -> None:
        """Phases 1-3 (collectives, caller's thread): plan, stage, hash, exchange, assign."""
        dist, rank, world = self.dist, self.rank, self.world
        try:
            self.prepared = p = self.saver.prepare(
                state, self.name, self.opts, self.t0, background=background
            )
            self.pool = self.saver.pool(self.opts.threads)
            if p.digests is None:  # CUDA: the state was staged to host buffers; hash those
                p.staged.wait()
                p.digests = hash_chunks(
                    p.plan, p.staged.arrays.__getitem__, self.pool, p.group_bufs
                )
            self.group_bufs = p.group_bufs
            self.arrays = p.staged.arrays
            self.digests = p.digests
            self.layout = Layout.of(self.prepared.plan)
            msg = rank_message(rank, self.layout, self.digests, self.cache)
            local_error: Exception | None = None
        except Exception as e:
            msg = RankMsg(rank, "", error=f"{type(e).__name__}: {e}")
            local_error = e
        gathered: list[RankMsg] | None = [None] * world if rank == 0 else None  # type: ignore[list-item]
        dist.gather_object(msg, gathered, dst=0, group=self.pg)
        assignment: list[Any] = [None]
        scatter_in = None
        if rank == 0 and gathered is not None:
            self.plan_bytes = sum(len(pickle.dumps(m)) for m in gathered)
            self.decision = _decide(self.st, gathered, self.cache)
            d0 = self.decision[0]
            scatter_in = d0 if isinstance(d0, list) else [d0] * world
        dist.scatter_object_list(assignment, scatter_in, src=0, group=self.pg)
        self.mine = assignment[0]
        if isinstance(self.mine, str):
            self.cache.structure = None
            raise DistributedError(self.mine) from local_error
        # still blocking: copy what must outlive this call (assigned chunks, next delta bases)
        self.saver.stage_needed(self.prepared, self.mine)

    def write(self) -> _Written:
        """Phase 4 (any thread, no collectives): write and fsync the assigned chunks."""
        p = self.prepared
        try:
            p.staged.wait()
            refs = self.st.delta_refs if p.use_refs else None
            self.refs_before = refs or {}
            self.wr = write_chunks(
                # the index only vouches for xor bases here; ``owned`` decides what to write
                self.st, p.plan, self.arrays.__getitem__, self.opts, self.pool, p.index, refs,
                digests=self.digests, owned=self.mine, group_bufs=self.group_bufs,
                chunk_data=p.chunk_data,
            )  # fmt: skip
            return _Written(self.wr.records, self.wr.pack_bytes)
        except Exception as e:
            return _Written({}, 0, f"rank {self.rank}: {type(e).__name__}: {e}")

    def commit(self, results: list[_Written]) -> SnapshotInfo | str:
        """Rank 0: build and commit the manifest, or say why not."""
        return _commit(
            self.st, self.name, self.prepared, self.decision, results, self.opts, self.meta,
            self.t0, self.plan_bytes, self.world, self.blocked,
        )  # fmt: skip

    def settle(self, result: SnapshotInfo | str) -> SnapshotInfo:
        """Every rank: adopt the outcome (remember the plan, keep delta bases) or raise."""
        if isinstance(result, str):
            self.cache.structure = None
            raise DistributedError(result)
        remember(self.cache, self.rank, self.layout, self.digests)
        if self.rank == 0:
            remember_all(self.cache, self.decision[1], self.decision[2])
        p = self.prepared
        if p.use_refs and self.wr is not None:
            known = {**p.index, **self.wr.records}  # chunks other ranks wrote: depth unknown
            self.st.delta_refs = next_refs(
                p.plan,
                self.digests,
                self.refs_before,
                p.staged_refs,
                known,
                self.opts.keyframe_every,
            )
        return result

    def finish_collective(self, written: _Written) -> SnapshotInfo:
        """Phases 5-6 with collectives (synchronous saves)."""
        dist = self.dist
        results: list[_Written] | None = [None] * self.world if self.rank == 0 else None  # type: ignore[list-item]
        dist.gather_object(written, results, dst=0, group=self.pg)
        outcome: list[Any] = [None]
        if self.rank == 0 and results is not None:
            outcome[0] = self.commit(results)
        dist.broadcast_object_list(outcome, src=0, group=self.pg)
        return self.settle(outcome[0])

    def finish_files(self, written: _Written, timeout: float) -> SnapshotInfo:
        """Phases 5-6 through files (background threads never run collectives): each rank
        writes its records to tmp/, rank 0 waits for all of them, commits, writes the outcome."""
        d = self.st.tmp_dir / f"{self.name}.{self.epoch}.dist"
        d.mkdir(parents=True, exist_ok=True)
        _put(
            d / f"rank-{self.rank}.json",
            {
                "records": {k: r.to_json() for k, r in written.records.items()},
                "pack_bytes": written.pack_bytes,
                "error": written.error,
            },
        )
        deadline = time.monotonic() + timeout
        if self.rank == 0:
            results = []
            for r in range(self.world):
                doc = _wait(
                    d / f"rank-{r}.json", deadline, f"rank {r} to finish writing {self.name!r}"
                )
                if doc is None:
                    results.append(
                        _Written({}, 0, f"rank {r} did not report within {timeout:.0f}s (dead?)")
                    )
                else:
                    recs = {k: ChunkRecord.from_json(v) for k, v in doc["records"].items()}
                    results.append(_Written(recs, doc["pack_bytes"], doc["error"]))
            outcome = self.commit(results)
            _put(
                d / "outcome.json",
                {"error": outcome} if isinstance(outcome, str) else {"name": outcome.name},
            )
            return self.settle(outcome)
        doc = _wait(d / "outcome.json", deadline, f"rank 0 to commit {self.name!r}")
        if doc is None:
            return self.settle(f"rank 0 did not commit {self.name!r} within {timeout:.0f}s (dead?)")
        if doc.get("error"):
            return self.settle(doc["error"])
        return self.settle(self.st.info(doc["name"]))

    def close(self) -> None:
        if self.prepared is not None:
            self.prepared.locks.close()


def _put(path: Any, doc: dict[str, Any]) -> None:
    tmp = path.with_suffix(".part")
    write_durable(tmp, json.dumps(doc).encode())
    os.replace(tmp, path)


def _wait(path: Any, deadline: float, what: str) -> dict[str, Any] | None:
    delay = 0.005
    while True:
        try:
            return json.loads(path.read_bytes())
        except FileNotFoundError:
            if time.monotonic() >= deadline:
                return None
            time.sleep(delay)
            delay = min(delay * 2, 0.1)


def _wrap(ds: _DistSave, e: Exception) -> DistributedError:
    ds.cache.structure = None
    return DistributedError(
        f"distributed save of {ds.name!r} failed on rank {ds.rank} of {ds.world}: {type(e).__name__}: {e}. "
        "No snapshot was committed; earlier snapshots are intact"
    )


def dist_save(
    state: Any, st: Store, name: str, opts: SaveOptions, meta: dict[str, Any], pg: Any, t0: float
) -> SnapshotInfo:
    ds = _DistSave(st, name, opts, meta, pg, t0)
    try:
        ds.plan(state, background=False)
        return ds.finish_collective(ds.write())
    except DistributedError:
        raise
    except Exception as e:  # a collective failed: a peer died or timed out
        raise _wrap(ds, e) from e
    finally:
        ds.close()


def dist_async_save(
    state: Any, st: Store, name: str, opts: SaveOptions, meta: dict[str, Any], pg: Any, t0: float
) -> SaveHandle:
    """Plan with collectives now; write and commit in the background (no collectives there)."""
    ds = _DistSave(st, name, opts, meta, pg, t0)
    try:
        epoch = [time.time_ns()]
        ds.dist.broadcast_object_list(epoch, src=0, group=pg)  # one tmp dir name for all ranks
        ds.epoch = epoch[0]
        ds.plan(state, background=True)
        ds.blocked = time.perf_counter() - t0
    except DistributedError:
        ds.close()
        raise
    except Exception as e:
        ds.close()
        raise _wrap(ds, e) from e

    def background() -> SnapshotInfo:
        try:
            return ds.finish_files(ds.write(), timeout=opts.lock_timeout)
        finally:
            ds.close()

    return ds.saver.submit(name, background)


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
    blocked: float | None = None,
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
            blocked_seconds=time.perf_counter() - t0 if blocked is None else blocked,
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

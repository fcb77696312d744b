"""Planning-step simulation for bench_dist.py: deltackpt's and DCP's per-save metadata traffic.

No processes and no data: for N ranks holding the Qwen2-0.5B-shaped state sharded Shard(0) (bf16,
tied lm_head as a second key, as ``model.state_dict()`` has it), build exactly what each system's
ranks would exchange and what rank 0 computes, using the systems' own code:

* deltackpt: per rank a :class:`deltackpt.distributed.save_plan.Layout` built like ``plan_state`` builds it
  for DTensor shards (``EntryPlan`` with ``shards``, chunks from ``deltackpt.saving.plan.layout_chunks``
  with the store defaults 4 MiB / 1 MiB), synthetic digests (random 32-hex, as xxh3-128). Each
  save: ``rank_message`` per rank (gathered), rank 0 ``resolve`` + ``merge`` + ``assign``
  (``plan_globally``, + ``remember_all``), the scattered assignments, the gathered records of the chunks each rank
  wrote (``Written``, new chunks only), the manifest (``snapshot_parts`` +
  ``build_manifest`` + ``to_json_bytes``) and the broadcast outcome (``SnapshotInfo``).
* DCP: per rank a ``SavePlan`` of ``WriteItem`` (SHARD, ``TensorWriteData``, ``MetadataIndex``)
  plus the ``planner_data`` flatten mapping ``DefaultSavePlanner`` attaches; rank 0's
  ``DefaultSavePlanner.create_global_plan`` (dedup + global plan + validation) with and without
  ``enable_plan_caching``; ``FileSystemWriter.prepare_global_plan``'s storage prefixes; the
  scattered global plans (or their cached empty deltas); every rank's ``WriteResult`` list
  (gathered at every save, caching or not); the ``Metadata`` with ``storage_data`` that rank 0
  pickles to ``.metadata`` and broadcasts to every rank (``_DistWrapper.all_reduce``).

Bytes are ``len(pickle.dumps(obj))`` of what the collectives pickle (gather_object,
scatter_object_list and broadcast_object_list pickle each object once); a broadcast reaches N-1
ranks, so it is counted N-1 times.
"""

from __future__ import annotations

import dataclasses
import gc
import math
import pickle
import random
import time
from typing import Any

import torch

MiB = 1 << 20


def _local_box(
    shape: tuple[int, ...], n: int, r: int, cache: dict[Any, Any]
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(local shape, global offsets) of rank r's Shard(0) piece: DTensor's own computation."""
    key = (shape, n, r)
    hit = cache.get(key)
    if hit is None:
        from torch.distributed.tensor import Shard
        from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

        sh, off = _compute_local_shape_and_global_offset(shape, (n,), [r], [Shard(0)])
        hit = cache[key] = (tuple(int(x) for x in sh), tuple(int(x) for x in off))
    return hit


def state_keys(
    shapes: list[tuple[str, tuple[int, ...]]], tied: bool
) -> list[tuple[str, tuple[int, ...]]]:
    out = list(shapes)
    if tied:
        out.append(("lm_head.weight", dict(shapes)["model.embed_tokens.weight"]))
    return out


# --------------------------------------------------------------------------- deltackpt


def dk_layout(
    keys: list[tuple[str, tuple[int, ...]]],
    n: int,
    r: int,
    chunk_bytes: int,
    small_bytes: int,
    cache: dict[Any, Any],
) -> tuple[Any, list[int]]:
    """Rank r's Layout as plan_state would build it for its bf16 DTensor shards; (layout, chunk sizes)."""
    from deltackpt.distributed.save_plan import Layout
    from deltackpt.saving.plan import EntryPlan, layout_chunks

    entries = []
    sizes: list[int] = []
    keys_s: list[str] = []
    for path, shape in keys:
        lshape, off = _local_box(shape, n, r, cache)
        # fresh tuples per entry, as plan_state makes them (pickle memoizes shared objects)
        e = EntryPlan(
            path, str(torch.bfloat16).removeprefix("torch."), tuple(list(shape)), False, False
        )
        e.shards = []
        numel = math.prod(lshape)
        if numel:
            e.shards.append((tuple(list(off)), tuple(list(lshape)), len(sizes)))
            keys_s.append(f"{path}@{','.join(map(str, off))}")
            sizes.append(numel * 2)
        entries.append(e)
    chunks, slices = layout_chunks(sizes, [2] * len(sizes), keys_s, chunk_bytes, small_bytes)
    return Layout(entries, [], slices, sizes), [c.size for c in chunks]


def _hex(rng: random.Random) -> str:
    return f"{rng.getrandbits(128):032x}"


def _pk(obj: Any) -> int:
    return len(pickle.dumps(obj))


def _new(s: str) -> str:
    return s.encode().decode()  # an equal but distinct string object


def _unshare(md: Any) -> Any:
    """Give the simulated Metadata the object sharing of a real ``.metadata`` (checked against
    one written by a 2-rank dcp.save), so its pickled size matches: planner_data's values hold
    the state_dict_metadata key objects, its keys are distinct strings, and every storage_data
    MetadataIndex has its own fqn string and offset."""
    from torch.distributed.checkpoint.metadata import MetadataIndex

    out = dataclasses.replace(md)
    out.state_dict_metadata = {_new(k): v for k, v in md.state_dict_metadata.items()}
    if md.planner_data:
        out.planner_data = {
            _new(k): (k2,) for k, k2 in zip(md.planner_data, out.state_dict_metadata, strict=True)
        }
    out.storage_data = {
        MetadataIndex(_new(i.fqn), torch.Size(list(i.offset)), i.index): v
        for i, v in md.storage_data.items()
    }
    return out


def sim_deltackpt(
    keys: list[tuple[str, tuple[int, ...]]],
    n: int,
    fracs: list[float],
    chunk_bytes: int = 4 * MiB,
    small_bytes: int = 1 * MiB,
    seed: int = 0,
) -> list[dict[str, Any]]:
    from deltackpt.distributed.save import Written
    from deltackpt.distributed.save_plan import (
        PlanCache,
        plan_globally,
        rank_message,
        remember,
        remember_all,
        snapshot_parts,
    )
    from deltackpt.format.manifest import ChunkRecord
    from deltackpt.format.tree import flatten
    from deltackpt.saving.commit import Timing, build_manifest
    from deltackpt.store.packs import new_pack_id
    from deltackpt.store.store import SnapshotInfo

    rng = random.Random(seed)
    box_cache: dict[Any, Any] = {}
    layouts, csizes = [], []
    for r in range(n):
        lay, cs = dk_layout(keys, n, r, chunk_bytes, small_bytes, box_cache)
        layouts.append(lay)
        csizes.append(cs)
    nchunks = [len(cs) for cs in csizes]
    total_chunks = sum(nchunks)
    digests = [[_hex(rng) for _ in range(nc)] for nc in nchunks]
    caches = [PlanCache() for _ in range(n)]
    # rank 0's SavePlan fields the manifest needs: its entries (the global view) and the tree
    tree, _ = flatten({p: torch.empty(0) for p, _ in keys})
    plan0 = type("Plan0", (), {"entries": layouts[0].entries, "tree": tree, "storage_sources": []})
    index: dict[str, ChunkRecord] = {}
    packs = [new_pack_id() for _ in range(n)]
    rows = []
    for step, frac in enumerate([None, *fracs]):
        if frac is not None and frac > 0:
            k = max(1, round(frac * total_chunks))
            flat = [(r, ci) for r in range(n) for ci in range(nchunks[r])]
            for r, ci in rng.sample(flat, k) if k < len(flat) else flat:
                digests[r][ci] = _hex(rng)
        changed = 0 if frac is None else (max(1, round(frac * total_chunks)) if frac else 0)
        gc.collect()
        t = time.perf_counter()
        msgs = [rank_message(r, layouts[r], digests[r], caches[r]) for r in range(n)]
        t_msg = (time.perf_counter() - t) / n
        gather_plan = sum(_pk(m) for m in msgs)
        t0 = time.perf_counter()
        gp = plan_globally(msgs, caches[0], index)
        t_decide = time.perf_counter() - t0
        owned = gp.owned
        scatter = sum(_pk(o) for o in owned)
        written = []
        pack_bytes = 0
        new: dict[str, ChunkRecord] = {}
        for r in range(n):
            recs = {}
            off = 0
            for ci in sorted(owned[r]):
                size = csizes[r][ci]
                recs[digests[r][ci]] = ChunkRecord(packs[r], off, size, size, "raw", 2)
                off += -(-size // 4096) * 4096
            new.update(recs)
            pack_bytes += off
            written.append(Written(recs, off))
        gather_rec = sum(_pk(w) for w in written)
        t1 = time.perf_counter()
        dist = {"world_size": n, "plan_bytes": gather_plan}
        parts = snapshot_parts(f"s{step}", plan0, gp.resolved, gp.merged, new, pack_bytes, {}, dist)
        m = build_manifest(parts, index, Timing(t1), time.time_ns())
        manifest = m.to_json_bytes()
        t_manifest = time.perf_counter() - t1
        outcome = _pk(SnapshotInfo.from_manifest(m, len(manifest))) * (n - 1)
        t2 = time.perf_counter()
        for r in range(n):
            remember(caches[r], layouts[r], digests[r])
        remember_all(caches[0], msgs, gp.resolved)
        t_remember = time.perf_counter() - t2
        index.update(new)
        rows.append(
            {
                "N": n,
                "save": "#1 full" if frac is None else f"{frac:.0%} changed",
                "chunks": total_chunks,
                "changed": total_chunks if frac is None else changed,
                "new_chunks": len(new),
                "gather_plan": gather_plan,
                "scatter_assign": scatter,
                "gather_records": gather_rec,
                "bcast_outcome": outcome,
                "exchanged": gather_plan + scatter + gather_rec + outcome,
                "manifest": len(manifest),
                "t_rank_msg_ms": t_msg * 1e3,
                "t_rank0_ms": (t_decide + t_remember) * 1e3,
                "t_manifest_ms": t_manifest * 1e3,
            }
        )
    return rows


# --------------------------------------------------------------------------- DCP


def dcp_local_plans(keys: list[tuple[str, tuple[int, ...]]], n: int) -> list[Any]:
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        MetadataIndex,
        TensorProperties,
    )
    from torch.distributed.checkpoint.planner import (
        SavePlan,
        TensorWriteData,
        WriteItem,
        WriteItemType,
    )

    box_cache: dict[Any, Any] = {}
    mappings = {fqn: (fqn,) for fqn, _ in keys}  # flatten_state_dict of a flat dict
    plans = []
    for r in range(n):
        items = []
        for fqn, shape in keys:
            lshape, off = _local_box(shape, n, r, box_cache)
            items.append(
                WriteItem(
                    index=MetadataIndex(fqn, torch.Size(off)),
                    type=WriteItemType.SHARD,
                    tensor_data=TensorWriteData(
                        chunk=ChunkStorageMetadata(
                            offsets=torch.Size(off), sizes=torch.Size(lshape)
                        ),
                        properties=TensorProperties(dtype=torch.bfloat16),
                        size=torch.Size(shape),
                    ),
                )
            )
        plans.append(SavePlan(items, planner_data=mappings))
    return plans


def _reset_dcp_caches() -> None:
    from torch.distributed.checkpoint.planner import SavePlanner

    for attr in (
        "_cached_save_plan",
        "_cached_all_plans",
        "_cached_global_plan",
        "_cached_metadata",
        "_cached_final_save_plan",
    ):
        d = getattr(SavePlanner, attr, None)
        if isinstance(d, dict):
            d.clear()


def sim_dcp(keys: list[tuple[str, tuple[int, ...]]], n: int) -> list[dict[str, Any]]:
    """DCP's metadata traffic per save for an unchanged structure (data changes do not change
    DCP's plans: it rewrites everything). Runs ``DefaultSavePlanner(enable_plan_caching=True)``:
    save #1 (which hydrates the cache by doing exactly the no-caching work) and save #2 with
    every rank's local plan unchanged (``SavePlan([], usable=False)``). Without caching every
    save repeats #1's work on the same plans, so "#2+ no caching" reports #1's numbers."""
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.checkpoint.filesystem import _StorageInfo, _StoragePrefix
    from torch.distributed.checkpoint.metadata import StorageMeta
    from torch.distributed.checkpoint.planner import SavePlan
    from torch.distributed.checkpoint.storage import WriteResult

    _reset_dcp_caches()
    full_local = dcp_local_plans(keys, n)
    rows = []
    for s in range(2):
        planner = DefaultSavePlanner(enable_plan_caching=True)
        local = [SavePlan([], usable=False) for _ in range(n)] if s else full_local
        gather_plan = sum(_pk(p) for p in local)
        gc.collect()
        t0 = time.perf_counter()
        delta, metadata = planner.create_global_plan(local)
        t_global = time.perf_counter() - t0
        delta = [
            dataclasses.replace(p, storage_data=_StoragePrefix(f"__{i}_"))
            if p.storage_data is None
            else p
            for i, p in enumerate(delta)
        ]
        scatter = sum(_pk(p) for p in delta)
        final = planner.global_plan  # what finish_plan writes on every rank (cached or not)
        results = []
        for r, plan in enumerate(final):
            off, wrs = 0, []
            fname = f"__{r}_0.distcp"  # one file per rank, its name shared by its items
            for item in plan.items:
                size = math.prod(item.tensor_data.chunk.sizes) * 2  # bf16
                wrs.append(
                    WriteResult(
                        index=item.index,
                        size_in_bytes=size,
                        storage_data=_StorageInfo(fname, off, size),
                    )
                )
                off += size
            results.append(wrs)
        gather_results = sum(_pk(w) for w in results)
        t1 = time.perf_counter()
        md = dataclasses.replace(metadata)  # FileSystemWriter.finish
        storage_md = {}
        for wr_list in results:
            storage_md.update({wr.index: wr.storage_data for wr in wr_list})
        md.storage_data = storage_md
        md.storage_meta = StorageMeta(checkpoint_id="/ckpt/step-000100", save_id="x" * 36)
        md_bytes = _pk(_unshare(md))
        t_finish = time.perf_counter() - t1
        rows.append(
            {
                "N": n,
                "save": "#2+ with caching" if s else "#1 (and #2+ no caching)",
                "items": sum(len(p.items) for p in full_local),
                "gather_plan": gather_plan,
                "scatter_plan": scatter,
                "gather_results": gather_results,
                "bcast_metadata": md_bytes * (n - 1),
                "metadata_file": md_bytes,
                "exchanged": gather_plan + scatter + gather_results + md_bytes * (n - 1),
                "t_global_ms": t_global * 1e3,
                "t_finish_ms": t_finish * 1e3,
            }
        )
    _reset_dcp_caches()
    return rows

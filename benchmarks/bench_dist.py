"""Distributed checkpointing: deltackpt(process_group=pg) vs torch.distributed.checkpoint (DCP).

Part 1, real: 2 ranks on this machine (spawned processes, gloo on 127.0.0.1, a hard timeout),
the Qwen2-0.5B-shaped state (hidden 896, MLP 4864, 24 layers, 14 q / 2 kv heads of dim 64, vocab
151936, q/k/v biases, tied lm_head; ~494M params) as bf16 DTensors ``Shard(0)`` on a 1-D mesh of
2. Each rank builds only its own shards (seeded per rank) as an fp32 master plus its bf16 copy.
The state is the flat ``{fqn: DTensor}`` dict, with ``lm_head.weight`` the same DTensor object as
``model.embed_tokens.weight`` (as ``model.state_dict()`` returns tied weights).

"Step": one AdamW step at lr=1e-5 as Adam's first step is, ``w -= lr * sign(g)``: the fp32
master takes ``w.sub_(1e-5 * s)`` with ``s`` = +-1 (views at random offsets into a fixed random
+-1 pool, so drawing the signs costs no RNG time), then the bf16 weights are ``copy_``-ed from it
in place (~10-15% of bf16 elements change, every 4 MiB chunk changes).

Timed per system (median of ``--reps``; each time is the max over ranks, taken after a barrier):
deltackpt.save full (fresh store), unchanged (same store, no step), incremental (step, save);
deltackpt.load(into=DTensors, process_group=pg) into the same layout and resharded (2-D
``Shard(1)``, 1-D ``Replicate``); deltackpt.async_save after a step (blocking = until it returns,
total = until ``result()``). DCP: ``dcp.save`` with ``FileSystemWriter`` (defaults: fsync, 1
thread) full (fresh dir) and after a step (fresh dir; DCP rewrites everything), once more with
``DefaultSavePlanner(enable_plan_caching=True)``; ``dcp.load`` with ``FileSystemReader`` into the
same two layouts; ``dcp.async_save`` after a step. Loads are verified bit-exact (every rank's
local shards against the saved values; resharded targets against ``redistribute`` of the saved
DTensors). Bytes = growth of ``du`` of the store / checkpoint directory.

Part 2, simulated (benchmarks/_dist_sim.py): the planning step of both systems at N ranks
(default 2, 64, 256, 1024) with their real classes and functions; bytes exchanged per save and
rank 0's planning time, for a full save and for saves after 0%, 1%, 10%, 100% of chunks changed.

    python benchmarks/bench_dist.py                      # default: real 2 ranks + simulation
    python benchmarks/bench_dist.py --scale 0.05 --sim-ranks 2,16   # quick debug
    python benchmarks/bench_dist.py --skip-real          # simulation only
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import json
import math
import multiprocessing as mp
import os
import pickle
import queue
import random
import shutil
import socket
import statistics
import sys
import time
import traceback
import warnings
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as C

T_START = time.perf_counter()


def log(*a: Any) -> None:
    print(f"[{time.perf_counter() - T_START:7.1f}s]", *a, file=sys.stderr, flush=True)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


# =========================================================================== part 1: 2 real ranks


class _Rank:
    """Everything one rank does; rank 0 collects the results."""

    def __init__(self, rank: int, world: int, port: int, cfg: dict[str, Any]) -> None:
        import torch
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        warnings.filterwarnings("ignore")
        torch.set_num_threads(cfg["torch_threads"])
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=cfg["pg_timeout"]),
        )
        self.torch, self.dist = torch, dist
        self.pg = dist.group.WORLD
        self.rank, self.world, self.cfg = rank, world, cfg
        self.mesh = init_device_mesh("cpu", (world,))
        self.work = Path(cfg["workdir"])
        self.rows: list[dict[str, Any]] = []
        self.checks: dict[str, Any] = {}
        self.rng = random.Random(1000 + rank)
        self._install_counters()

    # ----------------------------------------------------------------- collective bytes

    def _install_counters(self) -> None:
        """Count the pickled bytes every object collective carries (both libraries call these
        through the ``torch.distributed`` module): gather = every rank's object, scatter = every
        element of the source's list, broadcast = the source's objects x (world - 1), the same
        rules as the simulation. Re-pickling costs ~1 ms per save (objects are <= ~150 kB)."""
        dist, me = self.dist, self
        self.coll: Counter = Counter()
        orig = {
            n: getattr(dist, n)
            for n in ("gather_object", "scatter_object_list", "broadcast_object_list")
        }

        def size(objs: Any) -> int:
            return sum(len(pickle.dumps(o)) for o in objs)

        def gather_object(*a: Any, **k: Any) -> Any:
            me.coll["gather"] += size([a[0] if a else k["obj"]])
            return orig["gather_object"](*a, **k)

        def scatter_object_list(*a: Any, **k: Any) -> Any:
            lst = a[1] if len(a) > 1 else k.get("scatter_object_input_list")
            if lst is not None:
                me.coll["scatter"] += size(lst)
            return orig["scatter_object_list"](*a, **k)

        def broadcast_object_list(*a: Any, **k: Any) -> Any:
            src = a[1] if len(a) > 1 else k.get("src", 0)
            if dist.get_rank() == (src or 0):
                me.coll["broadcast"] += size(a[0] if a else k["object_list"]) * (me.world - 1)
            return orig["broadcast_object_list"](*a, **k)

        dist.gather_object = gather_object
        dist.scatter_object_list = scatter_object_list
        dist.broadcast_object_list = broadcast_object_list

    def coll_sum(self) -> dict[str, int]:
        """Collective bytes since the last call, summed over ranks."""
        keys = ("gather", "scatter", "broadcast")
        t = self.torch.tensor([self.coll[k] for k in keys], dtype=self.torch.int64)
        self.coll.clear()
        self.dist.all_reduce(t, group=self.pg)
        out = dict(zip(keys, (int(x) for x in t.tolist()), strict=True))
        out["total"] = sum(out.values())
        return out

    # ----------------------------------------------------------------- helpers

    def barrier(self) -> None:
        self.dist.barrier(group=self.pg)

    def max_over_ranks(self, x: float) -> float:
        t = self.torch.tensor([x], dtype=self.torch.float64)
        self.dist.all_reduce(t, op=self.dist.ReduceOp.MAX, group=self.pg)
        return float(t.item())

    def all_true(self, ok: bool) -> bool:
        t = self.torch.tensor([0 if ok else 1], dtype=self.torch.int64)
        self.dist.all_reduce(t, op=self.dist.ReduceOp.SUM, group=self.pg)
        return int(t.item()) == 0

    def timed(self, fn: Any) -> tuple[float, Any]:
        gc.collect()
        self.barrier()
        t0 = time.perf_counter()
        out = fn()
        return self.max_over_ranks(time.perf_counter() - t0), out

    def du(self, path: Path) -> int:
        """Allocated bytes under ``path`` (rank 0 measures after everyone finished)."""
        self.barrier()
        n = C.du_bytes(path) if self.rank == 0 else 0
        self.barrier()
        return n

    def rm(self, path: Path) -> None:
        self.barrier()
        if self.rank == 0:
            shutil.rmtree(path, ignore_errors=True)
        self.barrier()

    def cold(self) -> None:
        if self.cfg["cold"]:
            self.barrier()
            if self.rank == 0:
                C.drop_caches()
            self.barrier()

    def rss_gb(self) -> float:
        with open("/proc/self/statm") as f:
            return self.max_over_ranks(int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1e9)

    def rec(
        self, system: str, op: str, secs: list[float], nbytes: int | None = None, **extra: Any
    ) -> None:
        extra["max_rank_rss_gb"] = round(self.rss_gb(), 2)
        if self.rank == 0:
            self.rows.append({"system": system, "op": op, "secs": secs, "bytes": nbytes, **extra})
            log(
                f"  {system:9s} {op:48s} "
                + " ".join(f"{s:.2f}" for s in secs)
                + (f"  bytes {nbytes / 1e6:.1f} MB" if nbytes is not None else "")
                + (f"  {extra}" if extra else "")
            )

    # ----------------------------------------------------------------- the state

    def build(self) -> None:
        torch = self.torch
        from torch.distributed.tensor import DTensor, Shard
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        t0 = time.perf_counter()
        self.shapes = C.qwen2_shapes(self.cfg["scale"])
        self.masters: dict[str, Any] = {}
        self.bf16: dict[str, Any] = {}
        self.state: dict[str, Any] = {}
        for i, (name, shape) in enumerate(self.shapes):
            lshape, _ = compute_local_shape_and_global_offset(shape, self.mesh, [Shard(0)])
            g = torch.Generator().manual_seed(7919 * i + self.rank)
            if name.endswith("norm.weight"):
                m = torch.ones(lshape)
            else:
                m = torch.empty(lshape).normal_(0, 0.02, generator=g)
            b = m.to(torch.bfloat16)
            dt = DTensor.from_local(
                b,
                self.mesh,
                [Shard(0)],
                run_check=False,
                shape=torch.Size(shape),
                stride=_contig_stride(shape),
            )
            assert dt.to_local().data_ptr() == b.data_ptr()
            self.masters[name], self.bf16[name], self.state[name] = m, b, dt
        if self.cfg["tied"]:
            self.state["lm_head.weight"] = self.state["model.embed_tokens.weight"]
        self.unique_global_bytes = sum(math.prod(s) * 2 for _, s in self.shapes)
        g = torch.Generator().manual_seed(99 + self.rank)
        self.pool = (torch.randint(0, 2, (1 << 22,), generator=g).to(torch.float32) * 2 - 1) * 1e-5
        self.steps = 0
        self.barrier()
        if self.rank == 0:
            log(
                f"state built in {time.perf_counter() - t0:.1f}s: {len(self.state)} keys, "
                f"{self.unique_global_bytes / 1e9:.3f} GB bf16 (global, tied counted once)"
            )

    def step(self) -> None:
        P = self.pool.numel()
        for name, m in self.masters.items():
            flat = m.view(-1)
            n, pos = flat.numel(), 0
            while pos < n:
                k = min(P // 2, n - pos)
                off = self.rng.randrange(0, P - k + 1)
                flat[pos : pos + k].sub_(self.pool[off : off + k])
                pos += k
            self.bf16[name].copy_(m)
        self.steps += 1

    def targets(self, resharded: bool) -> dict[str, Any]:
        """Zeroed DTensors to load into: the saved layout, or 2-D Shard(1) / 1-D Replicate."""
        torch = self.torch
        from torch.distributed.tensor import DTensor, Replicate, Shard
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        out: dict[str, Any] = {}
        for name, shape in self.shapes:
            pl = [Shard(0)] if not resharded else [Shard(1) if len(shape) == 2 else Replicate()]
            lshape, _ = compute_local_shape_and_global_offset(shape, self.mesh, pl)
            out[name] = DTensor.from_local(
                torch.zeros(lshape, dtype=torch.bfloat16),
                self.mesh,
                pl,
                run_check=False,
                shape=torch.Size(shape),
                stride=_contig_stride(shape),
            )
        if self.cfg["tied"]:
            out["lm_head.weight"] = out["model.embed_tokens.weight"]
        return out

    def verify(self, tgt: dict[str, Any]) -> bool:
        """Bit-exact check of this rank's loaded locals against the saved values: the saved
        bf16 shards themselves, or (other placements) ``redistribute`` of the saved DTensor,
        one tensor at a time (no second copy of the state)."""
        ok = True
        for name, _ in self.shapes:
            t = tgt[name]
            if tuple(t.placements) == tuple(self.state[name].placements):
                ok = C.bit_equal(t.to_local(), self.bf16[name]) and ok
            else:
                exp = self.state[name].redistribute(self.mesh, t.placements).to_local()
                ok = C.bit_equal(t.to_local(), exp) and ok
                del exp
        return self.all_true(ok)

    def zero(self, tgt: dict[str, Any]) -> None:
        for k, _ in self.shapes:
            tgt[k].to_local().zero_()

    # ----------------------------------------------------------------- deltackpt

    def release_store(self, path: Path) -> None:
        """Benchmark hygiene: free a finished store's staging arenas (deltackpt keeps Store
        objects, and their arenas, alive per path for the life of the process)."""
        import deltackpt

        st = deltackpt.open_store(path, create=False)
        s = getattr(st, "_saver", None)
        if s is not None:
            s.flush()
            for a in s._arenas:
                a.buffers.clear()
        st.delta_refs = {}
        trim()

    def dk_save(self, path: Path, name: str, label: str, out: list[float], extra: dict) -> None:
        import deltackpt

        before = self.du(path)
        self.coll.clear()
        secs, info = self.timed(
            lambda: deltackpt.save(self.state, path, name, process_group=self.pg)
        )
        out.append(secs)
        coll = self.coll_sum()
        if self.rank == 0:
            extra.setdefault("coll", []).append(coll)
        added = self.du(path) - before
        if self.rank == 0:
            st = deltackpt.open_store(path)
            m = st.manifest(name)
            old = self.prev_chunks.get(str(path), set())
            codecs = Counter(r.codec for d, r in m.chunks.items() if d not in old)
            self.prev_chunks[str(path)] = old | set(m.chunks)
            extra.setdefault("bytes", []).append(added)
            extra.setdefault("bytes_written", []).append(info.bytes_written)
            extra.setdefault("plan_bytes", []).append(m.dist["plan_bytes"])
            extra.setdefault("manifest_bytes", []).append(st.manifest_path(name).stat().st_size)
            extra.setdefault("chunks_new", []).append(info.chunks_new)
            extra.setdefault("codecs_new", []).append(dict(codecs))
            extra.setdefault("lib_seconds", []).append(round(info.seconds, 3))

    def run_deltackpt(self) -> None:
        import deltackpt

        reps = self.cfg["reps"]
        self.prev_chunks: dict[str, set[str]] = {}
        log("deltackpt") if self.rank == 0 else None
        full: list[float] = []
        fx: dict[str, Any] = {}
        for i in range(reps):
            path = self.work / f"dk-full-{i}"
            self.rm(path)
            if self.rank == 0:
                deltackpt.open_store(path)
            self.barrier()
            self.dk_save(path, "s0", "full", full, fx)
            last = i == reps - 1 or (i >= 1 and full[0] > 10)  # >10 s per save: 2 runs
            if not last:
                self.release_store(path)
                self.rm(path)
            else:
                break
        store = path
        self.store = store
        self.rec("deltackpt", "save full (fresh store)", full, med(fx.get("bytes", [0])), **_x(fx))
        self.load_both(
            "deltackpt",
            lambda tgt: deltackpt.load(store, "s0", into=tgt, process_group=self.pg),
            "snapshot s0: the full save (keyframe)",
        )
        un: list[float] = []
        ux: dict[str, Any] = {}
        for i in range(reps):
            self.dk_save(store, f"u{i}", "unchanged", un, ux)
        self.rec("deltackpt", "save unchanged (no step)", un, med(ux.get("bytes", [0])), **_x(ux))
        inc: list[float] = []
        ix: dict[str, Any] = {}
        for i in range(reps):
            self.step()
            self.dk_save(store, f"i{i}", "incremental", inc, ix)
        self.rec(
            "deltackpt", "save incremental (after step)", inc, med(ix.get("bytes", [0])), **_x(ix)
        )
        # async, after a step each (same store: staging arenas already allocated)
        blk, tot, ax = [], [], {}
        for i in range(reps):
            self.step()
            before = self.du(store)
            gc.collect()
            self.barrier()
            t0 = time.perf_counter()
            h = deltackpt.async_save(self.state, store, f"a{i}", process_group=self.pg)
            t1 = time.perf_counter()
            info = h.result(timeout=self.cfg["pg_timeout"])
            t2 = time.perf_counter()
            blk.append(self.max_over_ranks(t1 - t0))
            tot.append(self.max_over_ranks(t2 - t0))
            added = self.du(store) - before
            if self.rank == 0:
                ax.setdefault("bytes", []).append(added)
                ax.setdefault("lib_blocked", []).append(round(info.blocked_seconds, 3))
                m = deltackpt.open_store(store).manifest(f"a{i}")
                old = self.prev_chunks.get(str(store), set())
                ax.setdefault("codecs_new", []).append(
                    dict(Counter(r.codec for d, r in m.chunks.items() if d not in old))
                )
                self.prev_chunks[str(store)] = old | set(m.chunks)
        self.rec(
            "deltackpt", "async_save after step: blocking", blk, med(ax.get("bytes", [0])), **_x(ax)
        )
        self.rec("deltackpt", "async_save after step: total (result())", tot)
        # the saved layout, to check the simulation's inputs
        from deltackpt.dist.save_plan import Layout
        from deltackpt.saving.plan import plan_state

        st = deltackpt.open_store(store)
        self.checks[f"dk_layout_key_rank{self.rank}"] = Layout.of(
            plan_state(self.state, st.chunk_bytes, st.small_bytes)
        ).key()
        # every rank rebuilds the store's chunk index (all manifests) at every save
        ci = []
        for _ in range(3):
            t0 = time.perf_counter()
            idx = st.chunk_index()
            ci.append(round((time.perf_counter() - t0) * 1e3, 1))
        self.checks[f"chunk_index_ms_rank{self.rank}"] = {
            "ms": ci,
            "snapshots": len(st.names()),
            "records": len(idx),
        }
        self.release_store(store)
        name = f"a{reps - 1}"
        depth = _chain_depth(st, name) if self.rank == 0 else None
        self.load_both(
            "deltackpt",
            lambda tgt: deltackpt.load(store, name, into=tgt, process_group=self.pg),
            f"snapshot {name}: last of {2 * reps} incremental saves (xor chains, max depth {depth})",
        )
        self.rm(store)

    # ----------------------------------------------------------------- DCP

    def run_dcp(self) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
        from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

        rank = self.rank
        stats: dict[str, Any] = {}

        class RecPlanner(DefaultSavePlanner):
            def create_local_plan(self):  # type: ignore[no-untyped-def]
                p = super().create_local_plan()
                stats.setdefault("local_plan_bytes", []).append(len(pickle.dumps(p)))
                return p

            def create_global_plan(self, all_plans):  # type: ignore[no-untyped-def]
                t0 = time.perf_counter()
                out = super().create_global_plan(all_plans)
                stats.setdefault("global_plan_ms", []).append(
                    round((time.perf_counter() - t0) * 1e3, 1)
                )
                stats.setdefault("gathered_plan_bytes", []).append(
                    sum(len(pickle.dumps(p)) for p in all_plans)
                )
                stats.setdefault("scattered_plan_bytes", []).append(
                    sum(len(pickle.dumps(p)) for p in out[0])
                )
                return out

        class RecWriter(FileSystemWriter):
            def finish(self, metadata, results):  # type: ignore[no-untyped-def]
                stats.setdefault("gathered_results_bytes", []).append(
                    sum(len(pickle.dumps(r)) for r in results)
                )
                super().finish(metadata, results)
                stats.setdefault("metadata_bytes", []).append(
                    os.path.getsize(os.path.join(self.path, ".metadata"))
                )

        def save(path: Path, caching: bool) -> Any:
            return dcp.save(
                self.state,
                storage_writer=RecWriter(str(path)),
                planner=RecPlanner(enable_plan_caching=caching),
                process_group=self.pg,
            )

        log("DCP") if rank == 0 else None
        reps = self.cfg["reps"]
        for label, do_step, caching in (
            ("save full (fresh dir)", False, False),
            ("save after step (rewrites all)", True, False),
            ("save after step, plan caching", True, True),
        ):
            secs, sizes = [], []
            stats.clear()
            for i in range(reps):
                if do_step:
                    self.step()
                path = self.work / f"dcp-{'c' if caching else 's' if do_step else 'f'}-{i}"
                self.rm(path)
                self.coll.clear()
                s, _ = self.timed(lambda p=path, c=caching: save(p, c))
                secs.append(s)
                stats.setdefault("coll", []).append(self.coll_sum())
                sizes.append(self.du(path))
                if label == "save full (fresh dir)" and i == reps - 1:
                    self.dcp_path = path
                    # load right away, while the state equals what was saved
                    self.rec(
                        "DCP",
                        label,
                        secs,
                        med(sizes),
                        bytes_each=sizes,
                        **{k: v for k, v in stats.items() if rank == 0 or k == "local_plan_bytes"},
                    )
                    self.checks[f"dcp_local_plan_bytes_rank{rank}"] = stats["local_plan_bytes"]
                    self.load_both(
                        "DCP",
                        lambda tgt, p=path: dcp.load(
                            tgt, storage_reader=FileSystemReader(str(p)), process_group=self.pg
                        ),
                    )
                else:
                    self.rm(path)
            trim()
            if label != "save full (fresh dir)":
                self.rec(
                    "DCP",
                    label,
                    secs,
                    med(sizes),
                    bytes_each=sizes,
                    **{k: v for k, v in stats.items() if k != "local_plan_bytes"},
                )
        self.rm(self.dcp_path)
        blk, tot, sizes = [], [], []
        for i in range(reps):
            self.step()
            path = self.work / f"dcp-a-{i}"
            self.rm(path)
            gc.collect()
            self.barrier()
            t0 = time.perf_counter()
            fut = dcp.async_save(
                self.state, storage_writer=FileSystemWriter(str(path)), process_group=self.pg
            )
            t1 = time.perf_counter()
            fut.result()
            t2 = time.perf_counter()
            blk.append(self.max_over_ranks(t1 - t0))
            tot.append(self.max_over_ranks(t2 - t0))
            sizes.append(self.du(path))
            self.rm(path)
        self.rec("DCP", "async_save after step: blocking", blk, med(sizes))
        self.rec("DCP", "async_save after step: total (future)", tot)
        trim()

    # ----------------------------------------------------------------- loads (both systems)

    def load_both(self, system: str, load: Any, variant: str = "") -> None:
        for resharded in (False, True):
            tgt = self.targets(resharded)
            secs, ok = [], True
            for _ in range(self.cfg["reps"]):
                self.zero(tgt)
                self.cold()
                s, _ = self.timed(lambda t=tgt: load(t))
                secs.append(s)
                ok = self.verify(tgt) and ok
            what = (
                "resharded to 2-D Shard(1) / 1-D Replicate" if resharded else "same layout Shard(0)"
            )
            mode = "cold" if self.cfg["cold"] else "warm"
            self.rec(
                system,
                f"load {what} ({mode}){' - ' + variant if variant else ''}",
                secs,
                None,
                bit_exact=ok,
            )
            del tgt
            trim()

    def main(self) -> dict[str, Any]:
        self.build()
        order = ("dcp", "dk") if self.cfg["dcp_first"] else ("dk", "dcp")
        for which in order:
            self.run_deltackpt() if which == "dk" else self.run_dcp()
            self.barrier()
        keys = [None] * self.world
        self.dist.all_gather_object(keys, self.checks, group=self.pg)
        self.dist.destroy_process_group()
        return {
            "rows": self.rows,
            "checks": keys,
            "unique_global_bytes": self.unique_global_bytes,
            "keys": len(self.state),
            "steps": self.steps,
        }


def _chain_depth(st: Any, name: str) -> int:
    """Longest xor chain (links to a keyframe) among a snapshot's chunks."""
    m = st.manifest(name)
    best = 0
    for rec in m.chunks.values():
        d = 0
        while rec.base is not None:
            d += 1
            rec = m.chunks[rec.base]
        best = max(best, d)
    return best


def trim() -> None:
    """gc, then glibc malloc_trim: hand freed heap back to the OS between phases (benchmark
    hygiene on a shared 24 GB machine; timed operations are unaffected)."""
    import ctypes

    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def _x(d: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in d.items() if k != "bytes"} | (
        {"bytes_each": d["bytes"]} if "bytes" in d else {}
    )


def _contig_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    out, acc = [], 1
    for n in reversed(shape):
        out.append(acc)
        acc *= n
    return tuple(reversed(out))


def _child(rank: int, world: int, port: int, cfg: dict[str, Any], q: Any) -> None:
    try:
        q.put((rank, True, _Rank(rank, world, port, cfg).main()))
    except BaseException:
        q.put((rank, False, traceback.format_exc()))


def mem_available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable"):
                return int(line.split()[1]) * 1024
    return 0


def run_real(cfg: dict[str, Any], timeout: float) -> dict[str, Any]:
    """Spawn the ranks, wait at most ``timeout`` s, kill them (by pid) if they overrun or if the
    machine runs out of memory (other jobs share it)."""
    world = cfg["world"]
    need = cfg["mem_need"]
    t_wait = time.monotonic() + cfg["mem_wait"]
    while mem_available() < need:
        if time.monotonic() > t_wait:
            raise RuntimeError(
                f"MemAvailable {mem_available() / 1e9:.1f} GB < {need / 1e9:.1f} GB "
                "needed by the ranks; not starting (other jobs use the memory)"
            )
        log(
            f"waiting for memory: {mem_available() / 1e9:.1f} GB available, {need / 1e9:.1f} needed"
        )
        time.sleep(10)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_child, args=(r, world, port, cfg, q), daemon=True) for r in range(world)
    ]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    results: dict[int, Any] = {}
    errors: dict[int, str] = {}
    try:
        while len(results) + len(errors) < world:
            if time.monotonic() > deadline:
                raise TimeoutError(f"real run exceeded {timeout:g}s; errors so far: {errors}")
            if mem_available() < cfg["mem_floor"]:
                raise MemoryError(
                    f"MemAvailable fell to {mem_available() / 1e9:.2f} GB; stopped the "
                    "ranks to protect the other jobs on this machine"
                )
            try:
                r, ok, payload = q.get(timeout=0.5)
            except queue.Empty:
                if (
                    any(not p.is_alive() and p.exitcode not in (0, None) for p in procs)
                    and not q.qsize()
                ):
                    dead = [(i, p.exitcode) for i, p in enumerate(procs) if not p.is_alive()]
                    time.sleep(2)
                    if q.empty():
                        raise RuntimeError(
                            f"rank(s) died without reporting: {dead}; {errors}"
                        ) from None
                continue
            (results if ok else errors)[r] = payload
            if not ok:
                log(f"rank {r} failed:\n{payload}")
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join(5)
    if errors:
        raise RuntimeError(f"ranks failed: {list(errors)}")
    return results[0]


# =========================================================================== part 2: simulation


def run_sim(ranks: list[int], fracs: list[float], tied: bool) -> dict[str, Any]:
    import _dist_sim as S

    keys = S.state_keys(C.qwen2_shapes(1.0), tied)
    out: dict[str, Any] = {"dk": [], "dcp": [], "layout_keys": {}}
    for n in ranks:
        t0 = time.perf_counter()
        out["dk"] += S.sim_deltackpt(keys, n, fracs)
        t1 = time.perf_counter()
        out["dcp"] += S.sim_dcp(keys, n)
        t2 = time.perf_counter()
        log(f"sim N={n}: deltackpt {t1 - t0:.1f}s, DCP {t2 - t1:.1f}s")
    return out


def sim_check(scale: float, world: int, tied: bool) -> dict[str, Any]:
    """The simulation's per-rank inputs at the real run's scale, to compare with the real run."""
    import _dist_sim as S

    from deltackpt.store.store import DEFAULT_CHUNK_BYTES, DEFAULT_SMALL_BYTES

    keys = S.state_keys(C.qwen2_shapes(scale), tied)
    cache: dict[Any, Any] = {}
    return {
        "layout_keys": [
            S.dk_layout(keys, world, r, DEFAULT_CHUNK_BYTES, DEFAULT_SMALL_BYTES, cache)[0].key()
            for r in range(world)
        ],
        "dcp_plan_bytes": [len(pickle.dumps(p)) for p in S.dcp_local_plans(keys, world)],
        "dk_rows": S.sim_deltackpt(keys, world, [0.0, 1.0]),
        "dcp_rows": S.sim_dcp(keys, world),
    }


# =========================================================================== report


def fb(n: float | None) -> str:
    return C.fmt_bytes(n) if n is not None and not (isinstance(n, float) and math.isnan(n)) else "-"


def real_tables(res: dict[str, Any]) -> str:
    rows = res["rows"]
    gb = res["unique_global_bytes"] / 1e9
    by = {(r["system"], r["op"]): r for r in rows}
    pairs = {  # deltackpt op -> DCP op it is compared with
        "save full (fresh store)": "save full (fresh dir)",
        "save unchanged (no step)": "save after step (rewrites all)",
        "save incremental (after step)": "save after step (rewrites all)",
        "async_save after step: blocking": "async_save after step: blocking",
        "async_save after step: total (result())": "async_save after step: total (future)",
    }
    for r in rows:
        if r["op"].startswith("load"):
            pairs[r["op"]] = r["op"].split(" - ")[0]
    out = [
        "| system | operation | runs (s) | median s | GB/s | bytes added (du) | deltackpt/DCP time | deltackpt/DCP bytes | notes |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        m = med(r["secs"])
        ratio_t = ratio_b = ""
        if r["system"] == "deltackpt" and r["op"] in pairs and ("DCP", pairs[r["op"]]) in by:
            d = by[("DCP", pairs[r["op"]])]
            ratio_t = f"{m / med(d['secs']):.2f}"
            if r.get("bytes") is not None and d.get("bytes"):
                ratio_b = f"{r['bytes'] / d['bytes']:.3g}"
        notes = []
        if r.get("bytes_each") and len(set(r["bytes_each"])) > 1:
            notes.append("du per run " + ", ".join(fb(b) for b in r["bytes_each"]))
        if "bit_exact" in r:
            notes.append(f"bit-exact={r['bit_exact']}")
        if "codecs_new" in r:
            notes.append(f"new-chunk codecs per run {r['codecs_new']}")
        if "chunks_new" in r:
            notes.append(f"chunks_new {r['chunks_new']}")
        if "plan_bytes" in r:
            notes.append(f"plan msgs {r['plan_bytes']} B; manifest {fb(med(r['manifest_bytes']))}")
        if "lib_blocked" in r:
            notes.append(f"lib blocked_seconds {r['lib_blocked']}")
        if "global_plan_ms" in r:
            notes.append(
                f"global plan ms {r['global_plan_ms']}; gathered plans "
                f"{r.get('gathered_plan_bytes')} B; results {r.get('gathered_results_bytes')} B; "
                f".metadata {r.get('metadata_bytes')} B"
            )
        out.append(
            f"| {r['system']} | {r['op']} | {' '.join(f'{s:.2f}' for s in r['secs'])} | "
            f"{m:.2f} | {gb / m:.2f} | {fb(r.get('bytes'))} | {ratio_t} | {ratio_b} | "
            f"{'; '.join(notes)} |"
        )
    return "\n".join(out)


def coll_table(real: dict[str, Any], sc: dict[str, Any]) -> str:
    """Measured collective bytes per save in the real run next to the simulation at the same N."""
    by = {(r["system"], r["op"]): r for r in real["rows"]}
    dk = {r["save"]: r for r in sc["dk_rows"]}
    dc = {r["save"]: r for r in sc["dcp_rows"]}
    spec = [
        ("deltackpt", "save full (fresh store)", dk.get("#1 full")),
        ("deltackpt", "save unchanged (no step)", dk.get("0% changed")),
        ("deltackpt", "save incremental (after step)", dk.get("100% changed")),
        ("DCP", "save full (fresh dir)", dc.get("#1 (and #2+ no caching)")),
        ("DCP", "save after step (rewrites all)", dc.get("#1 (and #2+ no caching)")),
        ("DCP", "save after step, plan caching", dc.get("#2+ with caching")),
    ]
    out = [
        "| system | save | measured per save: gather / scatter / broadcast x(N-1) = total | simulated total (same N) |",
        "|---|---|---|---|",
    ]
    for system, op, simrow in spec:
        r = by.get((system, op))
        if r is None or not r.get("coll"):
            continue
        meas = "; ".join(
            f"{c['gather']} / {c['scatter']} / {c['broadcast']} = **{c['total']}**"
            for c in r["coll"]
        )
        out.append(f"| {system} | {op} | {meas} | {simrow['exchanged'] if simrow else '-'} |")
    return "\n".join(out)


def sim_tables(sim: dict[str, Any]) -> str:
    dcp = {(r["N"], r["save"]): r for r in sim["dcp"]}
    lines = [
        "#### Bytes exchanged per save (all collectives: gather plans, scatter plans/assignments, "
        "gather write results, broadcast outcome x (N-1))",
        "",
        "| N | save | chunks changed | deltackpt exchanged | DCP exchanged, no caching | "
        "DCP exchanged, plan caching | deltackpt / DCP (caching) | DCP caching without its "
        "Metadata broadcast | deltackpt / that | deltackpt plan gather | "
        "DCP plan gather (caching) | deltackpt manifest | DCP .metadata |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in sim["dk"]:
        n = r["N"]
        d1 = dcp[(n, "#1 (and #2+ no caching)")]
        dc = d1 if r["save"] == "#1 full" else dcp[(n, "#2+ with caching")]
        lines.append(
            f"| {n} | {r['save']} | {r['changed']} of {r['chunks']} | {fb(r['exchanged'])} | "
            f"{fb(d1['exchanged'])} | {fb(dc['exchanged'])} | {r['exchanged'] / dc['exchanged']:.2g} | "
            f"{fb(dc['exchanged'] - dc['bcast_metadata'])} | "
            f"{r['exchanged'] / (dc['exchanged'] - dc['bcast_metadata']):.2g} | "
            f"{fb(r['gather_plan'])} | {fb(dc['gather_plan'])} | {fb(r['manifest'])} | "
            f"{fb(d1['metadata_file'])} |"
        )
    lines += [
        "",
        "#### deltackpt per-save breakdown and rank-0 time",
        "",
        "| N | save | new chunks | gather plan msgs | scatter assignments | gather records | "
        "broadcast outcome x(N-1) | rank_message per rank (ms) | rank 0 resolve+merge+assign+remember (ms) | "
        "rank 0 manifest build+JSON (ms) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in sim["dk"]:
        lines.append(
            f"| {r['N']} | {r['save']} | {r['new_chunks']} | {fb(r['gather_plan'])} | "
            f"{fb(r['scatter_assign'])} | {fb(r['gather_records'])} | {fb(r['bcast_outcome'])} | "
            f"{r['t_rank_msg_ms']:.2f} | {r['t_rank0_ms']:.0f} | {r['t_manifest_ms']:.0f} |"
        )
    lines += [
        "",
        "#### DCP per-save breakdown and rank-0 time (DefaultSavePlanner + FileSystemWriter)",
        "",
        "| N | save | write items | gather local plans | scatter global plans | gather WriteResults | "
        "broadcast Metadata x(N-1) | .metadata | create_global_plan (ms) | finish: storage_data + pickle (ms) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in sim["dcp"]:
        lines.append(
            f"| {r['N']} | {r['save']} | {r['items']} | {fb(r['gather_plan'])} | "
            f"{fb(r['scatter_plan'])} | {fb(r['gather_results'])} | {fb(r['bcast_metadata'])} | "
            f"{fb(r['metadata_file'])} | {r['t_global_ms']:.0f} | {r['t_finish_ms']:.0f} |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--scale", type=float, default=1.0, help="shrink layers/vocab (real run only)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--cold", action="store_true", help="drop the page cache before every load")
    ap.add_argument("--no-tie", action="store_true", help="leave out lm_head.weight")
    ap.add_argument("--dcp-first", action="store_true", help="run DCP before deltackpt")
    ap.add_argument("--sim-ranks", default="2,64,256,1024")
    ap.add_argument("--fracs", default="0,0.01,0.1,1")
    ap.add_argument("--skip-real", action="store_true")
    ap.add_argument("--skip-sim", action="store_true")
    ap.add_argument(
        "--mem-need-gb",
        type=float,
        default=7.0,
        help="MemAvailable to wait for before spawning the ranks: 0.8 + this x scale GB "
        "(2 ranks peak at ~3.2 GB RSS each at scale 1)",
    )
    ap.add_argument("--timeout", type=float, default=600, help="hard limit for the real run (s)")
    ap.add_argument("--workdir", default=str(C.OUT_DIR / f"dist-work-{os.getpid()}"))
    ap.add_argument("--out", default=str(C.OUT_DIR / "dist.md"))
    args = ap.parse_args()

    cmd = "python " + " ".join([os.path.relpath(__file__, C.REPO), *sys.argv[1:]])
    info = C.machine_info()
    log(f"{cmd}  {info}")
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    cfg = {
        "scale": args.scale,
        "reps": args.reps,
        "world": args.world,
        "cold": args.cold,
        "tied": not args.no_tie,
        "dcp_first": args.dcp_first,
        "workdir": str(work),
        "torch_threads": 1,
        "pg_timeout": max(120.0, args.timeout),
        "mem_need": int((0.8 + args.mem_need_gb * args.scale) * 1e9),
        "mem_floor": int(0.7e9),
        "mem_wait": 300,
    }
    real = sim = None
    if not args.skip_sim:  # first: it needs little memory, the real run needs ~6.5 GB
        sim = run_sim(
            [int(x) for x in args.sim_ranks.split(",") if x],
            [float(x) for x in args.fracs.split(",") if x],
            not args.no_tie,
        )
    try:
        if not args.skip_real:
            real = run_real(cfg, args.timeout)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    md = [
        f"# bench_dist: deltackpt vs DCP, distributed ({info['date']})",
        "",
        f"Command: `{cmd}` (default run ~6-9 min here). Quick debug: "
        "`python benchmarks/bench_dist.py --scale 0.05 --reps 2 --sim-ranks 2,16`; simulation only: "
        "`python benchmarks/bench_dist.py --skip-real`.",
        "",
        f"Machine: {info['cpus']} cpus, {info['mem_total']}, torch {info['torch']}, python "
        f"{info['python']}, git {info['git_rev']}{' (dirty)' if info['git_dirty'] else ''}, "
        f"load average at start {tuple(round(x, 2) for x in info['loadavg_start'])}; "
        f"load average at end {tuple(round(x, 2) for x in os.getloadavg())}. Shared, noisy machine: "
        "compare ratios within this run.",
        "",
    ]
    if real is not None:
        md += [
            f"## 1. Real run: {args.world} ranks (gloo, 127.0.0.1), Qwen2-0.5B-shaped bf16 DTensors "
            f"Shard(0), scale {args.scale}",
            "",
            f"State: {real['keys']} keys ({'lm_head tied: the same DTensor under two keys' if cfg['tied'] else 'no lm_head'}), "
            f"{real['unique_global_bytes'] / 1e9:.3f} GB global (tied counted once; GB/s uses this). "
            "Times: max over ranks after a barrier; 'runs' lists each repetition. 'Step' = one "
            "AdamW step at lr 1e-5 in Adam's first-step form w -= 1e-5*sign(g) on the fp32 master, "
            "then copied into the bf16 weights. deltackpt's unchanged and incremental saves are "
            "compared with DCP's save after a step (DCP rewrites everything). Loads "
            f"{'cold (drop_caches before each)' if cfg['cold'] else 'warm (page cache)'}; "
            "torch threads 1 per rank, deltackpt threads default, DCP FileSystemWriter defaults.",
            "",
            real_tables(real),
            "",
        ]
        chk = real["checks"]
        sc = sim_check(args.scale, args.world, cfg["tied"])
        w = range(args.world)
        same = [chk[r].get(f"dk_layout_key_rank{r}") == sc["layout_keys"][r] for r in w]
        dk_full = next((r for r in real["rows"] if r["op"] == "save full (fresh store)"), {})
        md += [
            f"Simulation check (same scale, N={args.world}): deltackpt `Layout.key()` of each real "
            f"rank's plan equals the simulated layout: {same}; deltackpt plan bytes of a full "
            f"save real {dk_full.get('plan_bytes')} vs simulated {sc['dk_rows'][0]['gather_plan']}; "
            f"DCP local plan bytes real (per save) "
            f"{[chk[r].get(f'dcp_local_plan_bytes_rank{r}') for r in w]} vs simulated "
            f"{sc['dcp_plan_bytes']}; DCP .metadata real "
            f"{next((r.get('metadata_bytes') for r in real['rows'] if r.get('metadata_bytes')), '-')}"
            f" vs simulated {sc['dcp_rows'][0]['metadata_file']}.",
            "",
            "Object-collective bytes per save measured in the real run (pickled sizes counted by "
            "wrapping torch.distributed.gather_object / scatter_object_list / "
            "broadcast_object_list; same counting rules as the simulation; the incremental row is "
            "compared with the simulation's 100%-changed save, as every chunk changes):",
            "",
            coll_table(real, sc),
            "",
            f"`Store.chunk_index()` (called by every rank at every distributed save since "
            f"0da86df, to vouch for xor bases), timed on the store after all deltackpt saves: "
            f"{[chk[r].get(f'chunk_index_ms_rank{r}') for r in w]}.",
            "",
        ]
    if sim is not None:
        md += [
            "## 2. Planning at simulated scale (no processes; the 0.5B state Shard(0) over N ranks)",
            "",
            "Each system's own planning code on synthetic inputs (benchmarks/_dist_sim.py). deltackpt: "
            "save #1 full, then saves with 0%, 1%, 10%, 100% of all chunks given new digests (each "
            "after the previous). DCP's plans do not depend on the data: #1 is also what every save "
            "without plan caching costs; '#2+ with caching' is every later save with "
            "`enable_plan_caching=True` (local plans sent as `SavePlan([], usable=False)`), whatever "
            "changed. Bytes = pickled size of what each collective carries; a broadcast counts N-1 "
            "times. Times are single runs on a shared 2-core machine (rank 0's Python work only; no "
            "network).",
            "",
            sim_tables(sim),
            "",
        ]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(md) + "\n")
    (out.with_suffix(".json")).write_text(
        json.dumps(
            {"cmd": cmd, "info": info, "cfg": cfg, "real": real, "sim": sim}, indent=1, default=str
        )
    )
    print("\n".join(md))
    log(f"wrote {out}")


if __name__ == "__main__":
    main()

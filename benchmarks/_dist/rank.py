"""What every rank of the real run does, whatever the system: join the group, build its shards
of the state, time a step max over ranks, count the bytes object collectives carry, measure du,
record rows (rank 0), and load into the saved or a resharded layout with a bit-exact check."""

from __future__ import annotations

import datetime
import gc
import math
import pickle
import random
import shutil
import time
import warnings
from collections import Counter
from pathlib import Path
from typing import Any

import _common as C

from _dist import log


def by_run(d: dict[str, Any]) -> dict[str, Any]:
    """A row's extras: "bytes" (one per run) renamed "bytes_each"."""
    return {k: v for k, v in d.items() if k != "bytes"} | (
        {"bytes_each": d["bytes"]} if "bytes" in d else {}
    )


class RankBase:
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
        return self.max_over_ranks(C.rss() / 1e9)

    def rec(
        self, system: str, op: str, secs: list[float], nbytes: float | None = None, **extra: Any
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
                stride=C.contig_stride(shape),
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
                stride=C.contig_stride(shape),
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
            C.trim()

"""Catch-up from a distributed trainer's snapshots: the trainer's ranks hold every tensor as
``Shard(0)`` row blocks (FSDP2) and save with their process group, so each tensor is stored as
row blocks, one per rank. A one-process follower holding version v0 catches up to v1 with
``load(since=)``, side by side in one run with the same catch-up reading every row block whole
(what it did before ``since.rows_as_data``) and with a full load of v1 into the same tensors.

Trainer: ``--ranks`` gloo processes, Qwen2-shaped bf16 weights (``--params``; the tied lm_head
left out), v0 and v1 the bf16 copies of fp32 masters before and after one AdamW step at ``--lr``
after two warm-up steps (``_harness/rl_step.py``), saved with ``encoding="smallest"`` (the
default for refit, issue 39). Loads go into preallocated tensors, best of ``--reps``, files in
the page cache (just written); every result is checked bit-exact against a full load.

    python benchmarks/bench_refit_dist.py --params 1e8 --ranks 2
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing as mp
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import _common as C
import torch
from _harness.rl_step import changed_fraction, rl_like_versions

import deltackpt
from deltackpt.loading import since as since_mod


def shapes_of(params: float) -> dict[str, tuple[int, ...]]:
    sd = C.qwen2_weights(torch.bfloat16, C.qwen2_scale(params), 0)
    del sd["lm_head.weight"]
    return {k: tuple(v.shape) for k, v in sd.items()}


def versions(params: float, lr: float) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    shapes = shapes_of(params)
    v0, v1 = rl_like_versions(list(shapes.values()), lr=lr, steps=1, warmup=2, seed=0)
    return dict(zip(shapes, v0, strict=True)), dict(zip(shapes, v1, strict=True))


def trainer_rank(rank: int, world: int, port: int, store: str, params: float, lr: float) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
        timeout=datetime.timedelta(seconds=300),
    )  # fmt: skip
    mesh = init_device_mesh("cpu", (world,))
    for name, v in zip(("v0", "v1"), versions(params, lr), strict=True):
        sd = {"model": {k: distribute_tensor(t, mesh, [Shard(0)]) for k, t in v.items()}}
        deltackpt.save(sd, store, name, encoding="smallest", process_group=dist.group.WORLD)
    dist.destroy_process_group()


def timed_loads(store: str, reps: int) -> dict[str, Any]:
    full_v1 = deltackpt.load(store, "v1")
    held = deltackpt.load(store, "v0")
    out: dict[str, Any] = {}

    def catch_up(name: str) -> None:
        best = float("inf")
        for _ in range(reps):
            deltackpt.load(store, "v0", into=held)  # back to v0
            stats = deltackpt.LoadStats()
            t0 = time.perf_counter()
            deltackpt.load(store, "v1", into=held, since="v0", stats=stats)
            best = min(best, time.perf_counter() - t0)
        exact = all(torch.equal(held["model"][k], full_v1["model"][k]) for k in held["model"])
        out[name] = {"s": best, "bytes_read": stats.bytes_read, "exact": exact,
                     "unchanged": stats.chunks_unchanged, "patched": stats.chunks_patched,
                     "read": stats.chunks_read}  # fmt: skip

    catch_up("since")
    real = since_mod.rows_as_data
    since_mod.rows_as_data = lambda m: m  # type: ignore[assignment]  # the row blocks read whole
    try:
        catch_up("since, row blocks whole")
    finally:
        since_mod.rows_as_data = real  # type: ignore[assignment]
    best, stats = float("inf"), deltackpt.LoadStats()
    for _ in range(reps):
        stats = deltackpt.LoadStats()
        t0 = time.perf_counter()
        deltackpt.load(store, "v1", into=held, stats=stats)
        best = min(best, time.perf_counter() - t0)
    out["full load"] = {"s": best, "bytes_read": stats.bytes_read, "exact": True}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--params", type=float, default=1e8)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--lr", type=float, default=1e-6)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default=str(C.OUT_DIR / "refit_dist.json"))
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-refit-dist-"))
    store = str(work / "s")
    deltackpt.open_store(store)
    port = C.free_port()
    ctx = mp.get_context("spawn")
    t0 = time.perf_counter()
    procs = [
        ctx.Process(target=trainer_rank, args=(r, args.ranks, port, store, args.params, args.lr))
        for r in range(args.ranks)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(900)
        if p.exitcode != 0:
            sys.exit(f"trainer rank failed (exit code {p.exitcode})")
    save_s = time.perf_counter() - t0
    v0, v1 = versions(args.params, args.lr)
    changed = changed_fraction(list(v0.values()), list(v1.values()))
    nbytes = sum(t.numel() * t.element_size() for t in v1.values())
    m = deltackpt.open_store(store).manifest("v1")
    blocks = sum(1 for e in m.tensors if e.shards is not None)
    res = {"params": args.params, "ranks": args.ranks, "lr": args.lr, "bytes": nbytes,
           "changed": changed, "row_block_tensors": blocks, "tensors": len(m.tensors),
           "trainer_s": save_s, "loads": timed_loads(store, args.reps)}  # fmt: skip
    full = res["loads"]["full load"]
    rows = [
        [
            name,
            f"{r['s']:.3f}",
            f"{r['s'] / full['s']:.3f}",
            f"{r['bytes_read'] / 1e6:.1f}",
            f"{r['bytes_read'] / full['bytes_read']:.4f}",
            "yes" if r["exact"] else "NO",
        ]
        for name, r in res["loads"].items()
    ]
    print(
        f"{nbytes / 1e6:.0f} MB bf16 in {len(m.tensors)} tensors, {blocks} saved as row blocks "
        f"of {args.ranks} ranks; {100 * changed:.2f}% of the elements changed (lr {args.lr})\n"
    )
    print(C.md_table(["v0 -> v1", "s", "/ full load", "MB read", "/ full load", "bit-exact"], rows))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=1))
    C.rmtree(work)


if __name__ == "__main__":
    main()

"""Weight-sync benchmark: one sender -> 1 and 2 receivers, gloo and shared memory.

State: Qwen2-0.5B-shaped (24 layers, hidden 896, vocab 151936, tied embeddings: ~494M params),
random values, bf16 by default (what an inference engine loads); ``--params`` scales the number
of layers and the vocabulary to reach another size.

For each transport and receiver count, in the same processes:

* ceiling — the raw cost of moving the same number of bytes through that transport, into a
  private buffer of every receiver: gloo: one ``dist.broadcast`` of one buffer of the total
  size; shm: the sender copies the bytes into a shared-memory file, then every receiver copies
  them out (one memcpy through shared memory = write + read);
* full round — ``push(full=True)`` / ``pull(load_weights)`` until every receiver has copied all
  tensors into its model (load_weights copies into preallocated tensors);
* delta round — the same after changing ``--delta-frac`` of the parameters (the last layers).

Receiver modes (``--apply``): ``on_commit``, ``per_bucket``, and the same with ``:trusted``
(e.g. ``on_commit:trusted``) — the behaviour before shared-memory windows were treated as
untrusted input: the receiver verifies and loads the window in place instead of copying each
bucket into private memory first (``WeightReceiver._trust_shared``, unsafe, for this comparison
only; it changes nothing on gloo, whose buffers are already private). ``staging MB`` is the
private memory a receiver holds for staging/copying buckets (not counting the model).

Times are wall clock between two barriers on the gloo group that every process joins, the best
of ``--repeats``. Run: ``python benchmarks/bench_sync.py`` (about 2-4 minutes, ~7 GB RAM plus
~1 GB per receiver for its private staging copy).
"""

from __future__ import annotations

import argparse
import json
import math
import mmap
import multiprocessing as mp
import os
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's deltackpt

import _common as C


def timed(dist: Any, fn: Any) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - t0


def worker(rank: int, world: int, cfg: dict[str, Any], port: int, name: str, q: Any) -> None:
    try:
        q.put((rank, run(rank, world, cfg, port, name)))
    except BaseException as e:
        import traceback

        q.put((rank, {"error": f"{e!r}\n{traceback.format_exc()}"}))


def run(rank: int, world: int, cfg: dict[str, Any], port: int, name: str) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from deltackpt import sync

    torch.set_num_threads(1)
    dtype = getattr(torch, cfg["dtype"])
    sync.init_group("127.0.0.1", port, rank, world, timeout=600)
    shapes = C.qwen2_shapes(C.qwen2_scale(cfg["params"]))
    if rank == 0:
        g = torch.Generator().manual_seed(0)
        state = {n: torch.randn(s, generator=g, dtype=torch.float32).to(dtype) for n, s in shapes}
    else:
        state = {n: torch.zeros(s, dtype=dtype) for n, s in shapes}  # the model, pre-faulted
    total = sum(t.numel() * t.element_size() for t in state.values())
    nparams = sum(t.numel() for t in state.values())
    out: dict[str, Any] = {"bytes": total, "params": nparams}
    kind, repeats = cfg["transport"], cfg["repeats"]

    # ---- ceiling -----------------------------------------------------------------------
    flat = (
        torch.ones(total, dtype=torch.uint8) if rank == 0 else torch.zeros(total, dtype=torch.uint8)
    )
    if kind == "gloo":
        ceil = min(timed(dist, lambda: dist.broadcast(flat, 0)) for _ in range(repeats))
    else:
        path = f"/dev/shm/deltackpt-bench-{name}"
        if rank == 0:
            with open(path, "wb") as f:
                f.truncate(total)
        dist.barrier()
        fd = os.open(path, os.O_RDWR)
        mm = mmap.mmap(fd, total, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
        os.close(fd)
        shm = np.frombuffer(mm, dtype=np.uint8)
        if rank == 0:
            shm[:] = 0  # fault the pages in once, as the sync window is after its first round
        mine = flat.numpy()

        def copy_through() -> None:
            if rank == 0:
                np.copyto(shm, mine)
            dist.barrier()
            if rank != 0:
                np.copyto(mine, shm)

        ceil = min(timed(dist, copy_through) for _ in range(repeats))
        del shm
        mm.close()
        dist.barrier()
        if rank == 0:
            os.unlink(path)
    flat = torch.empty(0, dtype=torch.uint8)  # free it before the sync rounds
    out["ceiling_s"] = ceil

    # ---- sync rounds -------------------------------------------------------------------
    if kind == "gloo":
        transport = sync.DistTransport(group=None, senders=[0])
    else:
        transport = sync.ShmTransport(name, rank=rank, world_size=world, senders=[0], timeout=600)
    changed: list[str] = []
    acc = 0
    for n, s in reversed(shapes):  # the last layers, ~delta_frac of the parameters
        if acc >= cfg["delta_frac"] * nparams:
            break
        changed.append(n)
        acc += math.prod(s)
    out["delta_params_frac"] = acc / nparams
    sender = (
        sync.WeightSender(transport, bucket_bytes=cfg["bucket_mb"] << 20) if rank == 0 else None
    )
    version = 0

    def load(ws: list[tuple[str, Any]]) -> None:  # what an nn.Module adapter does
        for n, t in ws:
            state[n].copy_(t)

    def mutate() -> None:  # a training step that touched the last layers
        if sender is not None:
            for n in changed:
                state[n].add_(0.01)

    out["modes"] = {}
    for mode in cfg["apply"]:
        stats: list[Any] = []
        apply, _, trust = mode.partition(":")
        receiver = None if sender else sync.WeightReceiver(transport, apply=apply)
        if receiver is not None and trust == "trusted":
            receiver._trust_shared = True  # the pre-fix receiver, to measure what the fix costs

        def one(full: bool, receiver: Any = receiver, stats: list[Any] = stats) -> None:
            nonlocal version
            version += 1
            stats.append(
                sender.push(state, version, full=full)
                if sender is not None
                else receiver.pull(load)
            )

        res: dict[str, Any] = {"first_round_s": timed(dist, lambda: one(True))}
        res["full_round_s"] = min(timed(dist, lambda: one(True)) for _ in range(repeats))
        deltas = []
        for _ in range(repeats):
            mutate()
            deltas.append(timed(dist, lambda: one(False)))
        res["delta_round_s"] = min(deltas)
        res["full_bytes"] = stats[1].bytes_sent
        res["delta_bytes"] = stats[-1].bytes_sent
        res["buckets"] = stats[-1].buckets_total
        h = xxhash.xxh3_128()  # every receiver must end with the sender's bytes
        for t in state.values():
            h.update(t.view(torch.uint8).numpy())
        res["state_digest"] = h.hexdigest()
        if receiver is not None:
            res["staging_bytes"] = sum(
                b.numel() for b in (receiver._arena, receiver._bounce) if b is not None
            )
            receiver.close()  # the next mode starts with its own plan and staging
        out["modes"][mode] = res
    transport.close()
    dist.barrier()
    return out


def bench(cfg: dict[str, Any], receivers: int) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    world = 1 + receivers
    name = uuid.uuid4().hex[:10]
    port = C.free_port()
    procs = [ctx.Process(target=worker, args=(r, world, cfg, port, name, q)) for r in range(world)]
    for p in procs:
        p.start()
    results = C.collect(procs, q, cfg["timeout"])
    from deltackpt.sync import ShmTransport

    ShmTransport.unlink(name)
    errors = [res["error"] for res in results.values() if "error" in res]
    if errors or len(results) < world:
        raise SystemExit(f"benchmark failed: {errors or 'timeout / crashed process'}")
    out = results[0]
    for m, v in out["modes"].items():
        v["staging_bytes"] = results[1]["modes"][m]["staging_bytes"]
    out["receivers_ok"] = all(
        results[r]["modes"][m]["state_digest"] == v["state_digest"]
        for r in range(1, world)
        for m, v in out["modes"].items()
    )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--params", type=float, default=494e6)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--bucket-mb", type=int, default=256)
    ap.add_argument("--transports", default="gloo,shm")
    ap.add_argument("--receivers", default="1,2")
    ap.add_argument(
        "--apply",
        default="on_commit,per_bucket",
        help="receiver modes to measure, comma-separated; MODE:trusted measures the "
        "pre-fix in-place shm receiver",
    )
    ap.add_argument("--delta-frac", type=float, default=0.10)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--json", help="also write the results here")
    ap.add_argument("--mxn", help="instead: MxN rounds for these shapes, e.g. 1x1,2x2 (_sync/)")
    ap.add_argument("--mxn-links", default="gloo", help="with --mxn: gloo,shm (comma-separated)")
    ap.add_argument("--sim", action="store_true", help="with --mxn: the simulated 256->128 plan")
    ap.add_argument(
        "--mxn-zero-copy",
        default="on",
        help="with --mxn: on,off (comma-separated): trainers send large contiguous pieces "
        "from the tensors (gloo; MxNSender zero_copy_min default) or pack every piece",
    )
    args = ap.parse_args()
    if args.mxn:
        return mxn_main(args)
    rows = []
    for kind in args.transports.split(","):
        for n in map(int, args.receivers.split(",")):
            cfg = {
                "params": args.params,
                "dtype": args.dtype,
                "bucket_mb": args.bucket_mb,
                "transport": kind,
                "apply": args.apply.split(","),
                "delta_frac": args.delta_frac,
                "repeats": args.repeats,
                "timeout": args.timeout,
            }
            r = bench(cfg, n)
            r.update(transport=kind, receivers=n)
            rows.append(r)
            print(f"# done {kind} x{n}: {json.dumps(r)}", file=sys.stderr, flush=True)
    first = rows[0]
    mode0 = next(iter(first["modes"].values()))
    print(
        f"\nstate: {first['params'] / 1e6:.0f}M params, {args.dtype}, "
        f"{first['bytes'] / C.GB:.2f} GB; bucket {args.bucket_mb} MiB ({mode0['buckets']} "
        f"buckets); delta rounds change {first['delta_params_frac']:.1%} of the parameters; "
        f"best of {args.repeats}\n"
    )
    print(
        "| transport | receivers | apply | ceiling s (GB/s) | full round s (GB/s) "
        "| full vs ceiling | first round s | delta round s | delta / full | delta bytes "
        "| staging MB |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        gb = r["bytes"] / C.GB
        for mode, m in r["modes"].items():
            print(
                f"| {r['transport']} | {r['receivers']} | {mode} | {r['ceiling_s']:.2f} "
                f"({gb / r['ceiling_s']:.2f}) | {m['full_round_s']:.2f} "
                f"({gb / m['full_round_s']:.2f}) | {r['ceiling_s'] / m['full_round_s']:.0%} "
                f"| {m['first_round_s']:.2f} | {m['delta_round_s']:.3f} "
                f"| {m['delta_round_s'] / m['full_round_s']:.1%} "
                f"| {m['delta_bytes'] / m['full_bytes']:.1%} "
                f"| {m['staging_bytes'] / 1e6:.0f} |"
            )
    if not all(r["receivers_ok"] for r in rows):
        raise SystemExit("a receiver ended with different weights")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


def mxn_main(args: argparse.Namespace) -> None:
    """``--mxn``: MxN rounds (``_sync/mxn.py``) and, with ``--sim``, the simulated plan."""
    from _sync.mxn import bench_mxn, mxn_table, sim_table

    cfg = {
        "params": args.params,
        "bucket_mb": args.bucket_mb,
        "delta_frac": args.delta_frac,
        "repeats": args.repeats,
        "timeout": args.timeout,
    }
    rows = []
    for kind in args.mxn_links.split(","):
        for shape in args.mxn.split(","):
            for zc in args.mxn_zero_copy.split(","):
                if zc == "off" and kind != "gloo":
                    continue  # shm links pack into the window: nothing to turn off
                m, n = map(int, shape.split("x"))
                r = bench_mxn(m, n, {**cfg, "links": kind, "zero_copy": zc})
                r.update(m=m, n=n, kind=kind, zero_copy=zc)
                rows.append(r)
            print(f"# done {kind} {m}x{n}: {json.dumps(r)}", file=sys.stderr, flush=True)
    r0 = rows[0]
    print(
        f"\nstate: {r0['bytes'] / C.GB:.2f} GB bf16; bucket {args.bucket_mb} MiB; delta rounds "
        f"change {r0['delta_params_frac']:.1%} of the parameters; best of {args.repeats}\n"
    )
    print(mxn_table(rows))
    if args.sim:
        from _sync.sim import simulate

        res = simulate()
        print("\n" + sim_table(res))
        rows.append({"sim": res})
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()

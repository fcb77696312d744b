"""Weight-sync benchmark: M trainer processes -> N inference processes, gloo and shared memory.

Rounds of ``deltackpt.sync`` (one engine: ``WeightSender`` / ``WeightReceiver`` over a
``SyncGroup``) beside the transport's ceiling measured in the same processes; see
``_sync/mxn.py`` for what each figure is. Run::

    python benchmarks/bench_sync.py --shapes 1x1,2x2 --links gloo,shm --params 50e6

``--sim`` adds the simulated 256 -> 128 plan (sizes only); ``--replicate`` gives every trainer
the whole state (data parallel) and times full rounds with and without the replicas' check.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's deltackpt

import _common as C


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", type=float, default=50e6)
    ap.add_argument("--bucket-mb", type=int, default=16)
    ap.add_argument("--delta-frac", type=float, default=0.10)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--json", help="also write the results here")
    ap.add_argument("--shapes", default="1x1,2x2", help="MxN shapes, e.g. 1x1,1x2,2x2")
    ap.add_argument("--links", default="gloo,shm", help="gloo,shm (comma-separated)")
    ap.add_argument("--sim", action="store_true", help="also the simulated 256->128 plan")
    ap.add_argument(
        "--steps",
        help="instead: delta rounds after real AdamW steps, e.g. rl-1e-6,rl-1e-5,pretrain "
        "(_sync/steps.py), patch vs dense, for every shape and link",
    )
    ap.add_argument(
        "--replicate",
        action="store_true",
        help="trainers hold every tensor whole (data parallel): full rounds also with "
        "WeightSender(replicas='trust') beside the default check",
    )
    ap.add_argument(
        "--zero-copy",
        default="on",
        help="on,off (comma-separated): trainers send large contiguous pieces "
        "from the tensors (gloo; WeightSender zero_copy_min default) or pack every piece",
    )
    args = ap.parse_args()
    if args.steps:
        return run_steps(args)
    run(args)


def run_steps(args: argparse.Namespace) -> None:
    """``--steps``: delta rounds after optimizer steps, patches against whole pieces."""
    from _sync.steps import bench_steps, steps_table

    rows = []
    for kind in args.links.split(","):
        for shape in args.shapes.split(","):
            for step in args.steps.split(","):
                m, n = map(int, shape.split("x"))
                cfg = {
                    "params": args.params,
                    "bucket_mb": args.bucket_mb,
                    "repeats": args.repeats,
                    "timeout": args.timeout,
                    "links": kind,
                    "step": step,
                }
                r = bench_steps(m, n, cfg)
                r.update(m=m, n=n, links=kind, step=step)
                rows.append(r)
                print(f"# done {kind} {shape} {step}: {json.dumps(r)}", file=sys.stderr, flush=True)
    r0 = rows[0]
    print(
        f"\nstate: {r0['state_bytes'] / C.GB:.3f} GB bf16; bucket {args.bucket_mb} MiB; "
        f"best of {args.repeats}; {r0.get('cores', os.cpu_count())} cores\n"
    )
    print(steps_table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


def run(args: argparse.Namespace) -> None:
    """Rounds of every shape and link kind (``_sync/mxn.py``) and, with ``--sim``, the plan."""
    from _sync.mxn import bench_mxn, mxn_table, sim_table

    cfg = {
        "params": args.params,
        "bucket_mb": args.bucket_mb,
        "delta_frac": args.delta_frac,
        "repeats": args.repeats,
        "timeout": args.timeout,
        "replicate": args.replicate,
    }
    rows = []
    for kind in args.links.split(","):
        for shape in args.shapes.split(","):
            for zc in args.zero_copy.split(","):
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

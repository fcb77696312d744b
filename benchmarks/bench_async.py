"""Async checkpointing: blocking time, incremental bytes, training slowdown, delta-chain restore.

One process, one run, every system on the same states, so ratios are comparable on a noisy
machine. States (Qwen2-0.5B shapes: hidden 896, MLP 4864, 24 layers, 14 q / 2 kv heads of dim
64, vocab 151936, q/k/v biases, tied lm_head; ~494M params):

* ``bf16``: the bf16 export of an fp32 master (``p.to(bfloat16)`` after each step, copied into
  persistent bf16 tensors, as a trainer exporting weights would), ~0.99 GB.
* ``train``: ``{"model": fp32 params, "optim": AdamW.state_dict()}``, ~5.9 GB.

Between two saves the fp32 master takes one real ``torch.optim.AdamW(lr=1e-5, fused=True)``
step with fresh random gradients (views at random offsets into a fixed N(0, 1e-3) pool, so
drawing gradients costs no RNG time; fused because the default single-tensor CPU AdamW takes
~17 s per step on this machine). Each system runs its own sequence of saves (a warm-up save,
then saves each after one step), one system after the other, so at most one system's staging
buffers are alive at a time (24 GB of RAM).

Systems (separate directories; deltackpt and DCP fsync, torch.save is followed by an fsync):

* ``torch.save`` (synchronous; blocking = the whole save + fsync).
* ``dcp.async_save`` with its default stager (``FileSystemWriter``: fresh copy per save) and with
  a reused ``DefaultStager`` (sync staging, cached CPU copies), on a 1-rank gloo group.
  blocking = until ``async_save`` returns, total = until its future is done.
* ``torchsnapshot.Snapshot.async_take`` if it imports (0.1.0 does not fsync: "total+fsync"
  adds an fsync of its files). blocking = until it returns, total = ``wait()``.
* ``deltackpt.async_save``: blocking = until it returns (``handle.staged`` is done on CPU),
  total = ``handle.result()``. It runs ``2 * keyframe_every`` saves (the library default,
  read from ``SaveOptions``), so the last one ends a full xor chain, used for the restore part.

Reference: one copy of the state into a warm (already touched) buffer of the state's size
(capped at 1 GiB, wrapping around), timed right before every save; the target is
median(blocking / that copy) <= 1.5 over a system's steady saves (pairing each save with its own
reference cancels most of the background load of a shared machine; the ratio of the medians is
shown too). deltackpt's first two saves both allocate (two staging arenas alternate when xor
deltas are on), so its steady state starts at save #2; the baselines' at save #1.

Also: a small CPU training loop (MLP, ~25M params, AdamW) timed per step with no checkpointing,
with ``deltackpt.Checkpointer(async_=True, every=N)`` and with ``dcp.async_save`` every N steps;
and restore (``deltackpt.load(into=...)``, the state's own tensors) of the chain end vs the
keyframe, cold (after ``drop_caches``) and warm.

    python benchmarks/bench_async.py                      # full 0.5B, bf16 + train, ~12 min
    python benchmarks/bench_async.py --scale small        # quick debug run
    python benchmarks/bench_async.py --which bf16         # bf16 weights only
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import _common as C
from _async import T_START, log
from _async.kinds import bench_kind
from _async.loop import train_loops
from _async.master import Master
from _async.report import ok, report_kind, report_loop

import deltackpt

warnings.filterwarnings("ignore")


def write_report(
    results: dict[str, Any],
    notes: list[str],
    args: argparse.Namespace,
    cmd: str,
    info: dict[str, Any],
    final: bool,
) -> None:
    """Write the markdown + JSON (also after each part, so a killed run keeps what it measured)."""
    if "total_seconds" not in results or not final:
        results["total_seconds"] = time.perf_counter() - T_START
    results["notes"] = notes
    total = results["total_seconds"]
    parts = [
        "## Async saves (`benchmarks/bench_async.py`)",
        "",
        f"Command: `{cmd}` (total {total / 60:.1f} min{'' if final else ', PARTIAL'})  ",
        f"Machine: {info['cpus']} cpus, {info['mem_total']}, torch {info['torch']} "
        f"({info['torch_threads']} threads), git {info['git_rev']}"
        f"{' (dirty)' if info['git_dirty'] else ''}, load avg at start "
        f"{info['loadavg_start'][0]:.1f}, end {os.getloadavg()[0]:.1f}; {info['date']}; "
        f"deltackpt from {Path(deltackpt.__file__).parent}. "
        "Shared, noisy machine: compare ratios within this run.",
        "",
    ]
    parts += [f"- {n}" for n in notes]
    all_targets: dict[str, Any] = {}
    for r in results["kinds"]:
        txt, t = report_kind(r)
        parts += [txt]
        all_targets.update(t)
    if results["loops"]:
        txt, t = report_loop(results["loops"], args)
        parts += [txt]
        all_targets.update(t)
    parts += [
        "### Targets",
        "",
        C.md_table(
            ["target", "value", "met"],
            [
                [
                    k,
                    (
                        f"{v[0]:+.1%} .. {v[1]:+.1%}"
                        if "slowdown" in k
                        else f"{v:.1%}"
                        if "bytes" in k
                        else f"{v:.3f}x"
                    ),
                    "-" if m is None else ok(m),
                ]
                for k, (m, v) in all_targets.items()
            ],
        ),
        "",
    ]
    tsnap = [r.get("torchsnapshot") for r in results["kinds"]]
    if tsnap:
        parts += [f"torchsnapshot: {tsnap[0]}; it does not fsync (its total+fsync adds one)."]
    md = "\n".join(parts) + "\n"
    if final:
        print(md)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(md)
    raw = out.with_suffix(".json")
    C.write_json(raw, results)
    log(f"wrote {out} and {raw}")


def init_pg() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        return
    port = C.free_port()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--scale",
        default="1.0",
        help="shrink layers/vocab: a float, or 'small' (= 0.05) for a debug run",
    )
    ap.add_argument("--which", choices=("bf16", "train", "both"), default="both")
    ap.add_argument(
        "--train-scale",
        type=float,
        help="scale of the train state only (default: --scale); its deltackpt run "
        "holds ~3x the state (live + two staging arenas): 17.8 GB at scale 1",
    )
    ap.add_argument(
        "--saves",
        type=int,
        default=3,
        help="saves per baseline system (1 warm-up + N-1 after a step each)",
    )
    ap.add_argument(
        "--chain",
        type=int,
        default=2 * deltackpt.SaveOptions().keyframe_every,
        help="deltackpt saves (default 2 x keyframe_every: the last ends a full chain)",
    )
    ap.add_argument("--restore-reps", type=int, default=1)
    ap.add_argument("--every", type=int, default=10)
    ap.add_argument("--loop-rounds", type=int, default=4)
    ap.add_argument("--loop-periods", type=int, default=2, help="save periods per segment")
    ap.add_argument("--loop-warmup", type=int, default=5)
    ap.add_argument("--loop-batch", type=int, default=64)
    ap.add_argument("--loop-blocks", type=int, default=3)
    ap.add_argument("--skip-loop", action="store_true")
    ap.add_argument(
        "--mem-wait",
        type=float,
        default=240,
        help="seconds to wait for free RAM before shrinking the train state",
    )
    ap.add_argument(
        "--stage-order",
        choices=("auto", "hash-first", "copy-first"),
        help="the blocking phase's order of deltackpt's saves without delta bases "
        "(DELTACKPT_STAGE_ORDER; deltackpt/saving/order.py); default: auto",
    )
    ap.add_argument("--out", default=str(C.OUT_DIR / "async.md"))
    ap.add_argument(
        "--report-from",
        metavar="JSON",
        help="only re-render the markdown from a saved results JSON",
    )
    ap.add_argument("--total-seconds", type=float, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.stage_order:  # read by each store's saver when it is created
        os.environ["DELTACKPT_STAGE_ORDER"] = args.stage_order
    if args.report_from:
        saved = json.loads(Path(args.report_from).read_text())
        if args.total_seconds:
            saved["total_seconds"] = args.total_seconds
        args.every = saved.get("args", {}).get("every", args.every)
        args.loop_periods = saved.get("args", {}).get("loop_periods", args.loop_periods)
        args.loop_rounds = saved.get("args", {}).get("loop_rounds", args.loop_rounds)
        args.loop_batch = saved.get("args", {}).get("loop_batch", args.loop_batch)
        write_report(
            saved, saved.get("notes", []), args, saved["cmd"], saved["machine"], final=True
        )
        return
    scale = 0.05 if args.scale == "small" else float(args.scale)
    if os.environ.get("DELTACKPT_FSYNC", "1") in ("0", "false", "no"):
        sys.exit("DELTACKPT_FSYNC is off; this benchmark compares durable saves")
    cmd = "python benchmarks/bench_async.py " + " ".join(sys.argv[1:])
    info = C.machine_info()
    work = C.OUT_DIR / f"async-work-{os.getpid()}"
    C.rmtree(work)
    work.mkdir(parents=True)
    init_pg()
    results: dict[str, Any] = {
        "cmd": cmd,
        "machine": info,
        "kinds": [],
        "loops": [],
        "args": vars(args),
    }
    notes = []
    kinds = ["bf16", "train"] if args.which == "both" else [args.which]
    master: Master | None = None
    try:
        for kind in kinds:
            sc = scale
            if kind == "train":
                if args.train_scale is not None:
                    sc = args.train_scale

                # state + deltackpt's two arenas + gradient pool + slack must fit in free RAM
                # (other jobs share this machine: wait a while for memory before shrinking)
                def need(s: float) -> float:
                    return 3.15 * 494e6 * 12 * s + 2.5e9

                held = 0 if master is None else 12 * master.numel + 4 * master.pool.numel()

                def avail(held: float = held) -> float:  # counting what our master holds
                    return C.mem_available() + held

                deadline = time.perf_counter() + args.mem_wait
                while need(sc) > avail() and time.perf_counter() < deadline:
                    log(
                        f"   waiting for memory: need {need(sc) / 1e9:.1f} GB, "
                        f"have {avail() / 1e9:.1f} GB"
                    )
                    time.sleep(10)
                have = avail()
                wanted = sc
                while sc > 0.05 and need(sc) > have:
                    sc = round(sc * 0.9, 3)
                if sc != wanted:
                    notes.append(
                        f"train state shrunk to scale {sc} (MemAvailable + own "
                        f"{have / 1e9:.1f} GB < {need(wanted) / 1e9:.1f} GB needed for "
                        f"state + 2 staging copies at scale {wanted})"
                    )
                    log(notes[-1])
                if sc != scale:
                    notes.append(
                        f"train state at scale {sc} (bf16 at {scale}): at scale 1 "
                        "deltackpt holds 3x the 5.9 GB state (live + two staging "
                        "arenas, 17.8 GB), which a shared 24 GB machine may not have"
                    )
            if master is None or master.scale != sc:
                master = None
                gc.collect()
                log(f"== building the fp32 master + AdamW (scale {sc})")
                master = Master(sc)
                log(f"   {master.numel / 1e6:.1f}M params, build {master.build_seconds:.1f}s")
            results["kinds"].append(bench_kind(kind, master, args, work))
            write_report(results, notes, args, cmd, info, final=False)
            gc.collect()
        master = None
        gc.collect()
        if not args.skip_loop:
            log("== training loop")
            results["loops"] = train_loops(args, work)
    finally:
        C.rmtree(work)
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()

    write_report(results, notes, args, cmd, info, final=True)


if __name__ == "__main__":
    main()

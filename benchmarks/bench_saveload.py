"""Save/load, side by side in one run: torch.save/load, safetensors, DCP and deltackpt.

All systems save and load the *same* state in one process, so their ratios are comparable even on
a noisy machine. The machine's own limits (memcpy, disk write+fsync, cold/warm read, xxh3) are
measured in the same run and every row is also given as a % of the relevant one.

States (``--model qwen0.5b``: Qwen2-0.5B shapes, random tensors, tied lm_head, ~494M params):

* ``--state weights`` (default): bf16 weights, ~0.99 GB.
* ``--state train``: fp32 weights + torch.optim.AdamW state (exp_avg, exp_avg_sq, step) after one
  real AdamW step, ~5.9 GB at scale 1. deltackpt keeps two staging copies of the state for xor
  deltas when they fit in half the RAM, so at scale 1 the peak is ~25 GB: use ``--scale 0.5``
  (~3 GB state, ~13 GB peak) on a 24 GB machine.

``--scale`` shrinks the number of layers and the vocabulary (``--scale 0.1`` for a quick run).

Save scenarios (every system saves the same state; torch/safetensors/DCP rewrite everything):

1. ``full``: first save into an empty location (a new file / directory / store each repetition).
2. ``unchanged``: save again, nothing changed.
3. ``10pct``: 10% of the tensors (by count, random, seeded) scaled by 0.99 in place before each
   repetition.
4. ``step``: one optimizer step before each repetition. ``weights``: ``w.add_(sign(randn),
   alpha=-1e-5)`` in bf16 (what AdamW's first steps do at lr 1e-5); ``train``: a real
   ``torch.optim.AdamW(lr=1e-5, weight_decay=0.01).step()`` with fixed random gradients.

Durability: deltackpt fsyncs packs, manifest and directories; DCP's FileSystemWriter fsyncs its
files (``sync_files=True``, the default); torch.save and safetensors do not, so their "durable"
rows add an explicit fsync of the file and its directory (their plain "no fsync" rows are the
same runs, timed before the fsync).

Loads of the last saved state, each checked bit-exact against the source (first load of a row:
``torch.equal`` on the raw bits of every tensor; repeats: xxh3-128 of the raw bits): ``new``
returns fresh tensors (torch.load; safetensors load_file + ``.clone()``, since load_file alone is a
lazy mmap; DCP into ``torch.empty`` tensors allocated in the timed region; ``deltackpt.load``),
``into`` fills an existing, touched state in place (torch.load(mmap=True) + copy_; load_file +
copy_; dcp.load; ``deltackpt.load(into=...)``). ``warm`` = files in the page cache; ``cold`` =
after ``sync; echo 3 > /proc/sys/vm/drop_caches`` (``into`` cold only with ``--into-cold``).

Systems (``--systems``): torch, safetensors, dcp, deltackpt (defaults), deltackpt-raw (compression
off: isolates the codec cost); optional deltackpt-ng (store without small-tensor grouping).
Each measurement runs ``--reps`` times (median) unless one run takes over 10 s. Results:
``bench-out/saveload-*.json`` plus a markdown table on stdout.

    python benchmarks/bench_saveload.py                       # full bf16 0.5B, ~10 min loaded
    python benchmarks/bench_saveload.py --scale 0.1           # quick
    python benchmarks/bench_saveload.py --state train --scale 0.5   # fp32 + AdamW, ~3 GB
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import _common as C
from _harness import stores
from _saveload.report import summarize
from _saveload.runs import run_loads, run_saves
from _saveload.state import BenchState
from _saveload.systems import SYSTEMS, DeltackptSystem

warnings.filterwarnings("ignore")  # DCP warns about running without a process group


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen0.5b", choices=["qwen0.5b"])
    ap.add_argument("--state", default="weights", choices=["weights", "train"])
    ap.add_argument("--scale", type=float, default=1.0, help="shrink layers and vocab")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument(
        "--systems",
        default="torch,safetensors,dcp,deltackpt,deltackpt-raw",
        help=f"comma list from {','.join(SYSTEMS)}",
    )
    ap.add_argument("--no-cold", action="store_true", help="skip drop_caches cold loads")
    ap.add_argument(
        "--into-cold",
        action="store_true",
        help="also time load(into=...) cold (off by default to keep the run short)",
    )
    ap.add_argument(
        "--workdir",
        type=Path,
        default=None,
        help="where checkpoints go (default bench-out/work-<pid>; removed at the end)",
    )
    ap.add_argument("--out", type=Path, default=None, help="JSON result path")
    ap.add_argument("--keep", action="store_true", help="keep the workdir")
    args = ap.parse_args()

    t_start = time.perf_counter()
    work = args.workdir or (C.OUT_DIR / f"work-{os.getpid()}")
    work.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out_path = (
        args.out or C.OUT_DIR / f"saveload-{args.state}-{args.model}-s{args.scale:g}-{stamp}.json"
    )

    log = C.make_log(sys.stdout, t_start)

    try:
        import safetensors

        import deltackpt

        minfo = C.machine_info()  # at the start: loadavg_start really is the start
        fingerprint = C.code_fingerprint()
        log(f"deltackpt code: {fingerprint}")
        log(f"building {args.state} state, scale {args.scale}")
        bs = BenchState(args.state, args.scale)
        nbytes = C.logical_bytes(bs.state)
        n_params = sum(
            t.numel()
            for _, t in C.unique_tensors(bs.state if args.state == "weights" else bs.state["model"])
        )
        state_info = {
            "kind": args.state,
            "model": args.model,
            "scale": args.scale,
            "params": n_params,
            "logical_bytes": nbytes,
            "tensors": len(C.flat_tensors(bs.state)),
            "build_seconds": bs.build_seconds,
        }
        log(
            f"state: {n_params / 1e6:.1f}M params, {nbytes / C.GB:.3f} GB, "
            f"{state_info['tensors']} tensor entries"
        )

        log("measuring machine limits")
        limits = C.measure_limits(work / "limits", min(nbytes, 4 << 30), args.reps)
        for k, v in limits.items():
            log(f"  {k}: {v.get('gbps', v.get('ok'))}")
        cold_ok = limits["drop_caches_ok"]["ok"] and not args.no_cold

        names = [n for n in args.systems.split(",") if n]
        # Warm-up: imports, first-call costs (DCP planning code, thread pools) on a tiny state.
        tiny = {"a": torch.randn(1000), "b": {"c": torch.ones(3, dtype=torch.bfloat16)}, "n": 1}
        for n in names:
            s = SYSTEMS[n](work / "warmup")
            s.save(tiny, fresh=True)
            s.load_new(tiny)
            s.load_into(C.map_tensors(tiny, torch.zeros_like))
        shutil.rmtree(work / "warmup")

        systems = [SYSTEMS[n](work) for n in names]
        log("saves")
        rows = run_saves(bs, systems, args.reps, log)
        bs.drop_grads()
        rss_after_saves = C.rss()
        stores.release_all()  # free deltackpt's staging arenas before loading
        gc.collect()
        log(
            f"RSS after saves {rss_after_saves / C.GB:.2f} GB, after dropping deltackpt stores "
            f"{C.rss() / C.GB:.2f} GB"
        )
        chains = {
            s.name: stores.chain_stats(s.path())
            for s in systems
            if isinstance(s, DeltackptSystem) and s.latest is not None
        }
        for k, v in chains.items():
            log(f"  {k} latest snapshot: {v}")
        log("loads")
        rows += run_loads(bs, systems, args.reps, cold_ok, args.into_cold, log)

        result = {
            "bench": "saveload",
            "args": {k: str(v) for k, v in vars(args).items()},
            "machine": minfo,
            "versions": {
                "safetensors": safetensors.__version__,
                "deltackpt": deltackpt.__version__,
            },
            "deltackpt_threads": deltackpt.SaveOptions().threads,
            "deltackpt_code": fingerprint,
            "state": state_info,
            "limits": limits,
            "deltackpt_latest_chains": chains,
            "rows": rows,
            "total_seconds": time.perf_counter() - t_start,
            "rss": {
                "after_saves": rss_after_saves,
                "peak_vmhwm": C.vmhwm(),
                "state_bytes": nbytes,
            },
            "loadavg_end": os.getloadavg(),
        }
        table = summarize(result)
        result["markdown"] = table
        C.write_json(out_path, result)
        print()
        print(
            f"## bench_saveload: {args.state} {args.model} scale {args.scale:g}: "
            f"{n_params / 1e6:.1f}M params, {nbytes / C.GB:.3f} GB "
            f"({minfo['date']}, {minfo['cpus']} cpus, load average "
            f"{minfo['loadavg_start'][0]:.1f} at start, {os.getloadavg()[0]:.1f} at end, "
            f"{result['total_seconds']:.0f} s)\n"
        )
        print(table)
        print(f"\nwrote {out_path} ({result['total_seconds']:.0f} s total)")
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()

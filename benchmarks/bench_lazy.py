"""Many small tensors read through ``open_snapshot``, side by side in one run: one call per
tensor against one pass for all of them.

The state is a LoRA run's (rank-16 adapters on every linear layer of a 0.5B Qwen2-shaped model,
bf16, and AdamW's two fp32 moments per adapter tensor: 1008 tensors under 1 MiB each, so the
saver groups them into shared chunks). Rows, warm (the packs in the page cache), median of
``--repeats``:

* ``get_tensor`` per key vs ``get_tensors(keys)`` (what ``export_peft`` and vLLM's ``add_lora``
  from the store read);
* ``read_box`` per tensor vs ``read_boxes`` (what the tiers' DCP reader, ``TieredReader``, reads
  for a plan's items);
* ``deltackpt.load`` of the whole snapshot, the floor.

Also this machine's memcpy, xxh3 and warm-read ceilings, measured in the same run.

    python benchmarks/bench_lazy.py
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

import torch
from _harness.limits import measure_limits, median, timed
from _harness.report import fmt_bytes, md_table
from bench_vllm_lora import adapter

import deltackpt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    sd = adapter("500m", args.rank, 1)
    state = {
        "model": sd,
        "optim": {
            f"{k}.{m}": torch.randn(v.shape, dtype=torch.float32)
            for k, v in sd.items()
            for m in ("exp_avg", "exp_avg_sq")
        },
    }
    tmp = Path(tempfile.mkdtemp(prefix="deltackpt-bench-lazy-"))
    try:
        deltackpt.save(state, tmp / "store", "v1")
        with deltackpt.open_snapshot(tmp / "store", "v1") as f:
            keys = f.keys()
            items = [
                (f.entry(k), ((0,) * len(f.entry(k).shape), tuple(f.entry(k).shape))) for k in keys
            ]
            nbytes = sum(e.nbytes for e, _ in items)
            limits = measure_limits(tmp / "limits", max(nbytes, 64 << 20))
            f.get_tensors(keys)  # warm the page cache

            def best(fn: object) -> tuple[float, float, float]:
                secs = [timed(fn)[0] for _ in range(args.repeats)]  # type: ignore[arg-type]
                return median(secs), min(secs), max(secs)

            rows_in = [
                ("`get_tensor` per key", best(lambda: [f.get_tensor(k) for k in keys])),
                ("`get_tensors(keys)`, one pass", best(lambda: f.get_tensors(keys))),
                ("`read_box` per tensor (TieredReader before)", best(lambda: [f.read_box(e, b) for e, b in items])),
                ("`read_boxes`, one pass (TieredReader now)", best(lambda: f.read_boxes(items))),
                ("`deltackpt.load` of the snapshot (the floor)", best(lambda: deltackpt.load(tmp / "store", "v1"))),
            ]  # fmt: skip
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    floor = rows_in[-1][1][0]
    rows = [
        [what, f"{s:.3f} [{lo:.3f}-{hi:.3f}]", f"{s / floor:.2f}x", f"{nbytes / s / 1e9:.2f}"]
        for what, (s, lo, hi) in rows_in
    ]
    print(f"\n`{' '.join(['python', *sys.argv])}`: {len(keys)} tensors, {fmt_bytes(nbytes)} "
          f"(LoRA rank {args.rank} on a 0.5B Qwen2 shape, bf16, + AdamW fp32 moments), "
          f"warm, median [range] of {args.repeats}\n")  # fmt: skip
    for key in ("memcpy", "xxh3", "read_warm"):
        print(f"- {limits[key]['what']}: {limits[key]['gbps']:.2f} GB/s")
    print()
    print(md_table(["read", "seconds", "vs load", "GB/s"], rows))


if __name__ == "__main__":
    main()

"""Refit into an engine that serves block-FP8 weights, side by side in one run: what the FP8
path costs the trainer and what it sends, against the bf16 refit of the same weights.

The weights: the linear layers of Qwen2-0.5B (q, k, v, o, gate, up, down; ``--scale`` shrinks
the layer count), fp32 masters stepped by AdamW as an RL trainer steps them
(``_harness/rl_step.py``: lr 1e-6 after 5 warm-up steps, ~1-2% of the bf16 elements change),
published as bf16. Per row, on this machine, one trainer and one receiver in this process over
a gloo link (loopback):

* ``quantize``: ``Fp8Blocks.apply`` of the bf16 weights (128 x 128 blocks, ``float8_e4m3fn``),
  against a copy of the same bytes (``memcpy``, this machine's ceiling, measured now);
* ``bf16 full / delta``: rounds of the bf16 weights (what an unquantized engine gets);
* ``fp8 full / delta``: rounds of the quantized weights with their scales (what
  ``DeltackptTrainerInitInfo(quantize="auto")`` sends an FP8 engine), their time with and
  without the quantize step;
* the changed elements of each form (bitwise).

    python benchmarks/bench_fp8.py              # scale 0.25 (6 layers, ~90M linear params)
    python benchmarks/bench_fp8.py --scale 1    # all 24 layers (~360M; ~6 GB of RAM)
    python benchmarks/bench_fp8.py --device cuda --quantize-only   # the trainer's GPU (device check)
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's deltackpt

import torch
from _harness.env import GB, OUT_DIR, free_port, machine_info
from _harness.limits import median
from _harness.models import qwen2_shapes
from _harness.report import fmt_bytes, md_table, write_results
from _harness.rl_step import changed_fraction, rl_like_versions

from deltackpt import sync
from deltackpt.sync.fp8 import SCALE_SUFFIX, Fp8Blocks

LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def pair() -> tuple[sync.SyncGroup, sync.SyncGroup]:
    port = free_port()
    out: list[Any] = [None, None]

    def join(r: int) -> None:
        out[r] = sync.SyncGroup("127.0.0.1", port, r, 2, [0], timeout=120.0, links="gloo")

    th = [threading.Thread(target=join, args=(r,)) for r in (0, 1)]
    for t in th:
        t.start()
    for t in th:
        t.join()
    return out[0], out[1]


def rounds(states: list[dict[str, torch.Tensor]], quantize: Fp8Blocks | None) -> list[dict]:
    """One round per state (the first full), each timed from the trainer's bf16 weights to
    the receiver's committed copies; with ``quantize``, its step inside the timing too."""
    g0, g1 = pair()
    sender = sync.WeightSender(g0, dtype=torch.bfloat16)  # (FP8 bytes and scales kept)
    receiver = sync.WeightReceiver(g1, dtype=torch.bfloat16)
    out = []
    try:
        for sd in states:
            t0 = time.perf_counter()
            sent = quantize.apply(sd) if quantize is not None else sd
            tq = time.perf_counter() - t0
            th = threading.Thread(target=receiver.pull)
            th.start()
            stats = sender.push(sent, version=len(out) + 1)
            th.join()
            out.append({"seconds": time.perf_counter() - t0, "quantize_s": tq,
                        "sent": stats.payload_bytes, "full": stats.full})  # fmt: skip
    finally:
        g0.close()
        g1.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scale", type=float, default=0.25)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=str(OUT_DIR))
    ap.add_argument("--device", default="cpu", help="where the weights are quantized")
    ap.add_argument("--quantize-only", action="store_true", help="no rounds (the device check)")
    args = ap.parse_args()
    torch.set_num_threads(2)
    shapes = [(n, s) for n, s in qwen2_shapes(args.scale) if n.split(".")[-2] in LINEAR]
    t0 = time.perf_counter()
    if args.quantize_only:  # no step needed: random weights
        g = torch.Generator().manual_seed(0)
        v1 = [(torch.randn(s, generator=g) * 0.02).to(torch.bfloat16) for _, s in shapes]
        v0 = v1
    else:
        v0, v1 = rl_like_versions([s for _, s in shapes], lr=1e-6, warmup=5)
    names = [n for n, _ in shapes]
    sd0, sd1 = dict(zip(names, v0, strict=True)), dict(zip(names, v1, strict=True))
    print(f"weights made in {time.perf_counter() - t0:.1f} s", flush=True)
    nbytes = sum(t.numel() * t.element_size() for t in v0)
    weights = [n for n in names if n.endswith(".weight")]  # (q/k/v biases travel as bf16)
    spec = Fp8Blocks(include=set(weights))

    # the ceiling: a copy of the same bytes into a touched buffer, on the quantizing device
    dev = torch.device(args.device)
    sync_dev = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    flat = torch.cat([t.view(-1) for t in v1]).to(dev)
    dst = torch.empty_like(flat)

    def copy(dst: torch.Tensor = dst, flat: torch.Tensor = flat) -> None:
        dst.copy_(flat)
        sync_dev()

    memcpy = median([_timed(copy) for _ in range(args.repeats + 1)][1:])
    del flat, dst
    on_dev = {n: t.to(dev) for n, t in sd1.items()}

    def quantize(on_dev: dict[str, torch.Tensor] = on_dev) -> None:
        spec.apply(on_dev)
        sync_dev()

    quant = median([_timed(quantize) for _ in range(args.repeats + 1)][1:])  # (warm-up first)
    del on_dev
    if args.quantize_only:
        print(f"bench_fp8 on {dev}: quantize {fmt_bytes(nbytes)} bf16 in {quant:.4f} s = "
              f"{nbytes / quant / GB:.1f} GB/s = {memcpy / quant:.2f}x a copy of the same bytes "
              f"({nbytes / memcpy / GB:.1f} GB/s)")  # fmt: skip
        return
    q0, q1 = spec.apply(sd0), spec.apply(sd1)
    fp8_changed = changed_fraction([q0[n] for n in weights], [q1[n] for n in weights])
    scales_changed = changed_fraction(
        [q0[n + SCALE_SUFFIX] for n in weights], [q1[n + SCALE_SUFFIX] for n in weights]
    )
    bf16_changed = changed_fraction(v0, v1)
    fp8_bytes = sum(t.numel() * t.element_size() for t in q1.values())
    del q0, q1

    bf16 = [rounds([sd0, sd1], None) for _ in range(args.repeats)]
    fp8 = [rounds([sd0, sd1], spec) for _ in range(args.repeats)]

    def med(rs: list[list[dict]], i: int, key: str) -> float:
        return median([r[i][key] for r in rs])

    rows = [
        ["quantize (Fp8Blocks.apply)", f"{quant:.3f}", fmt_bytes(nbytes),
         f"{nbytes / quant / GB:.2f} GB/s", f"{memcpy / quant:.2f}x memcpy"],
        ["bf16 full round", f"{med(bf16, 0, 'seconds'):.3f}", fmt_bytes(med(bf16, 0, "sent")),
         "", ""],
        ["bf16 delta round", f"{med(bf16, 1, 'seconds'):.3f}", fmt_bytes(med(bf16, 1, "sent")),
         f"{med(bf16, 1, 'sent') / med(bf16, 0, 'sent'):.1%} of full", ""],
        ["fp8 full round (quantize + round)", f"{med(fp8, 0, 'seconds'):.3f}",
         fmt_bytes(med(fp8, 0, "sent")), f"{med(fp8, 0, 'sent') / med(bf16, 0, 'sent'):.1%} "
         "of bf16 full", f"quantize {med(fp8, 0, 'quantize_s'):.3f} s"],
        ["fp8 delta round (quantize + round)", f"{med(fp8, 1, 'seconds'):.3f}",
         fmt_bytes(med(fp8, 1, "sent")), f"{med(fp8, 1, 'sent') / med(fp8, 0, 'sent'):.1%} "
         "of fp8 full", f"quantize {med(fp8, 1, 'quantize_s'):.3f} s"],
    ]  # fmt: skip
    text = (
        f"bench_fp8: {len(weights)} linear weights (+ {len(names) - len(weights)} biases), {fmt_bytes(nbytes)} bf16 "
        f"({fmt_bytes(fp8_bytes)} as FP8 + scales); changed elements after the step: bf16 "
        f"{bf16_changed:.2%}, FP8 {fp8_changed:.2%}, scales {scales_changed:.2%}; memcpy "
        f"{nbytes / memcpy / GB:.1f} GB/s (quantized on {dev})\n\n"
        + md_table(["what", "seconds", "bytes", "share / rate", "note"], rows)
    )
    print(text)
    doc = {"machine": machine_info(), "args": vars(args), "bytes": nbytes, "fp8_bytes": fp8_bytes,
           "changed": {"bf16": bf16_changed, "fp8": fp8_changed, "scales": scales_changed},
           "memcpy_s": memcpy, "quantize_s": quant, "bf16": bf16, "fp8": fp8}  # fmt: skip
    print(write_results(args.out, "fp8", doc, text))


def _timed(fn: Any) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


if __name__ == "__main__":
    main()

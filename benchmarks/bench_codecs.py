"""Micro-benchmark of deltackpt.format.codecs on synthetic weights.

For bf16 and fp32 weights (torch.randn) and the same weights after a simulated AdamW step
(``w - lr * sign(randn)``, the shape of an Adam update at its steady state), encodes the new
weights in 4 MiB chunks on a thread pool, decodes them back (checking bit-exactness) and prints
a markdown table of ratio (payload / raw), encode and decode GB/s per codec. ``auto`` is the
default policy (probe, then the best of raw/zstd/xor). A second table shows what the probe costs
on incompressible data, relative to compressing it.

    python benchmarks/bench_codecs.py --mib 256
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

# Run from a checkout without installing: make the repo root importable.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from deltackpt.format.codecs import RAW, XOR, ZSTD, Encoded, EncodePolicy, decode, encode

POLICIES: dict[str, EncodePolicy] = {
    "raw": EncodePolicy(force=RAW),
    "zstd": EncodePolicy(force=ZSTD),
    "xor": EncodePolicy(force=XOR),
    "auto": EncodePolicy(),
}


def make_weights(nbytes: int, dtype: torch.dtype, lr: float) -> tuple[np.ndarray, np.ndarray]:
    """(new, base) raw bytes: base = randn weights, new = base after one optimizer step."""
    gen = torch.Generator().manual_seed(0)
    n = nbytes // (torch.finfo(dtype).bits // 8)
    base = torch.randn(n, generator=gen)
    new = base - lr * torch.sign(torch.randn(n, generator=gen))
    as_bytes = lambda t: t.to(dtype).view(torch.uint8).numpy()  # noqa: E731
    return as_bytes(new), as_bytes(base)


def chunk_slices(nbytes: int, chunk: int) -> list[slice]:
    return [slice(s, min(s + chunk, nbytes)) for s in range(0, nbytes, chunk)]


def timed(fn: Callable[[], object]) -> tuple[float, object]:
    t0 = time.perf_counter()
    result = fn()
    return time.perf_counter() - t0, result


def run_codec(
    pool: ThreadPoolExecutor,
    new: np.ndarray,
    base: np.ndarray,
    itemsize: int,
    policy: EncodePolicy,
    chunk: int,
    repeat: int,
) -> tuple[float, float, float, Counter]:
    """Return (ratio, encode GB/s, decode GB/s, codec counts) for one policy, best of repeat."""
    slices = chunk_slices(new.size, chunk)

    def enc(s: slice) -> Encoded:
        return encode(new[s], itemsize, base=base[s], policy=policy)

    # Best of `repeat`: the machine may be shared, and the minimum is the least noisy estimate.
    t_enc, encoded = min(
        (timed(lambda: list(pool.map(enc, slices))) for _ in range(repeat)), key=lambda r: r[0]
    )
    out = np.ones_like(new)  # touched up front: time decoding, not first-touch page faults

    def dec(item: tuple[slice, Encoded]) -> None:
        s, e = item
        decode(e.codec, e.payload, s.stop - s.start, e.itemsize, out[s], base=base[s])

    t_dec = min(
        timed(lambda: list(pool.map(dec, zip(slices, encoded, strict=True))))[0]
        for _ in range(repeat)
    )
    if not np.array_equal(out, new):
        raise SystemExit(f"round trip is not bit-exact for policy {policy}")
    payload = sum(len(e.payload) for e in encoded)
    return (
        payload / new.size,
        new.size / t_enc / 1e9,
        new.size / t_dec / 1e9,
        Counter(e.codec for e in encoded),
    )


def probe_cost(
    pool: ThreadPoolExecutor, nbytes: int, chunk: int, repeat: int
) -> tuple[float, float, str]:
    """On random bytes: (auto encode s, forced zstd encode s, codecs auto chose)."""
    data = np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8)
    slices = chunk_slices(nbytes, chunk)

    def run(policy: EncodePolicy) -> tuple[float, list[Encoded]]:
        return timed(lambda: list(pool.map(lambda s: encode(data[s], 2, policy=policy), slices)))

    run(POLICIES["auto"])  # warm up caches and per-thread scratch
    t_auto, encs = min((run(POLICIES["auto"]) for _ in range(repeat)), key=lambda r: r[0])
    t_zstd = min(run(POLICIES["zstd"])[0] for _ in range(repeat))
    chosen = ",".join(sorted({e.codec for e in encs}))
    return t_auto, t_zstd, chosen


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--mib", type=int, default=256, help="weight bytes per dtype (default 256)")
    ap.add_argument("--chunk-mib", type=float, default=4, help="chunk size in MiB (default 4)")
    ap.add_argument("--threads", type=int, default=2, help="thread pool size (default 2)")
    ap.add_argument("--repeat", type=int, default=3, help="timed runs, best kept (default 3)")
    ap.add_argument("--lr", type=float, default=1e-5, help="simulated update size (default 1e-5)")
    args = ap.parse_args()

    nbytes = args.mib << 20
    chunk = int(args.chunk_mib * (1 << 20))
    print(
        f"{args.mib} MiB per dtype, {chunk >> 10} KiB chunks, {args.threads} threads, "
        f"update w - {args.lr:g} * sign(randn), best of {args.repeat}, torch {torch.__version__}\n"
    )
    print("| dtype | codec | ratio | encode GB/s | decode GB/s | chunks |")
    print("|---|---|---:|---:|---:|---|")
    with ThreadPoolExecutor(max_workers=args.threads) as pool:
        for dtype, itemsize in ((torch.bfloat16, 2), (torch.float32, 4)):
            new, base = make_weights(nbytes, dtype, args.lr)
            for name, policy in POLICIES.items():
                ratio, enc_gbs, dec_gbs, counts = run_codec(
                    pool, new, base, itemsize, policy, chunk, args.repeat
                )
                mix = " ".join(f"{c}:{n}" for c, n in sorted(counts.items()))
                enc_col = "zero copy" if name == "raw" else f"{enc_gbs:.2f}"
                print(
                    f"| {str(dtype).removeprefix('torch.')} | {name} | {ratio:.3f} "
                    f"| {enc_col} | {dec_gbs:.2f} | {mix} |"
                )
            del new, base

        t_auto, t_zstd, chosen = probe_cost(pool, min(nbytes, 64 << 20), chunk, args.repeat)
    print("\nIncompressible data (random bytes, 64 MiB max):\n")
    print("| policy | encode s | chose | probe cost vs zstd |")
    print("|---|---:|---|---:|")
    print(f"| zstd (forced) | {t_zstd:.3f} | zstd | 100% |")
    print(f"| auto (probe) | {t_auto:.3f} | {chosen} | {100 * t_auto / t_zstd:.1f}% |")


if __name__ == "__main__":
    main()

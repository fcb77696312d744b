"""How fast a device round's digests run (deltackpt/sync/device_digest.py) beside the device's
copy limit and the chunk fingerprints they are built from, on the messages of one round (a few
large pieces and a tail of small ones per message); on CUDA also the fingerprints fused by
``torch.compile`` (``DELTACKPT_FINGERPRINT_COMPILE=on``), their compile time and whether they
give the same integers.

    python benchmarks/bench_digest.py --gb 1 --bucket-mb 64     # on a GPU (the device check)
    python benchmarks/bench_digest.py --gb 0.03                 # the CPU dry run

Prints one table: seconds and GB/s per way.
"""

from __future__ import annotations

import argparse
import time

import torch
from _harness.limits import device_best

from deltackpt.format.fingerprint import source_fingerprints
from deltackpt.options import overrides
from deltackpt.sync.device_digest import message_digests


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--gb", type=float, default=1.0 if torch.cuda.is_available() else 0.03)
    ap.add_argument("--bucket-mb", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    bucket = args.bucket_mb << 20
    n = max(1, int(args.gb * 1e9) // bucket)
    data = torch.randint(0, 256, (n * bucket,), dtype=torch.uint8, device=dev)
    msgs = [data[i * bucket : (i + 1) * bucket] for i in range(n)]
    # a bucket's pieces: a few large ones and a tail of small ones (norms, biases)
    spans = [(256 + j * (bucket // 4), bucket // 4 - 512) for j in range(4)]
    spans[-1] = (spans[-1][0], spans[-1][1] - 64 * 1024)
    spans += [(bucket - 64 * 1024 + j * 1024, 1000 + j) for j in range(60)]
    gb = n * bucket / 1e9
    rows: list[tuple[str, float]] = []
    other = torch.empty_like(data)
    rows.append(
        ("device-to-device copy", device_best(lambda: other.copy_(data), dev, args.repeats))
    )
    for m in msgs:  # warm-up: the position keys are made once per device
        message_digests(m, spans)
    rows.append(
        (
            "digests, torch ops",
            device_best(lambda: [message_digests(m, spans) for m in msgs], dev, 3),
        )
    )
    rows.append(
        (
            "chunk fingerprints (1 MiB)",
            device_best(lambda: [source_fingerprints(m, 1 << 20) for m in msgs], dev, 3),
        )
    )
    note = ""
    if dev.type == "cuda":  # DELTACKPT_FINGERPRINT_COMPILE=on: the same, fused
        ref = [source_fingerprints(m, 1 << 20) for m in msgs]
        t0 = time.perf_counter()
        try:
            fused = [source_fingerprints(m, 1 << 20, fused=True) for m in msgs]
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            same = all(torch.equal(a, b) for a, b in zip(ref, fused, strict=True))
            note = f"compile + first pass {time.perf_counter() - t0:.1f} s; same integers: {same}"
            rows.append(
                (
                    "chunk fingerprints, fused (torch.compile)",
                    device_best(
                        lambda: [source_fingerprints(m, 1 << 20, fused=True) for m in msgs], dev, 3
                    ),
                )
            )
            with overrides(DELTACKPT_FINGERPRINT_COMPILE="on"):
                rows.append(
                    (
                        "digests, fused fingerprints",
                        device_best(lambda: [message_digests(m, spans) for m in msgs], dev, 3),
                    )
                )
        except Exception as e:  # reported, not fatal: the default needs no compiler
            note = f"torch.compile failed: {type(e).__name__}: {str(e)[:300]}"
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    print(
        f"\n## device digests: {name}, {n} messages of {args.bucket_mb} MiB ({gb:.2f} GB), "
        f"{len(spans)} pieces each\n"
    )
    print("| way | seconds | GB/s |\n|---|---|---|")
    for label, s in rows:
        print(f"| {label} | {s:.4f} | {gb / s:.1f} |")
    if note:
        print(f"\n{note}")


if __name__ == "__main__":
    main()

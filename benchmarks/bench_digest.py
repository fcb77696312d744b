"""How fast a device round's digests run (deltackpt/sync/device_digest.py) beside the device's
copy limit and the chunk fingerprints they are built from, on the messages of one round (a few
large pieces and a tail of small ones per message), for each way to compute them
(``DELTACKPT_FINGERPRINT_COMPILE``): the torch operations; on CUDA fused by ``torch.compile``
(``on``) and the Triton kernel (``triton``, where Triton is installed), with their first call's
time (the compile) and whether they give the same integers; where the kernel runs, also the copy
of the messages' pieces and their fingerprints fused in one pass (``fingerprint_kernel.copy_spans``:
what a receiver's copy out of the shared bucket and its verification cost together in a device
round on an ipc link whose header comes in the cell).

    python benchmarks/bench_digest.py --gb 1 --bucket-mb 64     # on a GPU (the device check)
    python benchmarks/bench_digest.py --gb 0.03                 # the CPU dry run

Prints one table: seconds and GB/s per way.
"""

from __future__ import annotations

import argparse
import time

import torch
from _harness.limits import device_best

from deltackpt.format import fingerprint_kernel
from deltackpt.format.fingerprint import many_fingerprints, position_keys
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
    notes: list[str] = []
    ref = many_fingerprints(msgs, 1 << 20)
    # the torch ops, fused by torch.compile (on CUDA), one Triton kernel (where it runs): the
    # same integers (DELTACKPT_FINGERPRINT_COMPILE=off / on / triton)
    kernels = ["torch"] + (["compile"] if dev.type == "cuda" else [])
    kernels += ["triton"] if fingerprint_kernel.available(dev) else []
    knob = {"torch": "off", "compile": "on", "triton": "triton"}
    for kernel in kernels:
        try:
            t0 = time.perf_counter()
            got = many_fingerprints(msgs, 1 << 20, kernel)
            first = time.perf_counter() - t0
            same = all(torch.equal(a, b) for a, b in zip(ref, got, strict=True))
            notes.append(f"{kernel}: first call {first:.1f} s; same integers: {same}")
            rows.append(
                (
                    f"chunk fingerprints (1 MiB), {kernel}",
                    device_best(lambda k=kernel: many_fingerprints(msgs, 1 << 20, k), dev, 3),
                )
            )
            with overrides(DELTACKPT_FINGERPRINT_COMPILE=knob[kernel]):
                rows.append(
                    (
                        f"digests, {kernel}",
                        device_best(lambda: [message_digests(m, spans) for m in msgs], dev, 3),
                    )
                )
        except Exception as e:  # reported, not fatal: the default needs no compiler
            notes.append(f"{kernel} failed: {type(e).__name__}: {str(e)[:300]}")
    if fingerprint_kernel.available(dev):  # a receiver's copy and its verification in one pass
        try:
            p, q = position_keys(dev, (1 << 20) // 8)
            every = [(i * bucket + o, k) for i in range(n) for o, k in spans]
            want = many_fingerprints([data[o : o + k] for o, k in every], 1 << 20)
            other.zero_()
            got = fingerprint_kernel.copy_spans(data, other, every, 1 << 20, p, q)
            copied = all(torch.equal(other[o : o + k], data[o : o + k]) for o, k in every)
            same = all(torch.equal(a, b) for a, b in zip(want, got, strict=True))
            notes.append(f"fused copy: copied every piece: {copied}; same integers: {same}")
            rows.append(
                (
                    "pieces copied + chunk fingerprints fused (Triton, one pass)",
                    device_best(
                        lambda: fingerprint_kernel.copy_spans(data, other, every, 1 << 20, p, q),
                        dev,
                        3,
                    ),
                )
            )
        except Exception as e:
            notes.append(f"fused copy failed: {type(e).__name__}: {str(e)[:300]}")
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    print(
        f"\n## device digests: {name}, {n} messages of {args.bucket_mb} MiB ({gb:.2f} GB), "
        f"{len(spans)} pieces each\n"
    )
    print("| way | seconds | GB/s |\n|---|---|---|")
    for label, s in rows:
        print(f"| {label} | {s:.4f} | {gb / s:.1f} |")
    print("\n" + "\n".join(notes))


if __name__ == "__main__":
    main()

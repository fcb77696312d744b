"""A receiver's check and write of host patches, side by side in one run: assembled vs not,
torch's indexing vs one C pass.

A delta round's ``PACKED`` piece (the changed elements of a bf16 tensor) is verified against the
digest of its new bytes before anything is applied. Two ways, on the same pieces:

* ``assembled`` (before 2026-11-29, and still for pieces whose target is not a contiguous host
  tensor): the receiver's copy of the piece (its base) is copied into the staging slot, the
  changed elements written there, and the slot hashed (xxh3-128).
* ``patched_digest`` (``deltackpt.sync.patches.patched_digest``): base and changed elements
  hashed together a cache-sized chunk at a time; nothing is written to the slot.

Then the write of the same changed elements into the receiver's copies (host tensors), keeping
the old values for its undo (a vLLM worker always keeps them: its ring staging writes before the
vote), two ways:

* ``torch indexing`` (before 2026-11-29): ``old = words[where]`` then ``words[where] = new``;
* ``one C pass`` (``deltackpt.sync.apply._host_patch``, ``_native.patch_apply``): each element's
  old value read and its new one written while its cache line is in;
* ``one C pass, 2 threads``: the same, a piece per thread (``apply.apply_round`` writes a
  round's host patches on the receiver's pool).

Pieces of 64 MiB (``--mb`` in all) of random bf16 words, ``--frac`` of their elements changed at
random places (an RL step at lr 1e-6 changes ~2.3%). The two paths alternate, ``--repeats``
times; rows give the best and the median. memcpy and xxh3-128 of the same pieces (one thread)
are this machine's limits, measured in the same run.

    python benchmarks/bench_patch_check.py --mb 1024 --frac 0.023
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
import xxhash

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness.report import md_table

from deltackpt.sync import apply, patches, wire

MiB = 1 << 20
PIECE = 64 * MiB


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=int, default=1024, help="MiB of bf16 pieces in all")
    ap.add_argument("--frac", type=float, default=0.023, help="fraction of elements changed")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    n = PIECE // 2
    count = max(1, args.mb * MiB // PIECE)
    k = max(1, int(n * args.frac))
    bases = [rng.integers(0, 1 << 16, n, dtype=np.uint16).view(np.uint8) for _ in range(count)]
    edits = [
        (
            np.sort(rng.choice(n, k, replace=False)).astype(np.int64),
            rng.integers(0, 1 << 16, k, dtype=np.uint16),
        )
        for _ in range(count)
    ]
    slot = np.ones(PIECE, dtype=np.uint8)  # the staging slot, its pages touched once

    def assembled() -> list[tuple[int, int]]:
        out = []
        for base, (idx, vals) in zip(bases, edits, strict=True):
            np.copyto(slot, base)
            slot.view(np.uint16)[idx] = vals
            h = xxhash.xxh3_128()
            h.update(slot)
            out.append(wire.digest_words(h))
        return out

    def fused() -> list[tuple[int, int]]:
        return [patches.patched_digest(b, *e) for b, e in zip(bases, edits, strict=True)]

    if assembled() != fused():
        raise SystemExit("the two checks disagree")

    targets = [torch.from_numpy(b.copy()).view(torch.int16) for b in bases]
    wheres = [(torch.from_numpy(i), torch.from_numpy(v.view(np.int16))) for i, v in edits]

    def torch_write() -> None:
        for words, (where, new) in zip(targets, wheres, strict=True):
            kept = words[where]  # the undo's old values: a copy
            words[where] = new
            del kept

    def c_write() -> None:
        for words, (idx, vals) in zip(targets, edits, strict=True):
            if not apply._host_patch(words, idx, vals.view(np.int16), []):
                raise SystemExit("no C extension (python setup.py build_ext --inplace)")

    pool = ThreadPoolExecutor(2)

    def c_write_2t() -> None:  # apply_round: a piece per thread of the receiver's pool
        def one(j: int) -> None:
            idx, vals = edits[j]
            apply._host_patch(targets[j], idx, vals.view(np.int16), [])

        list(pool.map(one, range(len(targets))))

    def memcpy() -> None:
        for base in bases:
            np.copyto(slot, base)

    def xxh3() -> None:
        for base in bases:
            xxhash.xxh3_128(base).digest()

    fns: dict[str, Callable[[], object]] = {
        "assembled": assembled, "patched_digest": fused, "memcpy": memcpy, "xxh3": xxh3,
        "torch indexing": torch_write, "one C pass": c_write,
        "one C pass, 2 threads": c_write_2t,
    }  # fmt: skip
    runs: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(args.repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            runs[name].append(time.perf_counter() - t0)
    total = count * PIECE
    best = {name: min(ts) for name, ts in runs.items()}
    gbs = {name: total / t / 1e9 for name, t in best.items()}
    print(
        f"{count} pieces of 64 MiB bf16 ({total / 1e9:.2f} GB), {100 * args.frac:.1f}% of the "
        f"elements changed; limits in this run (one thread): memcpy {gbs['memcpy']:.1f} GB/s, "
        f"xxh3-128 {gbs['xxh3']:.1f} GB/s\n"
    )
    rows = [
        [
            name,
            f"{best[name]:.3f}",
            f"{statistics.median(runs[name]):.3f}",
            f"{gbs[name]:.2f}",
            f"{best['assembled'] / best[name]:.2f}x",
            f"{100 * gbs[name] / gbs['xxh3']:.0f}%",
        ]
        for name in ("assembled", "patched_digest")
    ]
    head = ["check", "best s", "median s", "GB/s of piece bytes", "speed vs assembled"]
    print(md_table([*head, "% of xxh3-128"], rows))
    print()
    rows = [
        [
            name,
            f"{best[name]:.3f}",
            f"{statistics.median(runs[name]):.3f}",
            f"{count * k / best[name] / 1e6:.0f}",
            f"{best['torch indexing'] / best[name]:.2f}x",
            f"{100 * best['memcpy'] / best[name]:.0f}%",
        ]
        for name in ("torch indexing", "one C pass", "one C pass, 2 threads")
    ]
    head = ["write (old values kept)", "best s", "median s", "M elements/s"]
    print(md_table([*head, "speed vs torch", "vs a memcpy of the pieces"], rows))


if __name__ == "__main__":
    main()

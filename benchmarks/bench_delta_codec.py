"""Benchmark of deltackpt.sync.delta_codec on bf16 weights before/after a real AdamW step.

Pieces of 64 KiB .. 64 MiB (``--mb`` in total) of bf16 weights; per setting (AdamW lr, and the
``pretrain_like`` setting of ~15% changed elements) prints the fraction of changed elements,
the size of each kind forced alone over the dense size (``planes`` = xor + zstd-1 on byte
planes, the reference "change size"), what the automatic choice sends, and encode/decode GB/s
of piece bytes on one thread and on 2 threads over separate pieces (the codec releases the
GIL), plus the rates with zstd ruled out (``allow={DENSE, SPARSE}``: what a CPU-bound sender
gets). memcpy and xxh3-128 (one thread, same pieces) are measured in the same run as yardsticks.

    python benchmarks/bench_delta_codec.py --mb 256 --lr 1e-6 1e-5
    python benchmarks/bench_delta_codec.py --scan   # the size-vs-density table of the codec docs
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import xxhash

# Run from a checkout without installing: make the repo root and the harness importable.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness.report import md_table
from _harness.rl_step import PRETRAIN_LR, changed_fraction, rl_like_versions

from deltackpt.sync.delta_codec import (
    DENSE,
    KIND_NAMES,
    PLANES,
    SPARSE,
    Encoded,
    encode,
)
from deltackpt.sync.delta_decode import decode_into

KiB, MiB, GB = 1 << 10, 1 << 20, 1e9
ITEMSIZE = 2  # bf16


@dataclass
class Piece:
    new: np.ndarray
    base: np.ndarray
    out: np.ndarray  # decode target, touched once so page faults are not timed


def piece_sizes(total: int) -> list[int]:
    """64 KiB, 128 KiB, ... 64 MiB, repeated until ``total`` bytes (the last one trimmed)."""
    ladder = [64 * KiB << i for i in range(11)]
    sizes: list[int] = []
    while sum(sizes) < total:
        for s in ladder:
            left = total - sum(sizes)
            if left <= 0:
                break
            sizes.append(max(64 * KiB, min(s, left)))
    return sizes


def make_pieces(total: int, lr: float) -> tuple[list[Piece], float]:
    shapes = [(s // ITEMSIZE,) for s in piece_sizes(total)]
    v0, v1 = rl_like_versions(shapes, lr=lr)
    frac = changed_fraction(v0, v1)
    as_u8 = lambda t: t.view(torch.uint8).numpy()  # noqa: E731
    pieces = [
        Piece(as_u8(b), as_u8(a), np.zeros(a.numel() * ITEMSIZE, np.uint8))
        for a, b in zip(v0, v1, strict=True)
    ]
    return pieces, frac


def best_time(fn: Callable[[], object], reps: int) -> float:
    """Fastest of ``reps`` runs after one untimed warm-up (per-thread scratch, page faults)."""
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def run_all(
    pool: ThreadPoolExecutor | None, work: Callable[[int], object], order: list[int]
) -> None:
    if pool is None:
        for i in order:
            work(i)
    else:
        list(pool.map(work, order))


def measure(pieces: Sequence[Piece], reps: int) -> dict[str, object]:
    total = sum(p.new.size for p in pieces)
    forced = {
        k: [encode(p.new, p.base, ITEMSIZE, allow=frozenset({k})) for p in pieces]
        for k in (SPARSE, PLANES)
    }
    chosen: list[Encoded | None] = [encode(p.new, p.base, ITEMSIZE) for p in pieces]
    for p, e in zip(pieces, chosen, strict=True):
        assert e is not None
        decode_into(e.kind, e.payload, p.base, ITEMSIZE, p.out)
        assert np.array_equal(p.out, p.new), "round trip is not bit-exact"

    def enc(i: int) -> object:
        return encode(pieces[i].new, pieces[i].base, ITEMSIZE)

    def dec(i: int) -> None:
        e, p = chosen[i], pieces[i]
        assert e is not None
        decode_into(e.kind, e.payload, p.base, ITEMSIZE, p.out)

    order = sorted(range(len(pieces)), key=lambda i: -pieces[i].new.size)  # largest first
    rates: dict[str, float] = {}
    with ThreadPoolExecutor(2) as pool:
        for label, p in (("1t", None), ("2t", pool)):
            rates["enc " + label] = total / best_time(lambda p=p: run_all(p, enc, order), reps) / GB
            rates["dec " + label] = total / best_time(lambda p=p: run_all(p, dec, order), reps) / GB

    no_zstd = frozenset({DENSE, SPARSE})
    sparse_enc = forced[SPARSE]

    def enc_sparse(i: int) -> object:
        return encode(pieces[i].new, pieces[i].base, ITEMSIZE, allow=no_zstd)

    def dec_sparse(i: int) -> None:
        e, p = sparse_enc[i], pieces[i]
        assert e is not None
        decode_into(e.kind, e.payload, p.base, ITEMSIZE, p.out)

    rates["enc sparse"] = total / best_time(lambda: run_all(None, enc_sparse, order), reps) / GB
    rates["dec sparse"] = total / best_time(lambda: run_all(None, dec_sparse, order), reps) / GB

    def size(encs: Sequence[Encoded | None]) -> float:
        return sum(e.nbytes if e is not None else 0 for e in encs) / total

    # the cheaper detector TRL uses: keep only each element's low byte (half the memory of a
    # bf16 base). A changed element whose low byte did not change is missed: its patch would
    # be wrong, the receiver's digest check fails the round and the next one is full
    changed = missed = pieces_missed = 0
    for p in pieces:
        new, base = p.new.view(np.uint16), p.base.view(np.uint16)
        diff = new != base
        miss = diff & (p.new[0::2] == p.base[0::2])
        changed += int(diff.sum())
        missed += int(miss.sum())
        pieces_missed += bool(miss.any())

    return {
        "sparse": size(forced[SPARSE]),
        "planes": size(forced[PLANES]),
        "chosen": size(chosen),
        "kinds": Counter(KIND_NAMES[e.kind] for e in chosen if e is not None),
        "low byte misses": missed / max(changed, 1),
        "pieces missed": pieces_missed / len(pieces),
        **rates,
    }


def yardsticks(pieces: Sequence[Piece], reps: int) -> tuple[float, float]:
    total = sum(p.new.size for p in pieces)
    copy = best_time(lambda: [np.copyto(p.out, p.new) for p in pieces], reps)
    digest = best_time(lambda: [xxhash.xxh3_128(p.new).digest() for p in pieces], reps)
    return total / copy / GB, total / digest / GB


def scan() -> None:
    """Forced SPARSE/PLANES sizes vs density: optimizer steps and random replacements."""
    rows = []
    for lr in (1e-8, 3e-7, 1e-6, 1e-5, 1e-4):
        pieces, frac = make_pieces(8 * MiB, lr)
        rows.append(scan_row(f"AdamW lr {lr:g}", pieces, frac))
    rng = np.random.default_rng(0)
    base = rng.integers(0, 256, 8 * MiB, dtype=np.uint8)
    for frac in (0.01, 0.1):
        new = base.copy()
        hit = rng.random(base.size // 2) < frac
        new.view(np.uint16)[hit] ^= rng.integers(1, 1 << 16, int(hit.sum()), dtype=np.uint16)
        rows.append(scan_row(f"random values {frac:.0%}", [Piece(new, base, new.copy())], frac))
    print(md_table(["data", "changed", "sparse/dense", "planes/dense", "chosen"], rows))


def scan_row(label: str, pieces: Sequence[Piece], frac: float) -> list[str]:
    total = sum(p.new.size for p in pieces)
    sizes = {}
    for k in (SPARSE, PLANES, None):
        encs = [
            encode(
                p.new,
                p.base,
                ITEMSIZE,
                allow=frozenset({k}) if k else frozenset({DENSE, SPARSE, PLANES}),
            )
            for p in pieces
        ]
        sizes[k] = sum(e.nbytes for e in encs if e is not None) / total
    return [
        label,
        f"{frac:.2%}",
        f"{sizes[SPARSE]:.2%}",
        f"{sizes[PLANES]:.2%}",
        f"{sizes[None]:.2%}",
    ]


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--mb", type=int, default=256, help="total piece bytes per setting, MiB")
    ap.add_argument(
        "--lr", type=float, nargs="+", default=[7e-7, 1e-6, 1e-5], help="AdamW learning rates"
    )
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--scan", action="store_true", help="print the size-vs-density table only")
    args = ap.parse_args()
    if args.scan:
        scan()
        return
    torch.set_num_threads(2)
    settings = [(f"lr {lr:g}", lr) for lr in args.lr] + [
        (f"pretrain (lr {PRETRAIN_LR:g})", PRETRAIN_LR)
    ]
    rows = []
    ref: tuple[float, float] | None = None
    for label, lr in settings:
        pieces, frac = make_pieces(args.mb * MiB, lr)
        m = measure(pieces, args.reps)
        if ref is None:
            ref = yardsticks(pieces, args.reps)
        kinds = " ".join(f"{k}:{c}" for k, c in sorted(m["kinds"].items()))  # type: ignore[union-attr]
        rows.append(
            [
                label,
                f"{frac:.2%}",
                f"{m['sparse']:.2%}",
                f"{m['planes']:.2%}",
                f"{m['chosen']:.2%}",
                kinds,
                f"{m['low byte misses']:.4%} · {m['pieces missed']:.0%}",
            ]
            + [
                f"{m[c]:.2f}"
                for c in ("enc 1t", "dec 1t", "enc 2t", "dec 2t", "enc sparse", "dec sparse")
            ]
        )
        del pieces
    assert ref is not None
    print(
        f"{args.mb} MiB of bf16 pieces (64 KiB .. 64 MiB) per setting; sizes / dense bytes; GB/s of piece bytes"
    )
    print(f"reference, 1 thread: memcpy {ref[0]:.2f} GB/s, xxh3-128 {ref[1]:.2f} GB/s\n")
    header = [
        "setting",
        "changed",
        "sparse",
        "planes (xor+zstd1)",
        "chosen",
        "kinds",
        "low-byte detector: changes missed · pieces with a miss",
        "enc 1t",
        "dec 1t",
        "enc 2t",
        "dec 2t",
        "enc 1t no zstd",
        "dec 1t no zstd",
    ]
    print(md_table(header, rows))


if __name__ == "__main__":
    main()

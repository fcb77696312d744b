"""Resume cost: Checkpointer.restore_latest (in place) vs load + load_state_dict vs torch.load.

    python benchmarks/bench_restore.py [--layers 16] [--width 2048] [--keep-last 3] [--steps 10]

Each variant runs in its own fresh process (so peak RSS is its own) against the same saved
state: fp32 MLP weights + AdamW moments after one step. Reported per variant: wall time of the
restore and peak RSS growth during it (sampled every ms), relative to the state's size, in all and
anonymous memory alone (mapped file pages are page cache, not the process's own). Variants:

* ``deltackpt in place``: ``Checkpointer.restore_latest``, reading into the live tensors;
* ``deltackpt copy``: ``deltackpt.load`` (new tensors) then ``load_state_dict``: what
  ``restore_latest`` did before issue 9 and what a plain-loop user does;
* ``torch.load``: ``torch.load(mmap=False)`` then ``load_state_dict`` (the peer);
* ``torch.load mmap``: ``torch.load(mmap=True)`` then ``load_state_dict``.

Then a retention run: ``Checkpointer(keep_last=K)`` over N dense AdamW steps, fp32 and bf16,
``encoding="auto"`` and ``"smallest"``: the most disk the store held after any save (packs and
manifests) as a multiple of the state, the bytes each save wrote, and the resume time.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as C

VARIANTS = ("deltackpt in place", "deltackpt copy", "torch.load", "torch.load mmap")


def build(layers: int, width: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, width)).sum().backward()
    opt.step()
    return model, opt


def child(variant: str, layers: int, width: int, root: Path) -> dict[str, float]:
    import deltackpt
    from deltackpt.checkpointer import restore_into

    model, opt = build(layers, width)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    opt.zero_grad(set_to_none=True)
    sampler = _RssSampler()  # ru_maxrss would keep the build's own (larger) high-water mark
    t0 = time.perf_counter()
    if variant == "deltackpt in place":
        deltackpt.Checkpointer(root / "store", every=1).restore_latest(
            {"model": model, "optim": opt}
        )
    elif variant == "deltackpt copy":
        loaded = deltackpt.load(root / "store")
        loaded.pop("deltackpt.rng", None)
        restore_into({"model": model, "optim": opt}, loaded)
    else:
        sd = torch.load(root / "state.pt", mmap=variant.endswith("mmap"), weights_only=True)
        model.load_state_dict(sd["model"])
        opt.load_state_dict(sd["optim"])
    seconds = time.perf_counter() - t0
    peak = sampler.stop()
    ok = all(bool((p != 0).any()) for p in model.parameters())
    return {"seconds": seconds, "peak_mb": peak / 1e6, "anon_mb": sampler.anon / 1e6, "ok": ok}


def _anon() -> int:
    """This process's anonymous resident memory (resident minus file-backed and shared pages:
    the pages of a memory-mapped file it reads are page cache, not its own), in bytes."""
    with open("/proc/self/statm") as f:
        _, resident, shared = (int(x) for x in f.read().split()[:3])
    return (resident - shared) * os.sysconf("SC_PAGE_SIZE")


class _RssSampler:
    """Highest resident set size above the starting one, sampled every millisecond; ``anon``:
    the same for anonymous memory alone (what the process allocated)."""

    def __init__(self) -> None:
        self.base, self.anon_base = C.rss(), _anon()
        self.peak, self.anon_peak = self.base, self.anon_base
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        self.peak = max(self.peak, C.rss())
        self.anon_peak = max(self.anon_peak, _anon())

    def _run(self) -> None:
        while not self._stop.wait(0.001):
            self._sample()

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        self._sample()
        return self.peak - self.base

    @property
    def anon(self) -> int:
        return self.anon_peak - self.anon_base


def retention(layers: int, width: int, keep: int, steps: int, root: Path) -> list[str]:
    """Checkpointer(keep_last=keep) over ``steps`` dense AdamW steps, fp32 and bf16: disk held
    (packs + manifests) after every save against ``keep`` x the state, and bytes written."""
    import deltackpt

    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        for encoding in ("auto", "smallest"):
            torch.manual_seed(0)
            model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)]).to(
                dtype
            )
            opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
            store = root / f"ret-{dtype}-{encoding}"
            ck = deltackpt.Checkpointer(
                store, every=1, keep_last=keep, async_=False, encoding=encoding
            )
            worst = 0.0
            written = []
            for step in range(steps):
                model(torch.randn(8, width, dtype=dtype)).float().pow(2).mean().backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                ck.maybe_save(step, {"model": model, "optim": opt})
                info = ck.infos[-1]
                disk = sum(
                    f.stat().st_size for f in store.rglob("*") if f.suffix in (".pack", ".json")
                )
                worst = max(worst, disk / info.logical_bytes)
                written.append(info.bytes_written / info.logical_bytes)
            ck.close()
            t0 = time.perf_counter()
            deltackpt.Checkpointer(store, every=1).restore_latest({"model": model, "optim": opt})
            resume = time.perf_counter() - t0
            rows.append(
                f"| {str(dtype).removeprefix('torch.')} | {encoding} | {keep} | {worst:.2f} | "
                f"{sum(written[1:]) / max(1, len(written) - 1):.0%} | {resume:.3f} |"
            )
            shutil.rmtree(store, ignore_errors=True)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--keep-last", type=int, default=3, help="retention run: keep_last")
    ap.add_argument("--steps", type=int, default=10, help="retention run: training steps")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--root", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.layers, args.width, Path(args.root))))
        return 0
    import deltackpt

    root = Path(tempfile.mkdtemp(prefix="bench_restore_"))
    try:
        model, opt = build(args.layers, args.width)
        state_mb = 3 * sum(p.numel() * 4 for p in model.parameters()) / 1e6
        ck = deltackpt.Checkpointer(root / "store", every=1, async_=False)
        ck.save(0, {"model": model, "optim": opt})
        ck.close()
        torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, root / "state.pt")
        del model, opt
        rows = {}
        for variant in VARIANTS:
            runs = []
            for _ in range(args.repeats):
                out = subprocess.run(
                    [sys.executable, __file__, "--child", variant, "--root", str(root),
                     "--layers", str(args.layers), "--width", str(args.width)],
                    capture_output=True, text=True, check=True,
                )  # fmt: skip
                runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
            rows[variant] = (
                min(r["seconds"] for r in runs),
                min(r["peak_mb"] for r in runs),
                min(r["anon_mb"] for r in runs),
                all(r["ok"] for r in runs),
            )
        load = os.getloadavg()[0]
        print(
            f"fp32 weights + AdamW, {state_mb:.0f} MB state; best of {args.repeats} fresh "
            f"processes (warm page cache); load average {load:.1f}\n"
        )
        print(
            "| variant | restore s | vs torch.load | peak RSS growth MB | x state "
            "| of it anonymous MB | x state | restored |"
        )
        print("|---|---|---|---|---|---|---|---|")
        ref = rows["torch.load"][0]
        for variant, (s, mb, anon, ok) in rows.items():
            print(
                f"| {variant} | {s:.3f} | {s / ref:.2f}x | {mb:.0f} | {mb / state_mb:.2f} | "
                f"{anon:.0f} | {anon / state_mb:.2f} | {'yes' if ok else 'NO'} |"
            )
        print(
            "\n(RSS counts the pages of files a variant maps, page cache the kernel may drop; "
            "anonymous memory is what the variant allocated)"
        )
        print(
            f"\nCheckpointer(keep_last={args.keep_last}) over {args.steps} AdamW steps (lr 1e-5): "
            "most disk held after any save, as a multiple of the state; mean bytes written per "
            "save after the first; resume (restore_latest) seconds\n"
        )
        print("| dtype | encoding | keep_last | max disk / state | written per save | resume s |")
        print("|---|---|---|---|---|---|")
        for row in retention(args.layers, args.width, args.keep_last, args.steps, root):
            print(row)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

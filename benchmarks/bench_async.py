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
import shutil
import socket
import sys
import time
import warnings
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import _common as C

import deltackpt

warnings.filterwarnings("ignore")

T_START = time.perf_counter()


def log(*a: Any) -> None:
    print(f"[{time.perf_counter() - T_START:7.1f}s]", *a, file=sys.stderr, flush=True)


def mem_available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable"):
                return int(line.split()[1]) * 1024
    return 0


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def fsync_tree(path: Path) -> None:
    for root, _dirs, files in os.walk(path):
        for f in files:
            C.fsync_file(os.path.join(root, f))
        C.fsync_dir(root)


def rmtree(p: Path) -> None:
    shutil.rmtree(p, ignore_errors=True)


# =========================================================================== the trained state


class Master:
    """fp32 Qwen2-shaped parameters + fused AdamW; exports the bf16 or the train state."""

    def __init__(self, scale: float, seed: int = 0) -> None:
        t0 = time.perf_counter()
        g = torch.Generator().manual_seed(seed)
        self.names: list[str] = []
        self.params: list[torch.nn.Parameter] = []
        for name, shape in C.qwen2_shapes(scale):
            if name.endswith("norm.weight"):
                t = torch.ones(shape)
            else:
                t = torch.empty(shape).normal_(0, 0.02, generator=g)
            self.names.append(name)
            self.params.append(torch.nn.Parameter(t))
        self.numel = sum(p.numel() for p in self.params)
        self.opt = torch.optim.AdamW(self.params, lr=1e-5, weight_decay=0.01, fused=True)
        biggest = max(p.numel() for p in self.params)
        self.pool = torch.empty(biggest + (1 << 20)).normal_(0, 1e-3, generator=g)
        self.rng = torch.Generator().manual_seed(seed + 1)
        self.bf16: dict[str, torch.Tensor] | None = None
        self.wc_buf: torch.Tensor | None = None
        self.steps = 0
        self.step_seconds: list[float] = []
        self.step()  # creates the optimizer state (exp_avg, exp_avg_sq)
        self.build_seconds = time.perf_counter() - t0
        self.scale = scale

    def step(self) -> None:
        t0 = time.perf_counter()
        span = self.pool.numel()
        for p in self.params:
            n = p.numel()
            off = int(torch.randint(0, span - n + 1, (1,), generator=self.rng))
            p.grad = self.pool[off : off + n].view(p.shape)
        self.opt.step()
        for p in self.params:
            p.grad = None
        self.steps += 1
        if self.bf16 is not None:
            self.export_bf16()
        self.step_seconds.append(time.perf_counter() - t0)

    def warm_copy(self, kind: str) -> float:
        """Time one copy of the state into an already-touched buffer. The buffer holds the whole
        state up to 1 GiB; a larger state wraps around in it (1 GiB is far beyond the caches, so
        the DRAM traffic is that of distinct buffers without a second copy of a 6 GB state).
        Taken right before every save, so each save has a reference measured under the same
        background load."""
        src = [
            t.detach().reshape(-1).view(torch.uint8)
            for t in state_tensors(self.state(kind))
            if t.numel()
        ]
        n = min(sum(s.numel() for s in src), max(1 << 30, max(s.numel() for s in src)))
        if self.wc_buf is None or self.wc_buf.numel() != n:
            self.wc_buf = None
            self.wc_buf = torch.empty(n, dtype=torch.uint8).fill_(1)
        buf = self.wc_buf
        gc.collect()
        t0 = time.perf_counter()
        pos = 0
        for s in src:
            k = s.numel()
            if pos + k > n:
                pos = 0
            buf[pos : pos + k].copy_(s)
            pos += k
        return time.perf_counter() - t0

    def export_bf16(self) -> None:
        with torch.no_grad():
            if self.bf16 is None:
                self.bf16 = {
                    n: p.detach().to(torch.bfloat16)
                    for n, p in zip(self.names, self.params, strict=True)
                }
                self.bf16["lm_head.weight"] = self.bf16["model.embed_tokens.weight"]
            else:
                for n, p in zip(self.names, self.params, strict=True):
                    self.bf16[n].copy_(p)

    def state(self, kind: str) -> dict[str, Any]:
        if kind == "bf16":
            if self.bf16 is None:
                self.export_bf16()
            assert self.bf16 is not None
            return self.bf16
        # what model.state_dict() gives: detached views of the parameters
        model: dict[str, torch.Tensor] = {
            n: p.detach() for n, p in zip(self.names, self.params, strict=True)
        }
        model["lm_head.weight"] = model["model.embed_tokens.weight"]
        return {"model": model, "optim": self.opt.state_dict()}


def state_tensors(state: Any) -> list[torch.Tensor]:
    return [t for _, t in C.unique_tensors(state)]


def state_bytes(state: Any) -> int:
    return C.logical_bytes(state)


# =========================================================================== systems


class Rec(dict):
    pass


def run_torch_save(master: Master, kind: str, root: Path, n: int) -> list[Rec]:
    root.mkdir(parents=True)
    recs = []
    prev: Path | None = None
    for i in range(n):
        if i:
            master.step()
        state = master.state(kind)
        warm = master.warm_copy(kind)
        path = root / f"step-{i}.pt"
        gc.collect()
        t0 = time.perf_counter()
        torch.save(state, path)
        t1 = time.perf_counter()
        C.fsync_file(path)
        C.fsync_dir(root)
        t2 = time.perf_counter()
        recs.append(
            Rec(
                i=i,
                warm=warm,
                blocking=t2 - t0,
                total=t2 - t0,
                nofsync=t1 - t0,
                bytes=C.du_bytes(path),
            )
        )
        if prev is not None:
            prev.unlink()
        prev = path
        log(f"  torch.save #{i}: {t2 - t0:.2f}s (no fsync {t1 - t0:.2f}s)")
    return recs


def run_dcp(master: Master, kind: str, root: Path, n: int, cached: bool) -> list[Rec]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    root.mkdir(parents=True)
    stager = DefaultStager(StagingOptions(False, False, False, False)) if cached else None
    recs = []
    prev: Path | None = None
    try:
        for i in range(n):
            if i:
                master.step()
            state = master.state(kind)
            warm = master.warm_copy(kind)
            d = root / f"step-{i}"
            kw: dict[str, Any] = {"storage_writer": dcp.FileSystemWriter(str(d))}
            if stager is not None:
                kw["async_stager"] = stager
            gc.collect()
            t0 = time.perf_counter()
            fut = dcp.async_save(state, **kw)
            t1 = time.perf_counter()
            upload = getattr(fut, "upload_completion", fut)
            staging = getattr(fut, "staging_completion", None)
            if staging is not None:
                staging.result()
            t_staged = time.perf_counter()
            upload.result()
            t2 = time.perf_counter()
            recs.append(
                Rec(
                    i=i,
                    warm=warm,
                    blocking=t1 - t0,
                    staged=t_staged - t0,
                    total=t2 - t0,
                    bytes=C.du_bytes(d),
                )
            )
            if prev is not None:
                rmtree(prev)
            prev = d
            log(
                f"  dcp{'(cached stager)' if cached else ''} #{i}: blocking {t1 - t0:.2f}s "
                f"total {t2 - t0:.2f}s"
            )
    finally:
        if stager is not None:
            stager.close()
    return recs


def run_tsnap(master: Master, kind: str, root: Path, n: int) -> list[Rec]:
    from torchsnapshot import Snapshot, StateDict

    root.mkdir(parents=True)
    recs = []
    prev: Path | None = None
    for i in range(n):
        if i:
            master.step()
        state = master.state(kind)
        warm = master.warm_copy(kind)
        d = root / f"step-{i}"
        gc.collect()
        t0 = time.perf_counter()
        pending = Snapshot.async_take(str(d), {"state": StateDict(**state)})
        t1 = time.perf_counter()
        pending.wait()
        t2 = time.perf_counter()
        fsync_tree(d)
        t3 = time.perf_counter()
        recs.append(
            Rec(
                i=i,
                warm=warm,
                blocking=t1 - t0,
                total=t2 - t0,
                total_fsync=t3 - t0,
                bytes=C.du_bytes(d),
            )
        )
        if prev is not None:
            rmtree(prev)
        prev = d
        log(
            f"  torchsnapshot #{i}: blocking {t1 - t0:.2f}s total {t2 - t0:.2f}s "
            f"(+fsync {t3 - t0:.2f}s)"
        )
    return recs


def chain_depths(store: Any, name: str) -> Counter:
    """Bytes of the snapshot's own chunks by xor-chain depth (0 = stored without a base)."""
    m = store.manifest(name)
    top: set[str] = set()
    for e in m.tensors:
        for d, _, _ in e.data or ():
            top.add(d)
    for _, data in m.storages:
        for d, _, _ in data:
            top.add(d)
    out: Counter = Counter()
    for d in top:
        depth, rec = 0, m.chunks[d]
        while rec.base is not None:
            depth += 1
            rec = m.chunks[rec.base]
        out[depth] += m.chunks[d].size
    return out


def codec_mix(store: Any, name: str, prev_names: set[str]) -> dict[str, int]:
    """Payload bytes by codec of the chunks this snapshot added."""
    m = store.manifest(name)
    old: set[str] = set()
    for pn in prev_names:
        old |= set(store.manifest(pn).chunks)
    mix: Counter = Counter()
    for d, rec in m.chunks.items():
        if d not in old:
            mix[rec.codec] += rec.length
    return dict(mix)


def category(path: str) -> str:
    if path.endswith("exp_avg_sq"):
        return "exp_avg_sq"
    if path.endswith("exp_avg"):
        return "exp_avg"
    if path.startswith("optim"):
        return "optim other"
    return "params" if path.startswith("model") else "weights"


def bytes_by_category(store: Any, name: str, prev_names: set[str]) -> dict[str, list[int]]:
    """{category: [raw bytes of the chunks this snapshot added, their payload bytes]}."""
    m = store.manifest(name)
    old: set[str] = set()
    for pn in prev_names:
        old |= set(store.manifest(pn).chunks)
    cat: dict[str, str] = {}
    for e in m.tensors:
        for d, _, _ in e.data or ():
            cat.setdefault(d, category(e.path))
    for _, data in m.storages:
        for d, _, _ in data:
            cat.setdefault(d, "tied embedding storage")
    out: dict[str, list[int]] = {}
    for d, rec in m.chunks.items():
        if d in cat and d not in old:
            v = out.setdefault(cat[d], [0, 0])
            v[0] += rec.size
            v[1] += rec.length
    return out


def run_deltackpt(master: Master, kind: str, root: Path, n: int) -> tuple[list[Rec], Any]:
    st = deltackpt.open_store(root)
    recs = []
    names: list[str] = []
    for i in range(n):
        if i:
            master.step()
        state = master.state(kind)
        warm = master.warm_copy(kind)
        name = f"step-{i}"
        gc.collect()
        t0 = time.perf_counter()
        h = deltackpt.async_save(state, st, name)
        t1 = time.perf_counter()
        staged_done = h.staged.done()
        info = h.result()
        t2 = time.perf_counter()
        mix = codec_mix(st, name, set(names))
        cats = bytes_by_category(st, name, set(names))
        depth = chain_depths(st, name)
        names.append(name)
        recs.append(
            Rec(
                i=i,
                warm=warm,
                blocking=t1 - t0,
                total=t2 - t0,
                bytes=info.bytes_written,
                logical=info.logical_bytes,
                lib_blocked=info.blocked_seconds,
                lib_seconds=info.seconds,
                staged_done_at_return=staged_done,
                chunks_new=info.chunks_new,
                chunks_reused=info.chunks_reused,
                codec_bytes=mix,
                max_depth=max(depth),
                depth_bytes=dict(depth),
                by_category=cats,
            )
        )
        log(
            f"  deltackpt #{i}: blocking {t1 - t0:.2f}s total {t2 - t0:.2f}s "
            f"bytes {info.bytes_written / info.logical_bytes:.1%} of logical, codecs {mix}, "
            f"max chain depth {max(depth)}"
        )
    return recs, st


# =========================================================================== restore


def restore(
    st: Any, kind: str, master: Master, names: dict[str, str], cold_reps: int, warm_reps: int
) -> list[dict[str, Any]]:
    out = []
    target = master.state(kind)
    nbytes = state_bytes(target)
    for label, name in names.items():
        depth = chain_depths(st, name)
        for mode, reps in (("cold", cold_reps), ("warm", warm_reps)):
            secs = []
            ok = True
            for _ in range(reps):
                if mode == "cold":
                    ok = C.drop_caches() and ok
                else:
                    deltackpt.load(st, name, into=target)  # make sure it is cached
                gc.collect()
                t0 = time.perf_counter()
                deltackpt.load(st, name, into=target)
                secs.append(time.perf_counter() - t0)
                log(f"  restore {label} {mode}: {secs[-1]:.2f}s")
            if reps:
                out.append(
                    {
                        "snapshot": label,
                        "name": name,
                        "mode": mode if ok else "warm(!)",
                        "seconds": secs,
                        "bytes": nbytes,
                        "max_depth": max(depth),
                        "depth_bytes": dict(depth),
                    }
                )
    return out


# =========================================================================== one state kind


def bench_kind(kind: str, master: Master, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    scale = master.scale
    log(f"== {kind} (scale {scale})")
    if kind == "bf16":
        master.export_bf16()
    i0 = len(master.step_seconds)
    state = master.state(kind)
    nbytes = state_bytes(state)
    log(
        f"   state {nbytes / 1e9:.3f} GB, rss {rss() / 1e9:.1f} GB, "
        f"avail {mem_available() / 1e9:.1f} GB"
    )
    res: dict[str, Any] = {
        "kind": kind,
        "scale": scale,
        "params": master.numel,
        "state_bytes": nbytes,
        "warm_copy": [],
        "systems": {},
    }
    n = args.saves
    systems: list[tuple[str, Callable[[], list[Rec]]]] = [
        ("torch.save (sync, +fsync)", lambda: run_torch_save(master, kind, work / "torch", n)),
        (
            "dcp.async_save (default stager)",
            lambda: run_dcp(master, kind, work / "dcp", n, cached=False),
        ),
        (
            "dcp.async_save (reused DefaultStager)",
            lambda: run_dcp(master, kind, work / "dcpc", n, cached=True),
        ),
    ]
    try:
        import torchsnapshot  # noqa: F401

        systems.append(
            ("torchsnapshot async_take", lambda: run_tsnap(master, kind, work / "tsnap", n))
        )
        res["torchsnapshot"] = "0.1.0 (pip install --no-deps torchsnapshot + its non-torch deps)"
    except Exception as e:
        res["torchsnapshot"] = f"skipped: import failed: {e!r}"
        log(f"   torchsnapshot skipped: {e!r}")

    for label, fn in systems:
        log(f"-- {label}")
        res["systems"][label] = fn()
        res["warm_copy"] += [x["warm"] for x in res["systems"][label]]
        gc.collect()

    need = 2 * nbytes + 1.5e9  # two staging arenas (xor deltas on) + slack
    deadline = time.perf_counter() + args.mem_wait
    while mem_available() < need and time.perf_counter() < deadline:
        log(
            f"   waiting for memory before deltackpt: need {need / 1e9:.1f} GB, "
            f"have {mem_available() / 1e9:.1f} GB"
        )
        time.sleep(10)
    res["mem_available_at_deltackpt"] = mem_available()
    log(
        f"-- deltackpt (needs {2 * nbytes / 1e9:.1f} GB of staging; "
        f"avail {mem_available() / 1e9:.1f} GB)"
    )
    recs, st = run_deltackpt(master, kind, work / "deltackpt", args.chain)
    res["systems"]["deltackpt.async_save"] = recs
    res["keyframe_every"] = deltackpt.SaveOptions().keyframe_every
    res["warm_copy"] += [x["warm"] for x in recs]
    master.wc_buf = None

    log("-- restore")
    names = {
        "keyframe (save #0)": "step-0",
        f"chain end (save #{args.chain - 1})": f"step-{args.chain - 1}",
    }
    keep = None
    if kind == "bf16":  # check bit-exactness of the chain end against the live state
        keep = {k: v.clone() for k, v in master.state(kind).items()}
    # drop the staging arenas before loading (they are not needed and hold 2x the state)
    st._saver = None  # benchmark only: release the saver's arenas before loading
    gc.collect()
    # warm restores only when the store fits in the page cache (the train chain end reads
    # keyframe + 7 deltas, ~6x the state)
    res["store_bytes"] = C.du_bytes(work / "deltackpt")
    warm = args.restore_reps if res["store_bytes"] < 0.6 * mem_available() else 0
    res["restore"] = restore(st, kind, master, names, args.restore_reps, warm)
    if keep is not None:
        got = master.state(kind)
        res["restore_chain_end_bit_exact"] = all(C.bit_equal(keep[k], got[k]) for k in keep)
        del keep
    res["step_seconds"] = master.step_seconds[i0:]
    master.bf16 = None
    for sub in ("torch", "dcp", "dcpc", "tsnap", "deltackpt"):
        rmtree(work / sub)
    return res


# =========================================================================== training loop


class MLP(torch.nn.Module):
    def __init__(self, d: int = 1024, hidden: int = 4096, blocks: int = 3) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(
                torch.nn.LayerNorm(d),
                torch.nn.Linear(d, hidden),
                torch.nn.GELU(),
                torch.nn.Linear(hidden, d),
            )
            for _ in range(blocks)
        )
        self.head = torch.nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = x + b(x)
        return self.head(x)


class LoopRunner:
    """One training run (own model, optimizer, checkpointing), advanced segment by segment."""

    def __init__(self, mode: str, args: argparse.Namespace, work: Path) -> None:
        torch.manual_seed(0)
        self.mode = mode
        self.every = args.every
        self.model = MLP(blocks=args.loop_blocks)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        self.x = torch.randn(args.loop_batch, 1024)
        self.y = torch.randn(args.loop_batch, 1024)
        self.root = work / f"loop-{mode}"
        self.ckpt = None
        self.pending: Any = None
        self.dcp_dirs: list[Path] = []
        if mode == "deltackpt":
            self.ckpt = deltackpt.Checkpointer(self.root, every=self.every, async_=True)
        elif mode == "deltackpt-1t":  # background encoding on one thread, leaving a core
            self.ckpt = deltackpt.Checkpointer(self.root, every=self.every, async_=True, threads=1)
        elif mode == "dcp":
            self.root.mkdir(parents=True)
        self.state = {"model": self.model, "optim": self.opt}
        self.step_no = 0
        self.times: list[float] = []
        self.is_save: list[bool] = []
        self.drains: list[float] = []
        self.segments: list[tuple[float, float]] = []  # (sum of step times, drain)
        for _ in range(args.loop_warmup):  # untimed warm-up, no saves
            self._train()

    def _train(self) -> None:
        self.opt.zero_grad(set_to_none=True)
        torch.nn.functional.mse_loss(self.model(self.x), self.y).backward()
        self.opt.step()

    def _save(self) -> None:
        import torch.distributed.checkpoint as dcp

        if self.ckpt is not None:
            self.ckpt.maybe_save(self.step_no, self.state)
        elif self.mode == "dcp" and (self.step_no + 1) % self.every == 0:
            if self.pending is not None:
                self.pending.result()  # one save in flight, like deltackpt's back-pressure
                for d in self.dcp_dirs[:-1]:
                    rmtree(d)
                self.dcp_dirs = self.dcp_dirs[-1:]
            sd = {"model": self.model.state_dict(), "optim": self.opt.state_dict()}
            d = self.root / f"s{self.step_no}"
            self.dcp_dirs.append(d)
            self.pending = dcp.async_save(sd, storage_writer=dcp.FileSystemWriter(str(d)))

    def segment(self, steps: int) -> None:
        total = 0.0
        for _ in range(steps):
            t0 = time.perf_counter()
            self._train()
            self._save()
            dt = time.perf_counter() - t0
            total += dt
            self.times.append(dt)
            self.is_save.append(self.mode != "none" and (self.step_no + 1) % self.every == 0)
            self.step_no += 1
        t0 = time.perf_counter()
        self.drain()
        drain = time.perf_counter() - t0
        self.drains.append(drain)
        self.segments.append((total, drain))

    def drain(self) -> None:
        if self.ckpt is not None:
            self.ckpt.wait()
        elif self.pending is not None:
            self.pending.result()
            self.pending = None

    def result(self) -> dict[str, Any]:
        nparams = sum(p.numel() for p in self.model.parameters())
        save_t = [t for t, s in zip(self.times, self.is_save, strict=True) if s]
        other = [t for t, s in zip(self.times, self.is_save, strict=True) if not s]
        out = {
            "mode": self.mode,
            "params": nparams,
            "state_bytes": nparams * 4 * 3,
            "times": self.times,
            "is_save": self.is_save,
            "segments": self.segments,
            "save_step_mean": sum(save_t) / len(save_t) if save_t else None,
            "other_step_mean": sum(other) / len(other) if other else None,
            "saves": len(save_t),
        }
        if self.ckpt is not None:
            out["deltackpt_infos"] = [
                {
                    "bytes": i.bytes_written,
                    "blocked": i.blocked_seconds,
                    "waited": i.waited_seconds,
                    "seconds": i.seconds,
                }
                for i in self.ckpt.infos
            ]
            self.ckpt.close()
        rmtree(self.root)
        return out


def train_loops(args: argparse.Namespace, work: Path) -> list[dict[str, Any]]:
    """Interleave the conditions in segments (rotating order) so each sees the same background
    load; a segment is ``loop_periods`` save periods and ends by waiting for its last save."""
    modes = ["none", "deltackpt", "deltackpt-1t", "dcp"]
    runners = {m: LoopRunner(m, args, work) for m in modes}
    seg = args.every * args.loop_periods
    for r in range(args.loop_rounds):
        order = modes[r % len(modes) :] + modes[: r % len(modes)]
        for m in order:
            runners[m].segment(seg)
            tot, dr = runners[m].segments[-1]
            log(f"  round {r} {m}: {tot / seg:.4f} s/step, drain {dr:.2f}s")
    return [runners[m].result() for m in modes]


# =========================================================================== report


def f3(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def ok(b: bool) -> str:
    return "✓" if b else "✗"


def report_kind(r: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    nb = r["state_bytes"]
    wc = C.median(r["warm_copy"])
    targets: dict[str, Any] = {}
    lines = [
        f"### {r['kind']} state: {nb / 1e9:.3f} GB ({r['params'] / 1e6:.1f}M params, "
        f"scale {r['scale']})",
        "",
        f"Warm copy of the state into a touched buffer (the state's size, capped at 1 GiB and "
        f"wrapping around), timed right before every save "
        f"({len(r['warm_copy'])} saves): median **{wc:.3f} s = {nb / wc / 1e9:.2f} GB/s** "
        f"(min {min(r['warm_copy']):.3f}, max {max(r['warm_copy']):.3f}: background load). "
        "'x warm copy' = median over the steady saves of (blocking / the copy timed just "
        "before that save); the target is judged on it. "
        f"AdamW step (fused, {len(r['step_seconds'])} steps in this part): median "
        f"{C.median(r['step_seconds']):.2f} s.",
        "",
    ]
    hdr = [
        "system",
        "saves",
        "first: blocking s",
        "steady: blocking s (median)",
        "x warm copy: paired / of medians",
        "blocking GB/s",
        "steady: total s",
        "total GB/s",
        "bytes/save (steady)",
        "% of state",
        "blocking ≤1.5x copy",
    ]
    rows = []
    full_bytes = nb
    for label, recs in r["systems"].items():
        first = recs[0]
        # deltackpt alternates two arenas: saves #0 and #1 both allocate; steady from #2
        skip = 2 if label.startswith("deltackpt") else 1
        steady = recs[skip:] or recs[-1:]
        b = C.median([x["blocking"] for x in steady])
        tot = C.median([x["total"] for x in steady])
        by = C.median([x["bytes"] for x in steady])
        ratio = C.median([x["blocking"] / x["warm"] for x in steady])
        met = ratio <= 1.5
        targets[f"{r['kind']}: {label} blocking ≤ 1.5x warm copy"] = (met, ratio)
        first_s = f"{first['blocking']:.3f}"
        if label.startswith("deltackpt"):
            first_s += f" (#1: {recs[1]['blocking']:.3f})" if len(recs) > 1 else ""
        extra = ""
        if "total_fsync" in first:
            extra = f" (+fsync {C.median([x['total_fsync'] for x in steady]):.3f})"
        if "staged" in first and any(abs(x["staged"] - x["blocking"]) > 1e-3 for x in recs):
            extra += f" (staged {C.median([x['staged'] for x in steady]):.3f})"
        rows.append(
            [
                label,
                len(recs),
                first_s,
                f"{b:.3f}",
                f"{ratio:.2f} / {b / wc:.2f}",
                f"{nb / b / 1e9:.2f}",
                f"{tot:.3f}{extra}",
                f"{nb / tot / 1e9:.2f}",
                C.fmt_bytes(by),
                f"{by / full_bytes:.1%}",
                ok(met),
            ]
        )
    lines.append(C.md_table(hdr, rows))
    lines.append("")

    d = r["systems"]["deltackpt.async_save"]
    lim = 0.25 if r["kind"] == "bf16" else 0.70

    def is_key(x: dict[str, Any]) -> bool:  # most of its bytes start a new chain
        d0 = {int(k): v for k, v in x["depth_bytes"].items()}.get(0, 0)
        return d0 >= 0.5 * nb

    inc = [x for x in d if not is_key(x)]  # saves that wrote xor deltas (not keyframes)
    kf = r.get("keyframe_every", deltackpt.SaveOptions().keyframe_every)
    cycle = d[-kf:]
    amort = sum(x["bytes"] for x in cycle) / len(cycle) / nb
    hdr2 = [
        "save",
        "blocking s",
        "warm copy s (just before)",
        "total s",
        "bytes written",
        "% of state",
        "payload by codec",
        "max xor depth",
    ]
    rows2 = []
    for x in d:
        mix = ", ".join(f"{k} {C.fmt_bytes(v)}" for k, v in sorted(x["codec_bytes"].items()))
        rows2.append(
            [
                f"#{x['i']}" + (" (keyframe)" if is_key(x) else ""),
                f"{x['blocking']:.3f}",
                f"{x['warm']:.3f}",
                f"{x['total']:.3f}",
                C.fmt_bytes(x["bytes"]),
                f"{x['bytes'] / nb:.1%}",
                mix,
                x["max_depth"],
            ]
        )
    med_frac = C.median([x["bytes"] / nb for x in inc]) if inc else float("nan")
    max_frac = max((x["bytes"] / nb for x in inc), default=float("nan"))
    met = max_frac <= lim
    targets[f"{r['kind']}: incremental bytes ≤ {lim:.0%} of a full save (max of the xor saves)"] = (
        met,
        max_frac,
    )
    targets[f"{r['kind']}: bytes per save amortized over a keyframe cycle (info; ≤ {lim:.0%}?)"] = (
        None,
        amort,
    )
    e2e = C.median([x["total"] for x in inc if x["i"] >= 2] or [x["total"] for x in inc])
    cats: dict[str, list[int]] = {}
    for x in inc:
        for k, (raw, pay) in x.get("by_category", {}).items():
            v = cats.setdefault(k, [0, 0])
            v[0] += raw
            v[1] += pay
    cat_line = "; ".join(
        f"{k}: {pay / raw:.1%} of its bytes" for k, (raw, pay) in sorted(cats.items()) if raw
    )
    lines += [
        f"deltackpt saves, each after one AdamW step (xor-delta saves: median "
        f"{med_frac:.1%}, max {max_frac:.1%} of the state; target ≤ {lim:.0%} "
        f"{ok(met)}. Amortized over the last keyframe cycle (#{cycle[0]['i']}-"
        f"#{cycle[-1]['i']}, keyframe_every={kf}): {amort:.1%} of the state per save. "
        f"End-to-end time of a delta save, median: {e2e:.3f} s = "
        f"{nb / e2e / 1e9:.2f} GB/s of state):",
        "",
        C.md_table(hdr2, rows2),
        "",
        f"Incremental (xor) saves, payload written per part of the state: {cat_line}.",
        "",
    ]

    hdr3 = [
        "restore (deltackpt.load into the live state)",
        "mode",
        "s (median)",
        "GB/s",
        "x keyframe",
        "chain depth of its bytes",
    ]
    rows3 = []
    base: dict[str, float] = {}
    for x in r["restore"]:
        s = C.median(x["seconds"])
        if x["snapshot"].startswith("keyframe"):
            base[x["mode"]] = s
    for x in r["restore"]:
        s = C.median(x["seconds"])
        depth = ", ".join(
            f"d{k}: {v / x['bytes']:.0%}" for k, v in sorted(x["depth_bytes"].items())
        )
        rel = s / base[x["mode"]] if x["mode"] in base else float("nan")
        rows3.append(
            [
                x["snapshot"],
                x["mode"],
                f"{s:.3f}",
                f"{x['bytes'] / s / 1e9:.2f}",
                f"{rel:.2f}",
                depth,
            ]
        )
    lines += [C.md_table(hdr3, rows3), ""]
    if "restore_chain_end_bit_exact" in r:
        lines += [
            f"Chain-end restore bit-exact vs the live bf16 state: "
            f"{r['restore_chain_end_bit_exact']}. Store size after {len(d)} saves: "
            f"{C.fmt_bytes(r['store_bytes'])}.",
            "",
        ]
    else:
        lines += [
            f"Every restored chunk is verified against its xxh3 digest (verify=True). "
            f"Store size after {len(d)} saves: {C.fmt_bytes(r['store_bytes'])}.",
            "",
        ]
    return "\n".join(lines), targets


def report_loop(loops: list[dict[str, Any]], args: argparse.Namespace) -> tuple[str, dict]:
    by = {x["mode"]: x for x in loops}
    base = by["none"]
    nseg = len(base["segments"])
    seg = args.every * args.loop_periods

    def per_step(x: dict[str, Any], with_drain: bool) -> list[float]:
        return [(t + (d if with_drain else 0.0)) / seg for t, d in x["segments"]]

    hdr = [
        "condition",
        "mean s/step (steps only)",
        "mean s/step (+ drain)",
        "slowdown steps only: pooled / median of rounds",
        "slowdown + drain: pooled / median of rounds",
        "median step s",
        "save steps: mean s",
        "other steps: mean s",
        "saves",
    ]
    rows = []
    targets = {}
    b0 = per_step(base, False)
    for x in loops:
        a0, a1 = per_step(x, False), per_step(x, True)
        m0, m1 = sum(a0) / nseg, sum(a1) / nseg
        name = {
            "none": "no checkpointing",
            "deltackpt": f"deltackpt.Checkpointer(async_=True, every={args.every})",
            "deltackpt-1t": "same, threads=1 (SaveOptions)",
            "dcp": f"dcp.async_save every {args.every} (default stager)",
        }[x["mode"]]
        if x["mode"] == "none":
            s0 = s1 = "-"
        else:
            r0 = [a / b - 1 for a, b in zip(a0, b0, strict=True)]
            r1 = [a / b - 1 for a, b in zip(a1, b0, strict=True)]
            p0, p1 = m0 / (sum(b0) / nseg) - 1, m1 / (sum(b0) / nseg) - 1
            s0 = f"{p0:+.1%} / {C.median(r0):+.1%}"
            s1 = f"{p1:+.1%} / {C.median(r1):+.1%}"
            targets[f"loop: {x['mode']} slowdown (steps only .. + drain, pooled)"] = (
                None,
                (p0, p1),
            )
        rows.append(
            [
                name,
                f"{m0:.4f}",
                f"{m1:.4f}",
                s0,
                s1,
                f"{C.median(x['times']):.4f}",
                f3(x["save_step_mean"]),
                f3(x["other_step_mean"]),
                x["saves"],
            ]
        )
    p = loops[0]
    rounds = "; ".join(
        f"round {i}: " + ", ".join(f"{x['mode']} {per_step(x, False)[i]:.3f}" for x in loops)
        for i in range(nseg)
    )
    text = [
        f"### Training-step slowdown ({p['params'] / 1e6:.1f}M-param MLP, AdamW, batch "
        f"{args.loop_batch}, state {p['state_bytes'] / 1e6:.0f} MB incl. AdamW)",
        "",
        f"{args.loop_rounds} rounds; in each, every condition trains {seg} steps "
        f"({args.loop_periods} save periods of {args.every} steps; rotating order), then "
        "waits for its pending save (drain). 'steps only' ignores that wait (lower bound of "
        "the cost), '+ drain' charges all of it (upper bound: in a continuous run part of it "
        "would overlap the next steps). 2 cores shared by torch's intra-op threads, "
        "the savers' threads and other agents' jobs.",
        "",
        C.md_table(hdr, rows),
        "",
        f"Per-round s/step (steps only): {rounds}.",
        "",
    ]
    return "\n".join(text), targets


# =========================================================================== main


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
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
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
    ap.add_argument("--out", default=str(C.OUT_DIR / "async.md"))
    ap.add_argument(
        "--report-from",
        metavar="JSON",
        help="only re-render the markdown from a saved results JSON",
    )
    ap.add_argument("--total-seconds", type=float, help=argparse.SUPPRESS)
    args = ap.parse_args()
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
    rmtree(work)
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
                    return mem_available() + held

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
        rmtree(work)
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()

    write_report(results, notes, args, cmd, info, final=True)


if __name__ == "__main__":
    main()

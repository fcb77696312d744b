"""Weight sync of CUDA weights through a host link (issue 36): one trainer and one receiver
process on one machine, shared-memory link, bf16 weights on the device on both sides, with the
ceilings measured in the same run.

The trainer pushes its CUDA tensors (``WeightSender``: the pinned host mirror copies only what
its device fingerprints say changed, deltackpt/sync/host_mirror.py); the receiver pulls every
tensor whole and its ``load_weights`` copies the changed ones into its own CUDA tensors (as an
inference engine's does). A round is timed on the receiver, from a barrier both processes leave
together to the end of its ``load_weights`` (device synchronised); the trainer's ``push`` time
and the bytes that crossed to its mirror (chunks, or changed elements with device patches) are
reported beside it. Best of ``--repeats``.

Rows:

* first round (allocates the pinned mirror, plans, opens the link windows);
* full round (``push(full=True)``);
* delta round, 1 tensor changed (every element of one matrix);
* RL-like round: ~3% of the elements of every tensor changed by a small add;
* RL-like round with device patches (``DELTACKPT_DEVICE_PATCH=auto``; ``always`` on the CPU
  stand-in; sync/device_patches.py): the changed elements are found on the device against a
  device copy of the last committed version and only they (index + value) cross to the mirror,
  after one untimed round that allocates the device copies; the rows above run with ``off``;
* ipc link (``links="ipc"``, a second group in the same processes; ``--no-ipc`` skips it): a
  full round and a 1-tensor delta round through tensor handles (CUDA buckets, ``ipc_device``,
  on a GPU; shared CPU storage without one), after one untimed round that plans and shares;
  then the same with the fingerprints (scan and digests) by the Triton kernel
  (``DELTACKPT_FINGERPRINT_COMPILE=triton``; the torch operations where Triton is missing),
  whose full round copies and fingerprints in one pass on both sides (docs/sync.md, Device
  passes), and once more with those copies unfused (``DELTACKPT_FUSED_COPY=off``);
* host buckets (a third group, ``links="ipc", ipc_device="cpu"`` with
  ``DELTACKPT_DEVICE_ROUNDS=always``; ``--no-host-buckets`` skips it): device rounds through
  host shared memory, the trainer's tensors copied into page-locked buckets, digests taken on
  its GPU (Triton), the receiver copying to its GPU and checking there: the shared-memory row
  of issue 36's goals (<= 2x pinned D2H + H2D) without the host mirror or xxh3;
* a bucket per bucket of the round (a fourth group, ``links="ipc", ipc_buckets=None`` on the
  same device; ``--no-per-bucket`` skips it): the ipc rows above run the default ring of two
  shared buckets per link, each reused once the receiver acknowledged its copy (the trainer's
  device memory: 2 buckets); these hold one per bucket (the round's bytes), as before the
  ring: its full and RL-like rounds against the ring's;
* host staging (a fifth group, ``links="ipc"`` with host buckets, device rounds; the receiver
  as a vLLM worker on a GPU receives: ``staging="ring"`` into its own host tensors, its
  ``load_weights`` copying them to the device; ``--no-worker-staging`` skips it): with the host
  staging page-locked where it lies (``WeightReceiver(pin="auto")``, the default: each
  message's check copies it to the GPU), then the same full round with the lock released
  (pageable staging, as before ``"auto"``);
* ceilings: one pinned D2H + H2D of the bytes (trainer's tensors -> pinned host buffers ->
  fresh device tensors), and a raw CUDA IPC round (the receiver maps the trainer's tensors with
  ``torch.multiprocessing`` and copies device to device; skipped without CUDA).

Without CUDA it runs the same rounds on CPU tensors with the mirror's stand-in forced
(``DELTACKPT_DEVICE_SCAN=always``): a check that the script works, not figures.

    python benchmarks/bench_gpu_sync.py --out $OUT          # on one GPU, 2 GB, well under 90 s
    python benchmarks/bench_gpu_sync.py --gb 0.02           # here, a dry run
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's deltackpt

import _common as C
import torch
from _harness.limits import device_best

CUDA = torch.cuda.is_available()
RL_SHARE = 0.03  # elements an RL-like step changes


def plan_of(repeats: int, device_patch: bool = True) -> list[tuple[str, int]]:
    """The main link's rounds, in order (both processes walk it)."""
    dp = [("rl_dp_first", 1), ("rl_dp", repeats)] if device_patch else []
    return [
        ("first", 1),
        ("full", repeats),
        ("rl", repeats),
        *dp,  # the first allocates the device bases (the RL change copied by chunks)
        # last: a whole changed matrix rests its patch base for 8 rounds (patches.REST_ROUNDS),
        # which would make the RL rows' payloads differ by what rested
        ("delta_1", repeats),
    ]


def patch_mode(kind: str) -> str:
    """``DELTACKPT_DEVICE_PATCH`` for a round of ``kind``."""
    if not kind.startswith("rl_dp"):
        return "off"
    return "auto" if CUDA else "always"


def ipc_plan(repeats: int) -> list[tuple[str, int]]:
    """The ipc link's rounds (device rounds: packed in the CUDA buckets, device digests, the
    receiver staging on the device): one untimed first round (plans, shares the buckets), then
    full, RL-like and 1-tensor delta rounds."""
    return [
        ("first", 1),
        ("full", repeats),
        ("rl", repeats),
        ("rl_dp_first", 1),  # the first with device patches allocates the device bases
        ("rl_dp", repeats),
        ("delta_1", repeats),
        # detect="version": the tensors torch did not write are not even scanned
        ("delta_1_version", repeats),
        # the fingerprints by the Triton kernel (DELTACKPT_FINGERPRINT_COMPILE=triton) on both
        # sides; the first round of it compiles the kernel (nothing changed in it)
        ("triton_first", 1),
        ("full_triton", repeats),
        # the same with the copies and their fingerprints apart (DELTACKPT_FUSED_COPY=off):
        # what the fused pass of the pack and of the receiver's copy out saves
        ("full_triton_apart", repeats),
        ("rl_triton", repeats),
        ("rl_dp_triton_first", 1),  # device bases again (rounds without patches drop them)
        ("rl_dp_triton", repeats),
        ("delta_1_version_triton", repeats),
    ]


def host_bucket_plan(repeats: int) -> list[tuple[str, int]]:
    """The host-bucket group's rounds (device rounds through host shared memory)."""
    return [
        ("triton_first", 1),  # plans, shares and page-locks the buckets, compiles the kernel
        ("full_triton", repeats),
        ("rl_triton", repeats),
        ("delta_1_version_triton", repeats),
    ]


def _held(group: Any) -> int:
    """Bytes of the shared buckets a trainer's ipc links hold (a ring's once)."""
    held = {id(b): b.shared for o in group._ipc._out.values() for b in o.buckets}
    return sum(t.numel() for t in held.values())


def perb_plan(repeats: int) -> list[tuple[str, int]]:
    """The per-bucket group's rounds (``ipc_buckets=None``, Triton fingerprints)."""
    return [("triton_first", 1), ("full_triton", repeats), ("rl_triton", repeats)]


def ws_plan(repeats: int) -> list[tuple[str, int]]:
    """The host-staging group's rounds: page-locked staging, then pageable (the receiver
    releases the lock before ``full_triton_pageable``)."""
    return [
        ("triton_first", 1),
        ("full_triton", repeats),
        ("rl_triton", repeats),
        ("full_triton_pageable", repeats),
    ]


def kernel_knob(kind: str) -> dict[str, str]:
    """``DELTACKPT_FINGERPRINT_COMPILE`` and ``DELTACKPT_FUSED_COPY`` for a round of ``kind``
    (both processes set them)."""
    return {
        "DELTACKPT_FINGERPRINT_COMPILE": "triton" if "triton" in kind else "off",
        "DELTACKPT_FUSED_COPY": "off" if kind.endswith("_apart") else "auto",
    }


def _log(msg: str) -> None:
    print(f"[bench_gpu_sync {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def shapes(gb: float) -> list[tuple[str, tuple[int, ...]]]:
    """Square bf16 matrices with a norm vector each, ``gb`` GB in all (4096-wide from 0.5 GB:
    32 MiB matrices)."""
    width = 4096 if gb >= 0.5 else 512
    mats = max(2, round(gb * 1e9 / (width * width * 2)))
    out: list[tuple[str, tuple[int, ...]]] = []
    for i in range(mats):
        out += [(f"layers.{i}.weight", (width, width)), (f"layers.{i}.norm", (width,))]
    return out


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _state(cfg: dict[str, Any], dev: torch.device) -> dict[str, torch.Tensor]:
    g = torch.Generator(device=dev).manual_seed(0)
    return {
        n: torch.randn(s, generator=g, device=dev, dtype=torch.float32).to(torch.bfloat16)
        for n, s in shapes(cfg["gb"])
    }


def _fingerprints(state: dict[str, torch.Tensor]) -> dict[str, list[list[int]]]:
    """Per tensor, its chunk fingerprints computed where it lives (format/fingerprint.py): how
    the two processes compare their final states without copying them to the host."""
    from deltackpt.format.fingerprint import source_fingerprints

    return {
        n: source_fingerprints(t.reshape(-1).view(torch.uint8), 4 << 20).cpu().tolist()
        for n, t in state.items()
    }


class _profiled:
    """``--profile KIND``: the last round of that kind (a kind of both links: both) under
    ``torch.profiler``, its busiest operations printed to stderr (a round's anatomy for the
    next change; the round's time in the table is then not comparable)."""

    def __init__(self, cfg: dict[str, Any], kind: str, i: int, n: int, who: str) -> None:
        self.on = cfg.get("profile") == kind and i == n - 1
        self.who, self.kind = who, kind
        self.prof: Any = None

    def __enter__(self) -> None:
        if self.on:
            from torch.profiler import ProfilerActivity, profile

            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if CUDA else [])
            self.prof = profile(activities=acts)
            self.prof.__enter__()
            self.sampler = _Sampler()

    def __exit__(self, *exc: object) -> None:
        if self.prof is None:
            return
        self.prof.__exit__(None, None, None)
        ev = self.prof.key_averages()
        key = "self_device_time_total" if CUDA else "self_cpu_time_total"
        _log(
            f"profile of one {self.kind} round, {self.who}:\n" + ev.table(sort_by=key, row_limit=18)
        )
        _log(f"... by calls, {self.who}:\n" + ev.table(sort_by="count", row_limit=12))
        _log(f"... where its threads spend host time, {self.who}:\n" + self.sampler.stop())


class _Sampler:
    """Every thread's Python stack sampled every millisecond (a profiler that sees every
    thread, on any torch): per sample, the innermost frame of deltackpt and what it was in
    (a torch call, a wait), counted; the top lines say where a round's host time goes."""

    def __init__(self, every: float = 0.001) -> None:
        self.counts: dict[tuple[str, str], int] = {}
        self.samples = 0
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, args=(every,), daemon=True)
        self._t.start()

    def _run(self, every: float) -> None:
        while not self._stop.wait(every):
            self.samples += 1
            for tid, frame in sys._current_frames().items():
                if tid == threading.get_ident():  # this sampler
                    continue
                inner = f"{frame.f_code.co_name} ({frame.f_code.co_filename.rsplit('/', 1)[-1]})"
                f = frame
                while f is not None and "deltackpt/" not in f.f_code.co_filename:
                    f = f.f_back
                if f is None or f.f_code.co_name == "_beat_loop":  # (the idle heartbeat)
                    continue
                code = f.f_code
                ours = f"{code.co_filename[code.co_filename.find('deltackpt/') :]}:{f.f_lineno} {code.co_name}"
                key = (ours, inner)
                self.counts[key] = self.counts.get(key, 0) + 1

    def stop(self) -> str:
        self._stop.set()
        self._t.join()
        top = sorted(self.counts.items(), key=lambda kv: -kv[1])[:25]
        return f"{self.samples} samples of 1 ms (count: our line <- innermost frame)\n" + "\n".join(
            f"{n:6d}  {ours}  <-  {inner}" for (ours, inner), n in top
        )


def _bucket(cfg: dict[str, Any]) -> int | None:
    """``bucket_bytes`` of every sender and receiver: the link's default unless --bucket-mb."""
    return None if cfg["bucket_mb"] is None else cfg["bucket_mb"] << 20


def _barrier(group: Any) -> None:
    group.pg.barrier().wait()


def _limits(state: dict[str, torch.Tensor], dev: torch.device, repeats: int) -> dict[str, float]:
    """One pinned D2H + H2D of the state's bytes, best of ``repeats`` each."""
    flat = [t.reshape(-1).view(torch.uint8) for t in state.values()]
    pinned = [torch.empty_like(f, device="cpu", pin_memory=dev.type == "cuda") for f in flat]
    back = [torch.empty_like(f) for f in flat]

    def timed(fn: Any) -> float:
        return device_best(fn, dev, repeats)

    def d2h() -> None:
        for dst, src in zip(pinned, flat, strict=True):
            dst.copy_(src, non_blocking=True)

    def h2d() -> None:
        for dst, src in zip(back, pinned, strict=True):
            dst.copy_(src, non_blocking=True)

    return {"pinned_d2h_s": timed(d2h), "pinned_h2d_s": timed(h2d)}


def trainer(cfg: dict[str, Any], port: int, ipc: Any) -> dict[str, Any]:
    from deltackpt import sync
    from deltackpt.options import overrides

    dev = torch.device("cuda" if CUDA else "cpu")
    state = _state(cfg, dev)
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    res: dict[str, Any] = {"bytes": nbytes, "tensors": len(state)}
    res.update(_limits(state, dev, cfg["repeats"]))
    if ipc is not None:  # the raw CUDA IPC round: the receiver maps these tensors
        ipc.put(state)
    knobs = {} if CUDA else {"DELTACKPT_DEVICE_SCAN": "always", "DELTACKPT_DEVICE_ROUNDS": "always"}
    group = sync.SyncGroup("127.0.0.1", port, 0, 2, [0], timeout=60, links=cfg["links"])
    sender = sync.WeightSender(group, bucket_bytes=_bucket(cfg))
    names = list(state)
    g = torch.Generator(device=dev).manual_seed(1)
    rows: dict[str, list[dict[str, float]]] = {}

    def change(kind: str, i: int) -> None:
        with torch.no_grad():
            if kind.startswith("delta_1"):  # every element of one matrix
                state[names[(2 * i) % len(names)]].add_(1.0 if i % 2 == 0 else -1.0)
            elif kind.startswith("rl"):
                for t in state.values():
                    mask = torch.rand(t.shape, generator=g, device=dev) < RL_SHARE
                    t.add_(mask.to(t.dtype) * 0.01)
        _sync(dev)

    plan = plan_of(cfg["repeats"], cfg["device_patch"])
    version = 0

    def push_rounds(
        sender: Any,
        group: Any,
        plan: list[tuple[str, int]],
        rows: dict[str, list[Any]],
        extra: dict[str, str] | None = None,
    ) -> None:
        nonlocal version
        for kind, n in plan:
            sender.detect = "version" if "_version" in kind else "hash"
            knob = {**knobs, **kernel_knob(kind), "DELTACKPT_DEVICE_PATCH": patch_mode(kind)}
            with overrides(**{**knob, **(extra or {})}):
                for i in range(n):
                    change(kind, i)
                    version += 1
                    _barrier(group)
                    t0 = time.perf_counter()
                    with _profiled(cfg, kind, i, n, "trainer"):
                        st = sender.push(state, version=version, full=kind.startswith("full"))
                    rows.setdefault(kind, []).append(
                        {
                            "push_s": time.perf_counter() - t0,
                            "mirror_s": sender.mirror.last.seconds,
                            "mirrored_bytes": st.mirrored_bytes,
                            "patched_bytes": sender.mirror.last.patched_bytes,
                            "patched_tensors": len(sender.mirror.last.patched),
                            "payload_bytes": st.payload_bytes,
                            "full": st.full,
                        }
                    )
                    res["device_base_bytes"] = max(
                        res.get("device_base_bytes", 0), sender.mirror.device.nbytes
                    )

    push_rounds(sender, group, plan, rows)
    res["rows"] = rows
    res["mirror_bytes"] = sender.mirror.nbytes
    res["mirror_pinned"] = all(s.is_pinned() for s in sender.mirror.segments)
    del sender  # its host mirror: the ipc sender keeps one of its own
    if cfg["ipc_port"]:  # the same rounds through tensor handles, a group of their own
        ipc_group = sync.SyncGroup(
            "127.0.0.1", cfg["ipc_port"], 0, 2, [0], timeout=60, links="ipc", ipc_device=dev
        )
        ipc_sender = sync.WeightSender(ipc_group, bucket_bytes=_bucket(cfg))
        res["ipc_rows"] = {}
        push_rounds(ipc_sender, ipc_group, ipc_plan(cfg["repeats"]), res["ipc_rows"])
        assert ipc_group._ipc is not None
        res["ipc_handles"] = ipc_group._ipc.handles_sent
        res["ipc_bytes"] = _held(ipc_group)
        res["ipc_buckets"] = sum(len(o.buckets) for o in ipc_group._ipc._out.values())
        _barrier(ipc_group)
        ipc_group.close()

    def host_buckets(port: int, plan: list[tuple[str, int]], rows: dict[str, list[Any]]) -> bool:
        """Device rounds through host shared memory (``ipc_device="cpu"``), a group of their
        own; whether the trainer's buckets were page-locked."""
        group = sync.SyncGroup(
            "127.0.0.1", port, 0, 2, [0], timeout=60, links="ipc", ipc_device="cpu"
        )
        sender = sync.WeightSender(group, bucket_bytes=_bucket(cfg))
        push_rounds(sender, group, plan, rows, {"DELTACKPT_DEVICE_ROUNDS": "always"})
        assert group._ipc is not None
        locked = all(b.locked for o in group._ipc._out.values() for b in o.buckets)
        _barrier(group)
        group.close()
        return locked

    if cfg["hb_port"]:  # device rounds through host shared memory, into device staging
        res["hb_rows"] = {}
        res["hb_locked"] = host_buckets(
            cfg["hb_port"], host_bucket_plan(cfg["repeats"]), res["hb_rows"]
        )
    if cfg["perb_port"]:  # a bucket per bucket of the round, against the default ring
        perb_group = sync.SyncGroup(
            "127.0.0.1",
            cfg["perb_port"],
            0,
            2,
            [0],
            timeout=60,
            links="ipc",
            ipc_device=dev,
            ipc_buckets=None,
        )
        perb_sender = sync.WeightSender(perb_group, bucket_bytes=_bucket(cfg))
        res["perb_rows"] = {}
        push_rounds(perb_sender, perb_group, perb_plan(cfg["repeats"]), res["perb_rows"])
        assert perb_group._ipc is not None
        res["perb_bytes"] = _held(perb_group)
        _barrier(perb_group)
        perb_group.close()
    if cfg["ws_port"]:  # host buckets into a receiver's host staging (a vLLM worker's)
        res["ws_rows"] = {}
        host_buckets(cfg["ws_port"], ws_plan(cfg["repeats"]), res["ws_rows"])
    res["fingerprints"] = _fingerprints(state)
    if ipc is not None:
        _barrier(group)  # the receiver's IPC rounds
        _barrier(group)  # it dropped the mapped tensors
    _barrier(group)
    group.close()
    return res


def receiver(cfg: dict[str, Any], port: int, ipc: Any) -> dict[str, Any]:
    from deltackpt import sync
    from deltackpt.options import overrides

    dev = torch.device("cuda" if CUDA else "cpu")
    mine = {n: torch.zeros(s, dtype=torch.bfloat16, device=dev) for n, s in shapes(cfg["gb"])}
    group = sync.SyncGroup("127.0.0.1", port, 1, 2, [0], timeout=60, links=cfg["links"])
    # its own tensors pinned: load_weights copies them to the device at the link's speed
    recv = sync.WeightReceiver(group, bucket_bytes=_bucket(cfg), pin=CUDA)

    def load(ws: list[tuple[str, torch.Tensor]]) -> None:
        for n, t in ws:
            mine[n].copy_(t)
        _sync(dev)

    plan = plan_of(cfg["repeats"], cfg["device_patch"])

    def pull_rounds(
        recv: Any, group: Any, plan: list[tuple[str, int]]
    ) -> dict[str, list[dict[str, float]]]:
        rows: dict[str, list[dict[str, float]]] = {}
        for kind, n in plan:
            with overrides(**kernel_knob(kind)):
                for i in range(n):
                    _barrier(group)
                    t0 = time.perf_counter()
                    with _profiled(cfg, kind, i, n, "receiver"):
                        recv.pull(load)
                    rows.setdefault(kind, []).append({"round_s": time.perf_counter() - t0})
        return rows

    @contextlib.contextmanager
    def ipc_receiver(port: int, ipc_device: str | None = None, **kw: Any) -> Any:
        """An ipc group of its own (its buckets where the trainer's group puts them) and a
        receiver in it (``kw``); closed with the trainer's after the rounds."""
        where = {} if ipc_device is None else {"ipc_device": ipc_device}
        group = sync.SyncGroup("127.0.0.1", port, 1, 2, [0], timeout=60, links="ipc", **where)
        yield group, sync.WeightReceiver(group, bucket_bytes=_bucket(cfg), **kw)
        _barrier(group)
        group.close()

    res: dict[str, Any] = {"rows": pull_rounds(recv, group, plan)}
    if cfg["ipc_port"]:  # staged on the device: a device round goes device to device
        with ipc_receiver(cfg["ipc_port"], device=dev) as (g, r):
            res["ipc_rows"] = pull_rounds(r, g, ipc_plan(cfg["repeats"]))
    if cfg["hb_port"]:
        with ipc_receiver(cfg["hb_port"], "cpu", device=dev) as (g, r):
            res["hb_rows"] = pull_rounds(r, g, host_bucket_plan(cfg["repeats"]))
    if cfg["perb_port"]:
        with ipc_receiver(cfg["perb_port"], device=dev) as (g, r):
            res["perb_rows"] = pull_rounds(r, g, perb_plan(cfg["repeats"]))
    if cfg["ws_port"]:  # as a vLLM worker: its own host tensors (host staging), two slots
        with ipc_receiver(cfg["ws_port"], "cpu", staging="ring") as (g, r):
            ws = ws_plan(cfg["repeats"])
            res["ws_rows"] = pull_rounds(r, g, ws[:-1])
            res["ws_locked"], res["ws_staging"] = r.staging_locked, r.staging_bytes
            if r._lock is not None:  # the same rounds through pageable staging
                r._lock.release()
            r._auto_lock = False
            res["ws_rows"].update(pull_rounds(r, g, ws[-1:]))
    res["fingerprints"] = _fingerprints(mine)
    if ipc is not None:
        theirs = ipc.get(timeout=cfg["timeout"])
        best = float("inf")
        for _ in range(cfg["repeats"]):
            _sync(dev)
            t0 = time.perf_counter()
            for n, t in theirs.items():
                mine[n].copy_(t)
            _sync(dev)
            best = min(best, time.perf_counter() - t0)
        res["ipc_round_s"] = best
        _barrier(group)
        del theirs
        _barrier(group)
    _barrier(group)
    group.close()
    return res


def _worker(rank: int, cfg: dict[str, Any], port: int, q: Any, ipc: Any) -> None:
    try:
        torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
        fn = trainer if rank == 0 else receiver
        q.put((rank, fn(cfg, port, ipc)))
    except BaseException as e:
        import traceback

        q.put((rank, {"error": f"{e!r}\n{traceback.format_exc()}"}))
    q.close()
    q.join_thread()
    os._exit(0)  # skip teardown: gloo's threads may still wait on the peer


def run(cfg: dict[str, Any]) -> dict[str, Any]:
    import torch.multiprocessing as tmp

    ctx = tmp.get_context("spawn")
    q = ctx.Queue()
    ipc = ctx.Queue() if CUDA else None
    port = C.free_port()
    cfg = {
        **cfg,
        "ipc_port": C.free_port() if cfg["ipc"] else 0,
        "hb_port": C.free_port() if cfg["host_buckets"] else 0,
        "perb_port": C.free_port() if cfg["per_bucket"] else 0,
        "ws_port": C.free_port() if cfg["worker_staging"] else 0,
    }
    procs = [ctx.Process(target=_worker, args=(r, cfg, port, q, ipc)) for r in range(2)]
    for p in procs:
        p.start()
    got = C.collect(procs, q, cfg["timeout"])
    errors = [r["error"] for r in got.values() if "error" in r]
    if errors or len(got) < 2:
        raise SystemExit(f"bench_gpu_sync failed: {errors or 'timeout / crashed process'}")
    return {"trainer": got[0], "receiver": got[1]}


def summarize(res: dict[str, Any]) -> dict[str, Any]:
    t, r = res["trainer"], res["receiver"]
    out: dict[str, Any] = {"gb": t["bytes"] / 1e9}
    for kind, recs in r["rows"].items():
        best = min(range(len(recs)), key=lambda i: recs[i]["round_s"])
        out[kind] = {**t["rows"][kind][best], **recs[best]}
    out["pinned_d2h_h2d_s"] = t["pinned_d2h_s"] + t["pinned_h2d_s"]
    out["ipc_round_s"] = r.get("ipc_round_s")
    # every round committed and the receiver's device tensors hold the trainer's bytes
    out["exact"] = t.pop("fingerprints") == r.pop("fingerprints")
    out["mirror_bytes"], out["mirror_pinned"] = t["mirror_bytes"], t["mirror_pinned"]
    out["device_base_bytes"] = t.get("device_base_bytes", 0)
    for kind, recs in r.get("ipc_rows", {}).items():
        best = min(range(len(recs)), key=lambda i: recs[i]["round_s"])
        out["ipc_" + kind] = {**t["ipc_rows"][kind][best], **recs[best]}
    out["ipc_handles"] = t.get("ipc_handles")
    for kind, recs in r.get("hb_rows", {}).items():
        best = min(range(len(recs)), key=lambda i: recs[i]["round_s"])
        out["hb_" + kind] = {**t["hb_rows"][kind][best], **recs[best]}
    out["hb_locked"] = t.get("hb_locked")
    for kind, recs in r.get("perb_rows", {}).items():
        best = min(range(len(recs)), key=lambda i: recs[i]["round_s"])
        out["perb_" + kind] = {**t["perb_rows"][kind][best], **recs[best]}
    for kind, recs in r.get("ws_rows", {}).items():
        best = min(range(len(recs)), key=lambda i: recs[i]["round_s"])
        out["ws_" + kind] = {**t["ws_rows"][kind][best], **recs[best]}
    out["ws"] = (r.get("ws_locked"), r.get("ws_staging"))
    out["held"] = (t.get("ipc_bytes"), t.get("perb_bytes"), t.get("ipc_buckets"))
    return out


def report(s: dict[str, Any], device: str) -> str:
    gb, ceil, ipc = s["gb"], s["pinned_d2h_h2d_s"], s["ipc_round_s"]
    labels = {
        "first": "first round (plans, allocates the mirror)",
        "full": "full round",
        "delta_1": "delta round, 1 tensor changed",
        "rl": f"RL-like round ({RL_SHARE:.0%} of elements)",
    }
    if "rl_dp" in s:
        labels["rl_dp"] = f"RL-like round ({RL_SHARE:.0%}), device patches"
    if "ipc_full" in s:
        labels["ipc_full"] = "ipc link, device rounds: full round"
        labels["ipc_rl"] = f"ipc link, device rounds: RL-like ({RL_SHARE:.0%})"
        labels["ipc_rl_dp"] = f"ipc link, device rounds: RL-like ({RL_SHARE:.0%}), device patches"
        labels["ipc_delta_1"] = "ipc link, device rounds: delta, 1 tensor changed"
        labels["ipc_delta_1_version"] = "ipc link, device rounds: delta, 1 tensor, detect=version"
    if "ipc_full_triton" in s:
        labels["ipc_triton_first"] = "ipc, Triton fingerprints: first round (compiles; no change)"
        labels["ipc_full_triton"] = "ipc, Triton fingerprints: full round"
        labels["ipc_full_triton_apart"] = "ipc, Triton fingerprints: full round, copies unfused"
        labels["ipc_rl_triton"] = f"ipc, Triton fingerprints: RL-like ({RL_SHARE:.0%})"
        labels["ipc_rl_dp_triton"] = (
            f"ipc, Triton fingerprints: RL-like ({RL_SHARE:.0%}), device patches"
        )
        labels["ipc_delta_1_version_triton"] = "ipc, Triton fingerprints: delta, 1 tensor, version"
    if "hb_full_triton" in s:
        hb = "host buckets, device rounds"
        labels["hb_full_triton"] = f"{hb}: full round"
        labels["hb_rl_triton"] = f"{hb}: RL-like ({RL_SHARE:.0%})"
        labels["hb_delta_1_version_triton"] = f"{hb}: delta, 1 tensor, version"
    if "perb_full_triton" in s:
        perb = "ipc, a bucket per bucket of the round (Triton fingerprints)"
        labels["perb_full_triton"] = f"{perb}: full round"
        labels["perb_rl_triton"] = f"{perb}: RL-like ({RL_SHARE:.0%})"
    if "ws_full_triton" in s:
        ws = "host buckets into host staging (a vLLM worker's ring)"
        labels["ws_full_triton"] = f"{ws}, page-locked: full round"
        labels["ws_rl_triton"] = f"{ws}, page-locked: RL-like ({RL_SHARE:.0%})"
        labels["ws_full_triton_pageable"] = f"{ws}, pageable: full round"
    rows = []
    for kind, label in labels.items():
        x = s[kind]
        rows.append(
            [
                label,
                f"{x['round_s']:.3f} s",
                f"{x['push_s']:.3f} s",
                C.fmt_bytes(x["mirrored_bytes"]),
                C.fmt_bytes(x["payload_bytes"]),
                f"{x['round_s'] / ceil:.2f}x",
                "-" if ipc is None else f"{x['round_s'] / ipc:.1f}x",
            ]
        )
    rows.append(["pinned D2H + H2D of the bytes", f"{ceil:.3f} s", "-", "-", "-", "1.00x", "-"])
    rows.append(
        [
            "raw CUDA IPC round (D2D)",
            "-" if ipc is None else f"{ipc:.4f} s",
            "-",
            "-",
            "-",
            "-",
            "-",
        ]
    )
    head = (
        f"device {device}, {gb:.2f} GB bf16, 1 trainer -> 1 receiver, {s['links']} link (ipc rows: "
        f"links='ipc', {s['ipc_handles']} bucket handles posted; host-bucket rows: ipc_device="
        f"'cpu', buckets page-locked: {s.get('hb_locked')}; the trainer's shared buckets for "
        f"the {s['held'][2]} buckets of a round: {C.fmt_bytes(s['held'][0] or 0)} in the "
        f"default ring, {C.fmt_bytes(s['held'][1] or 0)} one per bucket; host-staging rows: "
        f"{C.fmt_bytes(s['ws'][1] or 0)} of staging, page-locked: {s['ws'][0]}); "
        "best of the "
        "repeats; round = receiver's pull incl. load_weights into its device tensors; "
        f"receiver bit-exact: {s['exact']}; trainer mirror {C.fmt_bytes(s['mirror_bytes'])} "
        f"(pinned: {s['mirror_pinned']}); device bases (device patches) "
        f"{C.fmt_bytes(s['device_base_bytes'])}\n\n"
    )
    return head + C.md_table(
        [
            "round",
            "round time",
            "trainer push",
            "to the host",
            "payload",
            "vs pinned D2H+H2D",
            "vs CUDA IPC",
        ],
        rows,
    )


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--gb", type=float, default=2.0 if CUDA else 0.02)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument(
        "--bucket-mb",
        type=int,
        default=None,
        help="bucket size of every group (default: each link's, 64 MiB shm, 256 MiB ipc)",
    )
    ap.add_argument("--links", default="shm", help="shm (default) or gloo")
    ap.add_argument("--no-ipc", action="store_true", help="skip the ipc link's rows (links='ipc')")
    ap.add_argument(
        "--no-device-patch", action="store_true", help="skip the device-patch rows (rl_dp)"
    )
    ap.add_argument(
        "--no-host-buckets", action="store_true", help="skip the host-bucket rows (hb_*)"
    )
    ap.add_argument(
        "--no-per-bucket",
        action="store_true",
        help="skip the rows of a bucket per bucket of the round (perb_*, ipc_buckets=None)",
    )
    ap.add_argument(
        "--no-worker-staging",
        action="store_true",
        help="skip the rows of host staging, as a vLLM worker receives (ws_*)",
    )
    ap.add_argument("--timeout", type=float, default=115 if CUDA else 60)
    ap.add_argument(
        "--profile",
        default="",
        help="profile the last round of this kind (e.g. full_triton) on both sides, to stderr",
    )
    ap.add_argument("--out", default=str(C.OUT_DIR), help="directory for the JSON and table")
    args = ap.parse_args()
    cfg = {
        "gb": args.gb,
        "repeats": args.repeats,
        "bucket_mb": args.bucket_mb,
        "links": args.links,
        "ipc": not args.no_ipc,
        "device_patch": not args.no_device_patch,
        "host_buckets": not args.no_host_buckets,
        "per_bucket": not args.no_per_bucket,
        "worker_staging": not args.no_worker_staging,
        "timeout": args.timeout,
        "profile": args.profile,
    }
    t0 = time.perf_counter()
    res = run(cfg)
    s = summarize(res)
    s["links"] = cfg["links"]
    device = torch.cuda.get_device_name() if CUDA else "cpu (dry run: the mirror's stand-in)"
    doc = {
        "config": cfg,
        "device": device,
        "summary": s,
        "raw": res,
        "seconds": time.perf_counter() - t0,
        "machine": C.machine_info(),
    }
    text = report(s, device)
    path = C.write_results(args.out, "bench_gpu_sync", doc, text)  # a directory, or the .json
    print(text)
    _log(f"done in {doc['seconds']:.1f} s; {path}")
    if not s["exact"]:
        raise SystemExit("the receiver's tensors differ from the trainer's after the rounds")


if __name__ == "__main__":
    main()

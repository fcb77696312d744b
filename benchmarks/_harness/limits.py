"""This machine's ceilings, measured in the same run as the benchmark: memcpy, alloc+copy, xxh3,
disk write (buffered and durable), cold and warm reads."""

from __future__ import annotations

import gc
import os
import statistics
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch

from _harness.env import GB, MiB
from _harness.files import drop_caches


def median(xs: Sequence[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    """Run ``fn`` once after a gc pass; return (seconds, result)."""
    gc.collect()
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def device_best(fn: Callable[[], Any], device: torch.device, repeats: int) -> float:
    """The best of ``repeats`` runs of ``fn``, each timed from an idle ``device`` until its
    work has landed (CUDA is synchronised around each run; nothing to wait for on CPU)."""
    best = float("inf")
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - t0)
    return best


def _write_file(path: Path, buf: np.ndarray, total: int, fsync: bool) -> tuple[float, float]:
    """Buffered write of ``total`` bytes from ``buf`` in its size; (write s, write+fsync s)."""
    t0 = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        mv = memoryview(buf)
        done = 0
        while done < total:
            n = os.write(fd, mv[: min(len(mv), total - done)])
            done += n
        t1 = time.perf_counter()
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)
    return t1 - t0, time.perf_counter() - t0


def _read_file(path: Path, dst: np.ndarray, chunk: int = 64 * MiB) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        mv = memoryview(dst)
        pos = 0
        while pos < len(mv):
            n = os.preadv(fd, [mv[pos : pos + chunk]], pos)
            if n == 0:
                break
            pos += n
    finally:
        os.close(fd)


def measure_limits(workdir: Path, nbytes: int, reps: int = 3) -> dict[str, dict[str, Any]]:
    """This machine's ceilings, measured now: memcpy, alloc+copy, xxh3, disk write, reads.

    Every entry: {"seconds": [...], "bytes": n, "gbps": median rate, "what": ...}.
    """
    import xxhash

    workdir.mkdir(parents=True, exist_ok=True)
    out: dict[str, dict[str, Any]] = {}

    def rec(key: str, what: str, n: int, secs: list[float]) -> None:
        out[key] = {"what": what, "bytes": n, "seconds": secs, "gbps": n / median(secs) / GB}

    mem_n = min(nbytes, 2 << 30)
    src = torch.ones(mem_n, dtype=torch.uint8)
    dst = torch.zeros(mem_n, dtype=torch.uint8)
    rec(
        "memcpy",
        f"torch copy_ into a touched buffer ({torch.get_num_threads()} threads)",
        mem_n,
        [timed(lambda d=dst, s=src: d.copy_(s))[0] for _ in range(reps)],
    )
    secs = []
    for _ in range(reps):
        s, c = timed(src.clone)
        secs.append(s)
        del c
    rec("alloc_copy", "torch clone (fresh pages: alloc + fault + copy)", mem_n, secs)
    del dst

    a = src.numpy()
    piece = 64 * MiB
    spans = [a[i : i + piece] for i in range(0, mem_n, piece)]
    with ThreadPoolExecutor(2) as pool:
        rec(
            "xxh3",
            "xxh3-128 of 64 MiB pieces, 2 threads",
            mem_n,
            [
                timed(lambda sp=spans: list(pool.map(xxhash.xxh3_128_hexdigest, sp)))[0]
                for _ in range(reps)
            ],
        )
    del src, a, spans

    path = workdir / "limits.bin"
    wbuf = np.random.default_rng(0).integers(0, 255, 64 * MiB, dtype=np.uint8)
    w_nofs, w_fs = [], []
    n_reps = reps
    for i in range(n_reps):
        if path.exists():
            path.unlink()
        os.sync()
        w, t = _write_file(path, wbuf, nbytes, fsync=True)
        w_nofs.append(w)
        w_fs.append(t)
        if i == 0 and t > 10:
            break
    rec("write_buffered", "buffered write, returns at page cache (no fsync)", nbytes, w_nofs)
    rec("write_fsync", "buffered write + fsync (durable)", nbytes, w_fs)

    cache_ok = drop_caches()
    out["drop_caches_ok"] = {"what": "echo 3 > /proc/sys/vm/drop_caches", "ok": cache_ok}
    touched = np.ones(nbytes, dtype=np.uint8)
    cold_t, cold_f, warm_t, warm_f = [], [], [], []
    for i in range(reps):
        if cache_ok:
            drop_caches()
            cold_t.append(timed(lambda b=touched: _read_file(path, b))[0])
            drop_caches()

            def fresh_cold() -> None:
                _read_file(path, np.empty(nbytes, dtype=np.uint8))

            cold_f.append(timed(fresh_cold)[0])
        _read_file(path, touched)  # make sure it is cached
        warm_t.append(timed(lambda b=touched: _read_file(path, b))[0])

        def fresh_warm() -> None:
            _read_file(path, np.empty(nbytes, dtype=np.uint8))

        warm_f.append(timed(fresh_warm)[0])
        if i == 0 and (cold_t[:1] or [0])[0] > 10:
            break
    if cold_t:
        rec(
            "read_cold",
            "cold read (after drop_caches), pread 64 MiB into a touched buffer",
            nbytes,
            cold_t,
        )
        rec("read_cold_fresh", "cold read into a fresh (untouched) buffer", nbytes, cold_f)
    rec("read_warm", "warm read (page cache), pread 64 MiB into a touched buffer", nbytes, warm_t)
    rec("read_warm_fresh", "warm read into a fresh (untouched) buffer", nbytes, warm_f)
    del touched
    path.unlink()
    return out

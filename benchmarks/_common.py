"""Small helpers shared by the benchmarks: timing, durability, page cache, machine limits, states.

Nothing here imports deltackpt, so the helpers also serve baselines that must not depend on it.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import platform
import statistics
import subprocess
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
OUT_DIR = REPO / "bench-out"  # gitignored
GB = 1e9
MiB = 1 << 20


# --------------------------------------------------------------------------- timing


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    """Run ``fn`` once after a gc pass; return (seconds, result)."""
    gc.collect()
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


# --------------------------------------------------------------------------- files


def fsync_file(path: str | os.PathLike[str]) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: str | os.PathLike[str]) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def du_bytes(path: str | os.PathLike[str]) -> int:
    """Allocated bytes (st_blocks * 512) of a file or of every file under a directory."""
    p = Path(path)
    if not p.exists():
        return 0
    if p.is_file():
        return p.stat().st_blocks * 512
    total = 0
    for root, _dirs, files in os.walk(p):
        for f in files:
            with contextlib.suppress(FileNotFoundError):
                total += os.stat(os.path.join(root, f)).st_blocks * 512
    return total


def drop_caches() -> bool:
    """sync, then drop the page cache (needs root). Returns whether it worked."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


# --------------------------------------------------------------------------- state trees


def iter_leaves(obj: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """(dotted path, leaf) for every leaf of nested dicts / lists / tuples."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from iter_leaves(v, f"{prefix}.{k}" if prefix else str(k))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from iter_leaves(v, f"{prefix}.{i}" if prefix else str(i))
    else:
        yield prefix, obj


def flat_tensors(obj: Any) -> dict[str, torch.Tensor]:
    return {k: v for k, v in iter_leaves(obj) if isinstance(v, torch.Tensor)}


def flat_values(obj: Any) -> dict[str, Any]:
    """Non-tensor leaves (tuples become lists, so JSON round trips compare equal)."""
    return {k: v for k, v in iter_leaves(obj) if not isinstance(v, torch.Tensor)}


def map_tensors(obj: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """Same structure, tensors replaced by ``fn(t)``; tensors sharing a storage stay shared."""
    memo: dict[tuple[int, int, tuple[int, ...]], torch.Tensor] = {}

    def go(o: Any) -> Any:
        if isinstance(o, torch.Tensor):
            key = (o.untyped_storage().data_ptr(), o.storage_offset(), tuple(o.shape))
            if key not in memo:
                memo[key] = fn(o)
            return memo[key]
        if isinstance(o, dict):
            return type(o)((k, go(v)) for k, v in o.items())
        if isinstance(o, list):
            return [go(v) for v in o]
        if isinstance(o, tuple):
            return tuple(go(v) for v in o)
        return o

    return go(obj)


def unique_tensors(obj: Any) -> list[tuple[str, torch.Tensor]]:
    """First (path, tensor) per distinct storage: tied weights counted once."""
    seen: set[int] = set()
    out = []
    for k, t in flat_tensors(obj).items():
        p = t.untyped_storage().data_ptr()
        if p not in seen:
            seen.add(p)
            out.append((k, t))
    return out


def logical_bytes(obj: Any) -> int:
    return sum(t.numel() * t.element_size() for _, t in unique_tensors(obj))


_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bit_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """torch.equal on the raw bits (so -0.0 != 0.0 and NaN payloads count)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    a, b = a.detach().cpu(), b.detach().cpu()
    if a.numel() == 0:
        return True
    it = _INT_OF_SIZE.get(a.element_size())
    if it is None or a.dtype.is_complex:
        return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))
    return torch.equal(a.contiguous().view(it), b.contiguous().view(it))


def _view_key(t: torch.Tensor) -> tuple[int, int, tuple[int, ...]]:
    return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))


def compare(src: dict[str, torch.Tensor], got: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Bit-exact check of every source tensor against the loaded one (matched by path)."""
    missing = [k for k in src if k not in got]
    # A tied pair (same storage in the source) that is also tied in the result is compared once.
    seen: dict[tuple[int, int, tuple[int, ...]], tuple[int, int, tuple[int, ...]]] = {}
    bad = []
    for k in src:
        if k not in got:
            continue
        s_key = _view_key(src[k])
        g_key = _view_key(got[k])
        if seen.get(s_key) == g_key:
            continue
        seen[s_key] = g_key
        if not bit_equal(src[k], got[k]):
            bad.append(k)
    return {
        "exact": not missing and not bad,
        "checked": len(src),
        "n_missing": len(missing),
        "n_mismatch": len(bad),
        "missing": missing[:5],
        "mismatch": bad[:5],
    }


def bit_digests(flat: dict[str, torch.Tensor]) -> dict[str, str]:
    """xxh3-128 of every tensor's raw bytes (plus dtype and shape): a cheap bit-exact check
    (~10x faster than torch.equal here) for repeated loads of the same data."""
    import xxhash

    out = {}
    for k, t in flat.items():
        t = t.detach().cpu().contiguous()
        b = t.reshape(-1).view(torch.uint8).numpy() if t.numel() else b""
        out[k] = f"{t.dtype}{tuple(t.shape)}:{xxhash.xxh3_128_hexdigest(b)}"
    return out


def compare_digests(src: dict[str, str], got: dict[str, torch.Tensor]) -> dict[str, Any]:
    d = bit_digests({k: got[k] for k in src if k in got})
    missing = [k for k in src if k not in got]
    bad = [k for k in src if k in d and d[k] != src[k]]
    return {
        "exact": not missing and not bad,
        "checked": len(src),
        "n_missing": len(missing),
        "n_mismatch": len(bad),
        "missing": missing[:5],
        "mismatch": bad[:5],
    }


# --------------------------------------------------------------------------- Qwen2-0.5B shapes


def qwen2_shapes(scale: float = 1.0) -> list[tuple[str, tuple[int, ...]]]:
    """Qwen2-0.5B parameter shapes (hidden 896, MLP 4864, 14 q heads / 2 kv heads of dim 64,
    vocab 151936, 24 layers, q/k/v biases, tied lm_head). ``scale`` shrinks layers and vocab."""
    hidden, inter, head_dim, n_kv = 896, 4864, 64, 2
    layers = max(1, round(24 * scale))
    vocab = max(1024, round(151936 * scale))
    kv = n_kv * head_dim
    out: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (vocab, hidden))]
    for i in range(layers):
        p = f"model.layers.{i}."
        out += [
            (p + "self_attn.q_proj.weight", (hidden, hidden)),
            (p + "self_attn.q_proj.bias", (hidden,)),
            (p + "self_attn.k_proj.weight", (kv, hidden)),
            (p + "self_attn.k_proj.bias", (kv,)),
            (p + "self_attn.v_proj.weight", (kv, hidden)),
            (p + "self_attn.v_proj.bias", (kv,)),
            (p + "self_attn.o_proj.weight", (hidden, hidden)),
            (p + "mlp.gate_proj.weight", (inter, hidden)),
            (p + "mlp.up_proj.weight", (inter, hidden)),
            (p + "mlp.down_proj.weight", (hidden, inter)),
            (p + "input_layernorm.weight", (hidden,)),
            (p + "post_attention_layernorm.weight", (hidden,)),
        ]
    out.append(("model.norm.weight", (hidden,)))
    return out  # lm_head.weight is tied to embed_tokens: added by the builder as the same tensor


def qwen2_weights(dtype: torch.dtype, scale: float = 1.0, seed: int = 0) -> dict[str, torch.Tensor]:
    """A state_dict-like dict: matrices and biases ~ N(0, 0.02), norms = 1, lm_head tied."""
    g = torch.Generator().manual_seed(seed)
    sd: dict[str, torch.Tensor] = {}
    for name, shape in qwen2_shapes(scale):
        if name.endswith("norm.weight"):
            t = torch.ones(shape, dtype=dtype)
        else:
            t = torch.randn(shape, generator=g, dtype=torch.float32).mul_(0.02).to(dtype)
        sd[name] = t
    sd["lm_head.weight"] = sd["model.embed_tokens.weight"]
    return sd


# --------------------------------------------------------------------------- machine limits


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


# --------------------------------------------------------------------------- reporting


def machine_info() -> dict[str, Any]:
    def git(*args: str) -> str:
        try:
            return subprocess.run(
                ["git", *args], cwd=REPO, capture_output=True, text=True, check=False
            ).stdout.strip()
        except OSError:
            return ""

    mem = ""
    with contextlib.suppress(OSError, StopIteration), open("/proc/meminfo") as f:
        mem = next(line for line in f if line.startswith("MemTotal")).split(":")[1].strip()
    return {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "cpus": os.cpu_count(),
        "mem_total": mem,
        "loadavg_start": os.getloadavg(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "git_rev": git("rev-parse", "--short", "HEAD"),
        "git_dirty": bool(git("status", "--porcelain", "--untracked-files=no")),
    }


def md_table(header: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


def fmt_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit, div in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= div:
            return f"{n / div:.3g} {unit}"
    return f"{int(n)} B"


def write_json(path: Path, data: Any) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1, default=str) + "\n")
    return path

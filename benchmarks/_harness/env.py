"""Where results go, what machine ran them, memory readings, ports and a timestamped log."""

from __future__ import annotations

import contextlib
import ctypes
import gc
import os
import platform
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import torch

REPO = Path(__file__).resolve().parents[2]
OUT_DIR = REPO / "bench-out"  # gitignored
GB = 1e9
MiB = 1 << 20


def make_log(stream: IO[str] | None = None, t0: float | None = None) -> Callable[..., None]:
    """``log(*parts)``: one line prefixed with the seconds since ``t0`` (default: now), flushed
    to ``stream`` (default: stderr)."""
    start = time.perf_counter() if t0 is None else t0

    def log(*parts: Any) -> None:
        print(
            f"[{time.perf_counter() - start:7.1f}s]", *parts, file=stream or sys.stderr, flush=True
        )

    return log


def rss() -> int:
    """This process's resident set size, in bytes."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def vmhwm() -> int:
    """This process's peak resident set size (VmHWM), in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM"):
                return int(line.split()[1]) * 1024
    return 0


def mem_available() -> int:
    """The machine's MemAvailable, in bytes (other jobs share it)."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable"):
                return int(line.split()[1]) * 1024
    return 0


def trim() -> None:
    """gc, then glibc malloc_trim: hand freed heap back to the OS between phases (benchmark
    hygiene on a shared machine; timed operations are unaffected)."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _git(*args: str) -> str:
    try:
        return subprocess.run(
            ["git", *args], cwd=REPO, capture_output=True, text=True, check=False
        ).stdout.strip()
    except OSError:
        return ""


def machine_info() -> dict[str, Any]:
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
        "git_rev": _git("rev-parse", "--short", "HEAD"),
        "git_dirty": bool(_git("status", "--porcelain", "--untracked-files=no")),
    }


def code_fingerprint() -> dict[str, Any]:
    """Which deltackpt code ran: the tree is edited concurrently, so git HEAD is not enough."""
    import hashlib

    pkg = REPO / "deltackpt"
    h = hashlib.sha256()
    for f in sorted(pkg.rglob("*.py")):
        h.update(f.relative_to(pkg).as_posix().encode() + b"\0" + f.read_bytes())
    st = _git("status", "--porcelain", "--", "deltackpt").split("\n")
    return {
        "sha256_of_deltackpt_py": h.hexdigest()[:16],
        "changed_vs_head": [x.strip() for x in st if x.strip()],
    }

"""Files: fsync, allocated size, the page cache, warm-up reads, removal."""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path


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


def fsync_tree(path: Path) -> None:
    """fsync every file under ``path`` and every directory (for systems that do not fsync)."""
    for root, _dirs, files in os.walk(path):
        for f in files:
            fsync_file(os.path.join(root, f))
        fsync_dir(root)


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


def all_files(path: Path) -> list[Path]:
    return [path] if path.is_file() else [Path(r) / f for r, _, fs in os.walk(path) for f in fs]


def warm_files(files: list[Path]) -> None:
    """Read the files once so they sit in the page cache."""
    buf = bytearray(64 << 20)
    for f in files:
        with open(f, "rb", buffering=0) as fh:
            while fh.readinto(buf):
                pass


def rmtree(p: str | os.PathLike[str]) -> None:
    shutil.rmtree(p, ignore_errors=True)

"""An audit hook that records every file opened or removed outside a store.

``sys.addaudithook`` cannot be removed, so one hook is installed for the whole test session and
does nothing until a test arms it with :func:`confined`. While armed, it records (and the test then
fails on) any ``open`` that resolves into the test's sandbox but outside the store (where the
tests put bait files), following symlinks as the kernel would unless the open passes
``O_NOFOLLOW``, and any removal, rename or link outside the store. Paths given relative to a
directory descriptor are resolved through ``/proc/self/fd``.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

_state = threading.local()
_armed: list[tuple[str, str, list[str]]] = []  # (store root, sandbox, violations)
_installed = False


def _resolve(path: object, dir_fd: object, follow: bool) -> str | None:
    if isinstance(path, int) or path is None:
        return None  # an fd: opened earlier, checked then
    p = os.fsdecode(path) if isinstance(path, (str, bytes, os.PathLike)) else None
    if p is None:
        return None
    if not os.path.isabs(p):
        base = os.readlink(f"/proc/self/fd/{dir_fd}") if isinstance(dir_fd, int) else os.getcwd()
        p = os.path.join(base, p)
    p = os.path.normpath(p)
    if follow:
        return os.path.realpath(p)
    return os.path.join(os.path.realpath(os.path.dirname(p)), os.path.basename(p))


def _inside(path: str, root: str) -> bool:
    return path == root or path.startswith(root + os.sep)


def _hook(event: str, args: tuple) -> None:
    if not _armed or getattr(_state, "busy", False):
        return
    if event not in ("open", "os.remove", "os.rmdir", "shutil.rmtree", "os.rename", "os.link"):
        return
    _state.busy = True
    try:
        for root, sandbox, violations in _armed:
            if event == "open":
                path, _mode, flags = args
                nofollow = isinstance(flags, int) and bool(flags & os.O_NOFOLLOW)
                p = _resolve(path, None, follow=not nofollow)
                if p is not None and _inside(p, sandbox) and not _inside(p, root):
                    violations.append(f"open {p}")
            elif event in ("os.remove", "os.rmdir", "shutil.rmtree"):
                p = _resolve(args[0], args[1], follow=False)
                if p is not None and not _inside(p, root):
                    violations.append(f"{event} {p}")
            else:  # rename / link: (src, dst, src_dir_fd, dst_dir_fd)
                for path, dfd in ((args[0], args[2]), (args[1], args[3])):
                    p = _resolve(path, dfd, follow=False)
                    if p is not None and not _inside(p, root):
                        violations.append(f"{event} {p}")
    finally:
        _state.busy = False


@contextlib.contextmanager
def confined(store: Path, sandbox: Path) -> Iterator[list[str]]:
    """Record file accesses under ``sandbox`` but outside ``store``; yields the violation list."""
    global _installed
    if not _installed:
        sys.addaudithook(_hook)
        _installed = True
    entry = (os.path.realpath(store), os.path.realpath(sandbox), [])
    _armed.append(entry)
    try:
        yield entry[2]
    finally:
        _armed.remove(entry)

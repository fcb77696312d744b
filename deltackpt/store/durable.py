"""Local file-system primitives under ``LocalStorage``: fsync, atomic publish, the store lock,
and opening a store's directories without following links.

Why commits look like this: a snapshot exists exactly when ``snapshots/<name>/MANIFEST.json``
exists. Pack data is fsynced before the manifest is written; the manifest is written under
``tmp/``, fsynced, then *linked* to its final name (``link`` fails if the name is taken, so two
writers of one name cannot both win) and the directory is fsynced. A crash at any instant leaves
either no manifest (the snapshot never existed; gc sweeps its packs) or a complete one whose data
is already durable. Nothing ever points at data that might not be there, and ``latest`` is
derived from committed manifests, never from a pointer that could run ahead of them.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import stat
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from deltackpt.errors import SnapshotExistsError, StoreLockedError, UnsafePathError


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def open_dir(path: str | Path, dir_fd: int | None = None) -> int:
    """Open a directory of the store without following a symlink (ELOOP or ENOTDIR if it is
    one), relative to ``dir_fd`` when given: paths from stored data never leave the store."""
    return os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=dir_fd)


def check_dir(path: Path) -> None:
    """Refuse a store sub-directory (``snapshots/``, ``packs/``, ``tmp/``) that is a symlink."""
    st = os.lstat(path)  # FileNotFoundError passes through: callers treat it as "empty"
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise UnsafePathError(
            f"{path} is {'a symlink' if stat.S_ISLNK(st.st_mode) else 'not a directory'}; "
            "deltackpt never follows links inside a store. Replace it with a real directory"
        )


def write_durable(path: Path, data: bytes) -> None:
    """Write ``data`` to a new file ``path`` and fsync it (not its directory)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        view = memoryview(data)
        while view:
            n = os.write(fd, view)
            view = view[n:]
        os.fsync(fd)
    finally:
        os.close(fd)


def publish(
    tmp: Path,
    final: Path,
    overwrite: bool = False,
    *,
    link: Callable[[Path, Path], None] = os.link,
) -> None:
    """Atomically make the durable file ``tmp`` visible as ``final``, then fsync the directory.

    ``link`` is the step that makes a new name visible (``os.link``; tests pass a failing one
    through ``LocalStorage(ops=DurableOps(publish=partial(publish, link=...)))``)."""
    if overwrite:
        os.replace(tmp, final)
    else:
        try:
            link(tmp, final)
        except FileExistsError:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise SnapshotExistsError(
                f"{final} already exists: another save committed that name first. Pick a new "
                "name, or pass overwrite=True to replace it atomically"
            ) from None
        os.unlink(tmp)
    fsync_dir(final.parent)


@contextlib.contextmanager
def store_lock(path: Path, exclusive: bool, timeout: float, what: str) -> Iterator[None]:
    """Hold an flock on ``path``: shared for saves, exclusive for gc.

    A fresh open file description per acquisition, so two threads of one process exclude each
    other like two processes do.
    """
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    mode = fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH
    deadline = time.monotonic() + timeout
    delay = 0.005
    try:
        while True:
            try:
                fcntl.flock(fd, mode | fcntl.LOCK_NB)
                break
            except OSError as e:
                if e.errno not in (errno.EAGAIN, errno.EACCES):
                    raise
                if time.monotonic() >= deadline:
                    holder = "a save is in flight" if exclusive else "gc is running"
                    raise StoreLockedError(
                        f"could not lock {path.parent} for {what} within {timeout:.0f}s: {holder}. "
                        "Wait for it to finish, or raise lock_timeout"
                    ) from None
                time.sleep(delay)
                delay = min(delay * 2, 0.2)
        yield
    finally:
        os.close(fd)  # releases the lock

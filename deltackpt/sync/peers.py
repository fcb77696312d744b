"""Whether a peer process on this host is still alive: the shared-memory links and the
heartbeat of a sync group use it to tell a dead peer from a slow one without waiting for a timeout.

"On this host" means "its pid means the same process here": the same kernel (its boot id) and
the same pid namespace. A host name is not enough: two containers started with ``--network host``
share the host's name but each numbers its own processes, so a peer's pid looked up here would
name another process, or none (a live trainer taken for dead)."""

from __future__ import annotations

import os

__all__ = ["pid_alive", "pid_space"]


def pid_alive(pid: int) -> bool:
    """The process exists and is not a zombie (a killed child its parent has not reaped yet
    still answers ``kill(pid, 0)``)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: it exists
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (OSError, IndexError):  # no /proc (not Linux): kill(0) is all we know
        return True


def pid_space() -> str:
    """Where this process's pid means this process: the kernel's boot id and the pid
    namespace (``"<boot id>/pid:[<inode>]"``); empty where the system does not say (no
    ``/proc``), and then peers compare host names only."""
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            boot = f.read().strip()
        return f"{boot}/{os.readlink('/proc/self/ns/pid')}"
    except OSError:
        return ""

"""Whether a peer process on this host is still alive: the shared-memory links and the
heartbeat of a sync group use it to tell a dead peer from a slow one without waiting for a timeout."""

from __future__ import annotations

import os

__all__ = ["pid_alive"]


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

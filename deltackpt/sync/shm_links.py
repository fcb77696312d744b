"""Shared-memory links of weight sync on one host (``SyncGroup(..., links="shm")``).

One file per (trainer, receiver) link under ``/dev/shm`` (``deltackpt-mxn-<job>-<s>-<r>``):
a cell per bucket of the link (the round that published it and its message bytes) and a slot
per bucket of the link's largest message. Both ends create-or-open the file with the same size,
so neither waits for the other to create it.

``send`` copies a message into its slot (the sender packs straight into the slot through
``window`` and only calls ``publish``), then publishes
the cell (bytes first, then the round: a reader that sees the round sees its bytes on x86-64's
store order; the digests check it anyway). ``recv`` returns a work whose ``wait`` polls the cell
and copies the message out into the receiver's private staging, where it is verified and from
where it is applied: the window is writable by any process that can open the file, so it is
never the staging (see docs/sync.md, Untrusted shared memory). While polling, ``wait`` checks
every 20 ms whether the round was aborted (store key) or the sender's process died.

Cleanup: ``SyncGroup.close`` and ``reconnect`` remove this rank's link files, and so does the
interpreter's exit when neither was called (an exception that ended the job). A process killed
with SIGKILL cannot: its files stay until the peer on the same link closes or reconnects, or
the host reboots; they are named ``deltackpt-mxn-<job>-<sender>-<receiver>`` and hold no state
anyone needs once every process of that job is gone (``rm /dev/shm/deltackpt-mxn-*``).
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import shutil
import weakref
from typing import TYPE_CHECKING

import numpy as np
import torch

from deltackpt.sync.cells import Done, Recv, wait_published
from deltackpt.sync.errors import PeerLostError, PlanError

if TYPE_CHECKING:
    from deltackpt.sync.group import SyncGroup

__all__ = ["ShmLinks"]


def _dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else "/tmp"


def _unlink_all(paths: set[str]) -> None:
    for p in list(paths):
        with contextlib.suppress(OSError):
            os.unlink(p)
    paths.clear()


def _reserve(fd: int, size: int, path: str) -> None:
    """Allocate the window's pages now: on a full RAM disk (Docker's default /dev/shm is 64 MB)
    a sparse file maps fine and the first write into it kills the process with SIGBUS; this
    fails here instead, with a typed error that says what to do."""
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as e:
        if e.errno in (errno.EOPNOTSUPP, errno.EINVAL):  # a file system without fallocate
            return
        free = shutil.disk_usage(os.path.dirname(path)).free
        with contextlib.suppress(OSError):
            os.unlink(path)
        raise PlanError(
            f"shared-memory link {path!r} needs {size} bytes, and {os.path.dirname(path)} "
            f"has {free} free ({e.strerror}). Give it more room (e.g. docker run "
            "--shm-size=8g), lower bucket_bytes, or use links='gloo'"
        ) from e


class ShmLinks:
    """The windows of this rank's links; ``open(peers)`` once per schedule (see module doc)."""

    def __init__(self, group: SyncGroup, job: str) -> None:
        self.g, self.job = group, job
        self._maps: dict[tuple[int, int], tuple[mmap.mmap, np.ndarray, torch.Tensor, int]] = {}
        # remove the files at interpreter exit if close()/reconnect() never ran
        self._paths: set[str] = set()
        self._at_exit = weakref.finalize(self, _unlink_all, self._paths)

    def path(self, s: int, r: int) -> str:
        return os.path.join(_dir(), f"deltackpt-mxn-{self.job}-{s}-{r}")

    def open(self, links: dict[tuple[int, int], tuple[int, int]]) -> None:
        """``links``: (sender, receiver) -> (buckets, slot bytes) for this rank's links."""
        self.close()
        for (s, r), (n, slot) in links.items():
            cells = -(-n * 16 // 4096) * 4096
            size = cells + n * slot
            self._paths.add(self.path(s, r))
            fd = os.open(self.path(s, r), os.O_RDWR | os.O_CREAT, 0o600)
            try:
                if os.fstat(fd).st_size != size:
                    os.ftruncate(fd, size)
                    _reserve(fd, size, self.path(s, r))
                mm = mmap.mmap(fd, size)
            finally:
                os.close(fd)
            cell = np.frombuffer(mm, np.int64, 2 * n, 0).reshape(n, 2)
            data = torch.frombuffer(mm, dtype=torch.uint8)[cells:]
            self._maps[(s, r)] = (mm, cell, data, slot)

    def window(self, dst: int, tag: int) -> torch.Tensor:
        """The slot of bucket ``tag`` on the link to ``dst``: a sender may pack straight into
        it, then :meth:`publish` (the previous round's bytes were copied out by every receiver
        before it voted, so the slot is free once the last round's vote is in)."""
        _, _, data, slot = self._maps[(self.g.rank, dst)]
        return data[tag * slot : (tag + 1) * slot]

    def publish(self, dst: int, tag: int, n: int) -> Done:
        """The first ``n`` bytes of the slot are the message of round ``seq``."""
        _, cell, _, _ = self._maps[(self.g.rank, dst)]
        cell[tag, 1] = n
        cell[tag, 0] = self.g.seq
        return Done()

    def send(self, buf: torch.Tensor, dst: int, tag: int) -> Done:
        self.window(dst, tag)[: buf.numel()].copy_(buf)
        return self.publish(dst, tag, buf.numel())

    def recv(self, into: torch.Tensor, src: int, tag: int) -> Recv:
        return Recv(self, src, tag, into, self.g.seq)

    def _wait_copy(self, src: int, tag: int, into: torch.Tensor, seq: int) -> None:
        _, cell, data, slot = self._maps[(src, self.g.rank)]
        what = f"shared-memory link from rank {src}"
        wait_published(self.g, src, tag, seq, lambda: int(cell[tag, 0]), what)
        n = int(cell[tag, 1])
        if not 0 < n <= min(slot, into.numel()):
            raise PeerLostError(f"bucket {tag} from rank {src}: cell claims {n} bytes")
        into[:n].copy_(data[tag * slot : tag * slot + n])

    def close(self) -> None:
        for mm, *_ in self._maps.values():
            with contextlib.suppress(BufferError):
                mm.close()
        self._maps.clear()

    def unlink(self) -> None:
        """Remove this rank's link files (call once no peer uses them)."""
        self._paths.update(self.path(s, r) for s, r in self._maps)
        _unlink_all(self._paths)

"""The old bytes of pieces a round overwrote whole, kept in an unlinked file instead of memory.

Why: a receiver that can take a round back (``pull(undo=True)``, and staging ``"ring"`` before
the vote) keeps what the round overwrote. For a patch that is the changed elements, a few
percent; for a round sent whole (the first after a revert, a pretraining-like step) it is a
second copy of every target: the host memory of a worker would double at that moment, which is
exactly when a bound on it matters. :class:`UndoSpill` writes those bytes into a file instead
(the kernel's page cache, written back to disk under memory pressure; not the process's
memory), and reads them back only if the round is taken back.

The file is created unlinked in the directory given (``tempfile.TemporaryFile``): nothing is
left behind by a crash, and nothing in that directory is ever deleted. Its contents are only
ever read back by the process that wrote them, at offsets it recorded: they are not input.
"""

from __future__ import annotations

import os
import tempfile
import threading
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from deltackpt.cuda import device_room
from deltackpt.errors import UndoSpillWarning
from deltackpt.sync.errors import SyncError

__all__ = ["Spilled", "UndoSpill", "keep_old", "open_spill", "ram_filesystem"]

_MAX_IO = 1 << 30  # bytes per pread/pwrite call (Linux caps one call just under 2 GiB)
_RAM_FS = {"tmpfs", "ramfs", "devtmpfs"}


def ram_filesystem(path: str | os.PathLike[str], mounts: str | None = None) -> bool:
    """Whether ``path`` lies on a filesystem kept in memory (tmpfs, ramfs): spilling there saves
    no memory. Reads ``mounts`` (default /proc/self/mounts; False where there is none)."""
    try:
        lines = (mounts or Path("/proc/self/mounts").read_text()).splitlines()
    except OSError:
        return False
    real = os.path.realpath(path)
    best, fstype = "", ""
    for line in lines:
        parts = line.split()
        if len(parts) < 3:
            continue
        mnt = parts[1].replace("\\040", " ")
        inside = real == mnt or real.startswith(mnt.rstrip("/") + "/")
        if inside and len(mnt) >= len(best):
            best, fstype = mnt, parts[2]
    return fstype in _RAM_FS


@dataclass(frozen=True)
class Spilled:
    """Bytes of a tensor written into an :class:`UndoSpill` at ``offset``."""

    spill: UndoSpill
    offset: int
    nbytes: int
    epoch: int

    def restore(self, dst: torch.Tensor) -> None:
        """Write the kept bytes back into ``dst`` (the tensor they were taken from)."""
        self.spill.read_into(self, dst)


class UndoSpill:
    """An append-only unlinked file of old tensor bytes, emptied by :meth:`clear`."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = str(directory)
        # kept open for the receiver's life; closed (and so gone) with it
        self._file = tempfile.TemporaryFile(dir=self.directory, prefix="deltackpt-undo-")  # noqa: SIM115
        self._fd = self._file.fileno()
        self._end = 0
        self._epoch = 0  # bumped by clear(): a Spilled of an older epoch is gone
        self._lock = threading.Lock()

    @property
    def nbytes(self) -> int:
        """Bytes written since the last :meth:`clear`."""
        return self._end

    def keep(self, src: torch.Tensor) -> Spilled:
        """Append ``src``'s bytes (a CPU tensor; a strided box is made contiguous piece by
        piece: one piece's copy at a time in memory)."""
        data = src.detach()
        if not data.is_contiguous():
            data = data.contiguous()
        raw = data.reshape(-1).view(torch.uint8).numpy() if data.numel() else np.empty(0, np.uint8)
        with self._lock:
            at = self._end
            self._end += raw.size
            epoch = self._epoch
        done = 0
        while done < raw.size:
            n = os.pwrite(self._fd, raw[done : done + _MAX_IO], at + done)
            if n <= 0:
                raise SyncError(f"undo spill in {self.directory}: write returned {n}")
            done += n
        return Spilled(self, at, raw.size, epoch)

    def read_into(self, s: Spilled, dst: torch.Tensor) -> None:
        if s.spill is not self or s.epoch != self._epoch:
            raise SyncError("undo spill: these bytes were already cleared; nothing to put back")
        direct = dst.is_contiguous() and dst.device.type == "cpu" and dst.numel() > 0
        if direct:  # straight back into the target's bytes
            buf = dst.detach().reshape(-1).view(torch.uint8).numpy()
        else:  # a strided box: through one piece's buffer
            buf = np.empty(s.nbytes, dtype=np.uint8)
        if buf.size != s.nbytes:
            raise SyncError(f"undo spill: {s.nbytes} bytes kept, the target has {buf.size}")
        done = 0
        while done < s.nbytes:
            n = os.preadv(self._fd, [buf[done : done + _MAX_IO]], s.offset + done)
            if n <= 0:
                raise SyncError(
                    f"undo spill in {self.directory}: {s.nbytes - done} bytes at "
                    f"{s.offset + done} could not be read back"
                )
            done += n
        if not direct:
            old = torch.from_numpy(buf).view(dst.dtype).view(dst.shape)
            with torch.no_grad():
                dst.copy_(old)

    def clear(self) -> None:
        """Drop everything kept (the file shrinks to nothing; pages never written back are
        discarded)."""
        with self._lock:
            self._epoch += 1
            self._end = 0
            os.ftruncate(self._fd, 0)

    def close(self) -> None:
        self._file.close()


def open_spill(directory: str) -> UndoSpill | None:
    """An :class:`UndoSpill` in ``directory``, or None with an :class:`UndoSpillWarning` when
    no file can be made there (the old bytes are then kept in memory)."""
    try:
        return UndoSpill(directory)
    except OSError as e:
        warnings.warn(
            UndoSpillWarning(
                f"undo_dir={directory!r}: cannot create the undo file there ({e}); the old bytes "
                "of rounds sent whole are kept in memory. Pass a writable directory on a disk"
            ),
            stacklevel=3,
        )
        return None


def keep_old(dst: torch.Tensor, spill: UndoSpill | None) -> torch.Tensor | Spilled:
    """``dst``'s bytes, before a round overwrites them: in ``spill`` where there is one, else
    (or if the write fails: a full disk) a copy in memory. A target in device memory keeps them
    in a second copy on its device where that leaves the device a margin
    (:func:`~deltackpt.cuda.device_room`), else on the host like a host target's: an inference
    engine fills its GPU with its cache, and a copy there could take what its next step needs."""
    data, own = dst.detach(), False
    if data.device.type != "cpu":
        if device_room(data.device, data.numel() * data.element_size()):
            return data.clone()
        data, own = data.cpu(), True  # a copy of its own: spilled, or kept as it is
    if spill is not None:
        try:
            return spill.keep(data)
        except OSError as e:
            warnings.warn(
                UndoSpillWarning(
                    f"undo file in {spill.directory}: writing {dst.numel() * dst.element_size()} "
                    f"bytes failed ({e}); kept in memory instead"
                ),
                stacklevel=3,
            )
    return data if own else data.clone()

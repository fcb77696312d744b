"""The bulk channel of :class:`~deltackpt.sync.shm.ShmTransport`: one shared window per plan.

``deltackpt-sync-<name>.w<gen>.<plan>`` under ``/dev/shm``: an arena where each round lays out
its buckets (``plan.arena_offsets``) plus, per bucket position, a "published in round r" cell
and a "packed so far" cell. The owner packs a bucket straight into the arena, advancing "packed
so far" every few MiB, and publishes it; receivers copy it out right behind the packer into
their own memory and hash the copy (the digest is ready when the bucket header arrives). The
arena is reused every round; the leader (lowest sender rank) creates the file and removes it.

The window is ``shared`` (see :class:`~deltackpt.sync.transport.Channel`): any process that can
open the file can write it, at any time, so its bytes are untrusted input. The sender hashes
what it packs from its own tensors, never from the window; a receiver verifies and hands to
``load_weights`` only its private copy, so a write to the window after the copy (a buggy
process, a sender that starts the next round early) is either caught by the digest or cannot
reach the model. Cost: /dev/shm holds the model's wire bytes once; each receiver holds a
private copy of a round (``on_commit``) or of one bucket (``per_bucket``), and copying out is
one memcpy of the round per receiver, overlapped with the packing.
"""

from __future__ import annotations

import contextlib
import glob
import mmap
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from deltackpt.sync.errors import PeerLostError
from deltackpt.sync.plan import Bucket, Plan
from deltackpt.sync.transport import Channel

if TYPE_CHECKING:
    from deltackpt.sync.shm import ShmTransport

__all__ = ["ShmWindow", "window_files"]

_PAGE = 4096


def window_files(control_path: str) -> list[str]:
    """The window files of the transport whose control segment is ``control_path``."""
    return glob.glob(glob.escape(control_path) + ".w*")


class ShmWindow(Channel):
    """One file per plan: cells per bucket position (the round that published it; bytes packed
    so far and their round), then an arena of ``plan.arena_bytes`` where each round lays out its
    buckets (``plan.arena_offsets``). Opened collectively by ``ShmTransport.open_channel``."""

    relays = False
    stable = True
    streams = True
    shared = True  # any process that can open the file can write the arena

    def __init__(self, t: ShmTransport, plan: Plan) -> None:
        self.t = t
        self.plan = plan
        cells = -(-plan.max_buckets * 3 * 8 // _PAGE) * _PAGE
        size = cells + -(-plan.arena_bytes // _PAGE) * _PAGE
        self.path = f"{t.path}.w{t.generation}.{plan.plan_id[:16]}"
        if t.rank == t.leader:
            for old in window_files(t.path):
                if old != self.path:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(old)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                os.ftruncate(fd, size)
            finally:
                os.close(fd)
        t.barrier()  # the file exists
        try:
            fd = os.open(self.path, os.O_RDWR)
        except FileNotFoundError as e:
            raise PeerLostError(
                f"rank {t.rank}: shm window {self.path} vanished; the leader "
                "moved on. Call transport.reset()"
            ) from e
        try:
            flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
            self.mm = mmap.mmap(fd, size, flags=flags)
        finally:
            os.close(fd)
        n = plan.max_buckets
        self.cells = np.frombuffer(self.mm, np.int64, n, 0)
        # packing progress per bucket position: bytes packed so far, and the round they belong
        # to (bytes are stored first, so a reader that sees this round sees this round's bytes)
        self.prog_bytes = np.frombuffer(self.mm, np.int64, n, n * 8)
        self.prog_round = np.frombuffer(self.mm, np.int64, n, 2 * n * 8)
        self.data = torch.frombuffer(self.mm, dtype=torch.uint8)[cells:]
        self.round = 0
        self.offsets: list[int] = []

    def begin_round(self, buckets: Sequence[Bucket]) -> None:
        self.round += 1
        self.offsets = self.plan.arena_offsets(buckets)

    def _view(self, bucket: Bucket) -> torch.Tensor:
        off = self.offsets[bucket.index]
        return self.data[off : off + bucket.nbytes]

    def buffer(self, bucket: Bucket) -> torch.Tensor:
        return self._view(bucket)

    def send(self, bucket: Bucket, extents: dict[int, torch.Tensor] | None = None) -> None:
        self.cells[bucket.index] = self.round

    def progress(self, bucket: Bucket, upto: int) -> None:
        i = bucket.index
        self.prog_bytes[i] = upto
        self.prog_round[i] = self.round

    def wait_bytes(self, bucket: Bucket, upto: int) -> torch.Tensor:
        i, r = bucket.index, self.round
        self.t.wait_for(
            lambda: self.prog_round[i] == r and self.prog_bytes[i] >= upto,
            f"waiting for bucket {i} from rank {bucket.owner}",
            bucket.owner,
        )
        return self._view(bucket)

    def expect(self, bucket: Bucket, into: torch.Tensor | None) -> None:
        pass

    def wait(self, bucket: Bucket) -> torch.Tensor:
        r = self.round
        self.t.wait_for(
            lambda: self.cells[bucket.index] == r,
            f"waiting for bucket {bucket.index} from rank {bucket.owner}",
            bucket.owner,
        )
        return self._view(bucket)

    def close(self) -> None:
        del self.cells, self.data, self.prog_bytes, self.prog_round
        with contextlib.suppress(BufferError):
            self.mm.close()
        if self.t.rank == self.t.leader:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)

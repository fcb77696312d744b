"""Shared-memory transport for sender and receiver processes on one host.

Two kinds of files under ``/dev/shm`` (memory, not disk), mapped by every rank:

* ``deltackpt-sync-<name>`` — the **control segment**, fixed size: per-rank cells (pid,
  generation, last finished op), all-reduce cells and two message slots for control broadcasts.
* ``deltackpt-sync-<name>.w<gen>.<plan>`` — the **window**, one per plan, through which bucket
  payloads travel: :class:`~deltackpt.sync.shm_window.ShmWindow` (``shm_window.py``), the
  channel this transport opens; any process can write it, so its bytes are untrusted input
  (see there). This module is the control segment and its collectives.

Synchronisation is lock-free polling of cells that each rank writes only for itself, tagged with
the generation and the op sequence number (every rank performs the same collectives in the same
order). Control messages carry an xxh3-64 checksum and bucket payloads are digest-checked by the
protocol, so a torn read is retried or rejected, never used.

Bounded waits: every wait polls with a deadline (``timeout``) and checks every 50 ms that the
ranks it waits for are alive (pid exists and is not a zombie) and still in this generation.

Generations (recovery): the leader (lowest sender rank) picks a new generation number, higher than
any in the segment, when it starts or resets; every other rank, at its first collective after
starting or resetting, waits for the leader to show a generation newer than the last one it
joined and adopts it. So after a failure: survivors call ``reset()``, replacements just start,
and all meet in the next generation.
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import time
from collections.abc import Callable, Iterable, Sequence

import numpy as np
import torch
import xxhash

from deltackpt.sync.errors import PeerLostError, SyncError, SyncTimeoutError
from deltackpt.sync.peers import pid_alive
from deltackpt.sync.plan import Plan
from deltackpt.sync.shm_window import ShmWindow, window_files
from deltackpt.sync.transport import Channel, Transport

__all__ = ["ShmTransport"]

_MAGIC = 0x64636B7073796E63  # "dckpsync"
_LAYOUT = 1
_RMAX = 256  # values per all-reduce cell
_RCELL = 4 + _RMAX  # gen, seq, n, check, values
_MHEAD = 8  # gen, seq, src, nbytes, check, pad
_CHECK_EVERY = 0.05


def _shm_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else "/tmp"


def _check(*parts: bytes | memoryview | np.ndarray) -> int:
    h = xxhash.xxh3_64()
    for p in parts:
        h.update(p)
    return int(np.uint64(h.intdigest()).astype(np.int64))


class ShmTransport(Transport):
    """Shared-memory transport between processes on one host.

    Every process of the job constructs it with the same ``name``, ``world_size`` and
    ``senders`` and its own unique ``rank`` (``0..world_size-1``). ``timeout`` (seconds) bounds
    every wait. Files live in ``/dev/shm``; they are reused by later runs with the same name, and
    :meth:`unlink` removes them.
    """

    def __init__(
        self,
        name: str,
        *,
        rank: int,
        world_size: int,
        senders: Sequence[int] = (0,),
        timeout: float = 60.0,
        control_bytes: int = 1 << 20,
    ) -> None:
        super().__init__()
        if not name or "/" in name:
            raise SyncError(f"ShmTransport name {name!r}: use a non-empty name without '/'")
        if not 0 <= rank < world_size:
            raise SyncError(f"ShmTransport rank={rank} is outside 0..{world_size - 1}")
        self.name = name
        self.rank = int(rank)
        self.world_size = int(world_size)
        self.senders = self._check_senders(senders)
        self.leader = self.senders[0]
        self.timeout = float(timeout)
        self.max_message = int(control_bytes)
        self.path = os.path.join(_shm_dir(), f"deltackpt-sync-{name}")
        self._mm = self._open_control()
        self._views()
        self._last_gen = int(self._ranks[self.rank, 1])
        self._gen = 0  # 0 = not joined yet; followers join at their first collective
        self._seq = 0
        self._ranks[self.rank, 0] = os.getpid()
        if self.rank == self.leader:
            self._join_leader()

    # ---- segment --------------------------------------------------------------------------

    def _sizes(self) -> tuple[int, int, int, int]:
        w = self.world_size
        ranks_off = 64
        red_off = ranks_off + w * 4 * 8
        msg_off = -(-(red_off + w * 2 * _RCELL * 8) // 64) * 64
        total = msg_off + 2 * (_MHEAD * 8 + self.max_message)
        return ranks_off, red_off, msg_off, total

    def _open_control(self) -> mmap.mmap:
        *_, total = self._sizes()
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            hdr = os.pread(fd, 32, 0)
            want = np.array([_MAGIC, _LAYOUT, self.world_size, self.max_message], dtype=np.int64)
            if len(hdr) < 32 or not np.array_equal(np.frombuffer(hdr, dtype=np.int64), want):
                if len(hdr) >= 32:
                    self._refuse_if_in_use(fd, np.frombuffer(hdr, dtype=np.int64))
                os.ftruncate(fd, 0)
                os.ftruncate(fd, total)
                os.pwrite(fd, want.tobytes(), 0)
            return mmap.mmap(fd, total)
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)

    def _refuse_if_in_use(self, fd: int, hdr: np.ndarray) -> None:
        if hdr[0] != _MAGIC or hdr[1] != _LAYOUT:
            return
        old_world = int(hdr[2])
        pids = np.frombuffer(os.pread(fd, old_world * 32, 64), dtype=np.int64)[::4]
        live = [int(p) for p in pids if pid_alive(int(p)) and int(p) != os.getpid()]
        if live:
            raise SyncError(
                f"shared-memory segment {self.path} is in use by pids {live} with "
                f"world_size={old_world}, control_bytes={int(hdr[3])} (this rank "
                f"asked for world_size={self.world_size}, control_bytes="
                f"{self.max_message}); use another name or stop those processes"
            )

    def _views(self) -> None:
        ranks_off, red_off, msg_off, _ = self._sizes()
        w = self.world_size
        self._ranks = np.frombuffer(self._mm, np.int64, w * 4, ranks_off).reshape(w, 4)
        self._red = np.frombuffer(self._mm, np.int64, w * 2 * _RCELL, red_off).reshape(w, 2, _RCELL)
        slot = _MHEAD * 8 + self.max_message
        self._mhead = [
            np.frombuffer(self._mm, np.int64, _MHEAD, msg_off + k * slot) for k in range(2)
        ]
        self._mdata = [
            np.frombuffer(self._mm, np.uint8, self.max_message, msg_off + k * slot + _MHEAD * 8)
            for k in range(2)
        ]

    # ---- generations ----------------------------------------------------------------------

    def _join_leader(self) -> None:
        me = self._ranks[self.rank]
        if self.rank == self.leader:
            # generation before pid: a follower that sees our pid also sees the new generation
            self._adopt(int(self._ranks[:, 1].max()) + 1)
            me[0] = os.getpid()
            return
        me[0] = os.getpid()
        lead = self._ranks[self.leader]
        self._poll(
            lambda: int(lead[1]) > self._last_gen and pid_alive(int(lead[0])),
            f"waiting for sender rank {self.leader} to start generation > {self._last_gen}",
            (),
            joining=True,
        )
        self._adopt(int(self._ranks[self.leader, 1]))

    def _adopt(self, gen: int) -> None:
        me = self._ranks[self.rank]
        me[2] = 0
        me[1] = gen
        self._gen = self._last_gen = gen
        self._seq = 0

    def reset(self) -> None:
        """Leave the current generation and join the next one (after a failed round)."""
        super().reset()
        self._gen = 0
        if self.rank == self.leader:
            self._join_leader()

    # ---- waiting --------------------------------------------------------------------------

    def _poll(
        self, ready: Callable[[], bool], what: str, peers: Iterable[int], *, joining: bool = False
    ) -> None:
        if ready():
            return
        peers = tuple(peers)
        start = time.monotonic()
        deadline = start + self.timeout
        next_check = start + _CHECK_EVERY
        delay = 2e-6
        while True:
            time.sleep(delay)
            delay = min(delay * 2, 5e-4)
            if ready():
                return
            now = time.monotonic()
            if now >= next_check:
                next_check = now + _CHECK_EVERY
                if not joining:
                    self._check_peers(peers, what)
            if now >= deadline:
                raise SyncTimeoutError(
                    f"rank {self.rank}: {what}: no answer within {self.timeout:g} s (shm "
                    f"transport {self.name!r}, generation {self._gen}); the peer is hung or "
                    "gone. Call transport.reset() on the surviving ranks and restart the others"
                )

    def _check_peers(self, peers: Iterable[int], what: str) -> None:
        for r in peers:
            pid, gen = int(self._ranks[r, 0]), int(self._ranks[r, 1])
            if gen > self._gen:
                raise PeerLostError(
                    f"rank {self.rank}: {what}: rank {r} moved on to generation "
                    f"{gen} (it reset or was replaced) while this rank is in "
                    f"{self._gen}; call transport.reset()"
                )
            if gen == self._gen and not pid_alive(pid):
                raise PeerLostError(
                    f"rank {self.rank}: {what}: rank {r} (pid {pid}) died; call "
                    "transport.reset() here and restart it"
                )

    def _others(self) -> list[int]:
        return [r for r in range(self.world_size) if r != self.rank]

    def _next_seq(self) -> int:
        if self._gen == 0:
            self._join_leader()
        self._seq += 1
        return self._seq

    def _done(self, seq: int) -> None:
        self._ranks[self.rank, 2] = seq

    # ---- for the window (shm_window.py) ---------------------------------------------------

    @property
    def generation(self) -> int:
        """The generation this rank is in (0 before it joined one)."""
        return self._gen

    def barrier(self) -> None:
        """Collective: return once every rank of this generation got here."""
        self._reduce(torch.zeros(1, dtype=torch.int64))

    def wait_for(self, ready: Callable[[], bool], what: str, peer: int) -> None:
        """Poll ``ready`` until it holds; raises if ``peer`` dies, moves on or times out."""
        self._guard("wait", lambda: self._poll(ready, what, (peer,)))

    # ---- control collectives --------------------------------------------------------------

    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        self._guard("broadcast", lambda: self._broadcast(tensor, src))

    def _broadcast(self, tensor: torch.Tensor, src: int) -> None:
        data = tensor.reshape(-1).view(torch.uint8).numpy()
        n = data.size
        if n > self.max_message:
            raise SyncError(
                f"control message of {n} bytes exceeds control_bytes={self.max_message}"
            )
        seq = self._next_seq()
        k = seq % 2
        head, body = self._mhead[k], self._mdata[k]
        gen = self._gen
        if self.rank == src:
            others = self._others()
            # everyone finished the previous op: its all-reduce cells and the message slot of
            # op seq-2 may be overwritten once we publish (see the module docstring)
            self._poll(
                lambda: all(
                    self._ranks[r, 1] == gen and self._ranks[r, 2] >= seq - 1 for r in others
                ),
                f"broadcast {seq}: waiting for ranks to finish op {seq - 1}",
                others,
            )
            body[:n] = data
            head[2], head[3] = src, n
            head[4] = _check(np.array([gen, seq, src, n], np.int64), body[:n])
            head[1] = seq
            head[0] = gen
        else:

            def ready() -> bool:
                if head[0] != gen or head[1] != seq or head[2] != src or head[3] != n:
                    return False
                return head[4] == _check(np.array([gen, seq, src, n], np.int64), body[:n])

            self._poll(ready, f"broadcast {seq}: waiting for rank {src}", (src,))
            data[:] = body[:n]
        self._done(seq)

    def all_reduce_max(self, tensor: torch.Tensor) -> None:
        if tensor.dtype != torch.int64:
            raise SyncError(f"all_reduce_max needs int64, got {tensor.dtype}")
        flat = tensor.reshape(-1)
        for off in range(0, max(flat.numel(), 1), _RMAX):
            part = flat[off : off + _RMAX]
            self._guard("all_reduce", lambda p=part: self._reduce(p))

    def _reduce(self, part: torch.Tensor) -> None:
        vals = part.numpy()
        n = vals.size
        seq = self._next_seq()
        k = seq % 2
        gen = self._gen
        cell = self._red[self.rank, k]
        cell[4 : 4 + n] = vals
        cell[2] = n
        cell[3] = _check(np.array([gen, seq, n], np.int64), cell[4 : 4 + n])
        cell[1] = seq
        cell[0] = gen

        def ready(r: int) -> bool:
            c = self._red[r, k]
            return bool(
                c[0] == gen
                and c[1] == seq
                and c[2] == n
                and c[3] == _check(np.array([gen, seq, n], np.int64), c[4 : 4 + n])
            )

        for r in self._others():
            self._poll(lambda r=r: ready(r), f"all_reduce {seq}: waiting for rank {r}", (r,))
        np.maximum.reduce(self._red[:, k, 4 : 4 + n], axis=0, out=vals)
        self._done(seq)

    # ---- bulk -----------------------------------------------------------------------------

    def open_channel(self, plan: Plan) -> Channel:
        return self._guard("open_channel", lambda: ShmWindow(self, plan))

    def close(self) -> None:
        with contextlib.suppress(BufferError):
            self._mm.close()

    @staticmethod
    def unlink(name: str) -> None:
        """Remove the shared-memory files of ``name`` (only when no process uses them)."""
        base = os.path.join(_shm_dir(), f"deltackpt-sync-{name}")
        for p in [base, *window_files(base)]:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(p)

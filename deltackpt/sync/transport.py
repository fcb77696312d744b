"""Transports: how bytes move between the ranks of a sync job.

A sync job has ``world_size`` ranks numbered ``0..world_size-1``; ``senders`` are the trainer
ranks that call :meth:`WeightSender.push`, every other rank is a receiver calling
:meth:`WeightReceiver.pull`. A transport offers two paths:

* **control** — small collectives that *every* rank of the job calls, in the same order:
  :meth:`Transport.broadcast` (a tensor from one rank to all) and :meth:`Transport.all_reduce_max`.
  The protocol (``_protocol.py``) builds the plan message, round header, bucket headers and the
  commit vote from these two.
* **bulk** — a :class:`Channel` opened once per plan (collectively, on every rank), through which
  each bucket's payload travels from its owner to the receivers.

Call order per round, on every rank (the protocol does this; users only construct transports)::

    all_reduce_max(begin)            # 1. version, who needs the plan / a full round
    broadcast(manifest) per sender   # 2. only when the plan changed
    open_channel(plan)               #    ... and then the channel is re-opened
    all_reduce_max(changed tensors)  # 3. delta rounds only; everyone derives the round's buckets
    channel.begin_round(buckets)     #
    for each bucket of the round:    # 4. owner: buffer() -> fill -> broadcast(header) -> send()
        broadcast(header)            #    others: broadcast(header) -> expect() ... wait()
    channel.flush()                  # 5. owners: all sends done
    all_reduce_max(vote)             # 6. commit (all zero) or abort

Failures: a transport raises :class:`PeerLostError` or :class:`SyncTimeoutError` within its
timeout when a peer dies or hangs, then refuses further use (``broken``) until :meth:`reset`.

Third path, not implemented here: **the store** — a receiver that starts late or falls behind
loads a committed snapshot (``deltackpt.load``) and hands it to
:meth:`WeightReceiver.install`; its next ``pull`` then asks the senders for the plan and a full
round. See docs/sync.md.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, TypeVar

import torch
import torch.distributed as dist

from deltackpt.sync.errors import PeerLostError, SyncError, SyncTimeoutError
from deltackpt.sync.plan import segments

if TYPE_CHECKING:
    from deltackpt.sync.plan import Bucket, Plan

__all__ = ["Channel", "DistTransport", "Transport", "broadcast_bytes", "init_group"]

T = TypeVar("T")


class Channel(ABC):
    """Bulk path for the buckets of one plan, opened by :meth:`Transport.open_channel`.

    Every rank calls ``begin_round(buckets)`` with the round's layout (``plan.layout(...)``);
    buckets are then identified by ``bucket.index``, their position in that layout.

    Owner of a bucket (a sender rank): ``buf = buffer(b)``, fill ``buf[:b.nbytes]``, broadcast
    the bucket header, ``send(b)``. ``send`` may return before the bytes left: the caller fills
    the next buffer meanwhile (at least two buffers, reused across rounds), and ``buffer``
    blocks until the buffer it returns is free again; tensors passed as ``extents`` must stay
    unchanged until ``flush()``, which waits for all sends.

    Other ranks, after the bucket header: ``expect(b, into)`` then later ``view = wait(b)``.
    ``into`` is an optional tensor of ``b.nbytes`` bytes to receive into; the transport may
    ignore it and return its own buffer. With ``stable`` the view stays valid until the next
    round begins, otherwise until the second next ``expect``. A rank that is neither owner nor
    receiver of a bucket calls ``expect``/``wait`` only if ``relays`` (e.g. a gloo broadcast
    needs every rank of the group).

    With ``shared`` the views (``wait``, ``wait_bytes``, ``buffer``) are memory that other
    processes can write at any time (a shared-memory window): their bytes are untrusted input.
    A receiver copies a bucket out into private memory and verifies and hands over only that
    copy; a sender hashes the bytes it packs from its own memory, never from the view.
    """

    relays: bool = False
    stable: bool = False
    shared: bool = False
    #: ``send`` accepts ``extents``: segments (``plan.segments``) to send from the caller's own
    #: tensors instead of the buffer — a large piece goes out without being copied.
    zero_copy: bool = False
    #: The owner reports packing progress (``progress``) and receivers can read a bucket's
    #: first bytes before it is published (``wait_bytes``), to verify it while it is packed.
    streams: bool = False
    #: After ``expect``, ``wait_bytes`` returns as soon as a prefix of the bucket arrived (the
    #: receiver verifies a bucket while its last bytes are still on the wire).
    partial: bool = False

    def begin_round(self, buckets: Sequence[Bucket]) -> None:  # noqa: B027 - optional hook
        """Called by every rank at the start of each round with the buckets it will carry."""

    @abstractmethod
    def buffer(self, bucket: Bucket) -> torch.Tensor: ...

    @abstractmethod
    def send(self, bucket: Bucket, extents: dict[int, torch.Tensor] | None = None) -> None: ...

    @abstractmethod
    def expect(self, bucket: Bucket, into: torch.Tensor | None) -> None: ...

    @abstractmethod
    def wait(self, bucket: Bucket) -> torch.Tensor: ...

    def progress(self, bucket: Bucket, upto: int) -> None:  # noqa: B027 - optional hook
        """Owner side (``streams``): ``buf[:upto]`` of the bucket is final for this round."""

    def wait_bytes(self, bucket: Bucket, upto: int) -> torch.Tensor:
        """Receiver side (``streams``): wait until the owner reported at least ``upto`` bytes
        of the bucket packed, return the bucket's view (bytes past ``upto`` may still change;
        the digest in the bucket header is what they are checked against)."""
        raise NotImplementedError

    def flush(self) -> None:  # noqa: B027 - optional hook
        """Owner side: block until every ``send`` completed."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release the channel's buffers; called when the plan changes or the transport closes."""


class Transport(ABC):
    """Moves control messages and bucket payloads between the ranks of one sync job.

    Every method is called by every rank of the job in the same order (collective), except
    :meth:`reset` and :meth:`close`, which each rank calls for itself.
    """

    rank: int
    world_size: int
    senders: tuple[int, ...]
    #: Largest tensor :meth:`broadcast` accepts, in bytes; bigger messages are chunked.
    max_message: int = 1 << 62

    def __init__(self) -> None:
        self.epoch = 0  # bumped by reset(): senders and receivers then re-negotiate the plan
        self._broken: BaseException | None = None

    @property
    def receivers(self) -> tuple[int, ...]:
        return tuple(r for r in range(self.world_size) if r not in self.senders)

    @property
    def broken(self) -> bool:
        return self._broken is not None

    def _check_senders(self, senders: Sequence[int]) -> tuple[int, ...]:
        out = tuple(sorted({int(s) for s in senders}))
        if not out or out[0] < 0 or out[-1] >= self.world_size or len(out) == self.world_size:
            raise SyncError(
                f"senders={list(senders)} for world_size={self.world_size}: need at "
                "least one sender and one receiver rank, all in range"
            )
        return out

    def _guard(self, what: str, fn: Callable[[], T]) -> T:
        """Run a transport operation; turn failures into PeerLost/SyncTimeout and mark broken."""
        if self._broken is not None:
            raise PeerLostError(
                f"transport on rank {self.rank} is broken since an earlier "
                f"failure ({self._broken}); call transport.reset() first "
                "(for DistTransport after init_group() re-created the group)"
            )
        try:
            return fn()
        except SyncError as e:
            if isinstance(e, (PeerLostError, SyncTimeoutError)):
                self._broken = e
            raise
        except RuntimeError as e:
            err = self._translate(what, e)
            self._broken = err
            raise err from e

    def _translate(self, what: str, e: BaseException) -> SyncError:
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        if "timed out" in msg.lower() or "timeout" in msg.lower():
            return SyncTimeoutError(
                f"rank {self.rank}: {what} timed out ({msg}); a peer is hung "
                "or dead. Re-create the group and call transport.reset()"
            )
        return PeerLostError(
            f"rank {self.rank}: {what} failed ({msg}); a peer rank probably "
            "died. Re-create the group and call transport.reset()"
        )

    @abstractmethod
    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        """Control path: copy ``tensor`` (CPU, contiguous) from rank ``src`` to all ranks."""

    @abstractmethod
    def all_reduce_max(self, tensor: torch.Tensor) -> None:
        """Control path: element-wise max of an int64 CPU tensor over all ranks, in place."""

    @abstractmethod
    def open_channel(self, plan: Plan) -> Channel:
        """Collective: create the bulk channel for ``plan`` (buffers sized for its buckets)."""

    def reset(self) -> None:
        """Forget a failed round so the next one starts cleanly (see subclasses)."""
        self._broken = None
        self.epoch += 1

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release resources held by this rank."""


def broadcast_bytes(transport: Transport, data: bytes | None, src: int) -> bytes:
    """Control path: send ``data`` (given on ``src`` only) to every rank; returns it everywhere."""
    n = torch.tensor([len(data) if data is not None else 0], dtype=torch.int64)
    transport.broadcast(n, src)
    total = int(n.item())
    out = bytearray(total)
    step = transport.max_message
    for off in range(0, total, step):
        size = min(step, total - off)
        if data is not None:
            chunk = torch.frombuffer(bytearray(data[off : off + size]), dtype=torch.uint8)
        else:
            chunk = torch.empty(size, dtype=torch.uint8)
        transport.broadcast(chunk, src)
        out[off : off + size] = chunk.numpy().tobytes()
    return bytes(out)


def init_group(
    master_addr: str,
    master_port: int,
    rank: int,
    world_size: int,
    *,
    timeout: float = 60.0,
    backend: str | None = None,
) -> dist.ProcessGroup:
    """Create the default torch.distributed group that trainer and inference ranks share.

    Every rank of the sync job calls it with the same address, port and ``world_size``; rank 0
    hosts the rendezvous store on ``master_port``. ``backend`` defaults to NCCL when CUDA is
    available, else gloo. ``timeout`` (seconds) bounds every collective, so a dead peer turns
    into an error, not a hang.

    Also the recovery step after a failed round: an existing default group is destroyed first,
    so survivors call ``init_group`` again (with a port that is free — the old store may still
    hold the previous one) together with the replacement ranks, then ``transport.reset()``.
    """
    if dist.is_initialized():
        with contextlib.suppress(Exception):  # a broken group may fail to tear down
            dist.destroy_process_group()
    td = timedelta(seconds=timeout)
    store = dist.TCPStore(
        master_addr, int(master_port), world_size, is_master=(rank == 0), timeout=td
    )
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=td)
    return dist.group.WORLD  # type: ignore[return-value]


class DistTransport(Transport):
    """torch.distributed transport: broadcasts over a group spanning trainer and inference ranks.

    ``group`` (``None`` = the default group) must contain every sender and receiver; ``senders``
    are ranks *within the group*. On CPU the group is gloo (payloads travel through host memory);
    with NCCL the buckets are CUDA tensors on ``device``. Timeouts are the group's timeout.

    After a peer died the group is unusable: every surviving rank calls :func:`init_group` (or
    builds its own new group) and then :meth:`reset` (``reset(group)`` for a non-default group);
    replacement ranks construct a new ``DistTransport``.
    """

    def __init__(
        self,
        group: dist.ProcessGroup | None = None,
        senders: Sequence[int] = (0,),
        *,
        device: torch.device | str = "cpu",
    ) -> None:
        super().__init__()
        self._default = group is None
        self.device = torch.device(device)
        self._senders_arg = tuple(senders)
        self._bind(group)

    def _bind(self, group: dist.ProcessGroup | None) -> None:
        if not dist.is_initialized():
            raise SyncError(
                "DistTransport needs an initialised torch.distributed group; call "
                "deltackpt.sync.init_group(...) or dist.init_process_group first"
            )
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.senders = self._check_senders(self._senders_arg)

    def reset(self, group: dist.ProcessGroup | None = None) -> None:
        """Re-bind to ``group`` (default: the current default group) after a failure."""
        if group is None and not self._default:
            raise SyncError(
                "this DistTransport was built on an explicit group; pass the new "
                "group: transport.reset(new_group)"
            )
        self._bind(group)
        super().reset()

    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        if tensor.numel() == 0:
            return
        t = tensor if tensor.device == self.device else tensor.to(self.device)
        self._guard("broadcast", lambda: dist.broadcast(t, group=self.group, group_src=src))
        if t is not tensor:
            tensor.copy_(t)

    def all_reduce_max(self, tensor: torch.Tensor) -> None:
        t = tensor if tensor.device == self.device else tensor.to(self.device)
        self._guard(
            "all_reduce", lambda: dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        )
        if t is not tensor:
            tensor.copy_(t)

    def open_channel(self, plan: Plan) -> Channel:
        return _DistChannel(self, plan)


class _DistChannel(Channel):
    """Async broadcasts, one per segment of a bucket (``plan.segments``): large pieces travel
    straight from the sender's tensors, small ones from a ring of two reusable pack buffers.
    Receivers receive into the caller's buffer or a ring of two of their own."""

    relays = True
    stable = False
    zero_copy = True
    partial = True

    def __init__(self, transport: DistTransport, plan: Plan) -> None:
        self.t = transport
        self.direct_bytes = plan.direct_bytes
        self.capacity = 0
        self._send_ring: list[torch.Tensor] = []
        self._recv_ring: list[torch.Tensor] = []
        self._send_work: list[list[dist.Work]] = [[], []]
        self._recv_work: list[list[dist.Work]] = [[], []]
        self._nsend = self._nrecv = 0
        # bucket index -> (works, buffer, segment ends, [segments known to have arrived])
        self._pending: dict[int, tuple[list[dist.Work], torch.Tensor, list[int], list[int]]] = {}

    def begin_round(self, buckets: Sequence[Bucket]) -> None:
        need = max((b.nbytes for b in buckets), default=0)
        if need > self.capacity:  # grow once; the rings are reused by later rounds
            self.flush()
            self.capacity = need
            self._send_ring.clear()
            self._recv_ring.clear()

    def _ring(self, ring: list[torch.Tensor]) -> list[torch.Tensor]:
        if not ring:
            ring.extend(
                torch.empty(self.capacity, dtype=torch.uint8, device=self.t.device)
                for _ in range(2)
            )
        return ring

    def _wait(self, works: list[dist.Work]) -> None:
        for w in works:
            self.t._guard("broadcast", w.wait)
        works.clear()

    def _post(
        self,
        bucket: Bucket,
        buf: torch.Tensor,
        extents: dict[int, torch.Tensor] | None = None,
        ends: list[int] | None = None,
    ) -> list[dist.Work]:
        works = []
        for lo, hi, _ in segments(bucket, self.direct_bytes):
            if ends is not None:
                ends.append(hi)
            data = extents.get(lo) if extents else None
            target = buf[lo:hi] if data is None else data
            works.append(
                self.t._guard(
                    "broadcast",
                    lambda x=target: dist.broadcast(
                        x, group=self.t.group, group_src=bucket.owner, async_op=True
                    ),
                )
            )
        return works

    def buffer(self, bucket: Bucket) -> torch.Tensor:
        k = self._nsend % 2
        self._wait(self._send_work[k])
        return self._ring(self._send_ring)[k][: bucket.nbytes]

    def send(self, bucket: Bucket, extents: dict[int, torch.Tensor] | None = None) -> None:
        k = self._nsend % 2
        self._nsend += 1
        self._send_work[k] = self._post(bucket, self._send_ring[k], extents)

    def expect(self, bucket: Bucket, into: torch.Tensor | None) -> None:
        ends: list[int] = []
        if into is None or into.device != self.t.device:
            k = self._nrecv % 2
            self._nrecv += 1
            self._wait(self._recv_work[k])  # the view of bucket-2 is released by now
            into = self._ring(self._recv_ring)[k][: bucket.nbytes]
            works = self._recv_work[k] = self._post(bucket, into, ends=ends)
        else:
            works = self._post(bucket, into, ends=ends)
        self._pending[bucket.index] = (works, into, ends, [0])

    def wait_bytes(self, bucket: Bucket, upto: int) -> torch.Tensor:
        works, into, ends, done = self._pending[bucket.index]
        k = done[0]
        while k < len(works) and (k == 0 or ends[k - 1] < upto):  # segments in bucket order
            self.t._guard("broadcast", works[k].wait)
            k += 1
        done[0] = k
        return into

    def wait(self, bucket: Bucket) -> torch.Tensor:
        works, into, _, _ = self._pending.pop(bucket.index)
        for w in works:
            self.t._guard("broadcast", w.wait)
        return into

    def flush(self) -> None:
        for works in (*self._send_work, *self._recv_work):
            self._wait(works)
        for works, *_ in self._pending.values():
            self._wait(works)
        self._pending.clear()

    def close(self) -> None:
        self._send_ring.clear()
        self._recv_ring.clear()
        self._pending.clear()

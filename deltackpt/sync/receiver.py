"""Inference side: :class:`WeightReceiver` takes part in a round and hands verified tensors over.

Called on every receiver rank of the transport, once per round the senders push::

    receiver = WeightReceiver(transport)               # apply="on_commit" (default)
    receiver.pull(model.load_weights)                  # vLLM / SGLang convention
    receiver.pull(ModuleAdapter(module))               # plain nn.Module
    receiver.version                                   # last committed version

``load_weights`` receives a list of ``(name, tensor)`` per bucket, in plan order. The tensors are
views into the receiver's (or the transport's) buffers, valid only during the call: copy them
(``param.copy_(t)``) — do not keep references.

When is ``load_weights`` called? (``apply=``)

* ``"on_commit"`` (default, transactional): every bucket is verified against its digest as it
  arrives and kept staged; only after all ranks voted to commit are the staged buckets handed to
  ``load_weights``. A failed round never touches the model. Memory: one private copy of the
  model's wire bytes (``plan.arena_bytes``) in this process, allocated at the first round of a
  plan and reused. :class:`DistTransport` receives the buckets straight into it.
  :class:`ShmTransport` copies each bucket out of the shared window into it, hashing the copy
  chunk by chunk right behind the packing sender: the window is writable by any process that
  maps it, so it cannot be the staging — bytes changed there after verification would reach
  ``load_weights``. (So /dev/shm holds the wire bytes once, and every receiver once more.)
* ``"per_bucket"``: each bucket is handed over as soon as it is verified. Memory: the two
  receive buffers of :class:`DistTransport`; for :class:`ShmTransport` one private buffer of the
  round's largest bucket, which each bucket is copied into (and verified in) before it is handed
  over. A round that fails midway leaves the model partly updated: ``version`` still names the
  last committed version, :attr:`WeightReceiver.consistent` becomes False and the next round is
  a full round that repairs it.

Either way ``load_weights`` only ever sees bytes in this process's own memory that were hashed
there and matched the sender's digest; what happens to the channel's buffers afterwards cannot
change them.

Tensors split over several buckets or sharded over several senders are assembled in buffers kept
across rounds (their total size), and handed over once their last piece arrived
(``assemble.py``). This module is the receiver's round protocol and the verification of every
bucket (hashing it as it is copied into this process's memory).
"""

from __future__ import annotations

import mmap
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Literal

import numpy as np
import torch
import xxhash

from deltackpt.format.hashing import digest
from deltackpt.sync import _protocol as proto
from deltackpt.sync._protocol import RoundStats
from deltackpt.sync.assemble import Assembler
from deltackpt.sync.errors import (
    DigestMismatchError,
    RoundAbortedError,
    SyncError,
)
from deltackpt.sync.plan import Bucket, Plan, build_plan
from deltackpt.sync.sender_manifest import DtypeSpec
from deltackpt.sync.transport import Channel, Transport

__all__ = ["LoadWeights", "WeightReceiver"]

#: ``load_weights(weights)``: takes a list of ``(name, tensor)``; return value ignored.
LoadWeights = Callable[[list[tuple[str, torch.Tensor]]], Any]

_STEP = 4 << 20  # streaming channels: hash this much at a time behind the packing sender
# copy-out granularity: the chunk is hashed right after its copy, from cache. np.copyto of
# chunks under ~512 KiB ran 2-4x slower on the 2-core dev box; 1 MiB copies + hashes ~1 GB in
# 0.16-0.18 s there (hashing alone: ~0.1 s)
_CHUNK = 1 << 20


def _follow(ch: Channel, bk: Bucket) -> str | None:
    """Digest of a bucket hashed as its bytes become readable (``ch.wait_bytes``): behind the
    packing owner (``streams``) or behind the wire (``partial``). None for non-CPU buffers."""
    out = []
    data = None
    for p in bk.pieces:
        h = xxhash.xxh3_128()
        for lo in range(p.bucket_offset, p.bucket_offset + p.nbytes, _STEP):
            hi = min(lo + _STEP, p.bucket_offset + p.nbytes)
            view = ch.wait_bytes(bk, hi)
            if data is None:
                if view.device.type != "cpu":
                    return None
                data = view.numpy()
            h.update(data[lo:hi])
        out.append(h.hexdigest())
    return proto.combine(out)


def _copy_verify(bk: Bucket, dst: torch.Tensor, ready: Callable[[int], torch.Tensor]) -> str:
    """Copy a bucket's pieces from the channel's view into ``dst`` (this process's memory) and
    return the digest of the copy: each chunk is hashed from ``dst`` right after it was copied,
    so the digest covers exactly the bytes that will be handed over, whatever the view holds
    later. ``ready(upto)`` returns the view once its first ``upto`` bytes are readable."""
    out = dst.numpy()
    src: np.ndarray | None = None
    digests = []
    for p in bk.pieces:
        h = xxhash.xxh3_128()
        end = p.bucket_offset + p.nbytes
        for lo in range(p.bucket_offset, end, _STEP):
            hi = min(lo + _STEP, end)
            view = ready(hi)
            if view.device.type != "cpu":  # e.g. a device ring buffer: one transfer per step
                dst[lo:hi].copy_(view[lo:hi])
                h.update(out[lo:hi])
                continue
            if src is None:
                src = view.numpy()
            for c in range(lo, hi, _CHUNK):
                e = min(c + _CHUNK, hi)
                np.copyto(out[c:e], src[c:e])
                h.update(out[c:e])
        digests.append(h.hexdigest())
    return proto.combine(digests)


def _private(nbytes: int) -> torch.Tensor:
    """``nbytes`` of this process's memory, faulted in up front (MAP_POPULATE where there is
    one) rather than page by page inside the first round's copy loop, which runs right behind
    the sender: 1 GB populated in ~0.5 s vs ~0.75 s of faults on the dev VM in isolation (both
    several times slower on memory the VM never touched before)."""
    flags = getattr(mmap, "MAP_POPULATE", 0)
    if not flags or nbytes == 0:
        return torch.empty(nbytes, dtype=torch.uint8)
    mem = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | flags)
    return torch.frombuffer(mem, dtype=torch.uint8)  # keeps `mem` alive as long as it is used


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.device == b.device and a.data_ptr() == b.data_ptr()


class WeightReceiver:
    """Receives rounds from the senders of ``transport`` and loads them into a model.

    ``apply`` chooses when ``load_weights`` runs (see the module docstring); ``dtype`` casts
    floating-point tensors (or ``f(name, dtype) -> dtype | None``) before they are handed over,
    e.g. fp32 master weights -> ``torch.bfloat16``.
    """

    def __init__(
        self,
        transport: Transport,
        *,
        apply: Literal["on_commit", "per_bucket"] = "on_commit",
        dtype: DtypeSpec = None,
    ) -> None:
        if transport.rank in transport.senders:
            raise SyncError(
                f"rank {transport.rank} is a sender of this transport; use WeightSender on it"
            )
        if apply not in ("on_commit", "per_bucket"):
            raise SyncError(f"apply={apply!r}: choose 'on_commit' or 'per_bucket'")
        self.transport = transport
        self.apply = apply
        self.dtype = dtype
        self.version: int | None = None
        self.last_round: RoundStats | None = None
        #: False while the model may hold a mix of versions (per_bucket mode after a failure).
        self.consistent = True
        self._plan: Plan | None = None
        self._epoch = -1
        self._channel: Channel | None = None
        self._asm: Assembler | None = None
        self._arena: torch.Tensor | None = None  # on_commit staging (plan.arena_bytes)
        self._bounce: torch.Tensor | None = None  # per_bucket copy of one shared-window bucket
        self._need_full = True

    #: Benchmarks only (``bench_sync.py --apply on_commit:trusted``): the behaviour before
    #: shared windows were treated as untrusted — stage and verify in the window itself, no
    #: private copy. Never set it elsewhere: bytes written to the window after verification
    #: reach ``load_weights``.
    _trust_shared = False

    @property
    def plan(self) -> Plan | None:
        """The agreed plan (tensor names, dtypes, shapes, bucket layout), once received."""
        return self._plan

    def pull(self, load_weights: LoadWeights) -> RoundStats:
        """Take part in one round; call ``load_weights`` with verified tensors; commit.

        Returns when the round is committed (``version`` then names it). Raises
        :class:`SyncError` (subclasses) when it is not; ``version`` and — with
        ``apply="on_commit"`` — the model are unchanged then. After :class:`PeerLostError` or
        :class:`SyncTimeoutError`, reset the transport before the next ``pull``.
        """
        t0 = time.perf_counter()
        t = self.transport
        b = proto.begin(
            t,
            version=None,
            need_plan=self._plan is None or self._epoch != t.epoch,
            need_full=self._need_full,
            failed=False,
        )
        self._need_full = True  # until this round commits
        if b.need_plan:
            plan = build_plan(proto.exchange_plan(t, None))
            if self._channel is not None:
                self._channel.close()
                self._channel = None
            if self._plan is None or plan.plan_id != self._plan.plan_id:
                self._arena = self._bounce = None
                self._asm = Assembler(plan, self.dtype)
            self._plan = plan
            self._channel = t.open_channel(plan)
            self._epoch = t.epoch
        plan, ch, asm = self._plan, self._channel, self._asm
        if plan is None or ch is None or asm is None:
            raise SyncError("internal: no plan after the plan exchange")
        send = None  # None: every tensor (a full round)
        if not (b.need_full or b.need_plan):
            send = proto.exchange_changed(t, plan, (), False, b.version)
        buckets = plan.layout(send)
        ch.begin_round(buckets)
        asm.start_round()
        failure, staged = self._receive(plan, ch, asm, buckets, b.version, load_weights)
        rejected = proto.vote(t, failure is not None)
        if rejected:
            if failure is not None:
                raise failure
            raise RoundAbortedError(
                f"round {b.version} was not committed: rank {rejected - 1} "
                f"rejected it; this receiver keeps version {self.version}"
            )
        if self.apply == "on_commit":
            asm.link(staged)
            for bk, view in staged:
                try:
                    weights = asm.emit(bk, view)
                    if weights:
                        load_weights(weights)
                except Exception as e:
                    self.consistent = False
                    raise SyncError(
                        f"round {b.version}: load_weights failed at commit on "
                        f"{plan.describe(bk)}: {e}. The model may be partly updated; "
                        f"version stays {self.version} and the next round is full"
                    ) from e
        self.version = b.version
        self.consistent = True
        self._need_full = False
        self.last_round = RoundStats.of(b.version, send, plan, buckets, b.need_plan, t0)
        return self.last_round

    def _staging(
        self, plan: Plan, ch: Channel, buckets: Sequence[Bucket], shared: bool
    ) -> Callable[[Bucket], torch.Tensor | None]:
        """Where each bucket is kept from its verification until ``load_weights``: a slice of
        this process's memory, or None to keep the channel's own buffer (private to this process
        and, for on_commit, ``stable``)."""
        if self.apply == "on_commit" and (shared or not ch.stable):
            if self._arena is None:
                self._arena = _private(plan.arena_bytes)
            arena, offsets = self._arena, plan.arena_offsets(buckets)
            return lambda bk: arena[offsets[bk.index] : offsets[bk.index] + bk.nbytes]
        if shared:  # per_bucket: a bucket is handed over before the next one is copied out
            need = max((bk.nbytes for bk in buckets), default=0)
            if self._bounce is None or self._bounce.numel() < need:  # grows once, then reused
                self._bounce = _private(max(need, plan.capacity))
            bounce = self._bounce
            return lambda bk: bounce[: bk.nbytes]
        return lambda bk: None

    def _receive(
        self,
        plan: Plan,
        ch: Channel,
        asm: Assembler,
        buckets: Sequence[Bucket],
        version: int,
        load_weights: LoadWeights,
    ) -> tuple[SyncError | None, list[tuple[Bucket, torch.Tensor]]]:
        """Receive and verify every bucket; the first failure is kept (the round is drained
        anyway so all ranks stay in step) and returned for the vote."""
        t = self.transport
        shared = ch.shared and not self._trust_shared
        private = self._staging(plan, ch, buckets, shared)
        failure: SyncError | None = None
        staged: list[tuple[Bucket, torch.Tensor]] = []
        prev: tuple[Bucket, str] | None = None

        def consume(bk: Bucket, expected: str, early: str | None = None) -> SyncError | None:
            """``early``: digest computed before the header arrived — of the private copy for a
            shared channel, of the channel's buffer otherwise."""
            if failure is not None:
                ch.wait(bk)
                return failure
            dst = private(bk)
            actual = early
            if actual is None and ch.partial and not shared:
                actual = _follow(ch, bk)  # hash behind the wire: prefixes as they arrive
            view = ch.wait(bk)
            if dst is not None and not (shared and early is not None) and not _same(view, dst):
                # not in our memory yet (a shared view; a channel that ignored `into` and will
                # reuse its buffer): what is verified and handed over is our copy
                actual = _copy_verify(bk, dst, lambda _upto: view)
            if dst is not None:
                view = dst
            if actual is None:
                data = view.numpy() if view.device.type == "cpu" else view.cpu().numpy()
                actual = proto.combine(
                    digest(data[p.bucket_offset : p.bucket_offset + p.nbytes]) for p in bk.pieces
                )
            if actual != expected:
                return DigestMismatchError(
                    f"round {version}: {plan.describe(bk)} arrived with digest {actual}, the "
                    f"sender announced {expected}; the round is not committed and this "
                    f"receiver keeps version {self.version}. Check the transport / memory of "
                    "both hosts (for shared memory: no other process may write the window); "
                    "the next round resends everything"
                )
            if self.apply == "on_commit":
                staged.append((bk, view))
                return None
            try:
                weights = asm.emit(bk, view)
                if weights:
                    self.consistent = False
                    load_weights(weights)
            except Exception as e:  # becomes this rank's vote against the round
                err = SyncError(f"round {version}: load_weights failed on {plan.describe(bk)}: {e}")
                err.__cause__ = e
                return err
            return None

        for bk in buckets:
            early = None  # streaming channel: the digest, computed while the owner packed
            if ch.streams and failure is None:
                dst = private(bk)
                if shared and dst is not None:  # copy out right behind the packer, hash the copy
                    early = _copy_verify(bk, dst, lambda upto, bk=bk: ch.wait_bytes(bk, upto))
                else:
                    early = _follow(ch, bk)
            status, expected = proto.header(t, bk.owner, bk.index)
            if status != proto.OK:
                ch.flush()
                raise RoundAbortedError(
                    f"round {version}: sender rank {bk.owner} aborted at "
                    f"bucket {bk.index} (its error is raised there); "
                    f"this receiver keeps version {self.version}"
                )
            ch.expect(bk, None if shared else private(bk))
            if ch.streams:
                failure = consume(bk, expected, early)
                continue
            if prev is not None:
                failure = consume(*prev)
            prev = (bk, expected)
        if prev is not None:
            failure = consume(*prev)
        ch.flush()
        return failure, staged

    def install(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        version: int,
        load_weights: LoadWeights,
        *,
        batch: int = 64,
    ) -> None:
        """Store path hook: load weights obtained elsewhere (e.g. a committed snapshot read with
        ``deltackpt.load``) and adopt ``version``. The next ``pull`` asks for a full round, since
        the senders cannot know what was installed."""
        items = list(named_tensors)
        for i in range(0, len(items), batch):
            load_weights(items[i : i + batch])
        self.version = int(version)
        self.consistent = True
        self._need_full = True

    def close(self) -> None:
        """Release channel and staging buffers (the transport stays open)."""
        if self._channel is not None:
            self._channel.close()
            self._channel = None
        self._arena = self._bounce = None
        self._plan = self._asm = None

"""Trainer side: :class:`WeightSender` runs a round: plan, changed tensors, buckets, vote.

Called on every sender rank of the transport, with the same ``version``, once per round::

    sender = WeightSender(transport, bucket_bytes=256 << 20)
    stats = sender.push(model.state_dict(), version=step)   # (name, tensor) pairs or a mapping

Each sender sends only the parts it holds: a DTensor's local shard (``Shard``/``Replicate``
placements), or a plain tensor (held whole; when several senders hold it, the lowest rank sends
it). No rank gathers the model; receivers assemble full tensors from the shards.

Pipelining: bucket i+1 is packed (copied into a reused flat buffer and hashed in cache-sized
chunks) while bucket i is on the wire — the channel's ``send`` is asynchronous and its buffers
come in a ring of at least two. With :class:`DistTransport`, large pieces of plain CPU tensors
are not copied at all: they are hashed and broadcast straight from the tensor. Packing runs in
the calling thread: async collectives give the overlap, no collective is issued from a
background thread, and errors surface where the caller can see them.

This module is the round protocol of a sender (``_protocol.py`` steps 1-5); filling and hashing
the buckets from the caller's tensors is ``packing.py``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from deltackpt.sync import _protocol as proto
from deltackpt.sync._protocol import RoundStats
from deltackpt.sync.errors import RoundAbortedError, SyncError
from deltackpt.sync.packing import NamedTensors, Packer
from deltackpt.sync.plan import Bucket, Plan, build_plan
from deltackpt.sync.sender_manifest import DtypeSpec, SenderManifest
from deltackpt.sync.transport import Channel, Transport

__all__ = ["DtypeSpec", "WeightSender"]


class WeightSender:
    """Sends named tensors to every receiver of ``transport``, one transactional round per push.

    Construct on every sender rank with the same ``bucket_bytes`` and ``align``. ``dtype``
    casts on the sender (halves the wire bytes for fp32 -> bf16); receivers can cast instead
    with ``WeightReceiver(dtype=...)``.

    Rounds after the first send only the tensors whose bytes changed since the last committed
    round (xxh3-128 of each sender's part), re-packed into as few buckets as they need;
    ``push(full=True)`` sends everything.
    """

    def __init__(
        self,
        transport: Transport,
        *,
        bucket_bytes: int = 256 << 20,
        align: int = 256,
        dtype: DtypeSpec = None,
    ) -> None:
        if transport.rank not in transport.senders:
            raise SyncError(
                f"rank {transport.rank} is not a sender of this transport (senders: "
                f"{list(transport.senders)}); use WeightReceiver on it"
            )
        self.transport = transport
        self.bucket_bytes = int(bucket_bytes)
        self.align = int(align)
        self.dtype = dtype
        self.version: int | None = None
        self.last_round: RoundStats | None = None
        self._plan: Plan | None = None
        self._manifest: bytes | None = None
        self._epoch = -1
        self._channel: Channel | None = None
        self._committed: dict[int, str] = {}  # tensor -> digest of my part, last committed round
        self._dirty = True  # last round failed: the next one is full
        self._packer = Packer(transport)

    # ---- public ---------------------------------------------------------------------------

    def push(
        self,
        named_tensors: NamedTensors,
        version: int,
        *,
        full: bool = False,
    ) -> RoundStats:
        """Run one round: send ``named_tensors`` as ``version``; returns once every rank voted to
        commit it (receivers then load and publish it).

        Every sender rank calls it with the same version; receivers call ``pull`` meanwhile.
        Raises :class:`SyncError` (subclasses) when the round fails; nothing is committed then,
        and the next push starts cleanly (a full round; after a transport failure, call
        ``transport.reset()`` first).
        """
        t0 = time.perf_counter()
        t = self.transport
        manifest: bytes | None = None
        error: BaseException | None = None
        try:
            version = int(version)
            manifest = self._packer.describe(
                named_tensors, self.dtype, self.bucket_bytes, self.align
            )
        except Exception as e:  # re-raised below, after telling the other ranks
            error = e
        need_plan = self._plan is None or manifest != self._manifest or self._epoch != t.epoch
        try:
            b = proto.begin(
                t,
                version=None if error else version,
                need_plan=need_plan,
                need_full=full or self._dirty,
                failed=error is not None,
            )
        except RoundAbortedError:
            if error is not None:
                raise error from None
            raise
        self._dirty = True
        if b.need_plan:
            self._new_plan(proto.exchange_plan(t, manifest))
            self._manifest, self._epoch = manifest, t.epoch
        plan, ch = self._plan, self._channel
        if plan is None or ch is None:
            raise SyncError("internal: no plan after the plan exchange")
        send: list[int] | None = None  # tensors of a delta round; None: all of them
        pieces: dict[tuple[int, int], str] = {}  # (tensor, start) -> digest of my piece
        if not (b.need_full or b.need_plan):
            send = self._changed(plan, pieces, version, error)
        layout = plan.layout(send)
        ch.begin_round(layout)
        self._send(plan, ch, layout, pieces, version)
        rejected = proto.vote(t, False)
        if rejected:
            raise RoundAbortedError(
                f"round {version} was not committed: rank {rejected - 1} rejected it (digest "
                "mismatch or load_weights error, raised on that rank); the receivers keep "
                f"version {self.version}; the next push is a full round"
            )
        if send is None:
            self._committed.clear()
        for i in self._mine(plan) if send is None else send:
            mine = plan.pieces_of(i, t.rank)
            if mine:
                self._committed[i] = proto.combine(pieces[(i, p.start)] for p in mine)
        self._dirty = False
        self.version = version
        self.last_round = RoundStats.of(version, send, plan, layout, b.need_plan, t0)
        return self.last_round

    def close(self) -> None:
        """Release the channel buffers (the transport stays open)."""
        if self._channel is not None:
            self._channel.close()
            self._channel = None
        self._plan = None

    # ---- round steps ----------------------------------------------------------------------

    def _new_plan(self, manifests: list[SenderManifest]) -> None:
        plan = build_plan(manifests)
        if self._channel is not None:
            self._channel.close()
            self._channel = None
        if self._plan is None or plan.plan_id != self._plan.plan_id:
            self._committed.clear()
        self._plan = plan
        self._channel = self.transport.open_channel(plan)

    def _mine(self, plan: Plan) -> list[int]:
        """Indices of the tensors of which this rank sends a part."""
        return [
            i
            for i, parts in enumerate(plan.parts)
            if any(p.owner == self.transport.rank for p in parts)
        ]

    def _changed(
        self,
        plan: Plan,
        pieces: dict[tuple[int, int], str],
        version: int,
        error: BaseException | None,
    ) -> list[int]:
        """Delta round: hash this rank's parts (filling ``pieces``), agree with the other
        senders on the changed tensors, return them all."""
        changed = []
        try:
            for i in self._mine(plan):
                mine = plan.pieces_of(i, self.transport.rank)
                for p in mine:
                    pieces[(i, p.start)] = self._packer.hash_piece(plan, p)
                if proto.combine(pieces[(i, p.start)] for p in mine) != self._committed.get(i):
                    changed.append(i)
        except Exception as e:  # told to the other ranks, then re-raised
            error = e
        try:
            return proto.exchange_changed(self.transport, plan, changed, error is not None, version)
        except RoundAbortedError:
            if error is not None:
                raise error from None
            raise

    def _send(
        self,
        plan: Plan,
        ch: Channel,
        buckets: Sequence[Bucket],
        pieces: dict[tuple[int, int], str],
        version: int,
    ) -> None:
        """Send the round's buckets. Pieces without a digest in ``pieces`` are hashed while they
        are packed, and their digests added."""
        t = self.transport
        for bk in buckets:
            if bk.owner == t.rank:
                buf = ch.buffer(bk)
                try:
                    extents = self._packer.pack(
                        plan,
                        bk,
                        buf,
                        pieces,
                        ch.zero_copy,
                        (lambda n, bk=bk: ch.progress(bk, n)) if ch.streams else None,
                        ch.shared,
                    )
                    d = proto.combine(pieces[(p.tensor, p.start)] for p in bk.pieces)
                except Exception as e:
                    if ch.streams:  # release receivers waiting for bytes that will not come
                        ch.progress(bk, bk.nbytes)
                    proto.header(t, t.rank, bk.index, proto.ABORT)
                    ch.flush()
                    raise SyncError(
                        f"round {version}: packing {plan.describe(bk)} failed: "
                        f"{e}; the round was aborted on every rank"
                    ) from e
                proto.header(t, t.rank, bk.index, proto.OK, d)
                ch.send(bk, extents)
            else:
                status, _ = proto.header(t, bk.owner, bk.index)
                if status != proto.OK:
                    ch.flush()
                    raise RoundAbortedError(
                        f"round {version}: sender rank {bk.owner} aborted "
                        f"at bucket {bk.index} (its error is raised there)"
                    )
                if ch.relays:
                    ch.expect(bk, None)
        ch.flush()

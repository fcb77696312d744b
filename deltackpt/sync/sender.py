"""Trainer side: :class:`WeightSender` packs tensors into buckets and sends a round.

Called on every sender rank of the transport, with the same ``version``, once per round::

    sender = WeightSender(transport, bucket_bytes=256 << 20)
    stats = sender.push(model.state_dict(), version=step)   # (name, tensor) pairs or a mapping

Each sender sends only the parts it holds: a DTensor's local shard (``Shard``/``Replicate``
placements), or a plain tensor (held whole; when several senders hold it, the lowest rank sends
it). No rank gathers the model; receivers assemble full tensors from the shards.

Pipelining: bucket i+1 is packed (copied into a reused flat buffer and hashed in cache-sized
chunks) while bucket i is on the wire — the channel's ``send`` is asynchronous and its buffers
come in a ring of at least two. With :class:`DistTransport`, large pieces of plain CPU tensors
are not copied at all: they are hashed and broadcast straight from the tensor. Digests are
always taken from this process's memory (the source, or a private cast of it), never read back
from a channel buffer that other processes can write (``Channel.shared``), so they name the
bytes the trainer meant to send and receivers reject anything else. Packing runs in
the calling thread: async collectives give the overlap, no collective is issued from a
background thread, and errors surface where the caller can see them.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
import xxhash

from deltackpt.format.hashing import digest
from deltackpt.sync import _protocol as proto
from deltackpt.sync._protocol import RoundStats
from deltackpt.sync.errors import PlanError, RoundAbortedError, SyncError
from deltackpt.sync.plan import (
    Bucket,
    Piece,
    Plan,
    SenderManifest,
    ShardEntry,
    build_plan,
    dtype_name,
)
from deltackpt.sync.transport import Channel, Transport

__all__ = ["DtypeSpec", "WeightSender"]

_CHUNK = 256 << 10  # copy+hash granularity: the chunk is still in L2 when it is hashed
_PROGRESS = 4 << 20  # streaming channels hear of packed bytes this often (a multiple of _CHUNK)

#: A dtype to cast floating-point tensors to, or ``f(name, dtype) -> dtype | None`` (None: keep).
DtypeSpec = torch.dtype | Callable[[str, torch.dtype], torch.dtype | None] | None


def resolve_dtype(spec: DtypeSpec, name: str, dtype: torch.dtype) -> torch.dtype:
    if spec is None:
        return dtype
    if isinstance(spec, torch.dtype):
        return spec if dtype.is_floating_point else dtype
    return spec(name, dtype) or dtype


def _is_dtensor(t: torch.Tensor) -> bool:
    mod = sys.modules.get("torch.distributed.tensor")  # no DTensor can exist before it is imported
    return mod is not None and isinstance(t, mod.DTensor)


def _dtensor_box(
    name: str, t: torch.Tensor
) -> tuple[torch.Tensor, tuple[int, ...], tuple[int, ...]]:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    for p in t.placements:  # type: ignore[attr-defined]
        if not (isinstance(p, Replicate) or type(p) is Shard):
            raise PlanError(
                f"tensor {name!r} has placement {p}; sync sends Shard(dim) and "
                "Replicate() shards only. Reduce Partial placements first, e.g. "
                "t.redistribute(placements=[Replicate()] * mesh.ndim)"
            )
    local = t.to_local()  # type: ignore[attr-defined]
    shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)  # type: ignore[attr-defined]
    if tuple(local.shape) != tuple(shape):
        raise PlanError(
            f"tensor {name!r}: local shard has shape {list(local.shape)} but its "
            f"placements {t.placements} imply {list(shape)}"
        )  # type: ignore
    return local, tuple(offset), tuple(shape)


def _byte_view(t: torch.Tensor, wire: torch.dtype) -> np.ndarray | None:
    """Zero-copy uint8 view of a CPU tensor's bytes, or None if it must go through torch."""
    if (
        t.device.type != "cpu"
        or t.dtype != wire
        or not t.is_contiguous()
        or t.is_conj()
        or t.is_neg()
    ):
        return None
    return t.reshape(-1).view(torch.uint8).numpy()


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
        self._src: dict[str, tuple[torch.Tensor, np.ndarray | None, torch.dtype]] = {}
        self._key: list[tuple[Any, ...] | None] = []  # what _describe saw last (see there)
        self._key_dtype: DtypeSpec = None
        self._described: bytes | None = None

    # ---- public ---------------------------------------------------------------------------

    def push(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor],
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
            manifest = self._describe(named_tensors)
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
        self.last_round = RoundStats(
            version,
            send is None or len(send) == len(plan.tensors),
            b.need_plan,
            len(layout),
            len(plan.buckets),
            sum(bk.nbytes for bk in layout),
            plan.total_bytes,
            time.perf_counter() - t0,
        )
        return self.last_round

    def close(self) -> None:
        """Release the channel buffers (the transport stays open)."""
        if self._channel is not None:
            self._channel.close()
            self._channel = None
        self._plan = None

    # ---- round steps ----------------------------------------------------------------------

    def _describe(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor]
    ) -> bytes:
        items = named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors
        items = list(items)
        # the same tensor objects with the same layout as last round: the manifest and sources
        # are still valid (re-describing ~300 tensors costs milliseconds, a delta round ~50)
        key = [
            (
                n,
                t,
                t.dtype,
                t.shape,
                t.stride(),
                t.storage_offset(),
                t.data_ptr(),
                t.is_conj(),
                t.is_neg(),
            )
            if isinstance(n, str) and isinstance(t, torch.Tensor) and not _is_dtensor(t)
            else None
            for n, t in items
        ]
        if (
            self._described is not None
            and self._key_dtype is self.dtype
            and len(key) == len(self._key)
            and all(
                a is not None and b is not None and a[1] is b[1] and a[0] == b[0] and a[2:] == b[2:]
                for a, b in zip(key, self._key, strict=True)
            )
        ):
            return self._described
        self._key, self._described = [], None
        entries = []
        src: dict[str, tuple[torch.Tensor, np.ndarray | None, torch.dtype]] = {}
        for name, tensor in items:
            if not isinstance(name, str) or not isinstance(tensor, torch.Tensor):
                raise SyncError(
                    f"push() takes (name: str, tensor) pairs; got ({name!r}, "
                    f"{type(tensor).__name__})"
                )
            if name in src:
                raise PlanError(
                    f"tensor name {name!r} appears twice in push(); names must be unique"
                )
            if _is_dtensor(tensor):
                local, offset, local_shape = _dtensor_box(name, tensor)
            else:
                local, offset, local_shape = tensor, (0,) * tensor.dim(), tuple(tensor.shape)
            local = local.detach()
            wire = resolve_dtype(self.dtype, name, tensor.dtype)
            entries.append(
                ShardEntry(name, dtype_name(wire), tuple(tensor.shape), offset, local_shape)
            )
            src[name] = (local, _byte_view(local, wire), wire)
        self._src = src
        self._described = SenderManifest(
            self.transport.rank, self.bucket_bytes, self.align, tuple(entries)
        ).to_json()
        self._key, self._key_dtype = key, self.dtype
        return self._described

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
                    pieces[(i, p.start)] = self._hash_piece(plan, p)
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
                    extents = self._pack(
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

    # ---- packing --------------------------------------------------------------------------

    def _source(
        self, plan: Plan, tensor: int
    ) -> tuple[torch.Tensor, np.ndarray | None, torch.dtype]:
        name = plan.tensors[tensor].name
        try:
            return self._src[name]
        except KeyError:
            raise PlanError(
                f"tensor {name!r} is planned on rank {self.transport.rank} but was "
                "not passed to push()"
            ) from None

    def _pack(
        self,
        plan: Plan,
        bk: Bucket,
        buf: torch.Tensor,
        pieces: dict[tuple[int, int], str],
        zero_copy: bool,
        progress: Callable[[int], None] | None = None,
        shared: bool = False,
    ) -> dict[int, torch.Tensor]:
        """Copy the bucket's pieces into ``buf`` and digest the ones not in ``pieces`` yet, chunk
        by chunk right after copying, while the chunk is still in cache. With ``zero_copy``,
        large pieces of plain CPU tensors are not copied: they are returned as extents (keyed by
        bucket offset) for the channel to send from the source. ``progress(n)`` is told every
        few MiB that ``buf[:n]`` is final (streaming channels verify while we pack).

        The digest is taken from this process's memory (the source chunk, or a private cast of
        it), never read back from ``buf``: with a ``shared`` buffer another process may write
        it between our copy and our hash, and the digest must name the bytes we meant to send so
        that receivers reject anything else."""
        dst = buf.numpy() if buf.device.type == "cpu" else None
        extents: dict[int, torch.Tensor] = {}
        for p in bk.pieces:
            local, raw, wire = self._source(plan, p.tensor)
            key = (p.tensor, p.start)
            size = wire.itemsize
            if raw is not None and zero_copy and p.nbytes >= plan.direct_bytes:
                src = raw[p.start * size : p.end * size]
                extents[p.bucket_offset] = torch.from_numpy(src)
                if key not in pieces:
                    pieces[key] = digest(src)
                continue
            h = None if key in pieces else xxhash.xxh3_128()
            end = p.bucket_offset + p.nbytes
            if raw is not None and dst is not None:
                src = raw[p.start * size : p.end * size]
                out = dst[p.bucket_offset : end]
                for c in range(0, p.nbytes, _CHUNK):
                    np.copyto(out[c : c + _CHUNK], src[c : c + _CHUNK])
                    if h is not None:  # the source chunk: just read, still in cache
                        h.update(src[c : c + _CHUNK])
                    if progress is not None and (c + _CHUNK) % _PROGRESS == 0:
                        progress(p.bucket_offset + min(c + _CHUNK, p.nbytes))
            elif shared:
                self._pack_cast(local, p, wire, buf, h)
            else:  # a private buffer (ours alone): cast straight into it, hash it there
                region = buf[p.bucket_offset : end]
                if p.nbytes:
                    region.view(wire).copy_(local.reshape(-1)[p.start : p.end])
                if h is not None:
                    h.update(region.cpu().numpy())
            if h is not None:
                pieces[key] = h.hexdigest()
            if progress is not None:
                progress(end)
        return extents

    @staticmethod
    def _pack_cast(
        local: torch.Tensor,
        p: Piece,
        wire: torch.dtype,
        buf: torch.Tensor,
        h: xxhash.xxh3_128 | None,
    ) -> None:
        """A piece that needs a cast or a gather, into a shared ``buf``: cast each chunk into
        private memory, hash it there, then copy it into ``buf`` (one extra cache-sized copy)."""
        flat = local.reshape(-1)
        step = max(1, _CHUNK // wire.itemsize)
        for start in range(p.start, p.end, step):
            stop = min(start + step, p.end)
            chunk = flat[start:stop].to(device="cpu", dtype=wire).contiguous().view(torch.uint8)
            if h is not None:
                h.update(chunk.numpy())
            lo = p.bucket_offset + (start - p.start) * wire.itemsize
            buf[lo : lo + chunk.numel()].copy_(chunk)

    def _hash_piece(self, plan: Plan, p: Piece) -> str:
        """Digest of a piece's wire bytes, computed from the source without packing it."""
        local, raw, wire = self._source(plan, p.tensor)
        if raw is not None:
            return digest(raw[p.start * wire.itemsize : p.end * wire.itemsize])
        h = xxhash.xxh3_128()
        flat = local.reshape(-1)
        step = max(1, _CHUNK // wire.itemsize)
        for start in range(p.start, p.end, step):
            chunk = flat[start : min(start + step, p.end)].to(device="cpu", dtype=wire)
            h.update(chunk.contiguous().view(torch.uint8).numpy())
        return h.hexdigest()

"""Sender side, the bytes: what this rank holds, and filling and hashing its buckets.

:class:`Packer` keeps what the last ``push`` passed: each tensor's part on this rank (a DTensor's
local shard, or the whole tensor), its wire dtype and, where the bytes can be read in place, a
zero-copy view of them, plus the :class:`~deltackpt.sync.sender_manifest.SenderManifest` that
describes them. It packs a bucket's pieces into a channel buffer, hashing each chunk right after
copying it (while it is still in cache), and hashes pieces without packing them for delta rounds.
The round protocol around it is ``sender.py``.

Digests are always taken from this process's memory (the source, or a private cast of it),
never read back from a channel buffer that other processes can write (``Channel.shared``), so
they name the bytes the trainer meant to send and receivers reject anything else.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import numpy as np
import torch
import xxhash

from deltackpt.format.dtensor import is_dtensor, local_box, local_tensor
from deltackpt.format.hashing import digest
from deltackpt.sync.errors import PlanError, SyncError
from deltackpt.sync.plan import Bucket, Piece, Plan
from deltackpt.sync.sender_manifest import (
    DtypeSpec,
    SenderManifest,
    ShardEntry,
    resolve_dtype,
    wire_name,
)
from deltackpt.sync.transport import Transport

__all__ = ["NamedTensors", "Packer"]

_CHUNK = 256 << 10  # copy+hash granularity: the chunk is still in L2 when it is hashed
_PROGRESS = 4 << 20  # streaming channels hear of packed bytes this often (a multiple of _CHUNK)

#: What ``push`` takes: ``(name, tensor)`` pairs or a mapping.
NamedTensors = Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor]
#: One tensor's part on this rank: (local tensor, zero-copy bytes or None, wire dtype).
_Source = tuple[torch.Tensor, np.ndarray | None, torch.dtype]


def _dtensor_box(
    name: str, t: torch.Tensor
) -> tuple[torch.Tensor, tuple[int, ...], tuple[int, ...]]:
    """(local shard, global offset, local shape) of a DTensor; sync sends Shard and Replicate
    placements only (a receiver places each box as one dense block)."""
    from torch.distributed.tensor import Replicate, Shard

    for p in t.placements:  # type: ignore[attr-defined]
        if not (isinstance(p, Replicate) or type(p) is Shard):
            raise PlanError(
                f"tensor {name!r} has placement {p}; sync sends Shard(dim) and "
                "Replicate() shards only. Reduce Partial placements first, e.g. "
                "t.redistribute(placements=[Replicate()] * mesh.ndim)"
            )
    local = local_tensor(t)
    offset, shape = local_box(t, name)
    if tuple(local.shape) != shape:
        raise PlanError(
            f"tensor {name!r}: local shard has shape {list(local.shape)} but its "
            f"placements {t.placements} imply {list(shape)}"  # type: ignore[attr-defined]
        )
    return local, offset, shape


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


class Packer:
    """This sender's tensors, between :meth:`describe` and the next one."""

    def __init__(self, transport: Transport) -> None:
        self.transport = transport
        self._src: dict[str, _Source] = {}
        self._key: list[tuple[Any, ...] | None] = []  # what describe saw last (see there)
        self._key_dtype: DtypeSpec = None
        self._described: bytes | None = None

    def describe(
        self, named_tensors: NamedTensors, dtype: DtypeSpec, bucket_bytes: int, align: int
    ) -> bytes:
        """Take the tensors of a push; return this rank's manifest (canonical JSON)."""
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
            if isinstance(n, str) and isinstance(t, torch.Tensor) and not is_dtensor(t)
            else None
            for n, t in items
        ]
        if (
            self._described is not None
            and self._key_dtype is dtype
            and len(key) == len(self._key)
            and all(
                a is not None and b is not None and a[1] is b[1] and a[0] == b[0] and a[2:] == b[2:]
                for a, b in zip(key, self._key, strict=True)
            )
        ):
            return self._described
        self._key, self._described = [], None
        entries = []
        src: dict[str, _Source] = {}
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
            if is_dtensor(tensor):
                local, offset, local_shape = _dtensor_box(name, tensor)
            else:
                local, offset, local_shape = tensor, (0,) * tensor.dim(), tuple(tensor.shape)
            local = local.detach()
            wire = resolve_dtype(dtype, name, tensor.dtype)
            entries.append(
                ShardEntry(name, wire_name(wire, name), tuple(tensor.shape), offset, local_shape)
            )
            src[name] = (local, _byte_view(local, wire), wire)
        self._src = src
        self._described = SenderManifest(
            self.transport.rank, bucket_bytes, align, tuple(entries)
        ).to_json()
        self._key, self._key_dtype = key, dtype
        return self._described

    def _source(self, plan: Plan, tensor: int) -> _Source:
        name = plan.tensors[tensor].name
        try:
            return self._src[name]
        except KeyError:
            raise PlanError(
                f"tensor {name!r} is planned on rank {self.transport.rank} but was "
                "not passed to push()"
            ) from None

    def pack(
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
                _pack_cast(local, p, wire, buf, h)
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

    def hash_piece(self, plan: Plan, p: Piece) -> str:
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

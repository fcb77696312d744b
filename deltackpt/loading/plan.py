"""Load step 1: a manifest entry and the region wanted of it -> chunk targets.

The one place that knows what a tensor entry of a manifest is: a whole tensor (``data``), a set of
saved blocks (``shards``, resharded through :mod:`deltackpt.loading.reshard`), or a view of a
shared storage (``storage``: tied weights); a value DCP stored as its ``torch.save`` bytes is a
whole uint8 tensor whose path :func:`deltackpt.format.dcp_values.byte_value_paths` lists.
:func:`read_entry` is the branch on those kinds; :class:`Reads` collects the chunk targets of one
read pass (a chunk wanted by several tensors is read once), then runs them through
:func:`deltackpt.store.chunks.run_jobs` (step 2: pread, decode, verify) and copies resharded
rows into place.

Its callers are :mod:`deltackpt.loading.assemble` (new tensors, or ``into=`` tensors) and
:mod:`deltackpt.dcp.reader` (DCP read items). A tensor returned by this module holds its bytes
only after :meth:`Reads.run`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from deltackpt.format.dtensor import is_dtensor, local_box, local_tensor
from deltackpt.format.dtypes import dtype_from_name
from deltackpt.format.manifest import Manifest, Slice, TensorEntry
from deltackpt.loading.reshard import (
    Alloc,
    Box,
    PieceRead,
    finish_box_reads,
    plan_box_reads,
    sub_slices,
)
from deltackpt.store.chunks import ChunkTargets, advise_huge, fresh_u8, run_jobs
from deltackpt.store.packs import PackReaders


def np_bytes(t: torch.Tensor) -> np.ndarray:
    """The bytes of a contiguous uint8 CPU tensor as an array a read can fill."""
    return t.numpy() if t.numel() else np.empty(0, dtype=np.uint8)


def typed(u8: torch.Tensor, e: TensorEntry) -> torch.Tensor:
    """The bytes of a whole tensor entry, viewed with its dtype and shape."""
    dtype = dtype_from_name(e.dtype)
    if u8.numel() == 0:
        return torch.empty(e.shape, dtype=dtype)
    return u8.view(dtype).reshape(e.shape)


def storage_view(e: TensorEntry, buf: torch.Tensor) -> torch.Tensor:
    """Entry ``e`` (a view of a shared storage) as a view of ``buf``, that storage's bytes."""
    assert e.storage is not None
    dtype = dtype_from_name(e.dtype)
    return torch.empty(0, dtype=dtype).set_(
        buf.untyped_storage(),
        (buf.storage_offset() + e.storage.offset) // dtype.itemsize,
        e.shape,
        e.storage.stride,
    )


def plain_cpu(t: torch.Tensor) -> bool:
    """A CPU tensor whose memory holds its values as they are (no DTensor, meta, conj or neg)."""
    return (
        isinstance(t, torch.Tensor)
        and not is_dtensor(t)
        and t.device.type == "cpu"
        and not t.is_meta
        and not t.is_conj()
        and not t.is_neg()
    )


def same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """``b`` is exactly the tensor view ``a`` (same bytes, shape, strides, dtype): copying ``a``
    into it would be a no-op."""
    return (
        plain_cpu(b)
        and a.dtype == b.dtype
        and a.shape == b.shape
        and a.stride() == b.stride()
        and a.data_ptr() == b.data_ptr()
    )


def copy_into(dst: torch.Tensor, t: torch.Tensor, path: str) -> None:
    """Copy a whole tensor ``t`` into ``dst``: a DTensor takes only its own box of it."""
    if is_dtensor(dst):  # saved as one shared storage: copy this rank's part
        offsets, shape = local_box(dst, path)
        for d, (o, n) in enumerate(zip(offsets, shape, strict=True)):
            t = t.narrow(d, o, n)
        local_tensor(dst).copy_(t)
    else:
        dst.copy_(t)


def _takes_bytes(dst: torch.Tensor) -> bool:
    """A target a whole entry's bytes can be read into in place."""
    return (
        dst.device.type == "cpu"
        and dst.is_contiguous()
        and dst.numel() > 0
        and not dst.is_conj()
        and not dst.is_neg()
    )


@dataclass
class Reads:
    """The chunk targets of one read pass over manifest ``m``.

    ``homes`` (set before planning) names, per shared storage id, a target that receives that
    storage's bytes in place instead of a fresh buffer."""

    m: Manifest
    homes: dict[int, torch.Tensor] = field(default_factory=dict)
    jobs: dict[str, ChunkTargets] = field(default_factory=dict)
    storages: dict[int, torch.Tensor] = field(default_factory=dict)
    pieces: list[tuple[list[PieceRead], torch.dtype]] = field(default_factory=list)

    def want(self, path: str, slices: tuple[Slice, ...], dst: np.ndarray) -> None:
        """Read the bytes ``slices`` describe (of the tensor at ``path``) into ``dst``."""
        pos = 0
        for d, start, length in slices:
            job = self.jobs.get(d)
            if job is None:
                job = self.jobs[d] = ChunkTargets(d, where=f"snapshot {self.m.name!r} key {path!r}")
            job.targets.append((start, length, dst[pos : pos + length]))
            pos += length

    def fresh(self, path: str, slices: tuple[Slice, ...]) -> torch.Tensor:
        """A new uint8 tensor that will hold the bytes ``slices`` describe."""
        u8 = fresh_u8(sum(n for _, _, n in slices))
        self.want(path, slices, np_bytes(u8))
        return u8

    def storage(self, sid: int, path: str) -> torch.Tensor:
        """The bytes of shared storage ``sid``, read once per pass (into its home if it has
        one); ``path`` names it in error messages."""
        buf = self.storages.get(sid)
        if buf is None:
            n, data = self.m.storages[sid]
            home = self.homes.get(sid)
            buf = fresh_u8(n) if home is None else home.detach().reshape(-1).view(torch.uint8)
            self.want(path, data, np_bytes(buf))
            self.storages[sid] = buf
        return buf

    def box(
        self, e: TensorEntry, target: torch.Tensor, box: Box, alloc: Alloc | None = None
    ) -> None:
        """Fill ``target`` (box ``box`` of the global tensor) from the saved pieces of ``e``
        (buffers for covering rows from ``alloc``, default new memory)."""
        reads = plan_box_reads(e, target, box, alloc)
        for r in reads:
            self.want(e.path, r.slices, r.buf)
        self.pieces.append((reads, target.dtype))

    def span(self, path: str, data: tuple[Slice, ...], start: int, stop: int) -> torch.Tensor:
        """Bytes [start, stop) of a saved block whose bytes ``data`` describes."""
        buf = torch.empty(stop - start, dtype=torch.uint8)
        self.want(path, sub_slices(data, start, stop), np_bytes(buf))
        return buf

    def run(self, packs: PackReaders, verify: bool, threads: int, name: str) -> None:
        """Read, decode and verify every chunk wanted, then copy resharded rows into place."""
        run_jobs(packs, self.m.chunks, list(self.jobs.values()), verify, threads, name)
        for reads, dtype in self.pieces:
            finish_box_reads(reads, dtype)


def read_entry(r: Reads, e: TensorEntry, dst: torch.Tensor | None = None) -> torch.Tensor:
    """Plan the reads of entry ``e`` and return the tensor that holds its value once ``r`` ran.

    Without ``dst`` that is a new CPU tensor (or a view of a shared storage's new buffer). With
    ``dst`` (a tensor of the same shape and dtype) the bytes go into ``dst`` itself when they can
    (then ``dst`` is returned): a DTensor gets only its own shard, a contiguous CPU tensor takes a
    whole tensor in place; otherwise the caller copies the returned tensor into ``dst``."""
    if e.storage is not None:  # a view of a shared storage
        view = storage_view(e, r.storage(e.storage.id, e.path))
        return dst if dst is not None and same_memory(view, dst) else view
    if dst is not None and is_dtensor(dst):  # only the saved rows overlapping this rank's shard
        r.box(e, local_tensor(dst), local_box(dst, e.path))
        return dst
    if e.shards is not None:  # saved blocks, assembled into one new tensor
        full = advise_huge(torch.empty(e.shape, dtype=dtype_from_name(e.dtype)))
        r.box(e, full, ((0,) * len(e.shape), e.shape))
        return full
    assert e.data is not None  # a whole tensor (validated: exactly one kind is set)
    if dst is not None and _takes_bytes(dst):
        r.want(e.path, e.data, np_bytes(dst.detach().reshape(-1).view(torch.uint8)))
        return dst
    return typed(r.fresh(e.path, e.data), e)

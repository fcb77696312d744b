"""Load step 2 for targets in device memory (CUDA): chunks read into reused pinned host buckets,
each bucket copied to its tensors on a side stream while the next one is read.

    pack the targets' chunk slices into buckets of about BUCKET bytes (a large tensor spans
    several; a chunk is never split between two, so none is read twice)
    per bucket, in two host buffers taken in turn:
        wait until the buffer's previous copies have landed (its events)
        read, decode and verify the bucket's chunks into it (store/chunks.run_jobs, the load's
        threads)
        queue its host-to-device copies (non-blocking, side stream: deltackpt/cuda.py)
    wait for the last copies

Host memory: two buckets (pinned, kept by torch's pinned-memory cache for the next load)
instead of a pageable host copy of the whole state, and no pageable host-to-device copy.

Which targets (:func:`takes`): whole-tensor entries (``data``) whose target is a plain contiguous
device tensor of the saved dtype and shape. The others (DTensor shards, views of shared
storages, non-contiguous targets, casts) go the general way (loading/assemble.py). On CPU the
same code runs with ordinary buffers and synchronous copies where ``DELTACKPT_DEVICE_SCAN=always``
forces the device paths, which is how the CPU test suite covers it.

As for every ``load(into=)``, a failed load may leave the targets partly written (a CPU target
is read into in place too); the error names the chunk and key.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import torch

from deltackpt.cuda import DeviceCopies, host_buffer, is_device
from deltackpt.format.dtensor import is_dtensor, local_box, local_tensor
from deltackpt.format.dtypes import dtype_from_name
from deltackpt.format.manifest import Manifest, Slice, TensorEntry
from deltackpt.loading.plan import Reads, np_bytes
from deltackpt.loading.reshard import Box, entry_shards, sub_slices
from deltackpt.store.packs import PackReaders

__all__ = [
    "BUCKET",
    "Ring",
    "box_entry",
    "copy_through",
    "device_items",
    "move_tensors",
    "read_to_device",
    "takes",
]

BUCKET = 64 << 20  # bytes a host buffer holds (chunks are 4 MiB by default: 16 a bucket)


def takes(e: TensorEntry, dst: torch.Tensor, forced: bool) -> bool:
    """Entry ``e`` goes to ``dst`` through the device pipeline: ``dst`` is on the device (or
    ``forced``, the CPU stand-in) and takes the saved bytes as they are."""
    return (
        e.data is not None
        and (is_device(dst) or (forced and dst.device.type == "cpu"))
        and not is_dtensor(dst)
        and dst.is_contiguous()
        and dst.numel() > 0
        and not dst.is_conj()
        and not dst.is_neg()
        and dst.dtype == dtype_from_name(e.dtype)
        and tuple(dst.shape) == tuple(e.shape)
    )


def box_entry(e: TensorEntry, box: Box) -> TensorEntry | None:
    """The part of ``e`` a DTensor's local ``box`` holds, as an entry of its own whose ``data``
    is the box's saved bytes in C order, where the box is whole leading rows (``Shard(0)``,
    ``Replicate``: every other dimension whole) and the saved pieces it overlaps are whole rows
    too (a tensor saved whole, or by ``Shard(0)`` ranks, whatever their number); else None (the
    general way: loading/reshard.py)."""
    off, shape = box
    if not e.shape or e.storage is not None or len(shape) != len(e.shape):
        return None
    if tuple(shape[1:]) != tuple(e.shape[1:]) or any(off[1:]):
        return None
    rb = math.prod(e.shape[1:]) * dtype_from_name(e.dtype).itemsize
    r0, r1 = off[0], off[0] + shape[0]
    out: list[Slice] = []
    covered = r0
    for sh in sorted(entry_shards(e), key=lambda s: s.offsets[0]):
        if tuple(sh.shape[1:]) != tuple(e.shape[1:]) or any(sh.offsets[1:]):
            return None  # a piece of some columns only
        a, b = max(r0, sh.offsets[0]), min(r1, sh.offsets[0] + sh.shape[0])
        if a >= b:
            continue
        if a != covered:  # a gap, or pieces that overlap
            return None
        out.extend(sub_slices(sh.data, (a - sh.offsets[0]) * rb, (b - sh.offsets[0]) * rb))
        covered = b
    if covered != r1:
        return None
    return replace(e, shape=tuple(shape), data=tuple(out), shards=None)


def device_items(
    m: Manifest, wanted: list[int], targets: dict[str, torch.Tensor], forced: bool
) -> list[tuple[int, TensorEntry, torch.Tensor]]:
    """The wanted entries of ``m`` (indices) whose targets go through :func:`read_to_device`,
    as (index, entry, destination): a target that :func:`takes` its entry, or a DTensor whose
    local tensor takes the part of the entry its box holds (:func:`box_entry`: FSDP2's
    ``Shard(0)`` parameters and their optimizer moments)."""
    out: list[tuple[int, TensorEntry, torch.Tensor]] = []
    for i in wanted:
        e = m.tensors[i]
        t = targets.get(e.path)
        if t is None:
            continue
        if takes(e, t, forced):
            out.append((i, e, t))
        elif is_dtensor(t):
            sub = box_entry(e, local_box(t, e.path))
            lt = local_tensor(t)
            if sub is not None and takes(sub, lt, forced):
                out.append((i, sub, lt))
    return out


@dataclass
class _Span:
    """Bytes [start, start + n) of one target, at ``offset`` in its bucket."""

    path: str
    dst: torch.Tensor  # the target's bytes, flat uint8
    start: int
    offset: int
    slices: list[Slice] = field(default_factory=list)
    n: int = 0


@dataclass
class _Bucket:
    spans: list[_Span] = field(default_factory=list)
    nbytes: int = 0


def _buckets(items: list[tuple[TensorEntry, torch.Tensor]], size: int) -> list[_Bucket]:
    out: list[_Bucket] = []
    cur = _Bucket()
    for e, dst in items:
        assert e.data is not None  # takes() checked it
        u8 = dst.detach().reshape(-1).view(torch.uint8)
        pos = 0
        span: _Span | None = None
        for sl in e.data:
            n = sl[2]
            if cur.nbytes and cur.nbytes + n > size:
                out.append(cur)
                cur, span = _Bucket(), None
            if span is None:
                span = _Span(e.path, u8, pos, cur.nbytes)
                cur.spans.append(span)
            span.slices.append(sl)
            span.n += n
            cur.nbytes += n
            pos += n
    if cur.nbytes:
        out.append(cur)
    return out


class Ring:
    """Two reused host buffers of ``cap`` bytes (pinned where ``on_device``) that ``batches``
    batches are staged in, in turn, each copied to the device from there on a side stream while
    the next is staged (``cuda.DeviceCopies``): :meth:`take` hands out batch ``i``'s buffer once
    its earlier copies have landed, :meth:`copy` queues a copy out of it, :meth:`done` marks its
    last; leaving the ``with`` block waits for every copy (also on failure), so no buffer is
    dropped with copies out of it in flight. Loads into device tensors and the DCP reader's."""

    def __init__(self, batches: int, cap: int, on_device: bool) -> None:
        self._bufs = [host_buffer(cap, on_device) for _ in range(min(2, batches))]
        self._copies = DeviceCopies()

    def __enter__(self) -> Ring:
        return self

    def __exit__(self, *exc: object) -> None:
        self._copies.wait()

    def take(self, i: int) -> torch.Tensor:
        slot = i % len(self._bufs)
        self._copies.reusable(slot)
        return self._bufs[slot]

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        self._copies.copy(dst, src)

    def done(self, i: int) -> None:
        self._copies.release(i % len(self._bufs))


def copy_through(pairs: list[tuple[torch.Tensor, torch.Tensor]], cap: int | None = None) -> None:
    """``dst.copy_(src)`` for each ``(dst, src)`` of ``pairs`` (``src`` in ordinary host
    memory, any strides; ``dst`` on a device, any strides) through a :class:`Ring` of two
    reused buffers of at most ``cap`` bytes (:data:`BUCKET`; no larger than the pairs need),
    pinned for a device: each ``src`` staged into a buffer (64-byte aligned, several to a
    buffer), copied to the device from there on a side stream while the next buffer is filled;
    a pair larger than a buffer goes in blocks of rows (of bytes, for flat ones), a row larger
    than one directly. Landed when this returns. Not pinned memory per tensor (pinning runs at
    ~2.5 GB/s, and the pinned blocks stay cached at up to twice their size), nor a blocking
    copy from pageable memory per tensor (~1.3 GB/s). On CPU (the stand-in) plain copies."""
    cap = BUCKET if cap is None else cap
    cuts: list[tuple[torch.Tensor, torch.Tensor]] = []
    for dst, src in pairs:
        n = src.numel() * src.element_size()
        if n <= cap:
            cuts += [(dst, src)] if n else []
            continue
        step = cap // (n // src.shape[0]) if src.dim() else 0
        if step:
            cuts += [(dst[a : a + step], src[a : a + step]) for a in range(0, src.shape[0], step)]
        else:
            dst.copy_(src)
    batches: list[list[tuple[torch.Tensor, torch.Tensor, int]]] = []  # (dst, src, offset)
    used, most = cap, 0
    for dst, src in cuts:
        n = src.numel() * src.element_size()
        if used + n > cap:
            batches.append([])
            used = 0
        batches[-1].append((dst, src, used))
        used += -(-n // 64) * 64  # the next one starts aligned
        most = max(most, used)
    if not batches:
        return
    with Ring(len(batches), min(most, cap), any(is_device(d) for d, _ in cuts)) as ring:
        for i, batch in enumerate(batches):
            buf = ring.take(i)
            for dst, src, at in batch:
                n = src.numel() * src.element_size()
                staged = buf[at : at + n].view(src.dtype).view(src.shape)
                staged.copy_(src)  # a host copy (src may be strided)
                ring.copy(dst, staged)
            ring.done(i)


def read_to_device(
    packs: PackReaders,
    m: Manifest,
    items: list[tuple[TensorEntry, torch.Tensor]],
    verify: bool,
    threads: int,
    bucket: int | None = None,
) -> int:
    """Fill every target of ``items`` (entries of ``m`` that :func:`takes`) from the store;
    returns the number of chunk reads. Errors are those of a read pass (a
    :class:`~deltackpt.errors.CorruptChunkError` naming the chunk and key), raised once the
    copies already queued have landed."""
    buckets = _buckets(items, BUCKET if bucket is None else bucket)
    if not buckets:
        return 0
    on_device = any(is_device(dst) for _, dst in items)
    jobs = 0
    with Ring(len(buckets), max(b.nbytes for b in buckets), on_device) as ring:
        for i, b in enumerate(buckets):
            host = ring.take(i)
            r = Reads(m)
            for s in b.spans:
                r.want(s.path, tuple(s.slices), np_bytes(host[s.offset : s.offset + s.n]))
            r.run(packs, verify, threads, "deltackpt-load")
            jobs += len(r.jobs)
            for s in b.spans:
                ring.copy(s.dst[s.start : s.start + s.n], host[s.offset : s.offset + s.n])
            ring.done(i)
    return jobs


def move_tensors(tensors: dict[int, torch.Tensor], device: torch.device) -> dict[int, torch.Tensor]:
    """``tensors`` on ``device``, each storage moved once: views that shared a storage on the
    host share one there (tied weights stay tied, as ``torch.load(map_location=)`` keeps them).
    Tensors already on ``device`` are left as they are."""
    moved: dict[int, torch.Tensor] = {}  # host storage address -> its bytes on the device
    out: dict[int, torch.Tensor] = {}
    for i, t in tensors.items():
        if t.device == device:
            out[i] = t
            continue
        st = t.untyped_storage()
        base = moved.get(st.data_ptr())
        if base is None:
            raw = torch.empty(0, dtype=torch.uint8, device=t.device).set_(st)
            base = moved[st.data_ptr()] = raw.to(device)
        view = torch.empty(0, dtype=t.dtype, device=device)
        view.set_(base.untyped_storage(), t.storage_offset(), t.shape, t.stride())
        out[i] = view
    return out

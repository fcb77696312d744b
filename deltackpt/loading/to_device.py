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

from dataclasses import dataclass, field

import torch

from deltackpt.cuda import DeviceCopies, host_buffer, is_device
from deltackpt.format.dtensor import is_dtensor
from deltackpt.format.dtypes import dtype_from_name
from deltackpt.format.manifest import Manifest, Slice, TensorEntry
from deltackpt.loading.plan import Reads, np_bytes
from deltackpt.store.packs import PackReaders

__all__ = ["BUCKET", "move_tensors", "read_to_device", "takes"]

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
    cap = max(b.nbytes for b in buckets)
    bufs = [host_buffer(cap, on_device) for _ in range(min(2, len(buckets)))]
    copies = DeviceCopies()
    jobs = 0
    try:
        for i, b in enumerate(buckets):
            slot = i % len(bufs)
            copies.reusable(slot)
            host = bufs[slot]
            r = Reads(m)
            for s in b.spans:
                r.want(s.path, tuple(s.slices), np_bytes(host[s.offset : s.offset + s.n]))
            r.run(packs, verify, threads, "deltackpt-load")
            jobs += len(r.jobs)
            for s in b.spans:
                copies.copy(s.dst[s.start : s.start + s.n], host[s.offset : s.offset + s.n])
            copies.release(slot)
    finally:
        copies.wait()  # never drop a host buffer with copies out of it in flight
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

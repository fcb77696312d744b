"""Receiver side, the tensors: turn verified buckets into ``(name, tensor)`` pairs.

:class:`Assembler` hands out a whole tensor as a view of its bucket, assembles a tensor split
over several buckets or sharded over several senders in a buffer kept across rounds (their total
size) and hands it out once its last piece arrived, and casts to the receiver's ``dtype``. The
round protocol that feeds it verified buckets is ``receiver.py``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from deltackpt.sync.plan import Bucket, Piece, Plan
from deltackpt.sync.sender_manifest import DtypeSpec, resolve_dtype, wire_dtype

__all__ = ["Assembler"]


class Assembler:
    """Turns a received bucket into ``(name, tensor)`` pairs: views of whole tensors, assembled
    tensors once their last piece arrived, cast to the requested dtype."""

    def __init__(self, plan: Plan, dtype: DtypeSpec) -> None:
        self.plan = plan
        self.wire = [wire_dtype(t.dtype) for t in plan.tensors]
        self.target = [
            resolve_dtype(dtype, t.name, w) for t, w in zip(plan.tensors, self.wire, strict=True)
        ]
        self.full: dict[int, torch.Tensor] = {}  # assembly buffers, kept across rounds
        self.shard: dict[tuple[int, int], torch.Tensor] = {}  # non-contiguous split boxes
        self.missing: dict[int, int] = {}  # elements still to come, this round
        self.scratch = torch.empty(0, dtype=torch.uint8)
        self.spans: dict[int, torch.Tensor] = {}  # split tensors staged contiguously, this round

    def start_round(self) -> None:
        self.missing.clear()
        self.shard.clear()
        self.spans.clear()

    def link(self, staged: Sequence[tuple[Bucket, torch.Tensor]]) -> None:
        """A round is staged whole (on_commit): a tensor of one sender split over consecutive
        buckets usually lies contiguously in the staging memory (each split piece fills its
        bucket, and bucket sizes are multiples of ``align``). Such tensors are handed over as one
        view of the staging, without being assembled (copied) into a buffer."""
        found: dict[int, list[tuple[Piece, torch.Tensor]]] = {}
        for bk, view in staged:
            for p in bk.pieces:
                if not p.whole and self.plan.tensors[p.tensor].num_parts == 1:
                    found.setdefault(p.tensor, []).append((p, view))
        for i, parts in found.items():
            info = self.plan.tensors[i]
            size = self.wire[i].itemsize
            p0, v0 = parts[0]
            base = v0.data_ptr() + p0.bucket_offset
            if (
                p0.start != 0
                or parts[-1][0].end != math.prod(info.shape)
                or any(
                    v.data_ptr() + p.bucket_offset != base + p.start * size
                    or v.untyped_storage().data_ptr() != v0.untyped_storage().data_ptr()
                    for p, v in parts
                )
            ):
                continue
            span = torch.empty(0, dtype=torch.uint8, device=v0.device).set_(
                v0.untyped_storage(),
                v0.storage_offset() + p0.bucket_offset,
                (math.prod(info.shape) * size,),
            )
            self.spans[i] = span.view(self.wire[i]).view(info.shape)

    def emit(self, bucket: Bucket, view: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        out: list[tuple[str, torch.Tensor]] = []
        casts: list[int] = []  # positions in out of whole-tensor views that need a cast
        for p in bucket.pieces:
            info = self.plan.tensors[p.tensor]
            span = self.spans.get(p.tensor)
            if span is not None:  # a contiguous staged span (see link): out with its last piece
                if p.end == span.numel():
                    if self.target[p.tensor] != self.wire[p.tensor]:
                        casts.append(len(out))
                    out.append((info.name, span))
                continue
            src = view[p.bucket_offset : p.bucket_offset + p.nbytes].view(self.wire[p.tensor])
            if p.whole:
                if self.target[p.tensor] != self.wire[p.tensor]:
                    casts.append(len(out))
                out.append((info.name, src.view(info.shape)))
                continue
            full = self.full.get(p.tensor)
            if full is None:
                full = self.full[p.tensor] = torch.empty(info.shape, dtype=self.target[p.tensor])
            self._place(full, p, src)
            left = self.missing.get(p.tensor, math.prod(info.shape)) - p.count
            self.missing[p.tensor] = left
            if left == 0:
                out.append((info.name, full))
        if casts:
            self._cast(bucket, out, casts)
        return out

    def _place(self, full: torch.Tensor, p: Piece, src: torch.Tensor) -> None:
        region = full[tuple(slice(o, o + n) for o, n in zip(p.offset, p.local_shape, strict=True))]
        numel = math.prod(p.local_shape)
        if p.start == 0 and p.count == numel:
            region.copy_(src.view(p.local_shape))
        elif region.is_contiguous():
            region.reshape(-1)[p.start : p.end].copy_(src)
        else:  # a split piece of a strided box: collect the box, then copy it in
            key = (p.tensor, p.owner)
            box = self.shard.get(key)
            if box is None:
                box = self.shard[key] = torch.empty(p.local_shape, dtype=full.dtype)
            box.view(-1)[p.start : p.end].copy_(src)
            if p.end == numel:
                region.copy_(box)
                del self.shard[key]

    def _cast(self, bucket: Bucket, out: list[tuple[str, torch.Tensor]], casts: list[int]) -> None:
        """Cast whole-tensor views into one scratch buffer reused by every call."""
        dtypes = {self.plan.tensors[p.tensor].name: self.target[p.tensor] for p in bucket.pieces}
        sizes = [-(-out[i][1].numel() * dtypes[out[i][0]].itemsize // 64) * 64 for i in casts]
        if sum(sizes) > self.scratch.numel():
            self.scratch = torch.empty(sum(sizes), dtype=torch.uint8)
        pos = 0
        for i, size in zip(casts, sizes, strict=True):
            name, t = out[i]
            dt = dtypes[name]
            dst = self.scratch[pos : pos + t.numel() * dt.itemsize].view(dt).view(t.shape)
            dst.copy_(t)
            out[i] = (name, dst)
            pos += size

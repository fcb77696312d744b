"""Load step 1, for saved shards: fill any box of a global tensor from the saved pieces that
overlap it (used by :mod:`deltackpt.loading.plan`).

A saved shard is the C-order bytes of a sub-block of the global tensor. For a target box, each
overlapping shard contributes the rows (along dim 0 of the shard) that the box touches: one
contiguous byte range, so a rank reads only the chunks covering those rows. The rows are then
narrowed along the other dims and copied into the target. Shard(0) targets therefore read exactly
their bytes; other layouts read the covering rows (at most one chunk of slack per shard per side).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from deltackpt.format.dtypes import dtype_from_name
from deltackpt.format.manifest import Shard, Slice, TensorEntry

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, shape) in the global tensor
Alloc = Callable[[int], np.ndarray]  # n -> a uint8 buffer of n bytes (for covering rows)


def entry_shards(e: TensorEntry) -> tuple[Shard, ...]:
    """The saved pieces of ``e``: its shards, or one piece covering the whole tensor."""
    if e.shards is not None:
        return e.shards
    if e.data is not None:
        return (Shard((0,) * len(e.shape), e.shape, e.data),)
    return ()


def intersect(a: Box, b: Box) -> Box | None:
    lo = tuple(max(x, y) for x, y in zip(a[0], b[0], strict=True))
    hi = tuple(min(x + n, y + m) for x, n, y, m in zip(a[0], a[1], b[0], b[1], strict=True))
    if any(h <= lo_ for lo_, h in zip(lo, hi, strict=True)):
        return None
    return lo, tuple(h - lo_ for lo_, h in zip(lo, hi, strict=True))


def sub_slices(slices: tuple[Slice, ...], start: int, stop: int) -> tuple[Slice, ...]:
    """The slices covering bytes [start, stop) of the concatenation of ``slices``."""
    out: list[Slice] = []
    pos = 0
    for d, s, n in slices:
        a, b = max(start, pos), min(stop, pos + n)
        if a < b:
            out.append((d, s + a - pos, b - a))
        pos += n
        if pos >= stop:
            break
    return tuple(out)


@dataclass
class PieceRead:
    """Bytes to read for one (saved shard, target box) overlap, and where they go."""

    path: str
    slices: tuple[Slice, ...]
    buf: np.ndarray  # receives the covering rows
    rows_shape: tuple[int, ...]  # the covering rows as a tensor shape
    narrow: tuple[tuple[int, int], ...]  # (start, length) per dim within the covering rows
    dest: torch.Tensor  # region of the target to copy into (same shape as the narrowed rows)
    in_place: bool = False  # buf is dest's own memory: nothing to copy


def plan_box_reads(
    e: TensorEntry, target: torch.Tensor, box: Box, alloc: Alloc | None = None
) -> list[PieceRead]:
    """Reads that fill ``target`` (shaped like ``box``) from the saved pieces of ``e``; the
    covering rows that need a buffer get one from ``alloc`` (default: new memory)."""
    dtype = dtype_from_name(e.dtype)
    itemsize = torch.empty(0, dtype=dtype).element_size()
    reads = []
    for sh in entry_shards(e):
        ov = intersect((sh.offsets, sh.shape), box)
        if ov is None:
            if len(box[1]) == 0:  # 0-d tensor: the single piece covers it
                ov = ((), ())
            else:
                continue
        lo, size = ov
        if len(sh.shape) == 0:
            start, stop, rows_shape = 0, itemsize, ()
            narrow: tuple[tuple[int, int], ...] = ()
        else:
            row_bytes = math.prod(sh.shape[1:]) * itemsize
            r0 = lo[0] - sh.offsets[0]
            start, stop = r0 * row_bytes, (r0 + size[0]) * row_bytes
            rows_shape = (size[0], *sh.shape[1:])
            narrow = (
                (0, size[0]),
                *((lo[d] - sh.offsets[d], size[d]) for d in range(1, len(size))),
            )
        dest = target
        for d, (o, n) in enumerate(zip(lo, size, strict=True)):
            dest = dest.narrow(d, o - box[0][d], n)
        in_place = _whole_rows(narrow, rows_shape, dest, dtype)  # rows land where they belong
        if in_place:
            buf = dest.detach().reshape(-1).view(torch.uint8).numpy()
        else:
            buf = np.empty(stop - start, dtype=np.uint8) if alloc is None else alloc(stop - start)
        reads.append(PieceRead(e.path, sub_slices(sh.data, start, stop), buf, rows_shape,
                               narrow, dest, in_place))  # fmt: skip
    return reads


def _whole_rows(
    narrow: tuple[tuple[int, int], ...],
    rows_shape: tuple[int, ...],
    dest: torch.Tensor,
    dtype: torch.dtype,
) -> bool:
    """The covering rows are ``dest`` itself (whole rows, a dense host region of the target's
    dtype), so they are read straight into it: no buffer, no copy."""
    return (
        len(narrow) > 0
        and all(o == 0 and n == full for (o, n), full in zip(narrow, rows_shape, strict=True))
        and dest.device.type == "cpu"
        and dest.dtype == dtype
        and dest.is_contiguous()
        and type(dest) is torch.Tensor
        and dest.numel() > 0
    )


def finish_box_reads(reads: list[PieceRead], dtype: torch.dtype) -> None:
    """After the bytes arrived: copy each piece's narrowed rows into its target region."""
    for r in reads:
        if r.buf.size == 0 or r.in_place:
            continue
        rows = torch.from_numpy(r.buf).view(dtype).reshape(r.rows_shape)
        for d, (o, n) in enumerate(r.narrow):
            rows = rows.narrow(d, o, n)
        with torch.no_grad():
            r.dest.copy_(rows)

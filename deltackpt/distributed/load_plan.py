"""The plan of a ``load(mode="broadcast")`` (:mod:`deltackpt.distributed.load`): which bytes travel in
which bucket. Rank 0 of the group builds it from the manifest and sends it to every rank in one
collective; every rank then knows, for each bucket, which rows of which tensor (or which bytes of
a shared storage) lie where, and copies out the parts its own targets hold.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from deltackpt.format.dtypes import dtype_from_name
from deltackpt.format.manifest import Manifest, Slice, TensorEntry
from deltackpt.loading.select import Select, prune_tree

ALIGN = 64  # piece offsets in a bucket: any dtype can view its bytes


@dataclass(frozen=True)
class Piece:
    """Part of a bucket: rows [start, start+count) of tensor entry ``index`` (``rows``), or
    bytes [start, start+count) of shared storage ``index`` (``storage``)."""

    kind: str
    index: int
    start: int
    count: int
    offset: int  # in the bucket
    nbytes: int


@dataclass
class Plan:
    """What rank 0 sends every rank in one collective."""

    manifest: Manifest  # without its chunk index (only the reading rank reads)
    tree: Any  # the manifest tree cut down to the selected keys
    wanted: list[int]  # tensor entries loaded
    buckets: list[list[Piece]]
    sizes: list[int]  # bytes of each bucket


def rows_of(e: TensorEntry) -> tuple[int, int]:
    """(rows, bytes per row) of entry ``e``; a 0-d tensor is one row."""
    isz = dtype_from_name(e.dtype).itemsize
    if not e.shape:
        return 1, isz
    return e.shape[0], math.prod(e.shape[1:]) * isz


def rows_shape(e: TensorEntry, count: int) -> tuple[int, ...]:
    return (count, *e.shape[1:]) if e.shape else ()


def make_plan(m: Manifest, select: Select | None, bucket_bytes: int) -> Plan:
    """Cut the selected entries into pieces and pack them into buckets of ``bucket_bytes``
    (a single row larger than that gets a bucket of its own)."""
    tree, kept = (
        (m.tree, set(range(len(m.tensors)))) if select is None else prune_tree(m.tree, select)
    )
    wanted = sorted(kept)
    buckets: list[list[Piece]] = [[]]
    sizes = [0]

    def room() -> int:
        return bucket_bytes - -(-sizes[-1] // ALIGN) * ALIGN

    def add(kind: str, index: int, start: int, count: int, unit: int) -> None:
        off = -(-sizes[-1] // ALIGN) * ALIGN
        buckets[-1].append(Piece(kind, index, start, count, off, count * unit))
        sizes[-1] = off + count * unit

    def cut(kind: str, index: int, total: int, unit: int) -> None:
        """Rows (or bytes) [0, total) in pieces filling the buckets (a chunk cut by a bucket's
        end is still read once: see ``BroadcastLoad._read_bucket``)."""
        done = 0
        while done < total:
            if room() < unit and buckets[-1]:
                buckets.append([])
                sizes.append(0)
            n = min(total - done, max(1, room() // unit))
            add(kind, index, done, n, unit)
            done += n

    sids: set[int] = set()
    for i in wanted:
        e = m.tensors[i]
        if e.storage is not None:
            sids.add(e.storage.id)
        elif math.prod(e.shape) > 0:
            cut("rows", i, *rows_of(e))
    for sid in sorted(sids):
        cut("storage", sid, m.storages[sid][0], 1)
    if not buckets[-1]:
        buckets.pop()
        sizes.pop()
    return Plan(dataclasses.replace(m, chunks={}), tree, wanted, buckets, sizes)


def row_data(e: TensorEntry) -> tuple[Slice, ...] | None:
    """The entry's bytes in C order as one sequence of slices when its saved pieces are whole
    rows (a whole tensor; shards split along dim 0 only, such as a replicated or ``Shard(0)``
    save): then any rows are one byte range of it. None otherwise."""
    if e.data is not None:
        return e.data
    shards = sorted(e.shards or (), key=lambda sh: sh.offsets)
    pos = 0
    for sh in shards:
        if not e.shape:
            return sh.data if len(shards) == 1 else None
        if sh.offsets[0] != pos or any(sh.offsets[1:]) or sh.shape[1:] != e.shape[1:]:
            return None
        pos += sh.shape[0]
    if not e.shape or pos != e.shape[0]:
        return None
    return tuple(s for sh in shards for s in sh.data)

"""Bucket planning: a pure function from the senders' manifests to the layout of every bucket.

The manifests (:class:`SenderManifest`, what each sender holds) are defined in
``sender_manifest.py`` and re-exported here; this module turns them into a :class:`Plan`.

Every rank (senders and receivers) receives the same manifests in the plan message and calls
:func:`build_plan` itself, so the layout is never sent: it is recomputed, deterministically, from
what each sender holds. No I/O, no torch.distributed here.

Layout rules:

* Tensors are ordered by first appearance, scanning manifests in sender-rank order.
* A tensor is held as *parts*: one per distinct shard box (a DTensor's local shard, or the whole
  tensor). A box held by several senders (replicated) is sent once, by the lowest rank.
* Buckets come in *rows*. A row holds consecutive tensors; within a row each sender owns one
  bucket with its parts of those tensors, so every tensor of a row is complete once the row's
  buckets have arrived. A row closes when any sender's bucket would exceed ``bucket_bytes``.
* A part larger than ``bucket_bytes`` gets rows of its own; it is split into *pieces*, element
  ranges of at most ``bucket_bytes``. Otherwise a piece is a whole part.
* Pieces start at multiples of ``align`` bytes inside their bucket; the gaps carry no data.

A full round sends :attr:`Plan.buckets`. A delta round sends :meth:`Plan.layout` of the changed
tensors only — the same rules applied to a subset, so every rank derives the round's buckets from
the set of changed tensors alone, and each changed tensor arrives whole.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from deltackpt.format.hashing import digest
from deltackpt.sync.errors import PlanError
from deltackpt.sync.sender_manifest import SenderManifest, ShardEntry, wire_dtype

__all__ = [
    "Bucket",
    "Part",
    "Piece",
    "Plan",
    "SenderManifest",
    "ShardEntry",
    "TensorInfo",
    "build_plan",
    "segments",
]


def _itemsize(name: str) -> int:
    return wire_dtype(name).itemsize


def _align_up(n: int, align: int) -> int:
    return -(-n // align) * align


@dataclass(frozen=True)
class TensorInfo:
    """A tensor of the plan, as the receiver will hand it to ``load_weights``."""

    index: int
    name: str
    dtype: str
    shape: tuple[int, ...]
    num_parts: int

    @property
    def itemsize(self) -> int:
        return _itemsize(self.dtype)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.itemsize


@dataclass(frozen=True)
class Piece:
    """Elements ``[start, start + count)`` of the row-major data of the box at ``offset`` /
    ``local_shape`` of tensor ``tensor``, stored at ``bucket_offset`` in its bucket."""

    tensor: int
    owner: int
    offset: tuple[int, ...]
    local_shape: tuple[int, ...]
    start: int
    count: int
    bucket_offset: int
    nbytes: int
    whole: bool  # the piece is the entire tensor: a receiver can hand out a view of the bucket

    @property
    def end(self) -> int:
        return self.start + self.count


@dataclass(frozen=True)
class Bucket:
    """One flat buffer of a round: ``index`` is its position in the round's layout."""

    index: int
    row: int
    owner: int
    nbytes: int
    pieces: tuple[Piece, ...]


@dataclass(frozen=True)
class Part:
    """A deduplicated box of a tensor and the sender rank that sends it."""

    owner: int
    offset: tuple[int, ...]
    local_shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.local_shape)


@dataclass(frozen=True)
class Plan:
    """The agreed layout. ``plan_id`` names it (equal manifests give equal ids)."""

    plan_id: str
    bucket_bytes: int
    align: int
    senders: tuple[int, ...]
    tensors: tuple[TensorInfo, ...]
    parts: tuple[tuple[Part, ...], ...]  # per tensor
    buckets: tuple[Bucket, ...]  # the full layout
    capacity: int = field(init=False)
    total_bytes: int = field(init=False)
    arena_bytes: int = field(init=False)
    max_buckets: int = field(init=False)

    def __post_init__(self) -> None:
        pieces = [p for b in self.buckets for p in b.pieces]
        by_part: dict[tuple[int, int], list[Piece]] = {}
        for p in pieces:
            by_part.setdefault((p.tensor, p.owner), []).append(p)
        object.__setattr__(self, "_by_part", {k: tuple(v) for k, v in by_part.items()})
        object.__setattr__(self, "capacity", max((b.nbytes for b in self.buckets), default=0))
        object.__setattr__(self, "total_bytes", sum(b.nbytes for b in self.buckets))
        # any layout of any subset fits: every piece costs at most its bytes plus one alignment
        # gap, every bucket at most one more gap where it starts (see arena_offsets)
        object.__setattr__(
            self,
            "arena_bytes",
            sum(p.nbytes for p in pieces) + 2 * self.align * max(len(pieces), 1),
        )
        object.__setattr__(self, "max_buckets", max(len(pieces), 1))

    def layout(self, tensors: Iterable[int] | None = None) -> tuple[Bucket, ...]:
        """Buckets of a round that sends only ``tensors`` (indices); ``None``: all of them."""
        if tensors is None:
            return self.buckets
        return _layout(
            self.tensors, self.parts, sorted(set(tensors)), self.bucket_bytes, self.align
        )

    @property
    def direct_bytes(self) -> int:
        """Pieces at least this big travel as their own segment (see :func:`segments`)."""
        return min(1 << 20, max(self.bucket_bytes // 16, self.align))

    def pieces_of(self, tensor: int, owner: int) -> tuple[Piece, ...]:
        """The pieces of ``owner``'s part of ``tensor``, in element order (the same split in
        every layout; only ``bucket_offset`` differs)."""
        return self._by_part.get((tensor, owner), ())  # type: ignore[attr-defined]

    def arena_offsets(self, buckets: Sequence[Bucket]) -> list[int]:
        """Where each bucket of a round starts in a flat arena of :attr:`arena_bytes`."""
        out, pos = [], 0
        for b in buckets:
            pos = _align_up(pos, self.align)
            out.append(pos)
            pos += b.nbytes
        return out

    def describe(self, bucket: Bucket, limit: int = 4) -> str:
        """Human-readable bucket summary for error messages."""
        names = [self.tensors[p.tensor].name for p in bucket.pieces]
        more = f" and {len(names) - limit} more" if len(names) > limit else ""
        return (
            f"bucket {bucket.index} (owner rank {bucket.owner}, {bucket.nbytes} bytes: "
            f"{', '.join(names[:limit])}{more})"
        )


def segments(bucket: Bucket, direct_bytes: int) -> list[tuple[int, int, Piece | None]]:
    """Split a bucket into transfer segments ``(lo, hi, piece)``: a piece of at least
    ``direct_bytes`` is a segment of its own (``piece`` set: a sender may send it straight from
    the source tensor), runs of smaller pieces form one packed segment (``piece`` None).
    Both ends compute the same segments; the bytes between pieces are never sent."""
    out: list[tuple[int, int, Piece | None]] = []
    run: list[Piece] = []
    for p in bucket.pieces:
        if p.nbytes == 0:
            continue
        if p.nbytes >= direct_bytes:
            if run:
                out.append((run[0].bucket_offset, run[-1].bucket_offset + run[-1].nbytes, None))
                run = []
            out.append((p.bucket_offset, p.bucket_offset + p.nbytes, p))
        else:
            run.append(p)
    if run:
        out.append((run[0].bucket_offset, run[-1].bucket_offset + run[-1].nbytes, None))
    return out


def _overlap(a: Part, b: Part) -> bool:
    return all(
        ao < bo + bl and bo < ao + al
        for ao, al, bo, bl in zip(a.offset, a.local_shape, b.offset, b.local_shape, strict=True)
    )


def _collect(manifests: Sequence[SenderManifest]) -> tuple[list[TensorInfo], list[list[Part]]]:
    order: dict[str, int] = {}
    meta: list[tuple[str, str, tuple[int, ...], int]] = []  # name, dtype, shape, first rank
    parts: list[list[Part]] = []
    for m in manifests:
        seen: set[str] = set()
        for e in m.entries:
            if e.name in seen:
                raise PlanError(
                    f"sender rank {m.rank} lists tensor {e.name!r} twice; names must be unique"
                )
            seen.add(e.name)
            _itemsize(e.dtype)
            if (
                len(e.offset) != len(e.shape)
                or len(e.local_shape) != len(e.shape)
                or any(
                    o < 0 or ls < 0 or o + ls > s
                    for o, ls, s in zip(e.offset, e.local_shape, e.shape, strict=False)
                )
            ):
                raise PlanError(
                    f"tensor {e.name!r} on sender rank {m.rank}: box offset "
                    f"{e.offset} size {e.local_shape} does not fit in shape {e.shape}"
                )
            idx = order.get(e.name)
            if idx is None:
                idx = order[e.name] = len(meta)
                meta.append((e.name, e.dtype, e.shape, m.rank))
                parts.append([])
            name, dt, shape, first = meta[idx]
            if (dt, shape) != (e.dtype, e.shape):
                raise PlanError(
                    f"tensor {name!r}: sender rank {first} has {dt}{list(shape)} but "
                    f"sender rank {m.rank} has {e.dtype}{list(e.shape)}; every sender "
                    "must describe the same global dtype and shape"
                )
            part = Part(m.rank, e.offset, e.local_shape)
            if part.numel == 0 or any(
                p.offset == part.offset and p.local_shape == part.local_shape for p in parts[idx]
            ):
                continue  # empty shard, or a replica of a box a lower rank already sends
            for p in parts[idx]:
                if _overlap(p, part):
                    raise PlanError(
                        f"tensor {name!r}: the box at {part.offset} size "
                        f"{part.local_shape} on rank {part.owner} overlaps the box at "
                        f"{p.offset} size {p.local_shape} on rank {p.owner}; shards "
                        "must be disjoint or identical (replicas)"
                    )
            parts[idx].append(part)
    tensors = []
    for idx, (name, dt, shape, first) in enumerate(meta):
        numel = math.prod(shape)
        covered = sum(p.numel for p in parts[idx])
        if covered != numel:
            raise PlanError(
                f"tensor {name!r} {list(shape)}: the senders' shards cover {covered} "
                f"of {numel} elements; every element must be held by some sender "
                "(Partial placements must be reduced before push)"
            )
        if numel == 0:  # one zero-byte piece so the receiver still gets the tensor
            parts[idx].append(Part(first, tuple(0 for _ in shape), shape))
        tensors.append(TensorInfo(idx, name, dt, shape, len(parts[idx])))
    return tensors, parts


def build_plan(manifests: Iterable[SenderManifest]) -> Plan:
    """Lay out the tensors of ``manifests`` (one per sender rank) into buckets.

    Pure and deterministic: the same manifests give the same plan on every rank. Raises
    :class:`PlanError` when the senders disagree or do not cover a tensor.
    """
    ms = sorted(manifests, key=lambda m: m.rank)
    if not ms:
        raise PlanError("no sender manifests: at least one sender rank must push")
    bucket_bytes, align = ms[0].bucket_bytes, ms[0].align
    for m in ms:
        if (m.bucket_bytes, m.align) != (bucket_bytes, align):
            raise PlanError(
                f"sender rank {m.rank} uses bucket_bytes={m.bucket_bytes} "
                f"align={m.align} but rank {ms[0].rank} uses "
                f"bucket_bytes={bucket_bytes} align={align}; pass the same values "
                "to every WeightSender"
            )
    if align < 16 or align & (align - 1):
        raise PlanError(f"align={align}: must be a power of two >= 16")
    if bucket_bytes < align:
        raise PlanError(f"bucket_bytes={bucket_bytes} is smaller than align={align}")
    tensors, parts = _collect(ms)
    frozen = tuple(tuple(p) for p in parts)
    buckets = _layout(tensors, frozen, range(len(tensors)), bucket_bytes, align)
    plan_id = digest(b"\n".join(m.to_json() for m in ms))
    return Plan(
        plan_id, bucket_bytes, align, tuple(m.rank for m in ms), tuple(tensors), frozen, buckets
    )


def _layout(
    tensors: Sequence[TensorInfo],
    parts: Sequence[Sequence[Part]],
    selected: Iterable[int],
    bucket_bytes: int,
    align: int,
) -> tuple[Bucket, ...]:
    Row = dict[int, list[tuple[int, Part, int, int]]]  # owner -> (tensor, part, start, count)
    rows: list[Row] = []
    cur: Row = {}
    used: dict[int, int] = {}
    for idx in selected:
        t = tensors[idx]
        size = t.itemsize
        if any(p.numel * size > bucket_bytes for p in parts[idx]):
            if cur:
                rows.append(cur)
                cur, used = {}, {}
            per = bucket_bytes // size
            for k in range(max(-(-p.numel // per) for p in parts[idx])):
                row: Row = {}
                for p in parts[idx]:
                    start = k * per
                    if start < p.numel:
                        row.setdefault(p.owner, []).append(
                            (idx, p, start, min(per, p.numel - start))
                        )
                rows.append(row)
            continue
        if cur and any(
            _align_up(used.get(p.owner, 0), align) + p.numel * size > bucket_bytes
            for p in parts[idx]
        ):
            rows.append(cur)
            cur, used = {}, {}
        for p in parts[idx]:
            cur.setdefault(p.owner, []).append((idx, p, 0, p.numel))
            used[p.owner] = _align_up(used.get(p.owner, 0), align) + p.numel * size
    if cur:
        rows.append(cur)

    buckets: list[Bucket] = []
    for r, row in enumerate(rows):
        for owner in sorted(row):
            pieces = []
            off = 0
            for idx, p, start, count in row[owner]:
                t = tensors[idx]
                off = _align_up(off, align)
                nbytes = count * t.itemsize
                whole = t.num_parts == 1 and count == math.prod(t.shape)
                pieces.append(
                    Piece(idx, owner, p.offset, p.local_shape, start, count, off, nbytes, whole)
                )
                off += nbytes
            buckets.append(Bucket(len(buckets), r, owner, off, tuple(pieces)))
    return tuple(buckets)

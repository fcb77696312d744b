"""The transfer schedule of weight sync (M trainer ranks -> N inference ranks): which trainer rank sends which box of which tensor to which
inference rank, computed once at setup from every rank's declaration (``schedule_decl.py``).

Pure and deterministic: every rank builds the same :class:`Schedule` from the same declarations
and derives the part it needs, so the schedule itself is never sent.

* Trainer shards of a tensor must be disjoint or identical (replicas) and cover it. A box held
  by several trainers is sent by one of them per receiver (``holders[receiver position %
  len(holders)]``), spreading replicated receivers over the replicas.
* A **transfer** is one intersection ``trainer box ∩ receiver box`` (non-empty), from the
  box's holder to the receiver, in the receiver's wanted dtype (the sender casts). No rank
  sends or receives more than these intersections: a receiver gets a full tensor only if it
  asked for the full tensor.
* The transfers of one (sender, receiver) **link** are ordered by (receiver's declaration
  order, trainer box), split into boxes of at most ``bucket_bytes`` when larger, and packed in
  that order into :class:`LinkBucket` s of at most ``bucket_bytes``; ``index`` numbers them
  within the link. Both ends compute the same buckets for their links (``link``,
  ``links_of``); ``link_bytes`` gives every link's bytes at once (vectorised, for planning at
  scale).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from deltackpt.sync.dtypes import wire_dtype
from deltackpt.sync.errors import PlanError
from deltackpt.sync.schedule_decl import Box, Decl, Wanted

__all__ = [
    "Link",
    "LinkBucket",
    "SchedTensor",
    "Schedule",
    "Transfer",
    "build_schedule",
    "check_sizes",
    "is_integer",
]


@dataclass(frozen=True)
class SchedTensor:
    """A trainer tensor: name, global dtype and shape, its distinct boxes and their holders."""

    index: int
    name: str
    dtype: str
    shape: tuple[int, ...]
    boxes: tuple[Box, ...]
    holders: tuple[tuple[int, ...], ...]  # per box, ascending trainer ranks


@dataclass(frozen=True)
class Transfer:
    """One piece on a link: ``box`` (global coordinates) of trainer tensor ``tensor``, for the
    receiver's wanted tensor ``want`` (index in its declaration), as ``dtype``."""

    tensor: int
    want: int
    box: Box
    dtype: str
    nbytes: int


@dataclass(frozen=True)
class LinkBucket:
    """Pieces ``pieces`` of link (``sender``, ``receiver``), bucket ``index`` of the link;
    ``capacity``: payload bytes when every piece is sent (aligned)."""

    sender: int
    receiver: int
    index: int
    pieces: tuple[Transfer, ...]
    capacity: int


@dataclass(frozen=True)
class Link:
    sender: int
    receiver: int
    buckets: tuple[LinkBucket, ...]

    @property
    def nbytes(self) -> int:
        """Payload bytes of a full round (the sum of the intersections, no padding)."""
        return sum(p.nbytes for b in self.buckets for p in b.pieces)


def _align_up(n: int, align: int) -> int:
    return -(-n // align) * align


def split_box(box: Box, itemsize: int, limit: int) -> list[Box]:
    """``box`` cut into boxes of at most ``limit`` bytes (at least one element each), along the
    outermost dimension that has more than one element, recursing into rows too large."""
    if box.numel * itemsize <= limit or box.numel <= 1:
        return [box]
    d = next(i for i, s in enumerate(box.size) if s > 1)
    row = math.prod(box.size[d + 1 :]) * itemsize
    step = max(1, limit // row) if row <= limit else 1
    out: list[Box] = []
    for lo in range(0, box.size[d], step):
        n = min(step, box.size[d] - lo)
        off = (*box.offset[:d], box.offset[d] + lo, *box.offset[d + 1 :])
        size = (*box.size[:d], n, *box.size[d + 1 :])
        sub = Box(off, size)
        out.extend([sub] if row <= limit else split_box(sub, itemsize, limit))
    return out


def is_integer(value: object) -> bool:
    """An int, or an integer type that says it is one (numpy's), not a bool: what a count, a
    size, a rank or a port of weight sync may be."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_sizes(owner: str, bucket_bytes: object, align: object) -> None:
    """``bucket_bytes`` (None: the links' default) and ``align`` of a sender, a receiver or a
    schedule: :class:`PlanError` naming the one that cannot be (a schedule also checks that
    every rank's agree)."""
    if not is_integer(align) or align < 16 or align & (align - 1):  # type: ignore[operator]
        raise PlanError(
            f"{owner}(align={align!r}): expected a power of two >= 16 (bytes; 64 by default, the "
            "same on every rank)"
        )
    if bucket_bytes is not None and (not is_integer(bucket_bytes) or bucket_bytes < align):  # type: ignore[operator]
        raise PlanError(
            f"{owner}(bucket_bytes={bucket_bytes!r}): expected None (the links' default: 64 MiB, "
            f"256 MiB on ipc links) or an int of bytes >= align={align}, the same on every rank"
        )


class Schedule:
    """The schedule of one sync job. Build with :func:`build_schedule`."""

    def __init__(self, decls: Sequence[Decl], bucket_bytes: int, align: int) -> None:
        check_sizes("build_schedule", bucket_bytes, align)
        self.bucket_bytes, self.align = int(bucket_bytes), int(align)
        ds = sorted(decls, key=lambda d: d.rank)
        if [d.rank for d in ds] != list(range(len(ds))):
            raise PlanError(
                f"declarations from ranks {[d.rank for d in ds]}: need one per rank 0..n-1"
            )
        self.trainers = tuple(d.rank for d in ds if d.trainer)
        self.receivers = tuple(d.rank for d in ds if not d.trainer)
        if not self.trainers or not self.receivers:
            raise PlanError("a sync schedule needs at least one trainer and one receiver rank")
        self._pos = {r: i for i, r in enumerate(self.receivers)}
        self.tensors = self._collect(ds)
        self._by_name = {t.name: t for t in self.tensors}
        # per tensor: trainer rank -> indices of the boxes it holds
        self._held_by: list[dict[int, list[int]]] = []
        for t in self.tensors:
            idx: dict[int, list[int]] = {}
            for bi, hs in enumerate(t.holders):
                for h in hs:
                    idx.setdefault(h, []).append(bi)
            self._held_by.append(idx)
        self.wanted: dict[int, tuple[tuple[Wanted, int, Box], ...]] = {
            d.rank: self._check_wanted(d) for d in ds if not d.trainer
        }
        self._links: dict[tuple[int, int], Link] = {}
        self._corners: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self._by_tensor: dict[int, tuple[list[tuple[int, int]], np.ndarray, np.ndarray]] = {}
        self._sizes: dict[str, int] = {}

    # ---- validation -----------------------------------------------------------------------

    def _collect(self, ds: Sequence[Decl]) -> tuple[SchedTensor, ...]:
        meta: dict[str, tuple[str, tuple[int, ...], int]] = {}
        boxes: dict[str, dict[Box, list[int]]] = {}
        for d in ds:
            if not d.trainer:
                continue
            for h in d.held:
                first = meta.setdefault(h.name, (h.dtype, h.shape, d.rank))
                if first[:2] != (h.dtype, h.shape):
                    raise PlanError(
                        f"tensor {h.name!r}: trainer rank {first[2]} declares "
                        f"{first[0]}{list(first[1])}, trainer rank {d.rank} "
                        f"{h.dtype}{list(h.shape)}; every trainer must declare the same "
                        "global dtype and shape"
                    )
                b = h.box
                if len(b.offset) != len(h.shape) or any(
                    o + s > n for o, s, n in zip(b.offset, b.size, h.shape, strict=True)
                ):
                    raise PlanError(
                        f"tensor {h.name!r} on trainer rank {d.rank}: box {b} does not "
                        f"fit in shape {list(h.shape)}"
                    )
                if b.numel:
                    holders = boxes.setdefault(h.name, {}).setdefault(b, [])
                    if d.rank in holders:
                        raise PlanError(f"trainer rank {d.rank} declares {h.name!r} twice")
                    holders.append(d.rank)
        out = []
        for i, (name, (dt, shape, _)) in enumerate(meta.items()):
            bs = boxes.get(name, {})
            _check_cover(name, shape, list(bs))
            out.append(
                SchedTensor(
                    i, name, dt, shape, tuple(bs), tuple(tuple(sorted(h)) for h in bs.values())
                )
            )
        return tuple(out)

    def _check_wanted(self, d: Decl) -> tuple[tuple[Wanted, int, Box], ...]:
        out = []
        seen: set[str] = set()
        for w in d.wanted:
            t = self._by_name.get(w.source)
            if t is None:
                raise PlanError(
                    f"receiver rank {d.rank} wants {w.name!r} from trainer tensor "
                    f"{w.source!r}, which no trainer declares; fix the name map"
                )
            if w.name in seen:
                raise PlanError(f"receiver rank {d.rank} wants {w.name!r} twice")
            seen.add(w.name)
            box = w.box or Box((0,) * len(t.shape), t.shape)
            if len(box.offset) != len(t.shape) or any(
                o + s > n for o, s, n in zip(box.offset, box.size, t.shape, strict=True)
            ):
                raise PlanError(
                    f"receiver rank {d.rank}: box {box} of {w.name!r} does not fit in "
                    f"{w.source!r} {list(t.shape)}"
                )
            out.append((w, t.index, box))
        return tuple(out)

    # ---- per link -------------------------------------------------------------------------

    def holder(self, tensor: int, box: int, receiver: int) -> int:
        hs = self.tensors[tensor].holders[box]
        return hs[self._pos[receiver] % len(hs)]

    def link(self, sender: int, receiver: int) -> Link:
        """The buckets of one link (empty when the sender holds nothing the receiver needs)."""
        key = (sender, receiver)
        if key not in self._links:
            found = self._transfers(receiver, sender_side=False).get(sender, [])
            self._links[key] = self._bucketize(sender, receiver, found)
        return self._links[key]

    def links_of(self, rank: int) -> list[Link]:
        """The non-empty links of ``rank``, by peer rank (one pass over its tensors)."""
        trainer = rank in self.trainers
        found = self._transfers(rank, sender_side=trainer)
        out = []
        for peer in sorted(found):
            key = (rank, peer) if trainer else (peer, rank)
            if key not in self._links:
                self._links[key] = self._bucketize(*key, found[peer])
            out.append(self._links[key])
        return out

    def _arrays(self, ti: int) -> tuple[np.ndarray, np.ndarray]:
        """Lower and upper corners of tensor ``ti``'s trainer boxes (cached)."""
        got = self._corners.get(ti)
        if got is None:
            t = self.tensors[ti]
            lo = np.array([b.offset for b in t.boxes], dtype=np.int64).reshape(len(t.boxes), -1)
            sz = np.array([b.size for b in t.boxes], dtype=np.int64).reshape(len(t.boxes), -1)
            got = self._corners[ti] = (lo, lo + sz)
        return got

    def _wants_of(self, ti: int) -> tuple[list[tuple[int, int]], np.ndarray, np.ndarray]:
        """Every receiver's wants of tensor ``ti``: (receiver, want index) and corners."""
        if not self._by_tensor:
            acc: dict[int, list[tuple[int, int, Box]]] = {}
            for r, ws in self.wanted.items():
                for wi, (_, t, box) in enumerate(ws):
                    acc.setdefault(t, []).append((r, wi, box))
            for t, items in acc.items():
                lo = np.array([b.offset for *_, b in items], dtype=np.int64)
                sz = np.array([b.size for *_, b in items], dtype=np.int64)
                lo, sz = lo.reshape(len(items), -1), sz.reshape(len(items), -1)
                self._by_tensor[t] = ([(r, wi) for r, wi, _ in items], lo, lo + sz)
        return self._by_tensor.get(ti, ([], np.zeros((0, 0)), np.zeros((0, 0))))

    def _transfers(self, rank: int, sender_side: bool) -> dict[int, list[Transfer]]:
        """Transfers of ``rank`` by peer, each list in link order (want index, box index)."""
        keyed: dict[int, list[tuple[int, int, Transfer]]] = {}
        if sender_side:
            for ti, bis in enumerate(self._held_by):
                who, wlo, whi = self._wants_of(ti)
                if rank not in bis or not who:
                    continue
                blo, bhi = self._arrays(ti)
                for bi in bis[rank]:
                    lo, hi = np.maximum(wlo, blo[bi]), np.minimum(whi, bhi[bi])
                    for k in np.flatnonzero((hi > lo).all(axis=1)):
                        r, wi = who[k]
                        if self.holder(ti, bi, r) == rank:
                            tr = self._transfer(r, wi, lo[k], hi[k])
                            keyed.setdefault(r, []).append((wi, bi, tr))
        else:
            for wi, (_, ti, box) in enumerate(self.wanted[rank]):
                if not self.tensors[ti].boxes:
                    continue
                blo, bhi = self._arrays(ti)
                lo = np.maximum(blo, np.array(box.offset, dtype=np.int64))
                hi = np.minimum(bhi, np.array(box.offset, dtype=np.int64) + box.size)
                for bi in np.flatnonzero((hi > lo).all(axis=1)):
                    s = self.holder(ti, int(bi), rank)
                    keyed.setdefault(s, []).append(
                        (wi, int(bi), self._transfer(rank, wi, lo[bi], hi[bi]))
                    )
        return {p: [tr for *_, tr in sorted(v, key=lambda x: x[:2])] for p, v in keyed.items()}

    def _transfer(self, receiver: int, wi: int, lo: np.ndarray, hi: np.ndarray) -> Transfer:
        w, ti, _ = self.wanted[receiver][wi]
        dt = w.dtype or self.tensors[ti].dtype
        box = Box(tuple(int(x) for x in lo), tuple(int(x) for x in hi - lo))
        return Transfer(ti, wi, box, dt, box.numel * self._itemsize(dt))

    def _itemsize(self, dt: str) -> int:
        got = self._sizes.get(dt)
        if got is None:
            got = self._sizes[dt] = wire_dtype(dt).itemsize
        return got

    def _bucketize(self, sender: int, receiver: int, transfers: list[Transfer]) -> Link:
        buckets: list[LinkBucket] = []
        cur: list[Transfer] = []
        used = 0
        for tr in transfers:
            size = self._itemsize(tr.dtype)
            for box in split_box(tr.box, size, self.bucket_bytes):
                p = Transfer(tr.tensor, tr.want, box, tr.dtype, box.numel * size)
                if cur and _align_up(used, self.align) + p.nbytes > self.bucket_bytes:
                    buckets.append(LinkBucket(sender, receiver, len(buckets), tuple(cur), used))
                    cur, used = [], 0
                cur.append(p)
                used = _align_up(used, self.align) + p.nbytes
        if cur:
            buckets.append(LinkBucket(sender, receiver, len(buckets), tuple(cur), used))
        return Link(sender, receiver, tuple(buckets))

    # ---- at scale -------------------------------------------------------------------------

    def link_bytes(self) -> np.ndarray:
        """Payload bytes of a full round per link: ``[trainer position, receiver position]``,
        the sum of the intersections, computed for all links at once (vectorised)."""
        tpos = {r: i for i, r in enumerate(self.trainers)}
        out = np.zeros((len(self.trainers), len(self.receivers)), dtype=np.int64)
        wants: dict[int, list[tuple[int, Box, int]]] = {}
        for r, ws in self.wanted.items():
            for w, ti, box in ws:
                size = wire_dtype(w.dtype or self.tensors[ti].dtype).itemsize
                wants.setdefault(ti, []).append((self._pos[r], box, size))
        for ti, ws in wants.items():
            t = self.tensors[ti]
            if not t.boxes:
                continue
            bo = np.array([b.offset for b in t.boxes], dtype=np.int64).reshape(len(t.boxes), -1)
            bs = np.array([b.size for b in t.boxes], dtype=np.int64).reshape(len(t.boxes), -1)
            wo = np.array([w[1].offset for w in ws], dtype=np.int64).reshape(len(ws), -1)
            wsz = np.array([w[1].size for w in ws], dtype=np.int64).reshape(len(ws), -1)
            lo = np.maximum(bo[:, None, :], wo[None, :, :])
            hi = np.minimum((bo + bs)[:, None, :], (wo + wsz)[None, :, :])
            vol = np.clip(hi - lo, 0, None).prod(axis=2)  # boxes x wants
            vol *= np.array([w[2] for w in ws], dtype=np.int64)[None, :]
            rpos = np.array([w[0] for w in ws], dtype=np.int64)
            nh = np.array([len(hs) for hs in t.holders], dtype=np.int64)
            table = np.zeros((len(t.holders), int(nh.max())), dtype=np.int64)
            for bi, hs in enumerate(t.holders):
                table[bi, : len(hs)] = [tpos[h] for h in hs]
            owner = table[np.arange(len(nh))[:, None], rpos[None, :] % nh[:, None]]
            flat = (owner * out.shape[1] + rpos[None, :]).ravel()
            out += (
                np.bincount(flat, weights=vol.ravel(), minlength=out.size)
                .astype(np.int64)
                .reshape(out.shape)
            )
        return out

    def wanted_bytes(self, receiver: int) -> int:
        """Bytes receiver ``receiver`` holds in its declared layout (what a full round moves
        into it)."""
        return sum(
            box.numel * wire_dtype(w.dtype or self.tensors[ti].dtype).itemsize
            for w, ti, box in self.wanted[receiver]
        )

    def full_bytes(self, receiver: int) -> int:
        """Bytes of every tensor the receiver wants, whole: what a broadcast design (every
        receiver gets full tensors and slices them itself) moves into it."""
        return sum(
            math.prod(self.tensors[ti].shape)
            * wire_dtype(w.dtype or self.tensors[ti].dtype).itemsize
            for w, ti, _ in self.wanted[receiver]
        )


def _check_cover(name: str, shape: tuple[int, ...], boxes: list[Box]) -> None:
    """Distinct boxes must be pairwise disjoint and cover the tensor exactly."""
    numel = math.prod(shape)
    covered = sum(b.numel for b in boxes)
    split = {
        d
        for b in boxes
        for d, (o, n) in enumerate(zip(b.offset, b.size, strict=False))
        if o or n != shape[d]
    }
    if len(split) == 1 and covered == numel:  # one sharded dim (Shard(d)): sort, no gaps
        d = split.pop()
        end = 0
        for b in sorted(boxes, key=lambda b: b.offset[d]):
            if b.offset[d] < end:
                break
            end = b.offset[d] + b.size[d]
        else:
            return
    if len(boxes) > 1:
        o = np.array([b.offset for b in boxes], dtype=np.int64).reshape(len(boxes), -1)
        e = o + np.array([b.size for b in boxes], dtype=np.int64).reshape(len(boxes), -1)
        lo = np.maximum(o[:, None, :], o[None, :, :])
        hi = np.minimum(e[:, None, :], e[None, :, :])
        hit = (hi > lo).all(axis=2)
        np.fill_diagonal(hit, False)
        if hit.any():
            a, b = (int(x) for x in np.argwhere(hit)[0])
            raise PlanError(
                f"tensor {name!r}: trainer boxes {boxes[a]} and {boxes[b]} overlap; shards "
                "must be disjoint or identical (replicas)"
            )
    if covered != numel:
        raise PlanError(
            f"tensor {name!r} {list(shape)}: the trainers' shards cover {covered} of {numel} "
            "elements; every element must be held by some trainer (reduce Partial first)"
        )


def build_schedule(decls: Iterable[Decl], *, bucket_bytes: int, align: int = 64) -> Schedule:
    """Validate every rank's declaration and return the schedule (pure, deterministic)."""
    return Schedule(list(decls), bucket_bytes, align)

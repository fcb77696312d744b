"""A follower's copy held in boxes: each tensor whole, or only the box of it its caller loads (a
tensor-parallel rank's rows or columns), read from a snapshot and kept up to date by
:class:`deltackpt.Follower` (``boxes=``).

The copy is a flat dict by key path (``load(into=)`` takes it as a state: a key path is its
own leaf's path). Tensors held whole catch up as any follower's do (``load(since=)``: unchanged
chunks not read, deltas patched in place). A boxed tensor that changed is read again, box only
(the chunks covering its box, each checked as read), into the held box: a box holds part of
each chunk, so a chunk's delta cannot be applied to it, nor checked. A catch-up that fails
leaves the copy between two versions, so the follower then holds none (its next poll loads
whole), as after a failed full load. A tensor boxed as none of it (False: another rank's
expert) is never read, held or handed over. What a catch-up costs (``bench_follow_boxes.py``):
on a store of raw chunks (a local disk's default) at most the whole copy's time; on a store of
delta chains a decode of each changed box's chain, where the whole copy applies patches
(docs/sync.md, "Each worker's share only").
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from deltackpt.errors import InvalidArgumentError
from deltackpt.format.dtypes import dtype_from_name
from deltackpt.format.manifest import Manifest, TensorEntry
from deltackpt.loading.lazy import SnapshotReader
from deltackpt.loading.select import Select
from deltackpt.loading.stats import CountingPackReaders, LoadStats
from deltackpt.options import LoadOptions
from deltackpt.store.store import Store

__all__ = ["WINDOW", "BoxOf", "Plan", "Scratch", "box_plan", "check_held", "read"]

Shape = tuple[int, ...]
#: ``(name, shape) -> box, None or False``: the box (``.offset`` and ``.size``, or a pair of
#: them) of a tensor of ``shape`` its caller loads, None for the whole tensor, False for none of
#: it (not held, not handed over: an expert another rank holds)
BoxOf = Callable[[str, Shape], Any]
#: per key path, ``(offset, size)`` of the box held, None for the whole tensor, False for none
Plan = dict[str, "tuple[Shape, Shape] | bool | None"]


def _as_box(got: Any, shape: Shape, path: str) -> tuple[Shape, Shape] | bool | None:
    """``got`` (a box the caller named for ``path``) as ``(offset, size)``, checked against the
    tensor's ``shape``; None when it is the whole tensor, False for none of it."""
    if got is None or got is False:
        return got
    try:
        off, size = (got.offset, got.size) if hasattr(got, "offset") else got
        off, size = tuple(int(x) for x in off), tuple(int(x) for x in size)
    except (TypeError, ValueError) as e:
        raise InvalidArgumentError(
            f"Follower(boxes=) gave {got!r:.80} for key {path!r}: expected None or a box with "
            f"an offset and a size per dimension ({e})"
        ) from None
    if (
        len(off) != len(shape)
        or len(size) != len(shape)
        or any(o < 0 or s <= 0 or o + s > n for o, s, n in zip(off, size, shape, strict=True))
    ):
        raise InvalidArgumentError(
            f"Follower(boxes=) gave offset {list(off)} size {list(size)} for key {path!r} of "
            f"shape {list(shape)}: expected a non-empty box inside the tensor (None: whole)"
        )
    return None if size == shape and not any(off) else (off, size)


def box_plan(
    m: Manifest, select: Select | None, box_of: BoxOf, rename: Callable[[str], str]
) -> Plan:
    """Per tensor of ``m`` that ``select`` keeps, the box ``box_of`` (asked with the name
    ``rename`` gives) says to hold."""
    out: Plan = {}
    for e in m.tensors:
        if select is None or select(e.path):
            shape = tuple(int(s) for s in e.shape)
            out[e.path] = _as_box(box_of(rename(e.path), shape), shape, e.path)
    return out


#: bytes of covering rows read at a time for boxes that are not whole rows (columns), through
#: one :class:`Scratch` buffer of this size (or of the largest such tensor)
WINDOW = 64 << 20
_ALIGN = 64


def _aligned(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


class Scratch:
    """A host buffer the box reads of every poll reuse for the rows covering a column box: its
    pages are faulted in once (new buffers each poll cost page faults: measured ~2.4x a TP=2
    rank's catch-up time here). Costs :data:`WINDOW` bytes (or the largest column-boxed
    tensor's) for the follower's life."""

    def __init__(self) -> None:
        self._buf = np.empty(0, dtype=np.uint8)
        self._used = 0

    def start(self, need: int) -> None:
        """A window that takes ``need`` bytes (its :func:`_aligned` sizes) begins."""
        if self._buf.size < need:
            self._buf = np.empty(0, dtype=np.uint8)  # the old one first: one buffer at a time
            self._buf = np.empty(need, dtype=np.uint8)
        self._used = 0

    def __call__(self, n: int) -> np.ndarray:
        if self._used + n > self._buf.size:  # not planned for (saved shards): new memory
            return np.empty(n, dtype=np.uint8)
        out = self._buf[self._used : self._used + n]
        self._used += _aligned(n)
        return out


def _covering(e: TensorEntry, box: tuple[Shape, Shape]) -> int:
    """Bytes of the rows covering ``box`` of a tensor saved whole that a read must buffer (0:
    whole rows, read in place; or a saved layout that buffers on its own)."""
    if e.data is None or e.storage is not None or not e.shape:
        return 0
    off, size = box
    shape = tuple(int(s) for s in e.shape)
    if all(o == 0 and n == full for o, n, full in zip(off[1:], size[1:], shape[1:], strict=True)):
        return 0
    return _aligned(size[0] * math.prod(shape[1:]) * dtype_from_name(e.dtype).itemsize)


def read(
    store: Store,
    m: Manifest,
    plan: Plan,
    options: LoadOptions,
    stats: LoadStats,
    into: dict[str, torch.Tensor] | None = None,
    scratch: Scratch | None = None,
) -> dict[str, torch.Tensor]:
    """Every tensor of ``plan`` from snapshot ``m``: whole, or its box, by key path, each chunk
    checked as it is read (``options.verify``), bytes counted in ``stats``. New CPU tensors, or
    (``into``, boxes only) the held ones, written in place. Column boxes are read in windows of
    :data:`WINDOW` covering bytes through ``scratch`` when given."""
    reader = SnapshotReader(store, m, options, packs=CountingPackReaders(store, stats))
    try:
        out = reader.get_tensors([p for p, b in plan.items() if b is None])
        boxed = [(p, reader.entry(p), b) for p, b in plan.items() if b]
        for window, need in _windows(boxed, scratch is not None):
            if scratch is not None:
                scratch.start(need)
            dst = None if into is None else [into[p] for p, _, _ in window]
            got = reader.read_boxes([(e, b) for _, e, b in window], dst, scratch)
            out.update((p, t) for (p, _, _), t in zip(window, got, strict=True))
        return out
    finally:
        reader.close()


def _windows(
    boxed: list[tuple[str, TensorEntry, tuple[Shape, Shape]]], cut: bool
) -> list[tuple[list[tuple[str, TensorEntry, tuple[Shape, Shape]]], int]]:
    """``boxed`` in windows of at most :data:`WINDOW` covering bytes (a larger tensor alone),
    each with its covering bytes; one window when not ``cut``."""
    if not cut:
        return [(boxed, 0)]
    windows: list[tuple[list[tuple[str, TensorEntry, tuple[Shape, Shape]]], int]] = [([], 0)]
    for item in boxed:
        n = _covering(item[1], item[2])
        items, need = windows[-1]
        if n and need and need + n > WINDOW:
            windows.append(([item], n))
        else:
            items.append(item)
            windows[-1] = (items, need + n)
    return windows


def check_held(state: Any, plan: Plan, m: Manifest) -> dict[str, torch.Tensor]:
    """``state`` (a copy handed to ``Follower.adopt``) as a flat dict by key path, each tensor
    of the shape ``plan`` holds; :class:`~deltackpt.errors.InvalidArgumentError` otherwise."""
    if not isinstance(state, dict) or not all(isinstance(k, str) for k in state):
        raise InvalidArgumentError(
            f"Follower(boxes=).adopt(): expected a dict of tensors by key path, got "
            f"{type(state).__name__}"
        )
    shapes = {e.path: tuple(int(s) for s in e.shape) for e in m.tensors}
    plan = {p: b for p, b in plan.items() if b is not False}  # none of it: not held
    if set(state) != set(plan):
        odd = sorted(set(state) ^ set(plan))[:5]
        raise InvalidArgumentError(
            f"Follower(boxes=).adopt(): the copy's keys differ from snapshot {m.name!r}'s "
            f"followed tensors at {odd}"
        )
    for p, t in state.items():
        b = plan[p]
        want = shapes[p] if b is None else b[1]  # type: ignore[index]
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != want:
            got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise InvalidArgumentError(
                f"Follower(boxes=).adopt(): key {p!r} holds {got}, expected shape {list(want)} "
                "(its box, or the whole tensor)"
            )
    return dict(state)

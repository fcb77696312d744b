"""A follower's copy held in boxes: each tensor whole, or only the box of it its caller loads (a
tensor-parallel rank's rows or columns), read from a snapshot and kept up to date by
:class:`deltackpt.Follower` (``boxes=``).

The copy is a flat dict by key path (``load(into=)`` takes it as a state: a key path is its
own leaf's path). Tensors held whole catch up as any follower's do (``load(since=)``: unchanged
chunks not read, deltas patched in place). A boxed tensor that changed is read again, box only
(the chunks covering its box, each checked as read), into the held box: a box holds part of
each chunk, so a chunk's delta cannot be applied to it, nor checked. A catch-up that fails
leaves the copy between two versions, so the follower then holds none (its next poll loads
whole), as after a failed full load. What that costs: on a store of raw chunks
(a local disk's default) about what the whole copy's catch-up reads, of the box's share; on a
store of delta chains, a decode of each changed box's chain (docs/sync.md, "Memory").
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from deltackpt.errors import InvalidArgumentError
from deltackpt.format.manifest import Manifest
from deltackpt.loading.lazy import SnapshotReader
from deltackpt.loading.select import Select
from deltackpt.loading.stats import CountingPackReaders, LoadStats
from deltackpt.options import LoadOptions
from deltackpt.store.store import Store

__all__ = ["BoxOf", "Plan", "box_plan", "check_held", "read"]

Shape = tuple[int, ...]
#: ``(name, shape) -> box or None``: the box (``.offset`` and ``.size``, or a pair of them) of a
#: tensor of ``shape`` its caller loads, None for the whole tensor
BoxOf = Callable[[str, Shape], Any]
#: per key path, ``(offset, size)`` of the box held, None for the whole tensor
Plan = dict[str, tuple[Shape, Shape] | None]


def _as_box(got: Any, shape: Shape, path: str) -> tuple[Shape, Shape] | None:
    """``got`` (a box the caller named for ``path``) as ``(offset, size)``, checked against the
    tensor's ``shape``; None when it is the whole tensor."""
    if got is None:
        return None
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


def read(
    store: Store,
    m: Manifest,
    plan: Plan,
    options: LoadOptions,
    stats: LoadStats,
    into: dict[str, torch.Tensor] | None = None,
) -> dict[str, torch.Tensor]:
    """Every tensor of ``plan`` from snapshot ``m``: whole, or its box, by key path, each chunk
    checked as it is read (``options.verify``), bytes counted in ``stats``. New CPU tensors, or
    (``into``, boxes only) the held ones, written in place."""
    reader = SnapshotReader(store, m, options, packs=CountingPackReaders(store, stats))
    try:
        out = reader.get_tensors([p for p, b in plan.items() if b is None])
        boxed = [(p, b) for p, b in plan.items() if b is not None]
        dst = None if into is None else [into[p] for p, _ in boxed]
        got = reader.read_boxes([(reader.entry(p), b) for p, b in boxed], dst)
        out.update((p, t) for (p, _), t in zip(boxed, got, strict=True))
        return out
    finally:
        reader.close()


def check_held(state: Any, plan: Plan, m: Manifest) -> dict[str, torch.Tensor]:
    """``state`` (a copy handed to ``Follower.adopt``) as a flat dict by key path, each tensor
    of the shape ``plan`` holds; :class:`~deltackpt.errors.InvalidArgumentError` otherwise."""
    if not isinstance(state, dict) or not all(isinstance(k, str) for k in state):
        raise InvalidArgumentError(
            f"Follower(boxes=).adopt(): expected a dict of tensors by key path, got "
            f"{type(state).__name__}"
        )
    shapes = {e.path: tuple(int(s) for s in e.shape) for e in m.tensors}
    if set(state) != set(plan):
        odd = sorted(set(state) ^ set(plan))[:5]
        raise InvalidArgumentError(
            f"Follower(boxes=).adopt(): the copy's keys differ from snapshot {m.name!r}'s "
            f"followed tensors at {odd}"
        )
    for p, t in state.items():
        b = plan[p]
        want = shapes[p] if b is None else b[1]
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != want:
            got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise InvalidArgumentError(
                f"Follower(boxes=).adopt(): key {p!r} holds {got}, expected shape {list(want)} "
                "(its box, or the whole tensor)"
            )
    return dict(state)

"""What the ranks of a sync job declare: the shards trainers hold, the layout receivers need.

A trainer rank declares, per tensor, a :class:`Held`: global dtype and shape and the box
(``offset`` + ``size``) of its local shard — from a DTensor's placements (:func:`held_from`),
or the whole tensor. An inference rank declares, per tensor, a :class:`Wanted`: its own name,
the trainer name it comes from (``source``: the name map), the dtype it wants on the wire (the
sender casts) and the box it holds — a tensor-parallel slice (:func:`shard_box`), or the whole
tensor for a replicated receiver. :func:`deltackpt.sync.schedule.build_schedule` turns the
declarations of every rank into the transfer schedule; they travel between ranks as canonical
JSON (:func:`decl_to_json` / :func:`decl_from_json`) once, at setup.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch

from deltackpt.format.dtensor import is_dtensor, local_box
from deltackpt.sync.dtypes import DtypeSpec, resolve_dtype, wire_dtype, wire_name
from deltackpt.sync.errors import PlanError

__all__ = [
    "DECL_FORMAT",
    "Box",
    "Decl",
    "Held",
    "LocalShard",
    "Wanted",
    "decl_from_json",
    "decl_to_json",
    "expand_every",
    "held_from",
    "shard_box",
]

DECL_FORMAT = 2  # 2: a wanted tensor says whether patches apply; "every"

Shape = tuple[int, ...]


@dataclass(frozen=True)
class Box:
    """A dense block of a tensor: ``size[d]`` elements from ``offset[d]`` along every dim."""

    offset: Shape
    size: Shape

    @property
    def numel(self) -> int:
        return math.prod(self.size)

    def intersect(self, other: Box) -> Box | None:
        lo = tuple(max(a, b) for a, b in zip(self.offset, other.offset, strict=True))
        hi = tuple(
            min(a + s, b + t)
            for a, s, b, t in zip(self.offset, self.size, other.offset, other.size, strict=True)
        )
        if any(h <= la for la, h in zip(lo, hi, strict=True)):
            return None
        return Box(lo, tuple(h - la for la, h in zip(lo, hi, strict=True)))

    def within(self, outer: Box) -> tuple[slice, ...]:
        """Index of this box inside the local tensor that holds ``outer``."""
        return tuple(
            slice(o - p, o - p + s)
            for o, s, p in zip(self.offset, self.size, outer.offset, strict=True)
        )


@dataclass(frozen=True)
class Held:
    """A trainer's shard of tensor ``name`` (global ``dtype`` / ``shape``) at ``box``."""

    name: str
    dtype: str
    shape: Shape
    box: Box


@dataclass(frozen=True)
class Wanted:
    """A receiver's tensor ``name``: box ``box`` of trainer tensor ``source``, as ``dtype``
    (None: the trainer's dtype)."""

    name: str
    source: str
    dtype: str | None
    box: Box | None  # None: the whole tensor (a replicated receiver)
    patch: bool = True  # the receiver holds the last version in the wire dtype: patches apply


@dataclass(frozen=True)
class Decl:
    """One rank's declaration: a trainer lists :class:`Held`, a receiver :class:`Wanted`."""

    rank: int
    trainer: bool
    held: tuple[Held, ...] = ()
    wanted: tuple[Wanted, ...] = ()
    every: bool = False  # a receiver that wants every trainer tensor whole (see expand_every)


@dataclass(frozen=True)
class LocalShard:
    """A trainer's shard given explicitly (no DTensor, e.g. a Megatron or hand-made split):
    ``tensor`` holds the box at ``offset`` of a global tensor of ``shape``."""

    tensor: torch.Tensor
    offset: Shape
    shape: Shape


def shard_box(shape: Iterable[int], dim: int, index: int, parts: int) -> Box:
    """The box of ``Shard(dim)`` part ``index`` of ``parts`` (torch.chunk sizes: ceil-sized
    parts, the last ones shorter or empty), e.g. a tensor-parallel column slice."""
    shape = tuple(int(s) for s in shape)
    if not 0 <= dim < len(shape) or not 0 <= index < parts:
        raise PlanError(f"shard_box: dim {dim} / index {index} of {parts} for shape {shape}")
    step = -(-shape[dim] // parts)
    lo = min(index * step, shape[dim])
    hi = min(lo + step, shape[dim])
    off = tuple(lo if d == dim else 0 for d in range(len(shape)))
    size = tuple(hi - lo if d == dim else s for d, s in enumerate(shape))
    return Box(off, size)


def held_from(
    named_tensors: Mapping[str, torch.Tensor | LocalShard]
    | Iterable[tuple[str, torch.Tensor | LocalShard]],
    dtype: DtypeSpec = None,
) -> tuple[list[Held], dict[str, torch.Tensor]]:
    """Declarations and local tensors of a trainer's state: a DTensor's local shard with its
    box (``Shard``/``Replicate`` placements), a :class:`LocalShard` as given, a plain tensor
    whole. ``dtype``: declare tensors as the dtype it picks (a dtype for floating tensors, or
    ``f(name, dtype) -> dtype | None``): their global dtype as a receiver sees it by default."""
    items = named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors
    held: list[Held] = []
    local: dict[str, torch.Tensor] = {}
    for item in items:
        name, t = _named(item)
        if name in local:
            raise PlanError(f"tensor name {name!r} appears twice; names must be unique")
        if isinstance(t, LocalShard):
            shape = tuple(int(x) for x in t.shape)
            loc, off, size = t.tensor, tuple(int(x) for x in t.offset), tuple(t.tensor.shape)
        elif is_dtensor(t):
            shape = tuple(t.shape)
            off, size = local_box(t, name)
            loc = t.to_local()  # type: ignore[attr-defined]
        else:
            shape, off, size, loc = tuple(t.shape), (0,) * t.dim(), tuple(t.shape), t
        dt = resolve_dtype(dtype, name, loc.dtype)
        held.append(Held(name, wire_name(dt, name), shape, Box(off, size)))
        local[name] = loc.detach()
    return held, local


def _named(item: object) -> tuple[str, torch.Tensor | LocalShard]:
    """One ``(name, tensor)`` of a trainer's state, checked: a bad value would otherwise fail
    deep inside planning with an AttributeError naming no tensor."""
    usage = (
        "push() takes a mapping name -> tensor or (name: str, tensor) pairs, where a tensor is "
        "a torch.Tensor, a DTensor or a LocalShard"
    )
    try:
        name, t = item  # type: ignore[misc]
    except (TypeError, ValueError) as e:
        raise PlanError(f"got {type(item).__name__} {item!r:.80} as an item; {usage}") from e
    if not isinstance(name, str):
        raise PlanError(f"tensor name {name!r} is a {type(name).__name__}, not a str; {usage}")
    inner = t.tensor if isinstance(t, LocalShard) else t
    if not isinstance(inner, torch.Tensor):
        what = "LocalShard.tensor" if isinstance(t, LocalShard) else "value"
        raise PlanError(
            f"tensor {name!r}: its {what} is a {type(inner).__name__}, expected a "
            f"torch.Tensor (convert it with torch.as_tensor); {usage}"
        )
    return name, t


def expand_every(decl: Decl, trainers: list[Decl], dtype: DtypeSpec) -> Decl:
    """A receiver that wants every trainer tensor whole (1 -> N broadcast): one :class:`Wanted`
    per trainer tensor, in the order the lowest trainer rank declares them (then the others'),
    as the dtype ``dtype`` picks from the trainer's."""
    seen: dict[str, Wanted] = {}
    for t in trainers:
        for h in t.held:
            if h.name not in seen:
                dt = resolve_dtype(dtype, h.name, wire_dtype(h.dtype))
                seen[h.name] = Wanted(h.name, h.name, wire_name(dt, h.name), None)
    return Decl(decl.rank, False, wanted=tuple(seen.values()))


def decl_to_json(d: Decl) -> bytes:
    """Canonical JSON (sorted keys, no spaces)."""
    doc = {
        "format": DECL_FORMAT,
        "rank": d.rank,
        "trainer": d.trainer,
        "every": d.every,
        "held": [[h.name, h.dtype, h.shape, h.box.offset, h.box.size] for h in d.held],
        "wanted": [
            [
                w.name,
                w.source,
                w.dtype,
                *((w.box.offset, w.box.size) if w.box else (None, None)),
                w.patch,
            ]
            for w in d.wanted
        ],
    }
    return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()


def _ints(v: object) -> Shape:
    if not isinstance(v, list) or not all(isinstance(x, int) and x >= 0 for x in v):
        raise ValueError(f"expected a list of non-negative ints, got {v!r}")
    return tuple(v)


def _bool(v: object) -> bool:
    if not isinstance(v, bool):
        raise ValueError(f"expected true or false, got {v!r}")
    return v


def decl_from_json(data: bytes) -> Decl:
    """Parse (and validate the types of) a declaration; :class:`PlanError` when malformed."""
    try:
        doc = json.loads(data)
        if doc.get("format") != DECL_FORMAT:
            raise PlanError(
                f"sync declaration format {doc.get('format')!r}, this version reads "
                f"{DECL_FORMAT}; run the same deltackpt on every rank"
            )
        held = tuple(
            Held(str(n), str(dt), _ints(s), Box(_ints(o), _ints(z)))
            for n, dt, s, o, z in doc["held"]
        )
        wanted = tuple(
            Wanted(
                str(n),
                str(src),
                None if dt is None else str(dt),
                None if o is None else Box(_ints(o), _ints(z)),
                _bool(patch),
            )
            for n, src, dt, o, z, patch in doc["wanted"]
        )
        for dt in [h.dtype for h in held] + [w.dtype for w in wanted if w.dtype]:
            wire_dtype(dt)
        every = doc.get("every", False)
        if not isinstance(every, bool) or (every and (held or wanted or doc["trainer"])):
            raise ValueError(f"'every' is {every!r} beside {len(held)} held / {len(wanted)} wanted")
        return Decl(int(doc["rank"]), bool(doc["trainer"]), held, wanted, every)
    except (ValueError, KeyError, TypeError) as e:
        if isinstance(e, PlanError):
            raise
        raise PlanError(
            f"malformed sync declaration ({e}); every rank must run the same deltackpt"
        ) from e

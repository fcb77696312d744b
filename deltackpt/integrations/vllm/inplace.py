"""Commits written straight into a vLLM model's parameters, where a parameter is seen to hold a
checkpoint tensor's bytes as they are: the pause of a commit becomes a copy of what changed
instead of the model's reload (docs/sync.md, "The pause").

vLLM's ``load_weights`` fuses checkpoint tensors (``q/k/v_proj`` into ``qkv_proj``,
``gate/up_proj`` into ``gate_up_proj``), keeps this rank's tensor-parallel rows or columns, and
some builds then repack a weight into a kernel layout (CPU oneDNN/AMX: the parameter is emptied,
or kept while the kernel reads a private copy). Where the tensor lands is *computed* from vLLM's
module attributes (the rules of :mod:`~deltackpt.integrations.vllm.tp_boxes`, plus each fused
part's rows in its parameter) and *trusted only when seen*: after a reload through
``load_weights``, a slot is kept for a tensor only if its parameter region equals the held bytes
bit for bit and those bytes are not all one value (a zero bias or a norm of ones cannot tell
places apart: such a tensor keeps the reload path until a reload shows it with distinct values).
A slot is used only while its parameter is the same object at the same address.

Never written in place (the reload path stays): a module whose weights are quantized, one that
keeps a derived copy (a CPU kernel ``cpu_linear`` closed over packed bytes or a handle to them,
any tensor kept as a plain attribute), a parameter vLLM emptied, a dtype that differs from the wire's, a parameter of a
kind not known to be read as is (linear, embedding, norm). What a content check cannot see: a
kernel that caches the weight somewhere else than the module; such a build must turn this off
(``DELTACKPT_VLLM_INPLACE=0``).
"""

from __future__ import annotations

import math
import types
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from deltackpt import cuda
from deltackpt.integrations.vllm import tp_boxes
from deltackpt.loading.to_device import copy_through
from deltackpt.options import vllm_switch
from deltackpt.sync.schedule_decl import Box

__all__ = [
    "BOUNCE",
    "BOUNCE_ON_HOST",
    "ENV",
    "SPARSE_ON_HOST",
    "ElementWrite",
    "Prepared",
    "Slot",
    "enabled",
    "learn",
    "prepare",
    "region_digests",
    "usable",
    "write",
]

#: the workers' switch: ``0`` keeps every commit on the model's reload
ENV = "DELTACKPT_VLLM_INPLACE"

_KINDS = (
    "ColumnParallelLinear",
    "MergedColumnParallelLinear",
    "QKVParallelLinear",
    "RowParallelLinear",
    "ReplicatedLinear",
    "VocabParallelEmbedding",
    "ParallelLMHead",
)


def enabled(flag: bool | None = None, env: str = ENV) -> bool:
    """``flag`` when given, else the workers' switch ``env`` (default on;
    :func:`deltackpt.options.vllm_switch`: a malformed value raises, naming it)."""
    if flag is not None:
        return bool(flag)
    return vllm_switch(env)


@dataclass(frozen=True)
class Slot:
    """Where held tensor ``name`` lands: ``held[src]`` is ``param[dst]``, bit for bit when seen."""

    module: str
    leaf: str
    param: torch.nn.Parameter
    ptr: int
    src: tuple[slice, ...]
    dst: tuple[slice, ...]

    def current(self, modules: dict[str, Any]) -> bool:
        m = modules.get(self.module)
        p = None if m is None else getattr(m, self.leaf, None)
        return p is self.param and p.data_ptr() == self.ptr


def _plain(m: Any, kind: str) -> bool:
    """The module computes from its parameters as they are (module doc)."""
    if not (kind in _KINDS or "Norm" in kind):
        return False
    qm = getattr(m, "quant_method", None)
    if qm is not None and not type(qm).__name__.startswith("Unquantized"):
        return False
    cpu = getattr(m, "cpu_linear", None)
    if cpu is not None and not all(_inert(c.cell_contents) for c in cpu.__closure__ or ()):
        return False  # a CPU kernel closed over packed bytes or a handle to them
    return not any(isinstance(v, torch.Tensor) for v in vars(m).values())


def _inert(v: Any) -> bool:
    """A value a kernel closure may hold that carries no copy of a weight."""
    return v is None or isinstance(
        v, (types.ModuleType, types.FunctionType, types.BuiltinFunctionType, type, int, float, str)
    )


def _fused_offset(m: Any, kind: str, part: int | None) -> int | None:
    """Rows of this rank's fused parameter before part ``part`` (0 when not fused)."""
    if part is None:
        return 0
    tp = int(getattr(m, "tp_size", 1) or 1)
    if kind == "QKVParallelLinear":
        q = int(m.num_heads) * int(m.head_size)
        k = int(m.num_kv_heads) * int(m.head_size)
        return [0, q, q + k][part] if part < 3 else None
    if kind == "MergedColumnParallelLinear":
        sizes = [int(s) for s in m.output_sizes]
        if part >= len(sizes) or any(s % tp for s in sizes):
            return None
        return sum(sizes[:part]) // tp
    return None


def _slot(
    name: str,
    held: torch.Tensor,
    full: tuple[int, ...],
    box: Box | None,
    modules: dict[str, Any],
    packed: dict[str, list[str]],
) -> Slot | None:
    where = tp_boxes.module_of(name, modules, packed)
    if where is None:
        return None
    target, part, leaf = where
    m = modules.get(target)
    if m is None:
        return None
    kind = type(m).__name__
    p = getattr(m, leaf, None)
    if not isinstance(p, torch.nn.Parameter) or not p.numel() or not _plain(m, kind):
        return None
    if p.dtype != held.dtype or p.dim() != len(full):
        return None
    fused = _fused_offset(m, kind, part)
    if fused is None:
        return None
    if box is not None:  # tp_boxes: the worker holds its box only, which is what lands
        size, src = tuple(box.size), tuple(slice(None) for _ in full)
    else:  # every tensor whole: this rank loads the box of tp_boxes' rules (whole at tp 1)
        spec = tp_boxes.rank_box(m, kind, leaf, part, full)[0]
        start = (0,) * len(full) if spec is None else tuple(spec.offset)
        size = tuple(full) if spec is None else tuple(spec.size)
        src = tuple(slice(o, o + n) for o, n in zip(start, size, strict=True))
    dst = tuple(slice(fused, fused + n) if d == 0 else slice(0, n) for d, n in enumerate(size))
    if any(s.stop > n for s, n in zip(dst, p.shape, strict=True)):
        return None
    return Slot(target, leaf, p, p.data_ptr(), src, dst)


def _seen(slot: Slot, held: torch.Tensor) -> bool:
    """The parameter region holds ``held``'s bytes, which are not all one value."""
    want = held[slot.src]
    if want.numel() < 2:
        return False
    flat = want.reshape(-1)
    if not bool((flat != flat[0]).any()):
        return False
    got = slot.param.data[slot.dst]
    if got.device != want.device:
        want = want.to(got.device)
    return bool(torch.equal(got, want))


def region_digests(model: Any, tensors: Iterable[tuple[str, Any, str]]) -> dict[str, Any]:
    """Per checkpoint tensor ``(name, full shape, dtype name)``, the digest of the parameter
    region that holds this rank's box of it (where :func:`_slot` computes it lands: fused rows,
    the tensor-parallel box of ``tp_boxes``' rules), taken where the parameter lives
    (``sync.device_digest.piece_digest``: the same bits on CPU and GPU):
    ``{"digests": {name: [box offset, box size, a, b]}, "unchecked": [names]}``. Unchecked:
    tensors whose place is not a plain parameter region (quantized or repacked modules, a dtype
    other than the parameter's, a name the model does not have). What a trainer compares with
    the bytes it believes the engine holds (``sync.CheckpointPatcher.check``); it trusts the
    computed place, where an in-place commit trusts only a place it has seen."""
    from deltackpt.format.dtypes import dtype_from_name
    from deltackpt.sync.device_digest import piece_digest

    modules = dict(model.named_modules())
    packed: dict[str, list[str]] = dict(getattr(model, "packed_modules_mapping", {}) or {})
    out: dict[str, Any] = {"digests": {}, "unchecked": []}
    for name, shape, dtype in tensors:
        full = tuple(int(n) for n in shape)
        stub = torch.empty(0, dtype=dtype_from_name(str(dtype)))
        s = _slot(str(name), stub, full, None, modules, packed)
        if s is None:
            out["unchecked"].append(name)
            continue
        region = s.param.data[s.dst].contiguous().reshape(-1).view(torch.uint8)
        a, b = piece_digest(region)
        offset = [0 if x.start is None else int(x.start) for x in s.src]
        size = [
            n if x.start is None else int(x.stop) - int(x.start)
            for x, n in zip(s.src, full, strict=True)
        ]
        out["digests"][name] = [offset, size, str(a), str(b)]
    return out


def learn(
    model: Any,
    held: dict[str, torch.Tensor],
    names: Iterable[str],
    shapes: dict[str, tuple[int, ...]],
    boxes: dict[str, Box | None],
    slots: dict[str, Slot],
) -> None:
    """After a reload of ``names`` through ``load_weights``: (re)learn their slots (module doc).
    A name whose slot is not seen loses it."""
    modules = dict(model.named_modules())
    packed: dict[str, list[str]] = dict(getattr(model, "packed_modules_mapping", {}) or {})
    for name in names:
        slots.pop(name, None)
        t = held.get(name)
        if t is None:
            continue
        full = shapes.get(name, tuple(t.shape))
        s = _slot(name, t, tuple(full), boxes.get(name), modules, packed)
        if s is not None and _seen(s, t):
            slots[name] = s


def usable(model: Any, slots: dict[str, Slot], names: Iterable[str]) -> bool:
    """Every one of ``names`` has a slot whose parameter is still the one seen."""
    modules = dict(model.named_modules())
    return all((s := slots.get(n)) is not None and s.current(modules) for n in names)


#: element writes at the commit into parameters on the host too (measured slower there: 0.28 s
#: against 0.10 s whole for an RL step of a 0.5B model, the index arithmetic outweighs the bytes
#: saved); a staged round's, whose arithmetic :func:`prepare` did before the pause, always
SPARSE_ON_HOST = False


def write(
    slots: dict[str, Slot],
    held: dict[str, torch.Tensor],
    changed: list[tuple[str, torch.Tensor]],
    fail: Callable[[str], None] | None = None,
    elements: dict[str, torch.Tensor | None] | None = None,
    prepared: Prepared | None = None,
) -> int:
    """Copy ``changed`` (held tensors, by name) into their parameter regions, in name order
    (whole tensors into device parameters land together, through the pinned buffers, after the
    last); ``fail(name)`` is called before each (a test hook that may raise). ``elements``: per name,
    the flat indices of the elements that changed (``WeightReceiver.changed_elements``; None:
    unknown): where they are few, only those are written, their indices and values moved to
    the parameters' device together through the pinned buffers; ``prepared``: those already
    there (:func:`prepare`, off the pause), used for the very tensors and slots it was made
    from. Returns the bytes written (values, and indices where written element by element).
    ``held`` is updated with ``changed`` first, as a reload does. Element writes are queued on
    the current stream: the caller waits for the parameters' devices before the engine's next
    step (``worker.commit_layers``)."""
    held.update(changed)
    n, bounced, sparse = 0, [], []
    ready = prepared.writes if prepared is not None else {}
    with torch.no_grad():
        for name, t in sorted(changed, key=lambda c: c[0]):
            if fail is not None:
                fail(name)
            s = slots[name]
            got = ready.pop(name, None)  # used once: a rollback later writes other bytes
            if got is not None and got.slot is s and got.source is t:
                n += _index_write(got)
                continue
            idx = None if elements is None else elements.get(name)
            if idx is not None and _sparse_pays(s, t, idx) and _sparse_ok(s, t):
                sparse.append((s, t, idx))
                continue
            src, dst = t[s.src], s.param.data[s.dst]
            if BOUNCE_ON_HOST or s.param.device.type != "cpu":
                bounced.append((dst, src))
            else:
                dst.copy_(src)
            n += src.numel() * src.element_size()
        for w in _elements_to_device(sparse, bounced, narrow=False):
            n += _index_write(w)
    return n


@dataclass
class ElementWrite:
    """The changed elements of held tensor ``source`` that land in ``slot``, on the parameter's
    device: their flat positions in the parameter (int64) and their values."""

    slot: Slot
    source: torch.Tensor
    at: torch.Tensor
    vals: torch.Tensor


@dataclass
class Prepared:
    """A commit's element writes moved to the parameters' device ahead of it (:func:`prepare`),
    by held tensor name."""

    writes: dict[str, ElementWrite] = field(default_factory=dict)

    @property
    def device_bytes(self) -> int:
        return sum(w.vals.numel() * (8 + w.vals.element_size()) for w in self.writes.values())


def prepare(
    slots: dict[str, Slot],
    changed: list[tuple[str, torch.Tensor]],
    elements: dict[str, torch.Tensor | None],
) -> Prepared:
    """Off the pause (a staged round, received and applied to the held copies): the changed
    elements :func:`write` would write one by one into device parameters, gathered from the held
    tensors, moved to the parameters' devices now (their indices as int32 where they fit) and
    turned into positions in the parameters there, so the commit only scatters them: one
    ``index_copy_`` per tensor; landed when this returns (the commit may run on another thread
    and stream). Only where the devices have room for them and for the work of turning them
    into positions (:func:`_prepare_bytes`) beside the serving engine (``cuda.serving_room``:
    free, not what torch's allocator holds for the engine's next step, beside 256 MiB: an
    engine that sized itself to most of the device leaves that); what is not prepared
    :func:`write` does as before. Their device memory lasts until the commit drops them. A
    prepared write is used once, and only for the very tensor and slot it was made from (a
    rollback writes other bytes: moved then)."""
    items = []
    for name, t in changed:
        s, idx = slots.get(name), elements.get(name)
        if s is None or idx is None or not (_sparse_pays(s, t, idx) and _sparse_ok(s, t, True)):
            continue
        items.append((name, s, t, idx))
    if not items:
        return Prepared()
    need = _prepare_bytes([(s, t, idx) for _, s, t, idx in items])
    devices = {s.param.device for _, s, _, _ in items}
    if not all(cuda.serving_room(d, need) for d in devices):
        return Prepared()
    try:  # room as counted, which a new block may still not get (feed._moved): none prepared
        with torch.no_grad():
            done = _elements_to_device([(s, t, idx) for _, s, t, idx in items], [], narrow=True)
        cuda.synchronize(devices)  # the positions' kernels ran on this thread's stream
    except torch.cuda.OutOfMemoryError:
        return Prepared()
    return Prepared({name: w for (name, *_), w in zip(items, done, strict=True)})


def _prepare_bytes(items: list[tuple[Slot, torch.Tensor, torch.Tensor]]) -> int:
    """Device bytes :func:`prepare` holds at its peak for the changed elements ``idx`` of each
    ``(slot, t, idx)``: every tensor's values, int32 indices and int64 positions (all moved
    first, kept until the commit), and the largest of one tensor's work in
    :func:`_positions` beside them (int64 each: the flat index for a block of its parameter;
    else also the remainder, a coordinate per dimension and two temporaries of the sum)."""
    kept = sum(idx.numel() * (4 + 8 + t.element_size()) for _, t, idx in items)
    work = max(
        idx.numel() * 8 * (1 if _block_start(s, t) is not None else t.dim() + 4)
        for s, t, idx in items
    )
    return kept + work


def _elements_to_device(
    items: list[tuple[Slot, torch.Tensor, torch.Tensor]],
    bounced: list[tuple[torch.Tensor, torch.Tensor]],
    narrow: bool,
) -> list[ElementWrite]:
    """The changed elements of each ``(slot, held, idx)`` gathered on the host and moved to
    the slot's parameter's device in one pass through the pinned buffers, together with the
    whole-tensor copies ``bounced`` (``to_device.copy_through``: landed on return), then their
    positions in the parameter computed there; ``narrow``: indices moved as int32 where the
    tensor's elements fit in one (half the bytes, one host pass more)."""
    pairs, moved = list(bounced), []
    for s, t, idx in items:
        dev = s.param.device
        vals = t.reshape(-1)[idx]  # gathered where the held copy is
        if narrow and t.numel() < 2**31 and dev != idx.device:
            idx = idx.to(torch.int32)
        if dev != idx.device:
            idx_d = torch.empty(idx.shape, dtype=idx.dtype, device=dev)
            vals_d = torch.empty(vals.shape, dtype=vals.dtype, device=dev)
            pairs += [(idx_d, idx), (vals_d, vals)]
            idx, vals = idx_d, vals_d
        moved.append((s, t, idx, vals))
    copy_through(pairs, BOUNCE)
    return [_positions(s, t, idx, vals) for s, t, idx, vals in moved]


def _positions(s: Slot, t: torch.Tensor, idx: torch.Tensor, vals: torch.Tensor) -> ElementWrite:
    """Flat indices ``idx`` of held tensor ``t`` turned into flat positions in the slot's
    parameter, where the indices are (the parameter's device): a rank's part of a whole tensor
    picked there, the others dropped with their values. The whole tensor into rows of its
    parameter (q/k/v and gate/up parts, a tensor of its own): its position plus where the
    rows start, one operation."""
    p = s.param.data
    base = _block_start(s, t)
    if base is not None:
        return ElementWrite(s, t, idx.long() + base, vals)
    flat = idx.long()
    rem, coords = flat, []
    for size in reversed(t.shape):
        coords.append(rem % size)
        rem = rem // size
    coords.reverse()
    keep: torch.Tensor | None = None
    at = torch.zeros_like(flat)
    for d, (c, a, b, stride) in enumerate(zip(coords, s.src, s.dst, p.stride(), strict=True)):
        lo = a.start or 0
        hi = t.shape[d] if a.stop is None else a.stop
        if lo > 0 or hi < t.shape[d]:  # this rank's part of a whole tensor
            inside = (c >= lo) & (c < hi)
            keep = inside if keep is None else keep & inside
        at += (c + ((b.start or 0) - lo)) * stride
    if keep is not None:
        at, vals = at[keep], vals[keep]
    return ElementWrite(s, t, at, vals)


def _block_start(s: Slot, t: torch.Tensor) -> int | None:
    """Where the whole of held tensor ``t`` lies as one block of its (contiguous) parameter:
    every element of ``t`` at that offset plus its own flat index; None where it does not (a
    rank's part of ``t``, columns of the parameter)."""
    p = s.param.data
    if t.dim() == 0 or t.dim() != p.dim() or not (p.is_contiguous() and t.is_contiguous()):
        return None
    whole = all(
        (a.start or 0) == 0 and (a.stop is None or a.stop == n)
        for a, n in zip(s.src, t.shape, strict=True)
    )
    rows = all(
        (b.start or 0) == 0 and b.stop == n and n == m
        for b, n, m in zip(s.dst[1:], p.shape[1:], t.shape[1:], strict=True)
    )
    return (s.dst[0].start or 0) * p.stride(0) if whole and rows else None


#: whole writes into parameters on a device go from the receiver's host copies (ordinary
#: memory) through two reused pinned buffers of ``BOUNCE`` bytes (None: ``to_device.BUCKET``),
#: copied in on a side stream while the next is filled (``to_device.copy_through``; a copy from
#: pageable memory runs at a few GB/s, blocking, per tensor); ``BOUNCE_ON_HOST``: the same for
#: parameters on the host (the CPU suite's cover)
BOUNCE: int | None = None
BOUNCE_ON_HOST = False


def _sparse_pays(s: Slot, t: torch.Tensor, idx: torch.Tensor) -> bool:
    """Writing the changed elements ``idx`` of ``t`` (an int64 index and a value each, all of
    the tensor's: a rank's part is picked on the device) moves fewer bytes to the parameter's
    device than its region of ``t`` whole (bf16: fewer than a fifth of the region's elements
    changed, at tp=1)."""
    region = math.prod(
        len(range(*sl.indices(size))) for sl, size in zip(s.src, t.shape, strict=True)
    )
    return idx.numel() * (8 + t.element_size()) < region * t.element_size()


def _sparse_ok(s: Slot, t: torch.Tensor, ahead: bool = False) -> bool:
    """Elements can be written alone into the slot (``ahead``: their positions computed before
    the pause, which makes them pay into host parameters too: :func:`prepare`)."""
    host = s.param.device.type == "cpu"
    return (SPARSE_ON_HOST or ahead or not host) and (
        s.param.data.is_contiguous() and t.is_contiguous()
    )


def _index_write(w: ElementWrite) -> int:
    """Scatter ``w``'s values into its slot's parameter; the bytes written (an int64 index and
    a value each). Prepared ones were allocated on the stage thread's stream and are dropped
    right after: their memory kept from reuse there until the scatter has run."""
    cuda.used_here(w.at, w.vals)
    w.slot.param.data.view(-1).index_copy_(0, w.at, w.vals)
    return int(w.vals.numel()) * (w.vals.element_size() + 8)


def slot_bytes(slots: dict[str, Slot]) -> int:
    """Bytes of the parameter regions the slots cover."""
    return sum(
        math.prod(s.stop - s.start for s in slot.dst) * slot.param.element_size()
        for slot in slots.values()
    )

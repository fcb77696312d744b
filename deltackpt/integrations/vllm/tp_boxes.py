"""Which box of each checkpoint tensor a tensor-parallel vLLM worker needs, and how that box is
handed to the model's own ``load_weights`` (opt-in: ``DELTACKPT_VLLM_TP_BOXES=1`` on the
workers or ``DeltackptTrainerInitInfo(tp_boxes=True)``; docs/sync.md, "Memory").

The rules, from the module that loads the tensor (vLLM's ``model/layers/linear.py`` and
``vocab_parallel_embedding.py``), along dim 0 unless said otherwise, for rank ``r`` of ``tp``:

* ``ColumnParallelLinear`` (weight, bias): ``output_size_per_partition`` rows from ``r`` x that;
* ``MergedColumnParallelLinear`` part ``i`` (``gate_proj``/``up_proj`` of ``gate_up_proj``):
  ``output_sizes[i] / tp`` rows from ``r`` x that;
* ``QKVParallelLinear``: ``q`` ``num_heads`` x ``head_size`` rows from ``r`` x that; ``k`` and
  ``v`` ``num_kv_heads`` x head size rows from ``r // num_kv_head_replicas`` x that (several
  ranks share a kv head when there are fewer kv heads than ranks);
* ``RowParallelLinear``: weight ``input_size_per_partition`` columns (dim 1) from ``r`` x that;
  the bias whole (added after the all-reduce);
* ``VocabParallelEmbedding`` / ``ParallelLMHead`` weight: rows ``shard_indices``
  ``org_vocab_start_index`` to ``org_vocab_end_index`` (vLLM pads each rank's rows; the padding
  is not in the checkpoint and vLLM zeroes it);
* a routed expert of a mixture of experts (``...experts.<e>.gate_proj|up_proj|down_proj.weight``,
  or ``w1``/``w3``/``w2``, loaded by vLLM's ``RoutedExperts.weight_loader``, sharded over the MoE
  layer's tensor-parallel ranks, ``moe_parallel_config.tp_size``): gate and up ``rows / tp``
  rows from ``r`` x that, down ``cols / tp`` columns (dim 1); the experts fused in one tensor
  (``...experts.down_proj`` ``[E, H, I]``, as transformers 5 saves them): down the same columns
  of every expert (dim 2), ``gate_up_proj`` ``[E, 2I, H]`` the rows covering the rank's gate
  rows and up rows (``I/tp`` each, one box: ``(1 + 1/tp) / 2`` of it); with expert
  parallelism (whole experts per rank) an expert of this rank's whole, another rank's none of
  it (``BoxRule.skip``: neither sent to this worker nor read from the store, nor held), fused
  experts the rows of this rank's along dim 0 when they are one run in order; a
  quantized or transposed layout: whole;
* anything else (norms, ``ReplicatedLinear``, quantized layers, subclasses with their own
  loaders, a name no module is found for, ``tp == 1``): the whole tensor (always correct).

``load_weights`` narrows the *full* checkpoint tensor at the rank's offset, so each box is
handed over as a full-shape view (:func:`full_view`) whose only bytes ever read are the box's:
a strided view over a buffer that holds the box where the narrow looks for it.
"""

from __future__ import annotations

import inspect
import math
import re
from dataclasses import dataclass
from typing import Any

import torch

from deltackpt.options import vllm_switch
from deltackpt.sync.schedule_decl import Box

__all__ = [
    "ENV",
    "BoxRule",
    "box_rules",
    "enabled",
    "expert_box",
    "expert_of",
    "full_view",
    "module_of",
    "rank_box",
]

#: the workers' switch (also ``DeltackptTrainerInitInfo(tp_boxes=True)``)
ENV = "DELTACKPT_VLLM_TP_BOXES"

Shape = tuple[int, ...]


def enabled(flag: bool | None = None) -> bool:
    """``flag`` when given, else the workers' switch (default off;
    :func:`deltackpt.options.vllm_switch`: a malformed value raises, naming it)."""
    if flag is not None:
        return bool(flag)
    return vllm_switch(ENV)


@dataclass(frozen=True)
class BoxRule:
    """Where a checkpoint tensor goes: ``module`` (its kind ``kind``), the box this rank loads
    (None: whole) and why."""

    module: str
    kind: str
    box: Box | None
    why: str
    skip: bool = False  # this rank loads none of it (an expert another rank holds)


def _split(shape: Shape, dim: int, start: int, size: int) -> Box:
    off = tuple(start if d == dim else 0 for d in range(len(shape)))
    sz = tuple(size if d == dim else s for d, s in enumerate(shape))
    return Box(off, sz)


def _unquantized(m: Any) -> bool:
    qm = getattr(m, "quant_method", None)
    return qm is None or type(qm).__name__.startswith("Unquantized")


def _own_loader(m: Any, leaf: str) -> bool:
    """The parameter loads through its module class's own loader (a model that sets another
    ``weight_loader`` may not narrow at the rank's offset); a parameter vLLM emptied after
    repacking it may have lost the attribute: its module's class decides."""
    p = getattr(m, leaf, None)
    wl = getattr(p, "weight_loader", None)
    if wl is None:
        return True
    wl = inspect.unwrap(wl)  # vLLM's layerwise reload wraps the loaders (functools.wraps)
    fn = getattr(wl, "__func__", None)
    return (
        getattr(wl, "__self__", None) is m
        and fn is not None
        and fn is getattr(type(m), fn.__name__, None)
    )


def box_rules(model: Any) -> Any:
    """A function ``rule(name, shape) -> BoxRule`` for checkpoint tensors of ``model`` (a vLLM
    model on this worker), by the module doc's rules."""
    modules = dict(model.named_modules())
    packed: dict[str, list[str]] = dict(getattr(model, "packed_modules_mapping", {}) or {})

    def rule(name: str, shape: Shape) -> BoxRule:
        expert = expert_of(name, modules)
        if expert is not None:
            target, m, shard, e = expert
            shp = tuple(int(s) for s in shape)
            if m.moe_config.moe_parallel_config.use_ep:
                box, why, skip = expert_parallel_box(m, shp, e)
                return BoxRule(target, type(m).__name__, box, why, skip)
            box, why = expert_box(m, shard, shp, e is None)
            return BoxRule(target, type(m).__name__, box, why)
        where = module_of(name, modules, packed)
        if where is None:
            return BoxRule("", "", None, "no module")
        target, part, leaf = where
        m = modules.get(target)
        if m is None:
            return BoxRule(target, "", None, "no module of that name: whole")
        kind = type(m).__name__
        box, why = rank_box(m, kind, leaf, part, tuple(int(s) for s in shape))
        if box is not None and box.size == tuple(shape):
            box = None
        return BoxRule(target, kind, box, why)

    return rule


def module_of(
    name: str, modules: dict[str, Any], packed: dict[str, list[str]]
) -> tuple[str, int | None, str] | None:
    """Where checkpoint tensor ``name`` loads: ``(module name, its part of a fused module or
    None, parameter name)`` by the model's ``packed_modules_mapping`` (``q_proj`` of
    ``qkv_proj`` is part 0); None for a name without a module part. The module may not exist
    (``modules`` is only asked whether the fused one does)."""
    parts = name.split(".")
    if len(parts) < 2:
        return None
    leaf, sub = parts[-1], parts[-2]
    target, part = ".".join(parts[:-1]), None
    for fused, subs in packed.items():
        if sub in subs:
            cand = ".".join([*parts[:-2], fused])
            if cand in modules:
                target, part = cand, subs.index(sub)
            break
    return target, part, leaf


#: checkpoint names of an expert's projections -> vLLM's shard ids (``w1``, ``w3``: the
#: gate and up halves of ``w13_weight``; ``w2``: down)
EXPERT_SHARDS = {"gate_proj": "w1", "w1": "w1", "up_proj": "w3", "w3": "w3",
                 "down_proj": "w2", "w2": "w2"}  # fmt: skip
#: the experts of a layer fused in one tensor -> shard ids (``w13``: gate and up halves)
FUSED_SHARDS = {"gate_up_proj": "w13", "w13": "w13", "down_proj": "w2", "w2": "w2"}
_EXPERT = re.compile(r"^(?P<layer>.+\.experts)\.(?P<e>\d+)\.(?P<proj>\w+)\.weight$")
_FUSED = re.compile(r"^(?P<layer>.+\.experts)\.(?P<proj>\w+?)(?:\.weight)?$")


def expert_of(name: str, modules: dict[str, Any]) -> tuple[str, Any, str, int | None] | None:
    """``(module name, module, shard id, expert)`` of the vLLM routed-experts module that loads
    checkpoint tensor ``name`` (one expert's projection: its global number; every expert's fused
    in one tensor: None), or None when ``name`` is neither. vLLM 0.32 nests it as
    ``<layer>.experts.routed_experts`` (the ``experts`` module is the MoE runner); older builds
    load at ``<layer>.experts`` itself."""
    one, fused = _EXPERT.match(name), _FUSED.match(name)
    if one is not None and one["proj"] in EXPERT_SHARDS:
        layer, shard = one["layer"], EXPERT_SHARDS[one["proj"]]
    elif fused is not None and fused["proj"] in FUSED_SHARDS:
        layer, shard = fused["layer"], FUSED_SHARDS[fused["proj"]]
    else:
        return None
    for target in (f"{layer}.routed_experts", layer):
        m = modules.get(target)
        if m is not None and hasattr(m, "moe_config") and hasattr(m, "w13_weight"):
            return target, m, shard, None if one is None else int(one["e"])
    return None


def expert_parallel_box(m: Any, shape: Shape, e: int | None) -> tuple[Box | None, str, bool]:
    """Under expert parallelism (each rank holds whole experts, none split): ``(box, why,
    skip)`` of expert ``e``'s projection (``skip``: another rank's expert, which this rank's
    loader drops) or of every expert fused (``e`` None: the rows of this rank's experts along
    dim 0 when they are one run in order, else whole)."""
    local = m._map_global_expert_id_to_local_expert_id
    if e is not None:
        if local(e) == -1:
            return None, f"expert {e} lives on another rank: none of it", True
        return None, f"expert {e} lives here, whole", False
    mine = [g for g in range(shape[0]) if local(g) != -1]
    run = list(range(mine[0], mine[0] + len(mine))) if mine else None
    if mine != run or [local(g) for g in mine] != list(range(len(mine))):
        return None, "fused experts: this rank's are not one run in order: whole", False
    return _split(shape, 0, mine[0], len(mine)), f"fused experts {mine[0]}-{mine[-1]}: rows", False


def expert_box(m: Any, shard: str, shape: Shape, fused: bool = False) -> tuple[Box | None, str]:
    """The box of an expert's projection of ``shape`` (shard ``shard``; ``fused``: every
    expert's, stacked on dim 0) that this rank's routed-experts module ``m`` loads, as its
    ``weight_loader`` narrows each expert (``_load_w13``, ``_load_w2``: ``shape[dim] // tp``
    from ``tp_rank`` x that), and why (None: whole)."""
    if fused and getattr(m, "is_fused_checkpoint_transposed", False):
        return None, "fused experts stored transposed: whole"
    cfg = m.moe_config
    par = cfg.moe_parallel_config
    tp, r = int(par.tp_size), int(cfg.tp_rank)
    if tp <= 1:
        return None, "experts not split (tp 1): whole"
    if par.use_ep:
        return None, "expert parallel: whole"
    if not _unquantized(m):
        return None, "quantized experts: whole"
    stem = "w2" if shard == "w2" else "w13"
    p = getattr(m, f"{stem}_weight", None)
    if p is None or getattr(p, "is_transposed", False) or len(shape) != 2 + fused:
        return None, "experts' layout not the checkpoint's: whole"
    if not _own_loader(m, f"{stem}_weight"):
        return None, "experts with a loader of the model's own: whole"
    dim = (1 if shard == "w2" else 0) + fused
    if shard == "w13":  # gate and up halves, each narrowed alike: the rows covering both
        if not cfg.is_act_and_mul or shape[dim] % 2:
            return None, "fused experts without gate and up halves: whole"
        half = shape[dim] // 2
        per = half // tp
        start, stop = per * r, half + min(per * (r + 1), half)
        if per <= 0 or stop <= start:
            return None, "experts' rows do not split: whole"
        why = "fused experts w13: the rows covering this rank's gate rows and up rows"
        return _split(shape, dim, start, stop - start), why
    per = shape[dim] // tp
    start = per * r
    size = min(per, shape[dim] - start)
    if per <= 0 or size <= 0:
        return None, "experts' rows do not split: whole"
    what = "columns" if shard == "w2" else "rows"
    why = f"{'fused experts' if fused else 'expert'} {shard}: {what}"
    return _split(shape, dim, start, size), why


def rank_box(
    m: Any, kind: str, leaf: str, part: int | None, shape: Shape
) -> tuple[Box | None, str]:
    """The box of a checkpoint tensor of ``shape`` (part ``part`` of a fused module) that this
    rank's module ``m`` (of class ``kind``) loads, by the module doc's rules, and why (None:
    whole)."""
    tp = int(getattr(m, "tp_size", 1) or 1)
    r = int(getattr(m, "tp_rank", 0) or 0)
    if tp <= 1:
        return None, "not split (tp 1): whole"
    if not _unquantized(m):
        return None, "quantized: whole"
    if leaf not in ("weight", "bias") or not shape:
        return None, f"{leaf}: whole"
    if not _own_loader(m, leaf):
        return None, f"{kind}.{leaf} has a loader of the model's own: whole"
    if kind == "QKVParallelLinear" and part is not None:
        name = "qkv"[part] if part < 3 else "?"
        if name == "q":
            size, total = m.num_heads * m.head_size, m.total_num_heads * m.head_size
            start = r * size
        elif name in "kv":
            hs = m.head_size if name == "k" else m.v_head_size
            size, total = m.num_kv_heads * hs, m.total_num_kv_heads * hs
            start = (r // m.num_kv_head_replicas) * size
        else:
            return None, "qkv part unknown: whole"
        if shape[0] != total:
            return None, f"{name}: checkpoint rows {shape[0]} != {total}: whole"
        return _split(shape, 0, start, size), f"qkv part {name}: rows"
    if kind == "MergedColumnParallelLinear" and part is not None:
        sizes = list(m.output_sizes)
        if part >= len(sizes) or shape[0] != sizes[part] or sizes[part] % tp:
            return None, "merged part does not match: whole"
        size = sizes[part] // tp
        return _split(shape, 0, r * size, size), f"merged part {part}: rows"
    if kind == "ColumnParallelLinear" and part is None:
        size = int(m.output_size_per_partition)
        if shape[0] != size * tp:
            return None, "column rows do not match: whole"
        return _split(shape, 0, r * size, size), "column parallel: rows"
    if kind == "RowParallelLinear" and part is None:
        if leaf == "bias":
            return None, "row-parallel bias: whole"
        size = int(m.input_size_per_partition)
        if len(shape) != 2 or shape[1] != size * tp:
            return None, "row columns do not match: whole"
        return _split(shape, 1, r * size, size), "row parallel: columns"
    if kind in ("VocabParallelEmbedding", "ParallelLMHead") and part is None and leaf == "weight":
        si = m.shard_indices
        lo, hi = int(si.org_vocab_start_index), int(si.org_vocab_end_index)
        if shape[0] != int(m.org_vocab_size) or hi <= lo:
            return None, "vocabulary does not match: whole"
        return _split(shape, 0, lo, hi - lo), "vocabulary rows"
    return None, f"{kind}: whole"


def full_view(t: torch.Tensor, box: Box | None, shape: Shape) -> torch.Tensor:
    """A tensor of the checkpoint's ``shape`` whose ``box`` holds ``t`` (a rank's box), for a
    weight loader that narrows the full tensor at the rank's offset: a strided view over a
    buffer laid out as ``t`` (same strides) with the box where the view's index maps it. The
    elements outside the box alias other bytes of the buffer and are never read by a loader
    that narrows to the box. The buffer spans the full index range (``offset`` x strides
    before the box), but only the box's pages are written: fresh pages never touched stay out
    of the resident set (a row split of the last dim costs (tp-1) rows of the box more)."""
    if box is None or tuple(t.shape) == tuple(shape):
        return t
    t = t.contiguous()
    strides = t.stride()
    pad = sum(o * s for o, s in zip(box.offset, strides, strict=True))
    span = sum((n - 1) * s for n, s in zip(shape, strides, strict=True)) + 1
    buf = torch.empty(max(span, pad + t.numel()), dtype=t.dtype)
    buf.as_strided(tuple(t.shape), strides, pad).copy_(t)
    return buf.as_strided(tuple(shape), strides, 0)


def box_bytes(shape: Shape, box: Box | None, itemsize: int) -> int:
    """Bytes of ``box`` (None: the whole ``shape``)."""
    return (math.prod(shape) if box is None else box.numel) * itemsize

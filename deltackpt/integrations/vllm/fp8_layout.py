"""Refit into an engine that serves block-FP8 weights (``quantization_config: {"quant_method":
"fp8", "weight_block_size": [128, 128]}``): the workers tell the trainer which weights they hold
as FP8 and in which blocks, the trainer quantizes exactly those
(:class:`~deltackpt.sync.fp8.Fp8Blocks`) and sends each with its scales, and a worker refuses a
round that would write another dtype into an FP8 parameter (docs/sync.md, "FP8 engines").

* :func:`engine_layout` (worker): the model's block-FP8 linear modules, their block shape and
  FP8 dtype, the fused-module map that names them from checkpoint names, and the FP8 modules
  deltackpt does not quantize (MoE experts, per-tensor scales);
* :func:`publish` / :func:`read` carry it through the group's store at the trainer's init;
* :func:`blocks_for` (trainer): the :class:`Fp8Blocks` of that layout;
* :func:`unfused` (trainer, and the store route): transformers 5's fused experts
  (``experts.gate_up_proj`` [E, 2I, H]) split into the per-expert weights vLLM quantizes and
  loads one by one (sent fused in bf16, vLLM's loader wrote them unscaled: garbage experts
  with scales of 1e32, found by a probe; now refused too);
* :func:`refusal` (worker, at each commit): why a round's tensors cannot go into the FP8
  parameters, before anything is loaded (the round is voted down and every worker keeps the
  previous version).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from deltackpt.format.dtensor import is_dtensor, local_box, local_tensor
from deltackpt.integrations.vllm.tp_boxes import module_of
from deltackpt.sync import LocalShard, PlanError, SyncGroup
from deltackpt.sync.dtypes import is_fp8, named_dtype
from deltackpt.sync.fp8 import FUSED_EXPERTS, Fp8Blocks, expert_parts

__all__ = [
    "blocks_for",
    "engine_layout",
    "for_engine",
    "publish",
    "read",
    "refusal",
    "unfused",
]

KEY = "vllm/fp8"


def _fp8_module(m: Any) -> str | None:
    """``"block"`` for a linear module vLLM holds as block-scaled FP8, ``"moe"`` for fused
    experts held so (``w13_weight``/``w2_weight`` with their ``*_scale_inv``), ``"other"`` for
    weights held as FP8 in another form (per-tensor or per-channel scales), None when its
    weights are not FP8 (an attention module's FP8 KV cache is not a weight)."""
    qm = getattr(m, "quant_method", None)
    if qm is None or type(qm).__name__.startswith("Unquantized"):
        return None
    block = getattr(m, "weight_block_size", None)
    w = getattr(m, "weight", None)
    if isinstance(w, torch.Tensor) and is_fp8(w.dtype):
        has_scale = isinstance(getattr(m, "weight_scale_inv", None), torch.Tensor)
        return "block" if block is not None and has_scale else "other"
    e = getattr(m, "w13_weight", None)
    if isinstance(e, torch.Tensor) and is_fp8(e.dtype):
        has_scale = isinstance(getattr(m, "w13_weight_scale_inv", None), torch.Tensor)
        return "moe" if block is not None and has_scale else "other"
    return None


def _experts_prefix(name: str) -> str | None:
    """The checkpoint prefix of fused-experts module ``name``: its name up to its last
    ``experts`` part (``model.layers.3.mlp.experts.routed_experts`` ->
    ``model.layers.3.mlp.experts``, under which the checkpoint has ``<e>.gate_proj.weight``)."""
    parts = name.split(".")
    last = max((i for i, p in enumerate(parts) if p == "experts"), default=None)
    return None if last is None else ".".join(parts[: last + 1])


def _expert(name: str, prefixes: set[str] | dict[str, Any]) -> str | None:
    """The experts prefix of checkpoint weight ``name`` (``<prefix>.<e>.<proj>.weight``)."""
    parts = name.split(".")
    if len(parts) < 4 or parts[-1] != "weight" or not parts[-3].isdigit():
        return None
    prefix = ".".join(parts[:-3])
    return prefix if prefix in prefixes else None


def _fused_expert(name: str, prefixes: set[str] | dict[str, Any]) -> str | None:
    """The experts prefix of a fused expert tensor ``name`` (``<prefix>.gate_up_proj``,
    :data:`~deltackpt.sync.fp8.FUSED_EXPERTS`)."""
    prefix, _, last = name.rpartition(".")
    return prefix if last in FUSED_EXPERTS and prefix in prefixes else None


def unfused(tensors: Mapping[str, Any], layout: dict[str, Any] | None) -> Mapping[str, Any]:
    """``tensors`` with the fused expert tensors of the engine's block-FP8 experts (transformers
    5's ``experts.gate_up_proj`` / ``experts.down_proj``) as the per-expert checkpoint weights
    vLLM loads and quantizes one by one (``experts.<e>.gate_proj.weight``...; views, no copy).
    A trainer rank's shard of whole experts (``Shard(0)`` of the experts, as expert parallelism
    splits them) gives those experts under their global numbers; a shard that cuts an expert
    raises :class:`PlanError`. Without such experts ``tensors`` is returned as it is."""
    experts = set(layout.get("experts") or []) if layout is not None else set()
    if not experts or not any(_fused_expert(n, experts) for n in tensors):
        return tensors
    out: dict[str, Any] = {}
    for name, t in tensors.items():
        prefix = _fused_expert(name, experts)
        if prefix is None:
            out[name] = t
            continue
        local, off, shape = _local_part(t)
        parts = expert_parts(name, shape)
        if parts is None:
            raise PlanError(
                f"tensor {name!r} has shape {list(shape)}; fused experts of {prefix} are "
                "expected as [experts, rows, columns] (transformers 5's layout)"
            )
        if off is not None and (any(off[1:]) or tuple(local.shape[1:]) != tuple(shape[1:])):
            raise PlanError(
                f"tensor {name!r}: this rank holds {list(local.shape)} at {list(off)} of "
                f"{list(shape)}, which cuts its experts; shard fused experts by whole experts "
                "(dim 0), send whole tensors, or quantize them yourself and pass "
                "quantize='none'"
            )
        first = 0 if off is None else off[0]
        for each, _, (e, r0, r1) in parts:  # this rank's experts, under their global numbers
            if first <= e < first + local.shape[0]:
                out[each] = local[e - first, r0:r1]
    return out


def _local_part(t: Any) -> tuple[torch.Tensor, tuple[int, ...] | None, tuple[int, ...]]:
    """``(local tensor, its offset or None for a whole tensor, global shape)``."""
    if isinstance(t, LocalShard):
        return t.tensor, tuple(int(x) for x in t.offset), tuple(int(x) for x in t.shape)
    if is_dtensor(t):
        off, _ = local_box(t, "fused experts")
        return local_tensor(t), off, tuple(t.shape)
    return t, None, tuple(t.shape)


def engine_layout(model: Any) -> dict[str, Any] | None:
    """The model's block-FP8 layout (module doc), as JSON-able values; None when it holds no
    FP8 weight. ``experts``: the checkpoint prefixes of its block-FP8 fused experts."""
    block: list[int] | None = None
    dtype: str | None = None
    modules: list[str] = []
    experts: list[str] = []
    other: list[str] = []
    for name, m in model.named_modules():
        kind = _fp8_module(m)
        if kind in ("block", "moe"):
            w = m.weight if kind == "block" else m.w13_weight
            mine = [int(b) for b in m.weight_block_size]
            mdt = str(w.dtype).removeprefix("torch.")
            prefix = _experts_prefix(name) if kind == "moe" else name
            if prefix is None or (block or mine) != mine or (dtype or mdt) != mdt:
                other.append(name)  # another block or dtype than the rest, or unnamed experts
                continue
            block, dtype = mine, mdt
            (modules if kind == "block" else experts).append(prefix)
        elif kind == "other":
            other.append(name)
    if not modules and not experts and not other:
        return None
    packed = {k: list(v) for k, v in (getattr(model, "packed_modules_mapping", {}) or {}).items()}
    return {"block": block, "dtype": dtype, "modules": modules, "experts": experts,
            "other": other, "packed": packed}  # fmt: skip


def publish(group: SyncGroup, layout: dict[str, Any] | None) -> None:
    """This worker's layout in the group's store (the trainer reads the first worker's)."""
    body = json.dumps(layout).encode()
    group.guard("store set", lambda: group.store.set(f"{KEY}/{group.rank}", body))


def read(group: SyncGroup, rank: int) -> dict[str, Any] | None:
    """Worker ``rank``'s layout, waiting for it within the group's timeout (the worker posts it
    when it joins); :class:`PlanError` for a malformed one."""
    key = f"{KEY}/{rank}"
    group.wait_until(lambda: bool(group.store.check([key])), "the engine's FP8 layout", None)
    raw = bytes(group.guard("store get", lambda: group.store.get(key)))
    try:
        layout = json.loads(raw)
    except ValueError:
        raise PlanError(f"the engine's FP8 layout ({key}) is not JSON: {raw[:80]!r}") from None
    if layout is not None and not _well_formed(layout):
        raise PlanError(
            f"the engine's FP8 layout ({key}) is malformed: {raw[:120]!r}; expected "
            '{"block": [int, int], "dtype": str, "modules": [str], "other": [str], '
            '"packed": {str: [str]}} (a worker of another deltackpt version?)'
        )
    return layout  # type: ignore[no-any-return]


def _strs(v: Any) -> bool:
    return isinstance(v, list) and all(isinstance(x, str) for x in v)


def _well_formed(layout: Any) -> bool:
    """The shape :func:`engine_layout` gives (a peer's JSON: checked before it is used)."""
    if not isinstance(layout, dict):
        return False
    block, dtype, packed = layout.get("block"), layout.get("dtype"), layout.get("packed", {})
    return (
        _strs(layout.get("modules"))
        and _strs(layout.get("experts", []))
        and _strs(layout.get("other", []))
        and (block is None or (isinstance(block, list) and len(block) == 2
                               and all(type(b) is int for b in block)))
        and (dtype is None or isinstance(dtype, str))
        and isinstance(packed, dict)
        and all(isinstance(k, str) and _strs(v) for k, v in packed.items())
    )  # fmt: skip


def _target(name: str, modules: dict[str, Any], packed: dict[str, list[str]]) -> str | None:
    """The engine module checkpoint weight ``name`` loads into (None: not a ``.weight``)."""
    where = module_of(name, modules, packed)
    if where is None or where[2] != "weight":
        return None
    return where[0]


def blocks_for(layout: dict[str, Any] | None) -> Fp8Blocks | None:
    """What the trainer quantizes for an engine of ``layout``: the checkpoint weights that load
    into its block-FP8 modules, in its blocks (None: nothing). :class:`PlanError` when the
    engine holds FP8 weights in a form deltackpt does not quantize."""
    if layout is None:
        return None
    if layout.get("other"):
        raise PlanError(
            f"the engine holds {len(layout['other'])} modules as FP8 in a form deltackpt does "
            f"not quantize (first: {layout['other'][:3]}; per-tensor or per-channel "
            "scales, or another block shape): quantize their weights yourself and start the "
            "trainer with DeltackptTrainerInitInfo(quantize='none')"
        )
    experts = set(layout.get("experts") or [])
    if not layout["modules"] and not experts:
        return None
    fp8 = dict.fromkeys(layout["modules"])
    packed = dict(layout.get("packed") or {})
    dtype = named_dtype(str(layout.get("dtype") or ""))
    if dtype is None or not is_fp8(dtype):
        raise PlanError(f"the engine's FP8 layout names dtype {layout.get('dtype')!r}")
    block = layout.get("block") or [128, 128]
    return Fp8Blocks(
        include=lambda n: _target(n, fp8, packed) in fp8 or _expert(n, experts) is not None,
        block=tuple(block),
        dtype=dtype,
    )


def for_engine(
    layout: dict[str, Any] | None,
    spec: Fp8Blocks | None,
    cast: torch.dtype | None,
    items: list[tuple[str, torch.Tensor]],
) -> list[tuple[str, torch.Tensor]]:
    """``items`` as an engine of ``layout`` / ``spec`` holds them (the follow path: a store's
    tensors): fused experts split (:func:`unfused`), each picked weight cast to ``cast`` and
    quantized, followed by its scales."""
    if spec is None:
        return items
    return list(spec.apply(unfused(dict(items), layout), cast=cast).items())


def refusal(
    model: Any, layout: dict[str, Any] | None, tensors: Iterable[tuple[str, torch.Tensor]]
) -> str | None:
    """Why ``tensors`` (a round's changed tensors) cannot be loaded into ``model``: a weight of
    a block-FP8 module that is not FP8 (it would be written unscaled), or an FP8 weight for a
    module the engine holds unquantized. None: they can (a scale of the wrong shape fails
    vLLM's own loader, which the commit takes back)."""
    tensors = list(tensors)
    if layout is None and not any(is_fp8(t.dtype) for _, t in tensors):
        return None
    fp8 = set(layout["modules"]) if layout is not None else set()
    experts = set(layout.get("experts") or []) if layout is not None else set()
    modules = dict(model.named_modules())
    packed = dict(getattr(model, "packed_modules_mapping", {}) or {})
    mapper = getattr(getattr(model, "hf_to_vllm_mapper", None), "map_name", None)
    for name, t in tensors:
        # a checkpoint name the model's loader renames (multimodal models' prefixes) is looked
        # up under the name its module has
        vname = (mapper(name) if mapper is not None else None) or name
        dt = str(t.dtype).removeprefix("torch.")
        fused = _fused_expert(vname, experts) or _fused_expert(name, experts)
        if fused is not None and not is_fp8(t.dtype):
            assert layout is not None
            return (
                f"tensor {name!r} is {dt} fused experts but the engine holds the experts of "
                f"{fused} as block FP8 ({layout['dtype']}, blocks {layout['block']}): sent as "
                "it is, vLLM's loader would write it unscaled. Start the trainer with "
                "DeltackptTrainerInitInfo(quantize='auto') (the default), which splits fused "
                "experts and sends each quantized with its scales"
            )
        prefix = _expert(vname, experts)
        if prefix is not None:
            if not is_fp8(t.dtype):
                assert layout is not None
                return (
                    f"tensor {name!r} is {dt} but the engine holds the experts of {prefix} as "
                    f"block FP8 ({layout['dtype']}, blocks {layout['block']}): sent as it is, "
                    "it would be written unscaled. Start the trainer with "
                    "DeltackptTrainerInitInfo(quantize='auto') (the default), which sends it "
                    "quantized with its scales"
                )
            continue
        target = _target(vname, modules, packed)
        if target is None:
            continue
        if target in fp8 and not is_fp8(t.dtype):
            assert layout is not None
            return (
                f"tensor {name!r} is {dt} but the engine holds {target} as block FP8 "
                f"({layout['dtype']}, blocks {layout['block']}): sent as it is, it would be "
                "written unscaled. Start the trainer with DeltackptTrainerInitInfo("
                "quantize='auto') (the default), which sends it quantized with its scales"
            )
        m = modules.get(target)
        if target not in fp8 and is_fp8(t.dtype) and m is not None and _fp8_module(m) is None:
            held = getattr(getattr(m, "weight", None), "dtype", None)
            return (
                f"tensor {name!r} is {dt} but the engine holds {target} unquantized "
                f"({str(held).removeprefix('torch.')}): send it unquantized "
                "(DeltackptTrainerInitInfo(quantize='auto') quantizes only what the engine "
                "holds as FP8)"
            )
    return None

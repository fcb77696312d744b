"""Block-scaled FP8 weights for engines that serve them: the trainer's weights quantized as the
engine holds them, each weight with its scales, so a refit sends what the engine loads.

An engine started from a block-FP8 checkpoint (``"quantization_config": {"quant_method":
"fp8", "weight_block_size": [128, 128]}``: DeepSeek-V3, Qwen3-*-FP8) holds every quantized
linear weight ``W`` (``[out, in]``) as ``W.weight`` in ``float8_e4m3fn`` and ``W.weight_scale_inv``
in float32, ``[ceil(out / 128), ceil(in / 128)]``: block ``(i, j)`` of the weight is
``q[i, j] * scale_inv[i, j]``. A trainer holds bf16 or fp32 weights; sending those into such an
engine writes unscaled values into the FP8 parameters (garbage output from the first token; the
SkyRL#1898 / verl#7519 class). :class:`Fp8Blocks` makes the pair from a weight, with torch
operations that give the same bytes on CPU and GPU:

* ``scale_inv = amax(|block|) / max(dtype)`` per block in float32 (448 for ``float8_e4m3fn``; a
  block of zeros gets 1), the amax of a block that runs past the weight's edge over its elements
  only;
* ``q = clamp(w / scale_inv, -max, max)`` in float32, rounded to the FP8 dtype (round to
  nearest even).

Dequantized, every element is within half an FP8 step of the weight: a relative ``2**-4`` for
``float8_e4m3fn``'s 3 mantissa bits, at most ``scale_inv * 2**-10`` near zero (its subnormals).
The pair travels as two tensors of one round, so an engine never holds a weight with another
version's scales (a round commits whole or not at all).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from deltackpt.format.dtensor import is_dtensor, local_box, local_tensor
from deltackpt.sync.dtypes import SCALE_SUFFIX, is_fp8
from deltackpt.sync.errors import PlanError
from deltackpt.sync.schedule_decl import LocalShard

__all__ = [
    "SCALE_SUFFIX",
    "Fp8Blocks",
    "block_grid",
    "dequantize_blocks",
    "expert_parts",
    "is_fp8",
    "quantize_blocks",
]

_FP8 = {
    torch.float8_e4m3fn: 448.0,
    torch.float8_e5m2: 57344.0,
}


def _check_block(block: tuple[int, int], dtype: torch.dtype) -> tuple[int, int]:
    if dtype not in _FP8:
        raise PlanError(
            f"Fp8Blocks(dtype={dtype}): expected torch.float8_e4m3fn or torch.float8_e5m2"
        )
    try:
        b0, b1 = (int(b) for b in block)
    except (TypeError, ValueError):
        raise PlanError(
            f"Fp8Blocks(block={block!r}): expected two block sizes, (128, 128)"
        ) from None
    if b0 <= 0 or b1 <= 0:
        raise PlanError(f"Fp8Blocks(block={block!r}): block sizes must be positive, (128, 128)")
    return b0, b1


def block_grid(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, int]:
    """The shape of the scales of a 2-D weight of ``shape`` in blocks of ``block`` (a block
    past the weight's edge counts)."""
    return -(-int(shape[0]) // block[0]), -(-int(shape[1]) // block[1])


def quantize_blocks(
    w: torch.Tensor, block: tuple[int, int] = (128, 128), dtype: torch.dtype = torch.float8_e4m3fn
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, scale_inv)`` of 2-D floating ``w`` (module doc), on ``w``'s device. Takes one
    float32 transient of ``w``'s size (and a padded copy of ``w`` for a weight whose shape is
    not a multiple of the block)."""
    b0, b1 = _check_block(block, dtype)
    if w.dim() != 2 or not w.is_floating_point() or is_fp8(w.dtype):
        raise PlanError(
            f"quantize_blocks: expected a 2-D bf16/fp16/fp32 weight, got {w.dtype} of shape "
            f"{list(w.shape)}"
        )
    o, i = w.shape
    n0, n1 = block_grid((o, i), (b0, b1))
    if not w.numel():  # a rank's empty shard (past a short weight's rows)
        return torch.empty(w.shape, dtype=dtype, device=w.device), torch.empty(
            n0, n1, dtype=torch.float32, device=w.device
        )
    x = w.detach()
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        x = x.float()  # (float64: divided in float32 like the others)
    if (n0 * b0, n1 * b1) != (o, i):
        x = F.pad(x, (0, n1 * b1 - i, 0, n0 * b0 - o))  # zeros: they never raise an amax
    blocks = x.view(n0, b0, n1, b1)
    fmax = _FP8[dtype]
    # max(|x|) as max(max, -min): no |x| copy; exact in the weight's own dtype
    amax = torch.maximum(blocks.amax(dim=(1, 3)), blocks.amin(dim=(1, 3)).neg()).float()
    scale = torch.where(amax > 0, amax / fmax, torch.ones_like(amax))
    # the weight's values widened exactly into one float32 copy, divided and clamped in place
    # (a mixed-dtype division is twice as slow on CPU), then rounded to FP8
    x32 = blocks.to(torch.float32, copy=True).div_(scale[:, None, :, None])
    q = x32.clamp_(-fmax, fmax).to(dtype)
    q = q.view(n0 * b0, n1 * b1)
    if q.shape != (o, i):
        q = q[:o, :i].contiguous()
    return q, scale


def dequantize_blocks(
    q: torch.Tensor,
    scale_inv: torch.Tensor,
    block: tuple[int, int] = (128, 128),
    dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """The weight ``q`` and ``scale_inv`` stand for, as ``dtype``; :class:`PlanError` when the
    scales' shape is not the blocks of ``q``'s."""
    b0, b1 = (int(b) for b in block)
    o, i = q.shape
    want = block_grid((o, i), (b0, b1))
    if tuple(scale_inv.shape) != want:
        raise PlanError(
            f"dequantize_blocks: scales of shape {list(scale_inv.shape)} for a weight of shape "
            f"{[o, i]} in blocks of {[b0, b1]}: expected {list(want)}"
        )
    s = scale_inv.float().repeat_interleave(b0, 0)[:o].repeat_interleave(b1, 1)[:, :i]
    return (q.float() * s).to(dtype)


#: transformers 5 holds each MoE layer's experts fused: ``<...>.experts.gate_up_proj`` [E, 2I, H]
#: (each expert's gate rows, then its up rows) and ``<...>.experts.down_proj`` [E, H, I]
FUSED_EXPERTS = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}


def expert_parts(
    name: str, shape: tuple[int, ...]
) -> list[tuple[str, tuple[int, int], tuple[int, int, int]]] | None:
    """For fused experts ``name`` of ``shape`` (:data:`FUSED_EXPERTS`), each expert's checkpoint
    weight as ``(name, shape, (expert, first row, end row))`` (``experts.<e>.gate_proj.weight``
    ..., the names vLLM's FP8 MoE loader quantizes one by one); None for any other tensor."""
    prefix, _, last = name.rpartition(".")
    if last not in FUSED_EXPERTS or not prefix.endswith("experts") or len(shape) != 3:
        return None
    projs = FUSED_EXPERTS[last]
    rows = shape[1] // len(projs)
    return [
        (f"{prefix}.{e}.{proj}.weight", (rows, shape[2]), (e, k * rows, (k + 1) * rows))
        for e in range(shape[0])
        for k, proj in enumerate(projs)
    ]


@dataclass(frozen=True)
class Fp8Blocks:
    """Which weights to quantize and how: ``include(name) -> bool`` picks 2-D floating
    ``*.weight`` tensors (a set of names works too), ``block`` the block shape, ``dtype`` the FP8
    type. :meth:`apply` turns a state dict into what the engine holds.

    From a vLLM engine's own configuration the trainer engine builds one by itself
    (``DeltackptTrainerInitInfo(quantize="auto")``, the default): exactly the weights the
    engine's workers hold as block FP8, with the engine's block shape."""

    include: Callable[[str], bool] | frozenset[str]
    block: tuple[int, int] = (128, 128)
    dtype: torch.dtype = torch.float8_e4m3fn

    def __post_init__(self) -> None:
        object.__setattr__(self, "block", _check_block(self.block, self.dtype))
        inc = self.include
        if isinstance(inc, (set, frozenset, list, tuple)):
            object.__setattr__(self, "include", frozenset(inc))
        elif not callable(inc):
            raise PlanError(
                f"Fp8Blocks(include={inc!r}): expected f(name) -> bool or a set of names"
            )

    def picks(self, name: str, t: object) -> bool:
        """Whether tensor ``name`` is quantized (:meth:`chooses`; a whole tensor, a ``DTensor``
        or a :class:`~deltackpt.sync.LocalShard`, judged by its global shape)."""
        if isinstance(t, LocalShard):
            return self.chooses(name, t.tensor.dtype, len(t.shape))
        if isinstance(t, torch.Tensor):
            return self.chooses(name, t.dtype, t.dim())
        return False

    def chooses(self, name: str, dtype: torch.dtype, dims: int) -> bool:
        """Whether a tensor ``name`` of ``dtype`` with ``dims`` dimensions is quantized:
        included, a 2-D floating ``.weight`` of 16 bits or more."""
        inc = self.include
        if not (name in inc if isinstance(inc, frozenset) else bool(inc(name))):
            return False
        return (
            name.endswith(".weight")
            and dims == 2
            and dtype.is_floating_point
            and not (is_fp8(dtype))
        )

    def apply(self, tensors: Mapping[str, Any], cast: torch.dtype | None = None) -> dict[str, Any]:
        """``tensors`` with each picked weight replaced by its FP8 bytes and followed by its
        scales (``name + SCALE_SUFFIX``), in order; the others as they are. ``cast``: the
        dtype the weights would travel as (the sender's ``dtype=``): each is cast to it first,
        so the engine gets what quantizing the checkpoint it would have been sent gives.

        A trainer rank's shard (a ``DTensor``'s local shard or a ``LocalShard``) is quantized
        where it is when it holds whole blocks (its box starts on a block boundary and ends on
        one or at the weight's edge, as FSDP2's ``Shard(0)`` rows of a weight whose rows divide
        into the ranks' blocks do): it becomes a ``LocalShard`` of the FP8 bytes and one of its
        blocks' scales, which the sender sends like any shard. A box that cuts a block raises
        :class:`PlanError` (that block's scale needs both ranks' rows), as does a scale's name
        taken by a tensor of ``tensors``."""
        out: dict[str, Any] = {}
        for name, t in tensors.items():
            if not self.picks(name, t):
                out[name] = t
                continue
            sname = name + SCALE_SUFFIX
            if sname in tensors:
                raise PlanError(
                    f"tensor {name!r} is picked for FP8 but {sname!r} is already one of the "
                    "tensors (a state that is already quantized): pass the unquantized weights, "
                    "or quantize='none'"
                )
            loc, off, shape = _local(name, t)
            w = loc.detach()
            if cast is not None and w.dtype != cast:
                w = w.to(cast)
            if off is None:  # a whole weight
                out[name], out[sname] = quantize_blocks(w, self.block, self.dtype)
                continue
            b0, b1 = self.block
            size = tuple(w.shape)
            for d, b in ((0, b0), (1, b1)):
                if size[d] and (off[d] % b or (size[d] % b and off[d] + size[d] != shape[d])):
                    raise PlanError(
                        f"tensor {name!r}: this rank holds rows/columns {off[d]}.."
                        f"{off[d] + size[d]} of {shape[d]} along dim {d}, which cut its "
                        f"{b}-wide FP8 blocks (a block's scale needs every rank's part of it). "
                        "Shard it on block boundaries, send whole weights (full_tensor()), or "
                        "quantize them yourself and pass quantize='none'"
                    )
            q, sc = quantize_blocks(w, self.block, self.dtype)
            blocks = block_grid(shape, self.block)
            out[name] = LocalShard(q, off, shape)
            out[sname] = LocalShard(sc, (off[0] // b0, off[1] // b1), blocks)
        return out

    def names(self, tensors: Mapping[str, Any]) -> frozenset[str]:
        """The names :meth:`apply` gives FP8 bytes or scales."""
        picked = [n for n, t in tensors.items() if self.picks(n, t)]
        return frozenset(picked) | frozenset(n + SCALE_SUFFIX for n in picked)


def _local(name: str, t: Any) -> tuple[torch.Tensor, tuple[int, ...] | None, tuple[int, ...]]:
    """``(local tensor, its offset or None for a whole tensor, global shape)``."""
    if isinstance(t, LocalShard):
        return t.tensor, tuple(int(x) for x in t.offset), tuple(int(x) for x in t.shape)
    if is_dtensor(t):
        off, _ = local_box(t, name)
        return local_tensor(t), off, tuple(t.shape)
    return t, None, tuple(t.shape)

"""Wire dtypes of weight sync: the dtype a tensor travels as, and its name in a declaration.

A tensor travels as the dtype :func:`resolve_dtype` picks from the ``dtype=`` option of a sender
(or the dtype a receiver asks for), named as checkpoints name dtypes
(:mod:`deltackpt.format.dtypes`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from deltackpt.errors import StoreFormatError, UnsupportedValueError
from deltackpt.format.dtypes import dtype_from_name, dtype_name
from deltackpt.sync.errors import PlanError

__all__ = [
    "SCALE_SUFFIX",
    "DtypeSpec",
    "dtype_spec",
    "is_fp8",
    "named_dtype",
    "resolve_dtype",
    "wire_dtype",
    "wire_name",
]

#: A dtype to cast floating-point tensors to, or ``f(name, dtype) -> dtype | None`` (None: keep).
DtypeSpec = torch.dtype | Callable[[str, torch.dtype], torch.dtype | None] | None


_SHORT = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32", "fp64": "float64"}


def named_dtype(name: str) -> torch.dtype | None:
    """The torch dtype ``name`` spells (``"bfloat16"``, ``"torch.int8"``, ``"bf16"``), or None."""
    name = name.strip().removeprefix("torch.")
    dt = getattr(torch, _SHORT.get(name, name), None)
    return dt if isinstance(dt, torch.dtype) else None


def dtype_spec(owner: str, spec: Any) -> DtypeSpec:
    """``spec`` checked where it is given (``owner``: the constructor, for the message): None, a
    floating torch dtype, a callable, or a floating dtype's name as torch and vLLM spell it
    (``"bfloat16"``, ``"torch.float16"``, ``"half"``, ``"bf16"``: turned into the dtype); else
    :class:`PlanError` naming it (it used to fail at the first round, as a ``TypeError`` of
    the setup)."""
    if spec is None or callable(spec):  # (a dtype and a str are not callable)
        return spec  # type: ignore[no-any-return]
    dt = named_dtype(spec) if isinstance(spec, str) else spec
    if isinstance(dt, torch.dtype) and dt.is_floating_point:
        return dt
    raise PlanError(
        f"{owner}(dtype={spec!r}): expected None, a floating torch dtype (torch.bfloat16) or its "
        "name ('bfloat16', 'float16', 'float32'), or f(name, dtype) -> dtype | None. It is the "
        "dtype floating tensors travel as; pass None to keep each tensor's own"
    )


#: the scales of FP8 weight ``X.weight`` are ``X.weight`` + this (``X.weight_scale_inv``, the
#: name block-FP8 checkpoints give them): :mod:`deltackpt.sync.fp8`
SCALE_SUFFIX = "_scale_inv"


def is_fp8(dtype: torch.dtype) -> bool:
    """``dtype`` is one of torch's 8-bit floating types: scaled storage (its scales travel as
    tensors of their own, :mod:`deltackpt.sync.fp8`), not a value type to cast."""
    return dtype.is_floating_point and dtype.itemsize == 1


def resolve_dtype(spec: DtypeSpec, name: str, dtype: torch.dtype) -> torch.dtype:
    """The dtype tensor ``name`` of ``dtype`` is cast to under ``spec``. A dtype casts floating
    tensors of 16 bits or more, except FP8 weights' scales (``*_scale_inv``, which a cast would
    round); FP8 tensors keep theirs (their values mean something only with their scales). A
    callable casts them where that is meant."""
    if spec is None:
        return dtype
    if isinstance(spec, torch.dtype):
        keep = not dtype.is_floating_point or is_fp8(dtype) or name.endswith(SCALE_SUFFIX)
        return dtype if keep else spec
    return spec(name, dtype) or dtype


def wire_name(dtype: torch.dtype, tensor: str) -> str:
    """The name of ``dtype`` in a manifest; :class:`PlanError` for a dtype sync cannot send."""
    try:
        return dtype_name(dtype, tensor)
    except UnsupportedValueError:
        raise PlanError(
            f"tensor {tensor!r} has dtype {dtype}, which sync cannot send as raw bytes "
            "(quantized tensors carry scale/zero-point outside their bytes); dequantize it "
            "before push"
        ) from None


def wire_dtype(name: str) -> torch.dtype:
    """The dtype a manifest names; raises :class:`PlanError` for a name this torch lacks."""
    try:
        return dtype_from_name(name)
    except StoreFormatError:
        raise PlanError(
            f"unknown dtype {name!r} in a sync plan; sender and receiver must run "
            "torch versions that both know it"
        ) from None

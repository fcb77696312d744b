"""Wire dtypes of weight sync: the dtype a tensor travels as, and its name in a declaration.

A tensor travels as the dtype :func:`resolve_dtype` picks from the ``dtype=`` option of a sender
(or the dtype a receiver asks for), named as checkpoints name dtypes
(:mod:`deltackpt.format.dtypes`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from deltackpt.errors import StoreFormatError, UnsupportedValueError
from deltackpt.format.dtypes import dtype_from_name, dtype_name
from deltackpt.sync.errors import PlanError

__all__ = ["DtypeSpec", "resolve_dtype", "wire_dtype", "wire_name"]

#: A dtype to cast floating-point tensors to, or ``f(name, dtype) -> dtype | None`` (None: keep).
DtypeSpec = torch.dtype | Callable[[str, torch.dtype], torch.dtype | None] | None


def resolve_dtype(spec: DtypeSpec, name: str, dtype: torch.dtype) -> torch.dtype:
    """The dtype tensor ``name`` of ``dtype`` is cast to under ``spec``."""
    if spec is None:
        return dtype
    if isinstance(spec, torch.dtype):
        return spec if dtype.is_floating_point else dtype
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

"""Names of torch dtypes as written in manifests (``str(dtype)`` without the ``torch.`` prefix)."""

from __future__ import annotations

import torch

from deltackpt.errors import StoreFormatError, UnsupportedValueError

_QUANTIZED = {torch.qint8, torch.quint8, torch.qint32, torch.quint4x2, torch.quint2x4}


def _all_dtypes() -> dict[str, torch.dtype]:
    out: dict[str, torch.dtype] = {}
    for attr in dir(torch):
        value = getattr(torch, attr, None)
        if isinstance(value, torch.dtype) and value not in _QUANTIZED:
            out[str(value).removeprefix("torch.")] = value
    return out


_BY_NAME = _all_dtypes()


def dtype_name(dtype: torch.dtype, key: str = "?") -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in _BY_NAME:
        raise UnsupportedValueError(
            f"tensor {key!r} has dtype {dtype}, which deltackpt cannot store as raw bytes "
            "(quantized tensors carry scale/zero-point outside their bytes); dequantize it "
            "first or pass allow_pickle=True"
        )
    return name


def dtype_from_name(name: str) -> torch.dtype:
    try:
        return _BY_NAME[name]
    except KeyError:
        raise StoreFormatError(
            f"manifest names dtype {name!r}, which this torch ({torch.__version__}) does not "
            "have; load with the torch version that wrote the snapshot"
        ) from None

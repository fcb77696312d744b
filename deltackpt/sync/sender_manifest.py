"""What one sender holds, as every rank learns it in the plan message, and the wire dtypes.

A :class:`SenderManifest` lists a sender rank's tensors (:class:`ShardEntry`: name, wire dtype,
global shape, and the box it holds) and the options every sender must agree on. It travels as
canonical JSON (sorted keys, no spaces), versioned by :data:`SYNC_MANIFEST_VERSION` under the
key ``"format"``; :func:`deltackpt.sync.plan.build_plan` lays buckets out from these. (Not to be
confused with a checkpoint's :class:`deltackpt.format.manifest.Manifest`.)

Wire dtypes: a tensor travels as the dtype :func:`resolve_dtype` picks from the ``dtype=``
option of a sender (a receiver casts with the same kind of option), named as checkpoints name
dtypes (:mod:`deltackpt.format.dtypes`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from deltackpt.errors import StoreFormatError, UnsupportedValueError
from deltackpt.format.dtypes import dtype_from_name, dtype_name
from deltackpt.sync.errors import PlanError

__all__ = [
    "SYNC_MANIFEST_VERSION",
    "DtypeSpec",
    "SenderManifest",
    "ShardEntry",
    "resolve_dtype",
    "wire_dtype",
    "wire_name",
]

SYNC_MANIFEST_VERSION = 1  # written as "format" in the JSON

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


@dataclass(frozen=True)
class ShardEntry:
    """One tensor as one sender holds it: global ``shape``, and the box ``offset``/``local_shape``
    of the part it holds (the whole tensor: zeros and ``shape``)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: tuple[int, ...]
    local_shape: tuple[int, ...]

    @property
    def local_numel(self) -> int:
        return math.prod(self.local_shape)


@dataclass(frozen=True)
class SenderManifest:
    """What one sender rank holds, plus the options that must agree between senders."""

    rank: int
    bucket_bytes: int
    align: int
    entries: tuple[ShardEntry, ...]

    def to_json(self) -> bytes:
        """Canonical JSON (sorted keys, no spaces): equal manifests give equal bytes."""
        doc = {
            "format": SYNC_MANIFEST_VERSION,
            "rank": self.rank,
            "bucket_bytes": self.bucket_bytes,
            "align": self.align,
            "tensors": [
                [e.name, e.dtype, list(e.shape), list(e.offset), list(e.local_shape)]
                for e in self.entries
            ],
        }
        return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, data: bytes) -> SenderManifest:
        try:
            doc = json.loads(data)
            if doc.get("format") != SYNC_MANIFEST_VERSION:
                raise PlanError(
                    f"sync manifest format {doc.get('format')!r}, this version reads "
                    f"{SYNC_MANIFEST_VERSION}; run the same deltackpt on every rank"
                )
            entries = tuple(
                ShardEntry(
                    str(n), str(d), tuple(map(int, s)), tuple(map(int, o)), tuple(map(int, ls))
                )
                for n, d, s, o, ls in doc["tensors"]
            )
            return cls(int(doc["rank"]), int(doc["bucket_bytes"]), int(doc["align"]), entries)
        except (ValueError, KeyError, TypeError) as e:
            if isinstance(e, PlanError):
                raise
            raise PlanError(
                f"malformed sync manifest ({e}); every rank must run the same deltackpt version"
            ) from e

"""DTensor helpers for saves and weight sync, without importing torch.distributed.tensor.

No DTensor can exist before ``torch.distributed.tensor`` was imported, so :func:`is_dtensor`
looks the class up in ``sys.modules`` instead of importing it: single-process use never loads
the distributed packages.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import torch

from deltackpt.errors import UnsupportedValueError


@dataclass(frozen=True)
class Piece:
    """This rank's piece of a global tensor without a DTensor: ``local`` at ``offsets`` of a
    tensor of ``shape``. Saved as a DTensor is (a distributed save tiles the pieces of all
    ranks); the tiers persist a local snapshot's pieces this way, off the training thread and
    its device mesh."""

    local: torch.Tensor
    offsets: tuple[int, ...]
    shape: tuple[int, ...]
    requires_grad: bool = False

    @property
    def dtype(self) -> torch.dtype:
        return self.local.dtype


def is_dtensor(t: Any) -> bool:
    """A DTensor, or a :class:`Piece` (what a save plans as one)."""
    if type(t) is Piece:
        return True
    mod = sys.modules.get("torch.distributed.tensor")
    return mod is not None and isinstance(t, mod.DTensor)


def local_box(dt: Any, key: str = "?") -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(global offsets, local shape) of this rank's piece of ``dt``."""
    if type(dt) is Piece:
        return dt.offsets, tuple(dt.local.shape)
    from torch.distributed.tensor import Partial
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if any(isinstance(p, Partial) for p in dt.placements):
        raise UnsupportedValueError(
            f"DTensor {key!r} has a Partial placement {dt.placements}; its local values are not "
            "the tensor's values. Call .redistribute(placements=[Replicate()]) or .full_tensor() "
            "before saving"
        )
    shape, offset = compute_local_shape_and_global_offset(dt.shape, dt.device_mesh, dt.placements)
    return tuple(int(o) for o in offset), tuple(int(s) for s in shape)


def local_tensor(dt: Any) -> torch.Tensor:
    return dt.local if type(dt) is Piece else dt.to_local()

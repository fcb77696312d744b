"""What an inference engine's parameters hold, against the checkpoint tensors they should hold:
each worker digests, where its parameters live, the region that holds its box of each tensor
(``integrations/vllm/inplace.region_digests``, the worker extension's
``deltackpt_checkpoint_digests``); here the same boxes of the expected tensors are digested and
compared. Any route may have written the engine (vLLM's sparse or NCCL backends, a reload, the
store link, deltackpt's rounds): an engine that holds the expected tensors matches everywhere,
one that a failed, partial or foreign update left elsewhere is named, tensor by tensor.

Digests are ``sync.device_digest``'s: the same bits on CPU and GPU (so a GPU engine and a CPU
trainer, or the reverse, compare without moving the tensors); a changed word is always
detected, several are missed with probability about 2**-120.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from deltackpt.sync.errors import SyncError

__all__ = ["EngineCheck", "check_spec", "compare"]


@dataclass
class EngineCheck:
    """What :func:`compare` found: per worker (its rank), the tensors whose parameter region
    differs from the expected bytes (``mismatched``), the tensors no worker could place
    (``unchecked``: quantized or repacked modules, names the model lacks), and the regions
    compared. ``ok``: at least one compared and none differs."""

    version: Any = None
    checked: int = 0
    mismatched: dict[int, list[str]] = field(default_factory=dict)
    unchecked: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.checked > 0 and not self.mismatched


def check_spec(state: Mapping[str, torch.Tensor]) -> list[list[Any]]:
    """``[name, shape, dtype]`` of every tensor of ``state``: what the workers are asked to
    digest (``collective_rpc("deltackpt_checkpoint_digests", args=(spec,))``)."""
    return [[n, list(t.shape), str(t.dtype).removeprefix("torch.")] for n, t in state.items()]


def compare(
    state: Mapping[str, torch.Tensor], reports: Iterable[Mapping[str, Any]], version: Any = None
) -> EngineCheck:
    """Each worker's reported region digests against the same boxes of ``state`` (module doc).
    A report that names a tensor ``state`` lacks, or a box outside it, raises
    :class:`~deltackpt.sync.errors.SyncError` naming the worker and the tensor."""
    from deltackpt.sync.device_digest import piece_digest

    out = EngineCheck(version)
    placed: set[str] = set()
    unplaced: set[str] = set()
    for i, rep in enumerate(reports):
        rank = int(rep.get("rank", i))
        unplaced.update(str(n) for n in rep.get("unchecked", ()))
        for name, got in dict(rep.get("digests", {})).items():
            t = state.get(name)
            try:
                off, size, a, b = got
                cut = tuple(slice(int(o), int(o) + int(n)) for o, n in zip(off, size, strict=True))
                if t is None:
                    raise ValueError("not a tensor of the check")
                if len(cut) != t.dim() or any(
                    c.start < 0 or c.stop > n or c.stop <= c.start
                    for c, n in zip(cut, t.shape, strict=True)
                ):
                    raise ValueError(f"box {list(off)} {list(size)} outside shape {list(t.shape)}")
                want = piece_digest(t[cut].contiguous().reshape(-1).view(torch.uint8))
            except (TypeError, ValueError) as e:
                raise SyncError(
                    f"engine check: worker {rank} reported {got!r:.80} for {name!r}: {e}; "
                    "expected [box offset, box size, a, b] of a tensor of the check's spec"
                ) from None
            placed.add(name)
            out.checked += 1
            if (str(want[0]), str(want[1])) != (str(a), str(b)):
                out.mismatched.setdefault(rank, []).append(name)
    out.unchecked = sorted(unplaced - placed)
    return out

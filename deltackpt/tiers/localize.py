"""A rank's own part of a state, for its local tier: every DTensor replaced by its local tensor.

A local-tier snapshot is a snapshot of a world of one, which cannot hold a piece of a DTensor
(a distributed save checks that the pieces of all ranks tile each tensor). Each rank therefore
saves its local tensors (views of the live DTensors, no copy) and records a digest of the layout
(every DTensor's path, global shape, offsets, local shape and dtype; optimizer state left out):
restore uses a local or replica snapshot only when the live state has the very same layout,
reads straight into the live DTensors' local tensors, and gives a fresh optimizer its moments as
DTensors placed like their parameters (:func:`moments_as_dtensors`).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from typing import Any

import torch

from deltackpt.format.dtensor import Piece, is_dtensor, local_box
from deltackpt.format.hashing import digest


def optimizer_keys(state: dict[str, Any]) -> list[str]:
    """The keys of ``state`` holding optimizers (anything with ``param_groups``)."""
    return [k for k, v in state.items() if isinstance(getattr(v, "param_groups", None), list)]


def map_leaves(tree: Any, fn: Callable[[Any, str], Any]) -> Any:
    """``tree`` (dicts, lists, plain tuples) rebuilt with ``fn(value, path)`` applied to every
    value that is not a container; paths are ``/key/index/...`` (``""`` for the root)."""

    def walk(v: Any, path: str) -> Any:
        if isinstance(v, dict):
            return {k: walk(x, f"{path}/{k}") for k, x in v.items()}
        if isinstance(v, list):
            return [walk(x, f"{path}/{i}") for i, x in enumerate(v)]
        if isinstance(v, tuple) and not hasattr(v, "_fields"):
            return tuple(walk(x, f"{path}/{i}") for i, x in enumerate(v))
        return fn(v, path)

    return walk(tree, "")


def localize(tree: Any, skip: tuple[str, ...] = ()) -> tuple[Any, str, dict[int, Any]]:
    """``tree`` with DTensors replaced by their local tensors, its layout digest, and the map
    from ``id(local tensor)`` back to its DTensor (for :func:`delocalize`). DTensors under a
    path prefix in ``skip`` (an optimizer's state: a fresh optimizer has none yet, and its
    moments are placed as their parameters are) are localized but left out of the digest."""
    boxes: list[Any] = []
    back: dict[int, Any] = {}

    def leaf(v: Any, path: str) -> Any:
        if not is_dtensor(v):
            return v
        offsets, shape = local_box(v, path)
        local = v.to_local()
        if not path.startswith(skip):
            boxes.append([path, list(v.shape), list(offsets), list(shape), str(v.dtype)])
        back[id(local)] = v
        return local

    out = map_leaves(tree, leaf)
    return out, digest(json.dumps(boxes).encode()), back


def delocalize(tree: Any, back: dict[int, Any]) -> Any:
    """``tree`` with each local tensor of ``back`` replaced by its DTensor again."""
    return map_leaves(tree, lambda v, _: back.get(id(v), v))


Box = tuple[tuple[int, ...], tuple[int, ...], bool]  # global offsets, global shape, grad


def dtensor_boxes(tree: Any) -> dict[str, Box]:
    """Path (as :func:`localize` walks it) -> where each DTensor's local piece sits."""
    out: dict[str, Box] = {}

    def leaf(v: Any, path: str) -> Any:
        if is_dtensor(v):
            offsets, _ = local_box(v, path)
            out[path] = (tuple(offsets), tuple(v.shape), bool(v.requires_grad))
        return v

    map_leaves(tree, leaf)
    return out


def as_pieces(tree: Any, boxes: dict[str, Box]) -> Any:
    """``tree`` (a local snapshot loaded back) with each tensor at a path of ``boxes`` made a
    :class:`~deltackpt.format.dtensor.Piece` again, so a distributed save tiles it as the
    DTensor it came from."""

    def leaf(v: Any, path: str) -> Any:
        b = boxes.get(path)
        return Piece(v, b[0], b[1], b[2]) if b is not None and isinstance(v, torch.Tensor) else v

    return map_leaves(tree, leaf)


def is_dtensor_loaded() -> bool:
    """Whether torch's DTensor module is imported (importing it costs ~1 s here)."""
    return "torch.distributed.tensor" in sys.modules


def moments_as_dtensors(live: dict[str, Any], loaded: dict[str, Any]) -> None:
    """In ``loaded``'s optimizer state dicts, turn each plain tensor that a fresh optimizer
    could not hold yet (a local piece read back from the local tier) into a DTensor placed as
    its parameter, so ``load_state_dict`` gives the optimizer DTensors like its parameters."""
    keys = optimizer_keys(live)
    if not keys or not is_dtensor_loaded():
        return  # no optimizer, or no DTensor anywhere in this process
    from torch.distributed.tensor import DTensor

    for key in keys:
        sd = loaded.get(key)
        if not isinstance(sd, dict):
            continue
        state, saved_groups = sd.get("state"), sd.get("param_groups")
        if not (isinstance(state, dict) and isinstance(saved_groups, list)):
            continue
        params: dict[Any, Any] = {}
        for sg, g in zip(saved_groups, live[key].param_groups, strict=False):
            if isinstance(sg, dict) and isinstance(g, dict):
                params.update(zip(sg.get("params", ()), g.get("params", ()), strict=False))
        for index, slot in state.items():
            p = params.get(index)
            if not (is_dtensor(p) and isinstance(slot, dict)):
                continue
            local_shape = tuple(p.to_local().shape)
            for field, v in list(slot.items()):
                if (
                    isinstance(v, torch.Tensor)
                    and not is_dtensor(v)
                    and v.dim() > 0
                    and tuple(v.shape) == local_shape
                ):
                    slot[field] = DTensor.from_local(
                        v, p.device_mesh, p.placements, run_check=False,
                        shape=p.shape, stride=p.stride(),
                    )  # fmt: skip

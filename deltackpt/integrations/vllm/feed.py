"""What a vLLM worker's reload hands the model's ``load_weights``: the worker's held tensors,
moved to the model's device first where its parameters live on one (docs/sync.md, "The
pause").

A worker keeps its copies of the weights in ordinary host memory. Handed to ``load_weights`` as
they are, every tensor crosses to the GPU inside vLLM's weight loader by a blocking copy from
pageable memory (``param.data.copy_(loaded_weight)``: a few GB/s, ~1.3 GB/s on the device
machines this project measures on), inside the pause. Here they cross in windows of about
:data:`WINDOW` bytes through the two reused pinned buffers of
:func:`~deltackpt.loading.to_device.copy_through` (at the link's speed, the next buffer filled
while one is copied), and ``load_weights`` gets device tensors, which vLLM's own NCCL and IPC
engines hand it too; its loaders then copy on the device. A **staged** round moves the whole
reload ahead (:func:`ahead`, while the engine serves) where the device has room for it
(``cuda.serving_room``), so the pause holds no host-to-device copy at all.

What stays on the host: a page-locked tensor (copied at the link's speed as it is), a tensor
that ``expand`` turns into another (a tensor-parallel box's
full-shape view, :func:`~deltackpt.integrations.vllm.tp_boxes.full_view`: on a device it would
take the whole tensor's memory), a window the device has no room for, or whose allocation fails
all the same (then the loader copies it, as before), and everything where the parameters are
on the host (CPU vLLM: nothing to move). Device memory: a window at a time, plus what vLLM's
layerwise reload keeps of a layer until the layer has all its tensors (it buffers what it is
handed; ``held`` is in layer order).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from deltackpt import cuda
from deltackpt.loading.to_device import copy_through

__all__ = [
    "AHEAD_MAX",
    "WINDOW",
    "Ahead",
    "ahead",
    "feed",
    "layer_key",
    "model_device",
    "reload_batch",
]

log = logging.getLogger("deltackpt.vllm")

#: bytes moved to the device ahead of ``load_weights`` at a time, inside a commit's pause
WINDOW = 256 << 20
#: the most a staged round holds on the device from its staging to its commit (beside the
#: engine, whose own work may want that memory meanwhile); a larger reload moves in windows
#: inside the pause, at the pinned copy's speed
AHEAD_MAX = 1 << 30

Expand = Callable[[str, torch.Tensor], torch.Tensor]
Batch = list[tuple[str, torch.Tensor]]


@dataclass
class Ahead:
    """A staged round's reload moved to the device before its pause (:func:`ahead`): name ->
    (the held tensor it is a copy of, the copy on the device). An entry is used once, and only
    for that very held tensor (a rollback hands the same tensors with their old bytes back:
    never these)."""

    moved: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    @property
    def device_bytes(self) -> int:
        return sum(d.numel() * d.element_size() for _, d in self.moved.values())

    def take(self, name: str, t: torch.Tensor) -> torch.Tensor | None:
        got = self.moved.get(name)
        if got is None or got[0] is not t:
            return None
        del self.moved[name]
        return got[1]


def layer_key(name: str) -> str:
    """The group a checkpoint tensor reloads with: the name up to and including its outermost
    integer segment (``model.layers.3``), or ``""`` for tensors outside the layer stacks."""
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[: i + 1])
    return ""


def model_device(model: Any) -> torch.device | None:
    """The one device ``model``'s parameters live on, where a reload's tensors cross before its
    loaders get them (None: several; a model partly on the host takes host tensors there)."""
    devices = {p.device for p in model.parameters()}
    return next(iter(devices)) if len(devices) == 1 else None


def reload_batch(
    held: dict[str, torch.Tensor], changed: list[tuple[str, torch.Tensor]]
) -> list[tuple[str, torch.Tensor]]:
    """What a reload of ``changed`` hands ``load_weights``, in order: every tensor of each
    layer with a changed tensor (a layer partly reloaded is rebuilt from what it was given:
    the worker's module doc), ``held``'s updated with ``changed``."""
    view = dict(held)
    view.update(changed)
    touched = {layer_key(n) for n, _ in changed}
    return [(n, t) for n, t in view.items() if layer_key(n) in touched]


#: move host tensors to host "devices" too: the CPU suite's cover of the windows (a copy each)
ON_HOST = False


def _movable(t: torch.Tensor, device: torch.device | None) -> bool:
    """A host tensor a loader would copy to ``device`` from pageable memory (a page-locked one
    is copied at the link's speed as it is)."""
    if device is None or t.device.type != "cpu":
        return False
    return ON_HOST if device.type == "cpu" else not t.is_pinned()


def _moved(
    items: list[torch.Tensor], device: torch.device, nbytes: int, serving: bool = False
) -> list[torch.Tensor]:
    """Copies of ``items`` (``nbytes`` in all) on ``device``, landed (through the pinned
    buffers); none where the device has no room for them: ``cuda.spare_room`` says so (in the
    pause), ``cuda.serving_room`` (``serving``: while the engine serves), or the allocation
    fails all the same (what torch's allocator holds unused may lie in a CUDA graph's private
    pool or in a segment still partly in use, which a new block cannot take)."""
    room = cuda.serving_room if serving else cuda.spare_room
    if not room(device, nbytes):
        return []
    try:
        out = [torch.empty(t.shape, dtype=t.dtype, device=device) for t in items]
    except torch.cuda.OutOfMemoryError:
        return []
    with torch.no_grad():
        copy_through(list(zip(out, items, strict=True)))
    return out


def feed(
    batch: Batch,
    device: torch.device | None,
    expand: Expand | None = None,
    window: int = WINDOW,
    prepared: Ahead | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Each ``(name, tensor)`` of ``batch``, in order, as ``load_weights`` takes it: through
    ``expand``; on ``device`` (None: where it is) in windows of about ``window`` bytes where it
    was a host tensor ``expand`` left as it is and the device has room; ``prepared``: copies
    moved there before the pause (:func:`ahead`), used instead of moving again."""
    pending: list[tuple[str, torch.Tensor, bool]] = []  # (name, tensor, to be moved)
    nbytes = 0
    for name, t in batch:
        x = t if expand is None else expand(name, t)
        early = prepared.take(name, t) if prepared is not None and x is t else None
        if early is not None:  # made on the stage thread's stream, read on this one's
            cuda.used_here(early)
        move = early is None and x is t and _movable(t, device)
        pending.append((name, x if early is None else early, move))
        nbytes += x.numel() * x.element_size() if move else 0
        if nbytes >= window or not nbytes:  # a window full, or nothing to move: hand out
            yield from _flush(pending, device, nbytes)
            nbytes = 0
    yield from _flush(pending, device, nbytes)


def _flush(
    pending: list[tuple[str, torch.Tensor, bool]], device: torch.device | None, nbytes: int
) -> Iterator[tuple[str, torch.Tensor]]:
    """``pending``'s tensors, those marked moved onto ``device`` first (all together, where it
    has room for their ``nbytes``); emptied as they are handed out."""
    todo = [t for _, t, move in pending if move]
    moved: list[torch.Tensor] = []
    if todo:
        assert device is not None
        moved = _moved(todo, device, nbytes)
        if not moved:
            log.info(
                "deltackpt: no room on %s for %d bytes; the loader copies them", device, nbytes
            )
    it = iter(moved)
    while pending:
        name, t, move = pending.pop(0)
        yield name, (next(it) if move and moved else t)


def ahead(batch: Batch, device: torch.device | None) -> Ahead:
    """``batch``'s host tensors moved to ``device`` now (a staged round's reload, before its
    pause), all of them where they are at most :data:`AHEAD_MAX` bytes and the device has room
    for them beside the engine (``cuda.serving_room``: it serves meanwhile, and its working set
    stays its own), else none: the commit then moves them in windows. Landed on return.
    ``batch`` holds no tensor that ``expand`` would change (the caller leaves those out)."""
    todo = [(n, t) for n, t in batch if _movable(t, device)]
    need = sum(t.numel() * t.element_size() for _, t in todo)
    if not todo or device is None or need > AHEAD_MAX:
        return Ahead()
    moved = _moved([t for _, t in todo], device, need, serving=True)
    if not moved:
        return Ahead()
    return Ahead({n: (t, d) for (n, t), d in zip(todo, moved, strict=True)})

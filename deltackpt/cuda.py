"""What only CUDA has, in one place: pinned host memory, side streams, events and non-blocking
copies. Everything else on the device paths (fingerprints, staging, hashing, the load pipeline)
is written with torch operations that run on CPU tensors too, so the CPU test suite runs the same
code a GPU does; the functions here take CPU tensors as well and do the plain thing there, named
as such: an ordinary host buffer where a pinned one would be, a synchronous copy where a side
stream would carry it.

Who calls this: ``saving/on_device.py`` (device-to-host copies of changed chunks) and
``loading/to_device.py`` (host-to-device copies of loaded chunks). Nothing here runs a
collective or starts a thread.
"""

from __future__ import annotations

import torch

__all__ = ["DeviceCopies", "HostCopies", "host_buffer", "is_device"]


def is_device(t: torch.Tensor) -> bool:
    """Whether ``t`` lives in device memory (CUDA), where it cannot be hashed in place."""
    return t.device.type == "cuda"


def host_buffer(nbytes: int, for_device: bool) -> torch.Tensor:
    """A 1-D uint8 host buffer of ``nbytes``: pinned (page-locked, so device-to-host copies run
    at the link's speed and may be non-blocking) when it will receive ``for_device`` bytes and
    CUDA is present; an ordinary buffer otherwise (the CPU stand-in)."""
    pin = for_device and torch.cuda.is_available()
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)


class HostCopies:
    """Device-to-host copies issued as one batch: on CUDA, non-blocking on a side stream (one
    per device) that first waits for the device's current stream, so they see every kernel the
    caller queued before; on CPU (the stand-in), plain synchronous copies. :meth:`wait` returns
    once every copy has landed. The sources must not be modified before that (the caller's
    thread waits before it returns to the user)."""

    def __init__(self) -> None:
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self._pending: list[torch.Tensor] = []

    def _stream(self, device: torch.device) -> torch.cuda.Stream:
        s = self._streams.get(device)
        if s is None:
            s = self._streams[device] = torch.cuda.Stream(device=device)
            s.wait_stream(torch.cuda.current_stream(device))
        return s

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Queue ``dst.copy_(src)`` (``dst`` on the host)."""
        if not is_device(src):
            dst.copy_(src)
            return
        with torch.cuda.stream(self._stream(src.device)):
            dst.copy_(src, non_blocking=True)
        src.record_stream(self._streams[src.device])
        self._pending.append(src)

    def wait(self) -> None:
        """Block until every queued copy is done."""
        for s in self._streams.values():
            s.synchronize()
        self._pending.clear()


class DeviceCopies:
    """Host-to-device copies out of reused host buffers (``slot`` numbers a buffer): on CUDA,
    non-blocking on a side stream (one per device) that first waits for the device's current
    stream, so kernels the caller queued on the targets come first; :meth:`release` records an
    event per buffer and :meth:`reusable` waits for it before the buffer is refilled. On CPU (the
    stand-in), plain synchronous copies. :meth:`wait` returns once every copy has landed; call it
    (also on failure) before a host buffer is dropped or the targets are handed back."""

    def __init__(self) -> None:
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self._events: dict[int, list[torch.cuda.Event]] = {}

    def _stream(self, device: torch.device) -> torch.cuda.Stream:
        s = self._streams.get(device)
        if s is None:
            s = self._streams[device] = torch.cuda.Stream(device=device)
            s.wait_stream(torch.cuda.current_stream(device))
        return s

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Queue ``dst.copy_(src)`` (``src`` in a host buffer, ``dst`` on the device)."""
        if not is_device(dst):
            dst.copy_(src)
            return
        with torch.cuda.stream(self._stream(dst.device)):
            dst.copy_(src, non_blocking=True)

    def release(self, slot: int) -> None:
        """Every copy queued so far out of buffer ``slot`` is its last until it is refilled."""
        events = []
        for s in self._streams.values():
            ev = torch.cuda.Event()
            ev.record(s)
            events.append(ev)
        self._events[slot] = events

    def reusable(self, slot: int) -> None:
        """Block until buffer ``slot``'s copies have landed, so it may be overwritten."""
        for ev in self._events.pop(slot, []):
            ev.synchronize()

    def wait(self) -> None:
        """Block until every queued copy is done."""
        for s in self._streams.values():
            s.synchronize()
        self._events.clear()

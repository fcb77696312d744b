"""What only CUDA has, in one place: pinned host memory, side streams, events and non-blocking
copies. Everything else on the device paths (fingerprints, staging, hashing, the load pipeline)
is written with torch operations that run on CPU tensors too, so the CPU test suite runs the same
code a GPU does; the functions here take CPU tensors as well and do the plain thing there, named
as such: an ordinary host buffer where a pinned one would be, a synchronous copy where a side
stream would carry it.

Who calls this: ``saving/on_device.py`` (device-to-host copies of changed chunks),
``saving/stage.py`` (an async save's copies: to pinned buffers, or held on the device first) and
``loading/to_device.py`` (host-to-device copies of loaded chunks), ``sync/ipc_links.py`` (a
CUDA bucket's copy before its peer is told, and the release of shared blocks),
``sync/receiver.py`` (its host staging page-locked once the process uses a GPU). Nothing here runs a
collective or starts a thread.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

import torch

T = TypeVar("T")

__all__ = [
    "DeviceCopies",
    "HostCopies",
    "HostLock",
    "StageCopies",
    "copy_and_wait",
    "current_stream",
    "device_room",
    "host_buffer",
    "ipc_collect",
    "is_device",
    "on_stream",
    "register_host",
    "serving_room",
    "spare_room",
    "to_device",
    "unregister_host",
    "used_here",
    "wait_for",
]

ROOM_MARGIN = (0.10, 256 << 20)  # device_room: spare this share of the device, plus these bytes


def is_device(t: torch.Tensor) -> bool:
    """Whether ``t`` lives in device memory (CUDA), where it cannot be hashed in place."""
    return t.device.type == "cuda"


def host_buffer(nbytes: int, for_device: bool) -> torch.Tensor:
    """A 1-D uint8 host buffer of ``nbytes``: pinned (page-locked, so device-to-host copies run
    at the link's speed and may be non-blocking) when it will receive ``for_device`` bytes and
    CUDA is present; an ordinary buffer otherwise (the CPU stand-in)."""
    pin = for_device and torch.cuda.is_available()
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)


def device_room(
    device: torch.device,
    nbytes: int,
    margin: tuple[float, int] = ROOM_MARGIN,
    cached: bool = False,
) -> bool:
    """Whether ``nbytes`` more fit on ``device`` with a margin left for the caller's own work
    (``margin``: a share of the device's memory plus bytes; :data:`ROOM_MARGIN`, 10% plus 256
    MiB). Free bytes as the driver counts them, plus with ``cached`` what torch's caching
    allocator holds unused in this process (else counted as taken, erring towards no). Always
    True for the CPU stand-in."""
    if device.type != "cuda":
        return True
    free, total = torch.cuda.mem_get_info(device)
    if cached:
        free += torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    share, extra = margin
    return free >= nbytes + int(total * share) + extra


def spare_room(device: torch.device, nbytes: int) -> bool:
    """:func:`device_room` for transient work next to an engine that took most of the device
    for itself (vLLM's ``gpu_memory_utilization`` leaves the rest) while the engine is paused:
    free or cached bytes, beside 256 MiB only."""
    return device_room(device, nbytes, margin=(0.0, 256 << 20), cached=True)


def serving_room(device: torch.device, nbytes: int) -> bool:
    """:func:`spare_room` for work done while the engine serves (a staged round's preparation):
    free bytes only. What torch's allocator holds unused is then the engine's working set (its
    activations, freed between steps), which its next step takes again: memory taken from it
    must come back from what the driver has free, or that step runs out."""
    return device_room(device, nbytes, margin=(0.0, 256 << 20), cached=False)


def copy_and_wait(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)``, landed when this returns: into device memory, the device's current
    stream is synchronised after the copy, so another process that maps ``dst`` (a CUDA IPC
    handle, sync/ipc_links.py) reads the new bytes once it is told to; on CPU a plain copy."""
    if not is_device(dst):
        dst.copy_(src)
        return
    dst.copy_(src, non_blocking=src.is_pinned())
    torch.cuda.current_stream(dst.device).synchronize()


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A small host tensor (indices, lengths) on ``device`` without waiting: through pinned
    memory, a non-blocking copy queued on the current stream (a plain ``.to(device)`` from
    pageable memory synchronises the stream: every kernel queued before it must finish first).
    The pinned block returns to torch's cache once the copy has run. On CPU: ``t``."""
    if device.type != "cuda":
        return t
    return t.pin_memory().to(device, non_blocking=True)


def wait_for(t: torch.Tensor) -> None:
    """Block until the work queued so far on the current stream of ``t``'s device is done
    (a device round's bucket before its peer is told, sync/ipc_links.py); nothing on CPU."""
    if is_device(t):
        torch.cuda.current_stream(t.device).synchronize()


_REGISTERED: dict[int, int] = {}  # host address -> bytes, page-locked by register_host


def register_host(t: torch.Tensor) -> bool:
    """Page-lock the host memory of the contiguous CPU tensor ``t`` where it lies
    (``cudaHostRegister``, portable to every device): copies between it and a GPU then run at
    the link's speed and may be non-blocking, as from a pinned buffer, without a copy into one
    (a shared-memory bucket another process maps: NCCL's shared-memory transport does the
    same). True when ``t``'s memory is page-locked after the call (also when it already was);
    False without CUDA, for an empty tensor, or when the driver refuses (a locked-memory limit:
    the caller copies through pageable memory, slower). Undo with :func:`unregister_host`
    before the memory is unmapped."""
    if t.device.type != "cpu" or not t.numel() or not torch.cuda.is_available():
        return False
    ptr, nbytes = t.data_ptr(), t.numel() * t.element_size()
    if ptr in _REGISTERED:
        return True
    if t.is_pinned():
        return True
    rc = int(torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 1))  # cudaHostRegisterPortable
    if rc != 0:
        _drain_error()
        return False
    _REGISTERED[ptr] = nbytes
    return True


def unregister_host(t: torch.Tensor, wait: bool = True) -> None:
    """Undo :func:`register_host` of ``t`` (nothing if it did not lock it), once the copies
    queued on the devices have run (a failed round may leave one in flight; ``wait=False``: the
    caller's copies to and from ``t`` are all blocking, nothing to wait for)."""
    if _REGISTERED.pop(t.data_ptr(), None) is None:
        return
    if wait:
        torch.cuda.synchronize()
    if int(torch.cuda.cudart().cudaHostUnregister(t.data_ptr())) != 0:
        _drain_error()


class HostLock:
    """A page-lock (:func:`register_host`) of the CPU tensor ``t`` for as long as this object
    holds it: :meth:`release`, or this object collected, unlocks it; the lock keeps ``t``, so
    its memory is never freed while locked. For memory whose copies to and from a device are
    all blocking: the release waits for no device (it may run from the garbage collector, on
    any thread, e.g. during a CUDA graph's capture). ``locked``: whether the driver took it
    (False without CUDA, or where it refused: the copies then go through pageable memory)."""

    def __init__(self, t: torch.Tensor) -> None:
        self.tensor: torch.Tensor | None = t
        _undo_deferred()  # (``t`` itself may be one: then locked anew, and owned)
        before = t.data_ptr() in _REGISTERED
        self.locked = register_host(t)
        # released only if this lock made it (not memory already pinned or locked before)
        self._owned = self.locked and not before and t.data_ptr() in _REGISTERED

    def release(self) -> None:
        t, self.tensor = self.tensor, None
        self.locked = False
        if t is not None and self._owned:
            self._owned = False
            unregister_host(t, wait=False)
        _undo_deferred()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # (at interpreter exit CUDA may be gone first)
            if self._owned and _capturing():
                # collected inside a CUDA graph's capture, where a runtime call such as
                # cudaHostUnregister would end the capture: undone at the next lock or release
                # (the memory kept until then)
                _DEFERRED.append(self.tensor)  # type: ignore[arg-type]
                self.tensor, self._owned, self.locked = None, False, False
                return
            self.release()


#: page-locked tensors whose lock was collected during a CUDA graph's capture (kept alive)
_DEFERRED: list[torch.Tensor] = []


def _capturing() -> bool:
    """Whether this thread's current CUDA stream is capturing a graph (False without CUDA)."""
    try:
        return bool(torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing())
    except (RuntimeError, AssertionError):  # no CUDA in this build or process
        return False


def _undo_deferred() -> None:
    """Unlock what :class:`HostLock` left locked during a graph's capture, once none runs."""
    while _DEFERRED and not _capturing():
        unregister_host(_DEFERRED.pop(), wait=False)


def _drain_error() -> None:
    """A failed runtime call (``cudaHostRegister``) leaves its error as the thread's last CUDA
    error, which torch's next kernel-launch check would raise as its own (torch binds no
    ``cudaGetLastError``): a tiny kernel's check takes it here instead, and it is dropped."""
    try:
        torch.ones(1, dtype=torch.uint8, device="cuda").add_(1)
        torch.cuda.synchronize()
    except RuntimeError:
        pass


def on_stream(stream: Any, fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` with ``stream`` (a CUDA stream, or None: the CPU stand-in) as the
    thread's current stream: for a worker thread that must queue its device work where the
    thread that handed it over queues its own (a thread starts on the default stream)."""
    return on_streams([] if stream is None else [stream], fn, *args)


def on_streams(streams: Sequence[Any], fn: Callable[..., T], *args: Any) -> T:
    """:func:`on_stream` with several devices' streams current at once (a worker copying into
    targets on more than one GPU)."""
    with contextlib.ExitStack() as stack:
        for s in streams:
            stack.enter_context(torch.cuda.stream(s))
        return fn(*args)


def synchronize(devices: Iterable[torch.device]) -> None:
    """Wait for every stream of each CUDA device of ``devices`` (a commit into an engine's
    weights, ordered with kernels any thread queued there); nothing on CPU."""
    for d in dict.fromkeys(devices):
        if d.type == "cuda":
            torch.cuda.synchronize(d)


def current_streams(devices: Iterable[torch.device]) -> list[Any]:
    """The calling thread's current stream on each CUDA device of ``devices`` (none on CPU)."""
    return [torch.cuda.current_stream(d) for d in dict.fromkeys(devices) if d.type == "cuda"]


def used_here(*tensors: torch.Tensor) -> None:
    """Tell torch's caching allocator that work queued on this thread's current stream uses
    ``tensors`` (``Tensor.record_stream``): memory allocated on another stream (a staged
    round's copies, made on its stage thread) is then not handed out again on that stream once
    freed until this work has run. Nothing for host tensors."""
    for t in tensors:
        if is_device(t):
            t.record_stream(torch.cuda.current_stream(t.device))


def current_stream(device: torch.device) -> Any:
    """The calling thread's current stream on ``device``, or None for a CPU device."""
    return torch.cuda.current_stream(device) if device.type == "cuda" else None


def ipc_collect() -> None:
    """Free the device blocks this process shared over CUDA IPC that every peer has released
    (``torch.cuda.ipc_collect``); nothing without CUDA, or before CUDA was initialised."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.ipc_collect()


class _SideStreams:
    """One side stream per device, made on first use, that first waits for the device's current
    stream (so the copies queued on it see every kernel the caller queued before)."""

    def __init__(self) -> None:
        self._streams: dict[torch.device, torch.cuda.Stream] = {}

    def _stream(self, device: torch.device) -> torch.cuda.Stream:
        s = self._streams.get(device)
        if s is None:
            s = self._streams[device] = torch.cuda.Stream(device=device)
            s.wait_stream(torch.cuda.current_stream(device))
        return s

    def synchronize(self) -> None:
        """Block until every copy queued so far is done."""
        for s in self._streams.values():
            s.synchronize()


class Events:
    """One event per device, recorded after the copies queued so far (:meth:`StageCopies.mark`)."""

    def __init__(self, events: list[torch.cuda.Event]) -> None:
        self._events = events

    def synchronize(self) -> None:
        """Block until every copy queued before the events was done."""
        for ev in self._events:
            ev.synchronize()


class StageCopies(_SideStreams):
    """The copies of an async save's staging step (saving/stage.py), on one side stream per
    device that first waits for the device's current stream, so they see every kernel the caller
    queued before:

    * :meth:`to_host`: into a (pinned) host buffer, non-blocking;
    * :meth:`hold`: into fresh device memory (~3 TB/s on an H100, where pinning a new host buffer
      runs at ~2.5 GB/s); the copy goes to the host later, by :meth:`to_host` from any thread;
    * :meth:`mark`: an event per device after the copies queued so far; the device's current
      stream waits for it, so kernels the caller queues there after the call cannot change the
      bytes before they are copied or held (the host thread does not wait: an async save returns
      while its copies run, and the training step queued next runs after them on the device).

    On CPU (the stand-in) every copy is synchronous and :meth:`hold` is a clone into an ordinary
    buffer. :meth:`synchronize` returns once every queued copy has landed."""

    def to_host(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Queue ``dst.copy_(src)`` (``dst`` on the host; ``src`` live or held)."""
        if not is_device(src):
            dst.copy_(src)
            return
        s = self._stream(src.device)
        with torch.cuda.stream(s):
            dst.copy_(src, non_blocking=True)
        src.record_stream(s)

    def hold(self, src: torch.Tensor) -> torch.Tensor:
        """A copy of ``src`` in fresh memory of its device, queued on the side stream. Allocated
        on the current stream (freed memory goes back to the caller's pool) and marked used by
        the side stream. Raises torch's OutOfMemoryError where the device has no room after all."""
        if not is_device(src):
            return src.clone()
        s = self._stream(src.device)
        dst = torch.empty_like(src)
        with torch.cuda.stream(s):
            dst.copy_(src, non_blocking=True)
        src.record_stream(s)
        dst.record_stream(s)
        return dst

    def mark(self) -> Events | None:
        """Events after every copy queued so far (None: nothing is in flight, all CPU)."""
        if not self._streams:
            return None
        events = []
        for device, s in self._streams.items():
            ev = torch.cuda.Event()
            ev.record(s)
            # the caller's next kernels (an optimizer step) wait for the copies, not its thread
            torch.cuda.current_stream(device).wait_event(ev)
            events.append(ev)
        return Events(events)


class HostCopies(StageCopies):
    """Device-to-host copies issued as one batch (:meth:`StageCopies.to_host` as ``copy``);
    :meth:`wait` returns once every copy has landed. The sources must not be modified before
    that (the caller's thread waits before it returns to the user)."""

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Queue ``dst.copy_(src)`` (``dst`` on the host)."""
        self.to_host(dst, src)

    def wait(self) -> None:
        """Block until every queued copy is done."""
        self.synchronize()


class DeviceCopies(_SideStreams):
    """Host-to-device copies out of reused host buffers (``slot`` numbers a buffer): on CUDA,
    non-blocking on a side stream (one per device) that first waits for the device's current
    stream, so kernels the caller queued on the targets come first; :meth:`release` records an
    event per buffer and :meth:`reusable` waits for it before the buffer is refilled. On CPU (the
    stand-in), plain synchronous copies. :meth:`wait` returns once every copy has landed; call it
    (also on failure) before a host buffer is dropped or the targets are handed back."""

    def __init__(self) -> None:
        super().__init__()
        self._events: dict[int, list[torch.cuda.Event]] = {}

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
        self.synchronize()
        self._events.clear()

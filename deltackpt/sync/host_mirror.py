"""The pinned host mirror of a trainer whose tensors live on CUDA: how a sender on host links
(gloo, shared memory) reads device weights without pulling every tensor to the host each round.

Every link packs from host memory (cast, hash, patch, copy into a window). Before the mirror, a
CUDA tensor was packed piece by piece through pageable copies and casts (issue 36, one H100,
8.05 GB of bf16: a full round 8.9 s against ~0.3 s for a pinned D2H + H2D of the bytes, a delta
round with 1 of 240 tensors changed 4.3 s, since every tensor was pulled to the host to find
the change). Now :class:`~deltackpt.sync.sender.WeightSender` keeps one host copy of its local
tensors, :class:`HostMirror`, and each round:

1. fingerprints every local tensor where it lives (``format.fingerprint.many_fingerprints``,
   per :data:`CHUNK_BYTES` chunk, torch ops on the device, small tensors together) and compares with the fingerprints
   recorded at the last *committed* round: one small device-to-host copy of the comparison;
2. copies into the mirror only the chunks whose fingerprint moved (adjacent ones as one copy;
   a full round copies everything), as one batch of non-blocking copies on a side stream
   (``cuda.HostCopies``), then one wait;
3. hands the mirror tensors to the unchanged pipeline (packer, detector, patches, wire) as the
   round's local tensors, with the names the device found unchanged, which the detector skips
   unread (``Detector.start_round(unchanged=)``).

Fingerprints become the comparison point only when the round commits: after a failed round the
next one (full) copies everything, and a delta round always compares with what the receivers
hold. What a fingerprint can miss (format/fingerprint.py): a change of several words of one
chunk whose two 64-bit sums both collide, about 2**-120 per changed chunk for ordinary data, and
state crafted by someone who knows the fixed keys; a change of one word is always seen.
``WeightSender(full_every=N)`` / ``push(full=True)`` bound how long such a miss can last: a full
round copies and sends every byte.

The mirror holds each tensor in the dtype it goes on the wire when every piece of it goes in one
floating dtype other than its own (``cast``, from the sender's schedule: an fp32 master sent as
bf16): the tensor is cast where it lives first, so its fingerprints, its changed elements
(``device_patches.py``) and its copy are of the bytes the receivers get, half an fp32 master's,
and an RL step's few changed bf16 elements are found although nearly every fp32 element moved.
The price: a device copy of each such tensor in the wire dtype for the round (from the cast to
the commit; skipped, the tensor mirrored in its own dtype and cast by the packer as before,
where ``cuda.device_room`` says it does not fit). Other tensors are mirrored in their own
dtype: one host copy of the trainer's local CUDA tensors, pinned, allocated in the first round
and reused. Pinned blocks come from torch's caching host
allocator, which rounds each block up to a power of two, so the mirror is cut into
power-of-two segments filled first-fit (the waste is in the last segment only).

``DELTACKPT_DEVICE_SCAN``: ``always`` also mirrors host tensors (ordinary buffers, synchronous
copies: the CPU stand-in the test suite runs); ``off`` copies every tensor every round (no
fingerprints are trusted); ``auto`` (default) mirrors the CUDA tensors only.

``DELTACKPT_DEVICE_PATCH`` (``device_patches.py``): in step 2, a tensor with a device copy of
its last committed bytes and few changed elements brings only those (index and value) to the
mirror instead of its changed chunks; the encoder then builds its patches from that list.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import numpy as np
import torch

from deltackpt import cuda
from deltackpt.format.fingerprint import many_fingerprints
from deltackpt.options import default_device_patch, default_device_scan, fingerprint_kernel
from deltackpt.sync.device_patches import DevicePatches

__all__ = ["CHUNK_BYTES", "HostMirror", "MirrorRound", "mirrored_names", "wire_casts"]

CHUNK_BYTES = 1 << 20  # fingerprint and copy granularity
_ALIGN = 64  # each mirrored tensor starts at a multiple of this in its segment
_MIN_SEGMENT = 256 << 20  # segments are powers of two of at least this (or the largest tensor)
_MIN_BLOCK = 1 << 20  # ... except the last ones, packed again down to this


def mirrored_names(local: Mapping[str, torch.Tensor], scan: str | None = None) -> list[str]:
    """The local tensors a sender mirrors this round: its CUDA tensors, or every tensor under
    ``DELTACKPT_DEVICE_SCAN=always`` (the CPU stand-in)."""
    scan = default_device_scan() if scan is None else scan
    return [n for n, t in local.items() if scan == "always" or cuda.is_device(t)]


@dataclass
class MirrorRound:
    """What one round did to the mirror: the tensors copied (whole or in part) and the bytes
    that crossed, the tensors brought by their changed elements found on the device
    (``patched``, ``patched_bytes``: index and value of each), the tensors the device found
    unchanged since the last commit, and the seconds spent fingerprinting, comparing, finding
    and copying."""

    copied: list[str] = field(default_factory=list)
    copied_bytes: int = 0
    patched: list[str] = field(default_factory=list)
    patched_bytes: int = 0
    unchanged: frozenset[str] = frozenset()
    copies: int = 0  # copy calls issued (runs of changed chunks)
    scanned_bytes: int = 0  # bytes fingerprinted (a device round: scan)
    seconds: float = 0.0


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _as_wire(t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """``t`` cast to ``dtype`` where it lives, if that dtype is another and the cast fits on the
    device (``cuda.device_room``); else ``t``."""
    if dtype is None or dtype == t.dtype or not t.is_floating_point():
        return t
    if not cuda.device_room(t.device, t.numel() * dtype.itemsize):
        return t
    return t.to(dtype)


def wire_casts(
    pieces: Iterable[tuple[str, torch.dtype]], local: Mapping[str, torch.Tensor]
) -> dict[str, torch.dtype]:
    """The local tensors a sender mirrors in their wire dtype: floating tensors all of whose
    ``(name, wire dtype)`` pieces go in one other floating dtype."""
    seen: dict[str, set[torch.dtype]] = {}
    for n, dt in pieces:
        seen.setdefault(n, set()).add(dt)
    out: dict[str, torch.dtype] = {}
    for n, dts in seen.items():
        t = local.get(n)
        if t is None or len(dts) != 1 or not t.is_floating_point():
            continue
        (dt,) = dts
        if dt.is_floating_point and dt != t.dtype:
            out[n] = dt
    return out


def _flat(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bytes as a flat uint8 tensor on its device (a device copy if not contiguous)."""
    return t.contiguous().reshape(-1).view(torch.uint8)


class HostMirror:
    """One host copy of a trainer's mirrored local tensors (see module doc). Not thread-safe:
    the sender's calling thread uses it, once per round: :meth:`stage`, then :meth:`commit`
    when the round committed."""

    def __init__(self, chunk_bytes: int = CHUNK_BYTES) -> None:
        self.chunk_bytes = int(chunk_bytes)
        self.segments: list[torch.Tensor] = []
        self.host: dict[str, torch.Tensor] = {}
        self._layout: tuple[tuple[str, tuple[int, ...], torch.dtype], ...] = ()
        self._committed: dict[str, torch.Tensor] = {}  # name -> fingerprints at the last commit
        self._round: dict[str, torch.Tensor] = {}
        self._later: set[str] = set()  # a scan's deferred tensors, not yet provided
        # name -> (a contiguous tensor a scan got, its flat bytes): the same tensor next round
        # is not flattened again (_flat_of)
        self._flats: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self.last = MirrorRound()
        self.total_copied_bytes = 0
        #: device copies of the last committed bytes (``DELTACKPT_DEVICE_PATCH``)
        self.device = DevicePatches()

    @property
    def nbytes(self) -> int:
        """Host bytes the mirror holds (its segments)."""
        return sum(s.numel() for s in self.segments)

    def clear(self) -> None:
        """Forget the committed fingerprints (the next round copies everything) and the
        device bases."""
        self._committed.clear()
        self._round.clear()
        self._later = set()
        self._flats.clear()
        self.device.clear()

    def _allocate(self, tensors: dict[str, torch.Tensor]) -> None:
        layout = tuple((n, tuple(t.shape), t.dtype) for n, t in tensors.items())
        if layout == self._layout:
            return
        self.segments, self.host = [], {}
        self.clear()
        sizes = {n: -(-t.numel() * t.element_size() // _ALIGN) * _ALIGN for n, t in tensors.items()}
        for size, names in _segments(sizes):
            for_device = any(cuda.is_device(tensors[n]) for n in names)
            seg = cuda.host_buffer(size, for_device)
            self.segments.append(seg)
            pos = 0
            for n in names:
                t = tensors[n]
                nb = t.numel() * t.element_size()
                self.host[n] = seg[pos : pos + nb].view(t.dtype).view(t.shape)
                pos += sizes[n]
        self._layout = layout

    def stage(
        self,
        local: Mapping[str, torch.Tensor],
        full: bool,
        scan: str | None = None,
        patch: str | None = None,
        cast: Mapping[str, torch.dtype] | None = None,
    ) -> tuple[dict[str, torch.Tensor], frozenset[str]]:
        """Bring the mirror up to date with ``local`` for one round: returns ``local`` with the
        mirrored tensors replaced by their host copies, and the mirrored names whose bytes did
        not change since the last committed round (none in a ``full`` round or when
        ``DELTACKPT_DEVICE_SCAN=off``). ``patch``: ``DELTACKPT_DEVICE_PATCH`` (None: the
        environment's); ``off`` under ``DELTACKPT_DEVICE_SCAN=off``. ``cast``: the wire dtype of
        tensors mirrored in it (module doc); their host copies are in that dtype."""
        t0 = time.perf_counter()
        scan = default_device_scan() if scan is None else scan
        patch = default_device_patch() if patch is None else patch
        names = mirrored_names(local, scan)
        tensors = {n: _as_wire(local[n], (cast or {}).get(n)) for n in names}
        self._allocate(tensors)
        self._round = {}
        self.device.start(tensors, "off" if scan == "off" else patch)
        # name -> per-chunk change mask on the host (None: copy it whole); "off": every tensor
        changed: dict[str, torch.Tensor | None] = (
            dict.fromkeys(names) if scan == "off" else self._compare(tensors, full, local)
        )
        rec = MirrorRound()
        # tensors with a device base: their changed elements only (device_patches.py)
        found = self.device.find([n for n, m in changed.items() if m is not None], self.host)
        rec.patched, rec.patched_bytes = found, self.device.last.patched_bytes
        patched = set(found)
        copies = cuda.HostCopies()
        try:
            for n, mask in changed.items():
                t = tensors[n]
                if t.numel() == 0 or n in patched:
                    continue
                dst = self.host[n]
                if mask is None or not t.is_contiguous():
                    copies.copy(dst, t)
                    rec.copies += 1
                    rec.copied_bytes += t.numel() * t.element_size()
                    rec.copied.append(n)
                    continue
                src_b, dst_b = t.reshape(-1).view(torch.uint8), dst.reshape(-1).view(torch.uint8)
                for lo, hi in _runs(mask):
                    a, b = lo * self.chunk_bytes, min(hi * self.chunk_bytes, src_b.numel())
                    copies.copy(dst_b[a:b], src_b[a:b])
                    rec.copies += 1
                    rec.copied_bytes += b - a
                rec.copied.append(n)
        finally:
            copies.wait()  # also on failure: no copy may land in a buffer after this returns
        rec.unchanged = frozenset(n for n in names if n not in changed)
        rec.seconds = time.perf_counter() - t0
        self.last = rec
        self.total_copied_bytes += rec.copied_bytes
        out = dict(local)
        out.update((n, self.host[n]) for n in names)
        return out, rec.unchanged

    @property
    def fingerprints(self) -> dict[str, torch.Tensor]:
        """This round's chunk fingerprints (:data:`CHUNK_BYTES`) of the tensors it compared,
        where they live, by name (those of a whole tensor fold into its device digest)."""
        return self._round

    def scan(
        self,
        local: Mapping[str, torch.Tensor],
        full: bool,
        scan: str | None = None,
        cast: Mapping[str, torch.dtype] | None = None,
        skip: frozenset[str] = frozenset(),
        patch: str | None = None,
        defer: frozenset[str] = frozenset(),
    ) -> tuple[dict[str, torch.Tensor], frozenset[str], frozenset[str]]:
        """A device round (an ipc link on CUDA: ``ipc_links.py``): the change found as
        :meth:`stage` finds it, and nothing copied to the host. Returns ``local`` with the
        tensors it scans in their wire dtype (``cast``: cast where they live), the names
        scanned, and those whose fingerprints did not move since the last committed round
        (none in a ``full`` round or under ``DELTACKPT_DEVICE_SCAN=off``). The mirror's host
        copy is not updated: the sender clears the mirror before a round that uses it after
        device rounds (``WeightSender``). ``skip``: tensors known untouched since the last
        commit (``detect="version"``: not written through torch), neither cast nor
        fingerprinted in a delta round: their committed fingerprints carry over. ``patch``
        (``DELTACKPT_DEVICE_PATCH``; None: the environment's): a changed tensor with a device
        base and few changed elements has them found on the device (``device_patches.py``,
        :attr:`DevicePatches.on_device`), for the packer's device patches. ``defer`` (a
        ``full`` round): tensors not fingerprinted here because the packer fingerprints them as
        it copies them into the buckets (one read of their bytes, not two) and hands their
        fingerprints to :meth:`provide`; one it does not provide has none committed, so the
        next round sends it whole."""
        t0 = time.perf_counter()
        scan = default_device_scan() if scan is None else scan
        patch = default_device_patch() if patch is None else patch
        names = mirrored_names(local, "always" if scan == "off" else scan)
        kept = set() if full or scan == "off" else {n for n in skip if n in self._committed}
        tensors = {n: _as_wire(local[n], (cast or {}).get(n)) for n in names if n not in kept}
        self._round = {n: self._committed[n] for n in kept}
        self.device.start(tensors, "off" if scan == "off" else patch, frozenset(kept))
        later = {n for n in defer if n in tensors and tensors[n].numel()} if full else set()
        if scan == "off":
            changed: dict[str, torch.Tensor | None] = dict.fromkeys(tensors)
        else:
            now = {n: t for n, t in tensors.items() if n not in later}
            changed = self._compare(now, full, local)
            changed.update(dict.fromkeys(later))  # sent whole; fingerprinted by the pack
        self._later = later
        rec = MirrorRound(unchanged=frozenset(n for n in names if n not in changed))
        # changed elements on the device where a base allows; the others' bases are refreshed
        # whole at the commit (``copied``)
        rec.patched = self.device.find_device([n for n, m in changed.items() if m is not None])
        rec.patched_bytes = self.device.last.patched_bytes
        rec.copied = [n for n in changed if n not in set(rec.patched)]
        rec.scanned_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
        rec.seconds = time.perf_counter() - t0
        self.last = rec
        out = dict(local)
        out.update(tensors)
        return out, frozenset(names), rec.unchanged

    def provide(self, name: str, fingerprints: torch.Tensor) -> None:
        """The chunk fingerprints of tensor ``name`` that this round's :meth:`scan` deferred
        (``defer``), taken by the packer as it copied the tensor's bytes into a bucket: this
        round's, as the scan would have taken them. Others are ignored."""
        if name in self._later:
            self._later.discard(name)
            self._round[name] = fingerprints

    def _compare(
        self,
        tensors: dict[str, torch.Tensor],
        full: bool,
        own: Mapping[str, torch.Tensor] | None = None,
    ) -> dict[str, torch.Tensor | None]:
        """This round's fingerprints of every tensor (kept for :meth:`commit`) and, per tensor
        that changed since the last commit, its per-chunk change mask on the host (None: copy it
        whole). One device-to-host copy of the masks per device."""
        out: dict[str, torch.Tensor | None] = {}
        names = [n for n, t in tensors.items() if t.numel()]
        by_device: dict[torch.device, list[str]] = {}
        for n in names:
            by_device.setdefault(tensors[n].device, []).append(n)
        for group in by_device.values():  # one batch of fingerprints, one wait per device
            fps = many_fingerprints(
                [self._flat_of(n, tensors[n], own) for n in group],
                self.chunk_bytes,
                fingerprint_kernel(),
            )
            same: list[tuple[str, torch.Tensor, torch.Tensor]] = []
            for n, fp in zip(group, fps, strict=True):
                self._round[n] = fp
                before = self._committed.get(n)
                if full or before is None or before.shape != fp.shape or before.device != fp.device:
                    out[n] = None
                else:
                    same.append((n, fp, before))
            if not same:
                continue
            moved = torch.cat([f for _, f, _ in same]) != torch.cat([b for _, _, b in same])
            flat = moved.any(dim=1).cpu()
            if not bool(flat.any()):  # nothing moved: no tensor is looked at again
                continue
            rows = np.fromiter((fp.shape[0] for _, fp, _ in same), np.int64, len(same))
            ends = np.cumsum(rows)
            starts = ends - rows  # every tensor here has a chunk or more
            hit = np.logical_or.reduceat(flat.numpy(), starts)
            for i in np.flatnonzero(hit).tolist():
                out[same[i][0]] = flat[int(starts[i]) : int(ends[i])]
        return out

    def _flat_of(
        self, name: str, t: torch.Tensor, own: Mapping[str, torch.Tensor] | None
    ) -> torch.Tensor:
        """:func:`_flat` of ``t``, kept for the next round while it is the same contiguous
        tensor of the caller's (``own``; a non-contiguous one is copied every round, and a
        tensor cast for the wire is a new one every round: neither is kept, nothing of the
        device's memory is held between rounds)."""
        got = self._flats.get(name)
        if got is not None and got[0] is t:
            return got[1]
        flat = _flat(t)
        if own is not None and own.get(name) is t and t.is_contiguous():
            self._flats[name] = (t, flat)
        else:
            self._flats.pop(name, None)
        return flat

    def commit(self) -> None:
        """The round committed: its fingerprints are what the next delta round compares with
        (none after a round that took none, ``DELTACKPT_DEVICE_SCAN=off``: the next round under
        another setting then copies everything), and the device bases take its bytes."""
        self._committed, self._round = self._round, {}
        self._later = set()
        self.device.commit(self.last.copied)

    def abandon(self) -> None:
        """The round failed: keep the last committed fingerprints and device bases."""
        self._round = {}
        self._later = set()
        self.device.abandon()


def _first_fit(sizes: dict[str, int], names: list[str], cap: int) -> list[list[str]]:
    """``names`` (largest first) packed first fit into bins of ``cap`` bytes (a name larger
    than ``cap`` gets a bin of its own)."""
    bins: list[list[str]] = []
    used: list[int] = []
    for n in names:
        for i, u in enumerate(used):
            if u + sizes[n] <= cap:
                bins[i].append(n)
                used[i] += sizes[n]
                break
        else:
            bins.append([n])
            used.append(sizes[n])
    return bins


def _segments(sizes: dict[str, int]) -> list[tuple[int, list[str]]]:
    """Power-of-two host blocks holding every name (``sizes``: bytes, aligned), little room
    left over: torch's caching host allocator rounds a pinned block up to a power of two, so
    blocks are filled first fit (largest first) at a cap of max(256 MiB, the largest tensor
    rounded up); the last, partly filled block is packed again at half the cap while that
    wastes less, so what is wasted is about the last small block's slack."""
    names = sorted(sizes, key=lambda n: -sizes[n])
    if not names:
        return []
    cap = max(_MIN_SEGMENT, _pow2(sizes[names[0]]))
    out: list[tuple[int, list[str]]] = []
    while True:
        bins = _first_fit(sizes, names, cap)
        last = bins.pop()
        out += [(_pow2(max(1, sum(sizes[n] for n in b))), b) for b in bins]
        used = max(1, sum(sizes[n] for n in last))
        block = _pow2(used)
        if block - used <= block // 4 or cap <= _MIN_BLOCK or sizes[last[0]] > cap // 2:
            out.append((block, last))
            return out
        names, cap = last, cap // 2


def _runs(mask: torch.Tensor) -> list[tuple[int, int]]:
    """``[lo, hi)`` chunk ranges where the bool host vector ``mask`` is true."""
    out: list[tuple[int, int]] = []
    start = None
    for i, v in enumerate(mask.tolist()):
        if v and start is None:
            start = i
        elif not v and start is not None:
            out.append((start, i))
            start = None
    if start is not None:
        out.append((start, len(mask)))
    return out

"""Delta rounds of device tensors by element: the changed elements of a trainer's CUDA tensors
are found on the device, and only they cross to the host mirror (issue 36).

Without this, a delta round of CUDA weights copies every 1 MiB chunk whose device fingerprint
moved into the pinned host mirror (``host_mirror.py``), and the host encoder then diffs the
mirror against its host bases. An RL step changes 1-3% of the bf16 elements, spread over every
chunk, so the whole model crosses PCIe each round. Here the sender also keeps, where the device
has room, a **device base** per mirrored tensor: a device copy of its bytes at the last
committed round. A delta round then, per tensor the fingerprints found changed:

1. finds the changed elements on the device (``format.device_changes.changed_many_on_device``:
   a comparison against the device base, the counts of every such tensor brought to the host in
   one wait, the lists taken at their known sizes without another), at most
   :data:`DEVICE_PATCH_BELOW` of the elements (above that the tensor's changed chunks are
   copied as before);
2. copies the element indices and new values to the host, (4 + itemsize) bytes per changed
   element, and writes them into the mirror, which holds the last committed bytes: the mirror
   is the tensor's new bytes again, for the hashes and the pieces the packer sends whole;
3. hands the list to the encoder (:class:`DeviceBases`): a piece of such a tensor, in its
   local dtype and contiguous in it, is encoded from the list (``changes.pack_changes``, the
   same payload the host encoder builds from its own diff; no host pass over the piece).

The device base is written only when the round commits: the changed elements are written into
it (a tensor whose chunks were copied instead is copied into it whole, device to device, from
the source, which must not change until ``push`` returns); a failed round leaves it at the last
committed version (the next round is full anyway and rewrites it).

Memory: one device copy of each mirrored tensor in the dtype the mirror holds it (its wire
dtype where every piece of it goes in one other floating dtype: an fp32 master sent as bf16 is
cast first, ``host_mirror.py``, so an RL step's 1-3% of changed bf16 elements are found although
nearly every fp32 element moved; else its own dtype), allocated at the commit of the first round
that copied it whole (the first, full round), and only where ``cuda.device_room`` says it fits;
a tensor without one goes by chunks.

Time, not measured on a GPU yet: the host writes the elements into the mirror with one scatter
(``index_put_``, ~200 M elements/s per core on the 2-core dev VM), which at 3% of the elements
can cost more than the pinned chunk copy it replaces; what it always spares is PCIe bytes and,
on links that patch, the host's diff of each changed piece.

``DELTACKPT_DEVICE_PATCH``: ``off`` (default until a GPU measures ``auto``), ``auto`` (CUDA
tensors), ``always`` (also the host tensors the mirror holds under ``DELTACKPT_DEVICE_SCAN=
always``: the CPU stand-in the test suite runs).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import numpy as np
import torch

from deltackpt import cuda
from deltackpt.format.changes import UINT
from deltackpt.format.device_changes import changed_many_on_device
from deltackpt.sync import delta_codec
from deltackpt.sync.dtypes import wire_dtype
from deltackpt.sync.patches import BaseKey, Bases, Changes
from deltackpt.sync.schedule import Schedule
from deltackpt.sync.schedule_decl import Box, Held

__all__ = [
    "DEVICE_PATCH_BELOW",
    "DeviceBases",
    "DevicePatches",
    "PatchRound",
    "piece_finder",
    "trackable",
]

#: A tensor whose changed elements are at most this share is patched from the device; above,
#: its changed chunks are copied (at 1/8 of bf16 elements the list is 3/8 of the tensor's bytes)
DEVICE_PATCH_BELOW = 1 / 8

_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}

#: (tensor index, box offset, box size, wire dtype) -> the piece's changed elements, if known
Finder = Callable[[BaseKey], Changes | None]


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def trackable(t: torch.Tensor, mode: str) -> bool:
    """Whether ``DELTACKPT_DEVICE_PATCH=mode`` keeps a device base of mirrored tensor ``t``."""
    if mode == "off" or (mode == "auto" and not cuda.is_device(t)):
        return False
    return t.is_contiguous() and 0 < t.numel() < 1 << 32 and t.element_size() in _INT


@dataclass
class PatchRound:
    """What the device found in one round: the tensors brought to the mirror by their changed
    elements, the bytes that crossed for them, and the elements."""

    patched: list[str] = field(default_factory=list)
    patched_bytes: int = 0
    elements: int = 0


class DevicePatches:
    """The device bases of a sender's mirrored tensors and one round's changed elements (see
    module doc). Used by :class:`~deltackpt.sync.host_mirror.HostMirror` from the sender's
    calling thread: :meth:`start`, :meth:`find`, then :meth:`commit` or :meth:`abandon`."""

    def __init__(self) -> None:
        self.bases: dict[str, torch.Tensor] = {}  # name -> flat uint8 device copy, committed
        self.found: dict[str, Changes] = {}  # this round's changed elements, on the host
        # ... a device round's, left on the device: (indices, values)
        self.on_device: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self._pending: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # ... on the device
        self._local: dict[str, torch.Tensor] = {}  # this round's tracked tensors (device)
        self.last = PatchRound()

    @property
    def nbytes(self) -> int:
        """Device bytes the bases hold."""
        return sum(b.numel() for b in self.bases.values())

    def clear(self) -> None:
        """Drop every base (its tensors go by chunks until a round copies them whole)."""
        self.bases.clear()
        self.abandon()

    def abandon(self) -> None:
        """The round failed (or is over): its changes are dropped, the bases stay committed."""
        self.found.clear()
        self.on_device.clear()
        self._pending.clear()
        self._local = {}

    def start(
        self, tensors: dict[str, torch.Tensor], mode: str, keep: frozenset[str] = frozenset()
    ) -> None:
        """A round over the mirrored ``tensors`` under ``DELTACKPT_DEVICE_PATCH=mode``: keeps
        the bases of the tensors it tracks (of the same size and device), and of ``keep``
        (tensors known untouched since the commit, not in ``tensors``), drops the others."""
        self.abandon()
        self.last = PatchRound()
        self._local = {n: t for n, t in tensors.items() if trackable(t, mode)}
        for n in list(self.bases):
            if n in keep and mode != "off":
                continue
            t = self._local.get(n)
            b = self.bases[n]
            if t is None or b.device != t.device or b.numel() != t.numel() * t.element_size():
                del self.bases[n]

    def find(self, names: list[str], host: dict[str, torch.Tensor]) -> list[str]:
        """For each of ``names`` (tensors whose fingerprints moved since the last commit) that
        has a device base and at most :data:`DEVICE_PATCH_BELOW` changed elements: bring its
        changed elements to the host and write them into ``host[name]`` (its mirror, holding
        the last committed bytes). Returns the names done so; the others' chunks are copied."""
        done: list[str] = []
        for n, size, (idx_d, vals_d) in self._changes(names):
            idx, vals = idx_d.cpu(), vals_d.cpu()  # the elements cross: (4 + itemsize) each
            dst = host[n].reshape(-1).view(_INT[size])
            dst.index_put_((idx.long(),), vals)  # through torch: the version counter moves
            self.found[n] = (
                idx.numpy().astype(np.uint32, copy=False),
                vals.numpy().view(UINT[size]),
            )
            done.append(n)
        return done

    def find_device(self, names: list[str]) -> list[str]:
        """A device round's :meth:`find`: the changed elements of each of ``names`` that has a
        device base and at most :data:`DEVICE_PATCH_BELOW` of them changed, left on the device
        (:attr:`on_device`, for the packer's device patches, ``device_delta.py``) and written
        into the base at :meth:`commit`. Returns the names found so."""
        done: list[str] = []
        for n, _, got in self._changes(names):
            self.on_device[n] = got
            done.append(n)
        return done

    def _changes(
        self, names: list[str]
    ) -> Iterator[tuple[str, int, tuple[torch.Tensor, torch.Tensor]]]:
        """(name, element size, its changed elements on the device) of each of ``names`` with a
        device base and at most :data:`DEVICE_PATCH_BELOW` of them changed; each is kept for
        :meth:`commit` and counted in :attr:`last`."""
        rec = self.last
        todo = []
        for n in names:
            t, base = self._local.get(n), self.bases.get(n)
            if t is not None and base is not None:
                todo.append((n, t, base))
        found = changed_many_on_device(  # one wait for the counts of every tensor
            [
                (_flat(t), b, t.element_size(), int(t.numel() * DEVICE_PATCH_BELOW))
                for _, t, b in todo
            ]
        )
        for (n, t, _), got in zip(todo, found, strict=True):
            if got is None:
                continue
            size = t.element_size()
            self._pending[n] = got
            rec.patched.append(n)
            rec.patched_bytes += got[0].numel() * (got[0].element_size() + size)
            rec.elements += got[0].numel()
            yield n, size, got

    def commit(self, copied: list[str]) -> None:
        """The round committed: the changed elements found on the device are written into their
        bases; the tracked tensors in ``copied`` (their chunks or all of them went to the mirror)
        are copied into theirs, a base allocated where missing and the device has room."""
        for n, (idx, vals) in self._pending.items():
            base = self.bases[n].view(_INT[vals.element_size()])
            base.index_put_((idx.long() if idx.dtype != torch.int64 else idx,), vals)
        for n in copied:
            t = self._local.get(n)
            if t is None:
                continue
            nbytes = t.numel() * t.element_size()
            base = self.bases.get(n)
            if base is None:
                if not cuda.device_room(t.device, nbytes):
                    continue
                base = self.bases[n] = torch.empty(nbytes, dtype=torch.uint8, device=t.device)
            base.copy_(_flat(t))
        self.abandon()


class DeviceBases(Bases):
    """:class:`~deltackpt.sync.patches.Bases` whose pieces may come with their changed elements
    already found (on the device, :class:`DevicePatches`): ``finder`` (set by the sender for one
    round) gives them, and :meth:`encode` builds the payload from that list instead of diffing
    the piece against its host base. The payload is the one the host path builds: the same
    choice between ``PACKED`` and ``SPARSE`` from the same list (``tests/sync/
    test_device_patch.py`` compares them); anything else (over ``packed_below``, a payload no
    smaller than the piece, no list) goes the host way."""

    def __init__(self) -> None:
        super().__init__()
        self.finder: Finder | None = None
        self.found_pieces = 0  # pieces encoded from a device list (all rounds)
        self._count_lock = threading.Lock()

    def start_round(self) -> None:
        super().start_round()
        self.finder = None

    def encode(
        self, key: BaseKey, new: torch.Tensor, itemsize: int
    ) -> tuple[int, np.ndarray] | None:
        with self.lock(key):
            return self._found(key, new, itemsize)

    def _found(
        self, key: BaseKey, new: torch.Tensor, itemsize: int
    ) -> tuple[int, np.ndarray] | None:
        got = None
        if self.finder is not None and key not in self._cache and key in self._base:
            got = self.finder(key)
        if got is None:
            return super().encode(key, new, itemsize)
        idx, vals = got
        nbytes = new.numel()
        n = nbytes // itemsize
        if (
            vals.itemsize != itemsize
            or delta_codec.PACKED not in self.allow
            or idx.size > int(n * self.packed_below)
        ):
            return super().encode(key, new, itemsize)
        if idx.size == 0:
            self._cache[key] = (0, np.empty(0, np.uint8))
            return self._cache[key]
        packed = delta_codec._encode_packed(idx, vals, itemsize)
        mode, sparse_size = delta_codec._sparse_layout(n, idx.size, itemsize)
        if delta_codec.SPARSE in self.allow and sparse_size < min(packed.nbytes, nbytes):
            mask = self._scratch.take("mask", n).view(np.bool_)
            mask[:] = False
            mask[idx] = True
            dst = self._scratch.take("payload", sparse_size)
            raw = new.numpy().view(UINT[itemsize])
            enc = delta_codec._encode_sparse(raw, mask, idx.size, mode, sparse_size, dst)
        elif packed.nbytes < nbytes:
            enc = packed
        else:  # nothing listed is smaller than the piece: the host's choice (raw or planes)
            return super().encode(key, new, itemsize)
        self._base[key].numpy().view(vals.dtype)[idx] = vals
        self._updated.add(key)
        with self._count_lock:  # packing threads encode other pieces at once
            self.found_pieces += 1
        self._cache[key] = (enc.kind, np.frombuffer(enc.payload, np.uint8, enc.nbytes).copy())
        return self._cache[key]


def piece_finder(
    sched: Schedule,
    boxes: dict[str, Held],
    local: dict[str, torch.Tensor],
    found: dict[str, Changes],
) -> Finder | None:
    """The changed elements of a piece, cut from its tensor's list in ``found``: for a piece in
    its tensor's local dtype whose box is contiguous in ``local[name]`` (the mirror: contiguous),
    the list's indices in the box's flat range, made relative to it; None otherwise."""
    if not found:
        return None

    def find(key: BaseKey) -> Changes | None:
        tensor, offset, size, dtype = key
        name = sched.tensors[tensor].name
        got = found.get(name)
        t = local.get(name)
        if got is None or t is None or wire_dtype(dtype) != t.dtype:
            return None
        view = t[Box(offset, size).within(boxes[name].box)]
        if not view.is_contiguous():
            return None
        start = view.storage_offset() - t.storage_offset()
        idx, vals = got
        lo, hi = np.searchsorted(idx, [start, start + view.numel()])
        return idx[lo:hi] - np.uint32(start), vals[lo:hi]

    return find

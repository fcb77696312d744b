"""Save step 2 for state in device memory (CUDA): find the changed chunks where the state lives,
copy only those to the host, hash them there.

    fingerprint every chunk (device) -> compare with the last save's fingerprints
      -> copy the changed chunks through a ring of host buffers (pinned on CUDA, side stream)
      -> hash each buffer while the next one fills (host thread pool; xxh3, as every chunk of
         the store is named)
      -> step 3 copies each changed chunk the store lacks to the host again as it writes it,
         into a buffer of the writing thread, checked against the digest it had here

The host memory of a sync save of device state is so bounded whatever the state's size
(:data:`RING_SLOTS` x :data:`SLOT_BYTES` for the hash pass, one chunk per writing thread for the
write), not a host copy of the state: the changed chunks cross PCIe twice (a pinned copy runs at
~54 GB/s on an H100, a disk writes at ~1-2 GB/s). Group chunks' small sources are copied once,
into the arena, as before. A chunk whose bytes changed between the two copies (a write to the
state from another stream or thread during the save) fails the save, naming it.

A chunk counts as unchanged when its key (source key, chunk index and size) had the same
fingerprint at this process's last committed save of the store, and the digest it had then is
still in the store's index (gc may have removed it since; a failed save never records one): it
keeps that digest and never crosses to the host. What a fingerprint can miss, and what it costs
on the device: format/fingerprint.py. Group chunks (small tensors packed together) are always
copied and hashed: they are small by construction.

The same code runs on CPU tensors (``DELTACKPT_DEVICE_SCAN=always``), which is how the CPU
test suite covers it; CPU state is otherwise hashed in place (saving/stage.py), which is faster
there. Sync saves take this path; an async save of device state copies everything to pinned
buffers and hashes behind the caller (saving/stage.py :func:`stage`).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping, MutableMapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import torch

from deltackpt.cuda import HostCopies, host_buffer, is_device
from deltackpt.errors import SaveFailedError
from deltackpt.format.fingerprint import many_fingerprints
from deltackpt.format.hashing import digest
from deltackpt.format.manifest import ChunkRecord
from deltackpt.options import fingerprint_kernel
from deltackpt.saving.hooks import hooks
from deltackpt.saving.plan import SavePlan, chunk_view
from deltackpt.saving.stage import Arena, StagedChunks, Unfilled

Fingerprint = tuple[int, int]
FingerprintKey = tuple[str, int]  # (chunk ref_key, chunk size)
RING_SLOTS = 4  # host buffers the hash pass copies changed chunks through, in turn
SLOT_BYTES = 16 << 20  # bytes of one (or a chunk's, when larger)


@dataclass
class DeviceScan:
    """What step 2 on a device found: every chunk's digest, the staged copies of the changed
    ones, and the fingerprints to remember once the save commits."""

    digests: list[str]
    copies: StagedChunks
    arrays: Unfilled  # per source: its host buffer (only the staged ranges hold its bytes)
    fingerprints: dict[FingerprintKey, tuple[Fingerprint, str]] = field(default_factory=dict)


def fingerprints(plan: SavePlan, chunk_bytes: int) -> list[Fingerprint | None]:
    """Per chunk of ``plan``: its fingerprint, computed on the device of its source (one small
    device-to-host transfer per device at the end); None for group chunks."""
    by_device: dict[torch.device, list[int]] = {}
    for si, src in enumerate(plan.sources):
        if any(plan.chunks[ci].ref_key for ci, _, _ in plan.source_slices[si]):  # not grouped
            by_device.setdefault(src.data.device, []).append(si)
    host: dict[int, list[list[int]]] = {}
    for group in by_device.values():  # fingerprinted together, one copy to the host
        fps = many_fingerprints(
            [plan.sources[si].data for si in group], chunk_bytes, fingerprint_kernel()
        )
        rows = torch.cat(fps).cpu().tolist()
        pos = 0
        for si, fp in zip(group, fps, strict=True):
            host[si] = rows[pos : pos + fp.shape[0]]
            pos += fp.shape[0]
    out: list[Fingerprint | None] = [None] * len(plan.chunks)
    for si, rows in host.items():
        chunk_ids = [ci for ci, _, _ in plan.source_slices[si]]
        for ci, (a, b) in zip(chunk_ids, rows, strict=True):
            out[ci] = (a, b)
    return out


def scan(
    plan: SavePlan,
    chunk_bytes: int,
    known: Mapping[FingerprintKey, tuple[Fingerprint, str]] | None,
    index: Mapping[str, ChunkRecord],
    arena: Arena,
    pool: ThreadPoolExecutor,
    group_bufs: dict[int, np.ndarray],
) -> DeviceScan:
    """Step 2 for ``plan`` on a device (module doc): ``known`` is the last committed save's
    fingerprints and digests (None: trust none, copy and hash every chunk); ``index`` the
    store's chunks now."""
    fps = fingerprints(plan, chunk_bytes) if known is not None else [None] * len(plan.chunks)
    known = known or {}
    digests = [""] * len(plan.chunks)
    todo: list[int] = []
    remember: dict[FingerprintKey, tuple[Fingerprint, str]] = {}
    for ci, spec in enumerate(plan.chunks):
        fp = fps[ci]
        if spec.ref_key is not None and fp is not None:
            prior = known.get((spec.ref_key, spec.size))
            if prior is not None and prior[0] == fp and prior[1] in index:
                digests[ci] = prior[1]
                remember[(spec.ref_key, spec.size)] = prior
                continue
        todo.append(ci)

    # group chunks: their whole small sources copied into the arena (small by construction)
    gathered = [ci for ci in todo if plan.chunks[ci].ref_key is None]
    streamed = [ci for ci in todo if plan.chunks[ci].ref_key is not None]
    ranges: dict[int, list[tuple[int, int]]] = {}
    for ci in gathered:
        for si, start, length in plan.chunks[ci].parts:
            ranges.setdefault(si, []).append((start, length))
    host: list[np.ndarray | None] = [None] * len(plan.sources)
    copies = HostCopies()
    for si, spans in ranges.items():
        src = plan.sources[si]
        buf = arena.buffer(src.key, src.nbytes, pin=is_device(src.data))
        for start, length in spans:
            copies.copy(buf[start : start + length], src.data[start : start + length])
        host[si] = buf.numpy()
    copies.wait()
    for ci in gathered:
        hooks.on_stage_copy(ci)
    arrays = Unfilled(host, "of a device save was read but never copied to the host")

    def one(ci: int) -> tuple[int, str, np.ndarray]:
        view = chunk_view(plan.chunks[ci], arrays.__getitem__, group_bufs, ci)
        return ci, digest(view), view

    chunks = DeviceChunks(plan, digests)
    for ci, d, view in pool.map(one, gathered):
        digests[ci], chunks.staged[ci] = d, view
    for ci, d in _hash_through_ring(plan, streamed, pool, copies).items():
        digests[ci] = d
        chunks.lazy.add(ci)  # its bytes copied again if step 3 writes it
        spec, fp = plan.chunks[ci], fps[ci]
        if fp is not None:
            remember[(spec.ref_key, spec.size)] = (fp, d)  # type: ignore[index]
    staged = StagedChunks(data=chunks, new={ci for ci in todo if digests[ci] not in index})
    return DeviceScan(digests, staged, arrays, remember)


def _hash_through_ring(
    plan: SavePlan, ids: list[int], pool: ThreadPoolExecutor, copies: HostCopies
) -> dict[int, str]:
    """The digests of chunks ``ids`` (one source range each), copied in batches through a ring
    of :data:`RING_SLOTS` host buffers: a batch is hashed on the pool while the next fills the
    next buffer; a buffer is refilled once its batch is hashed."""
    if not ids:
        return {}
    pin = any(is_device(plan.sources[plan.chunks[ci].parts[0][0]].data) for ci in ids)
    slot_bytes = max(SLOT_BYTES, max(plan.chunks[ci].size for ci in ids))
    batches: list[list[int]] = [[]]
    used = 0
    for ci in ids:
        n = plan.chunks[ci].size
        if batches[-1] and used + n > slot_bytes:
            batches.append([])
            used = 0
        batches[-1].append(ci)
        used += n
    slots = [host_buffer(slot_bytes, pin) for _ in range(min(RING_SLOTS, len(batches)))]
    pending: list[list[Future[tuple[int, str]]]] = [[] for _ in slots]
    out: dict[int, str] = {}

    def hashed(k: int) -> None:  # slot k's batch: its digests (and the slot free again)
        for f in pending[k]:
            ci, d = f.result()
            out[ci] = d
        pending[k] = []

    try:
        for b, batch in enumerate(batches):
            k = b % len(slots)
            hashed(k)
            buf, pos, spans = slots[k], 0, []
            for ci in batch:
                si, start, length = plan.chunks[ci].parts[0]
                copies.copy(buf[pos : pos + length], plan.sources[si].data[start : start + length])
                spans.append((ci, pos, length))
                pos += length
            copies.wait()
            for ci in batch:
                hooks.on_stage_copy(ci)
            arr = buf.numpy()
            pending[k] = [
                pool.submit(lambda ci=ci, v=arr[o : o + n]: (ci, digest(v)))  # type: ignore[misc]
                for ci, o, n in spans
            ]
        for k in range(len(slots)):
            hashed(k)
    finally:  # a failure: the pool's jobs still read the buffers they hold; let them end
        for fs in pending:
            for f in fs:
                f.cancel()
    return out


class DeviceChunks(MutableMapping[int, np.ndarray]):
    """Step 3's bytes of the chunks a sync save of device state copied (:func:`scan`): the
    group chunks gathered into the arena (``staged``), and the changed chunks the store lacks
    (``lazy``), copied from the device again when asked for, into a buffer of the asking thread
    (valid until its next ask), and checked against the digest the scan took."""

    def __init__(self, plan: SavePlan, digests: list[str]) -> None:
        self.plan, self.digests = plan, digests
        self.staged: dict[int, np.ndarray] = {}
        self.lazy: set[int] = set()
        self._mine = threading.local()

    def __getitem__(self, ci: int) -> np.ndarray:
        got = self.staged.get(ci)
        if got is not None:
            return got
        if ci not in self.lazy:
            raise KeyError(ci)
        spec = self.plan.chunks[ci]
        si, start, length = spec.parts[0]
        src = self.plan.sources[si]
        buf: torch.Tensor | None = getattr(self._mine, "buf", None)
        if buf is None or buf.numel() < length:
            buf = self._mine.buf = host_buffer(length, is_device(src.data))
        buf[:length].copy_(src.data[start : start + length])  # waits for the copy
        view = buf[:length].numpy()
        d = digest(view)
        if d != self.digests[ci]:
            raise SaveFailedError(
                f"{src.key!r} changed while it was being saved: chunk {ci} (bytes {start}-"
                f"{start + length} of it) had digest {self.digests[ci]} when hashed and {d} when "
                "written. Nothing was committed. A save of device state reads it twice; finish "
                "every write to it (other threads, other CUDA streams) before saving, then "
                "save again"
            )
        return view

    def __setitem__(self, ci: int, view: np.ndarray) -> None:
        self.staged[ci] = view

    def __delitem__(self, ci: int) -> None:
        self.staged.pop(ci, None)
        self.lazy.discard(ci)

    def __contains__(self, ci: object) -> bool:
        return ci in self.staged or ci in self.lazy

    def __iter__(self) -> Iterator[int]:
        yield from self.staged
        yield from (ci for ci in self.lazy if ci not in self.staged)

    def __len__(self) -> int:
        return len(self.staged) + len(self.lazy - self.staged.keys())

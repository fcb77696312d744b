"""Save step 2 for state in device memory (CUDA): find the changed chunks where the state lives,
copy only those to the host, hash them there.

    fingerprint every chunk (device) -> compare with the last save's fingerprints
      -> copy the changed chunks into reused host buffers (pinned on CUDA, side stream)
      -> hash them (host thread pool; xxh3, as every chunk of the store is named)

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

from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import torch

from deltackpt.cuda import HostCopies, is_device
from deltackpt.format.fingerprint import many_fingerprints
from deltackpt.format.hashing import digest
from deltackpt.format.manifest import ChunkRecord
from deltackpt.options import fingerprint_kernel
from deltackpt.saving.hooks import hooks
from deltackpt.saving.plan import SavePlan, chunk_view
from deltackpt.saving.stage import Arena, StagedChunks, Unfilled

Fingerprint = tuple[int, int]
FingerprintKey = tuple[str, int]  # (chunk ref_key, chunk size)


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

    # copy what changed: whole small sources of group chunks, the changed ranges of the others
    ranges: dict[int, list[tuple[int, int]]] = {}
    for ci in todo:
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
    for ci in todo:
        hooks.on_stage_copy(ci)
    arrays = Unfilled(host, "of a device save was read but never copied to the host")

    staged = StagedChunks()

    def one(ci: int) -> tuple[int, str, np.ndarray]:
        view = chunk_view(plan.chunks[ci], arrays.__getitem__, group_bufs, ci)
        return ci, digest(view), view

    for ci, d, view in pool.map(one, todo):
        digests[ci] = d
        staged.data[ci] = view
        if d not in index:
            staged.new.add(ci)
        spec, fp = plan.chunks[ci], fps[ci]
        if spec.ref_key is not None and fp is not None:
            remember[(spec.ref_key, spec.size)] = (fp, d)
    return DeviceScan(digests, staged, arrays, remember)

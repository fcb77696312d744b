"""The last step of a committed round on a receiver: copy every verified piece from the private
staging into its target tensor (the ``into`` parameter, or the receiver's own copy handed to
``load_weights``). Runs only after every rank voted to commit, so a failed round never gets
here and the model never holds half a round.

A piece that came as a ``PACKED`` patch (or a device round's device patch) into a contiguous
target box is applied by writing its k changed elements (verified in staging: base + patch has the digest of the new piece) instead
of copying the whole piece: an RL step changes a few percent of them.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from deltackpt import cuda
from deltackpt.sync import wire
from deltackpt.sync.dtypes import wire_dtype
from deltackpt.sync.schedule import LinkBucket
from deltackpt.sync.schedule_decl import Box, Wanted
from deltackpt.sync.spill import Spilled, UndoSpill, keep_old

__all__ = ["Staged", "Undo", "View", "Views", "apply_round", "revert"]

# a verified bucket: its slot, piece offsets (each piece whole there), flags, and the changed
# elements of its PACKED pieces (patches.expand)
Staged = tuple[
    LinkBucket, torch.Tensor, list[int | None], list[int], dict[int, tuple[np.ndarray, np.ndarray]]
]
_SIGNED = {1: (torch.int8, np.int8), 2: (torch.int16, np.int16), 4: (torch.int32, np.int32)}
_SIGNED[8] = (torch.int64, np.int64)

try:  # setup.py builds it; torch's indexing below does the same
    from deltackpt._native import patch_apply as _native_apply
except ImportError:  # pragma: no cover - depends on the install
    _native_apply = None

#: what :func:`apply_round` overwrote, to put back (:func:`revert`): a target region and its old
#: bytes (a piece copied whole), or a target's flat elements, their indices and old values (a
#: patch: only the changed elements are kept); a piece's old bytes may be in an undo spill file
Undo = list[tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | Spilled]]


class View:
    """What a receiver keeps of one piece of its schedule from round to round, so that a round
    does not index its target and its slot again piece by piece: the target's view (and that
    view as raw bytes where the piece is copied in byte for byte) while the target is the same
    tensor in the same place (``param.data = ...`` moves a parameter: then it is made again),
    and the piece's bytes in its slot while the slot and the offset are the same."""

    __slots__ = ("at", "bk", "dst", "dt", "flat", "off", "slot", "src", "target")

    def __init__(
        self, bk: LinkBucket, target: torch.Tensor, at: tuple, dst: torch.Tensor, dt: torch.dtype
    ) -> None:
        self.bk, self.target, self.at, self.dst, self.dt = bk, target, at, dst, dt
        self.flat = wire.raw_bytes(dst, dt)
        self.slot: torch.Tensor | None = None
        self.off = -1
        self.src: torch.Tensor | None = None


#: (bucket, piece) -> its :class:`View`: kept by a receiver for its schedule
Views = dict[tuple[int, int], View]
#: a copy of a round: (into, from, whether both are raw bytes of one device)
Job = tuple[torch.Tensor, torch.Tensor, bool]


def apply_round(
    targets: Sequence[torch.Tensor],
    wanted: Sequence[tuple[Wanted, int, Box]],
    staged: list[Staged],
    pool: ThreadPoolExecutor | None,
    undo: Undo | None = None,
    spill: UndoSpill | None = None,
    views: Views | None = None,
) -> set[int]:
    """Copy every staged piece into its target; returns the wants touched. The copies run on
    ``pool`` (a copy releases the GIL): after the vote the senders are idle, so this rank may
    use the cores they used. With ``undo``, what is overwritten is kept there first (for a
    patch, only the changed elements), so :func:`revert` can put the previous round back; with
    ``spill`` the old bytes of pieces copied whole into host targets go into that file.
    ``views``: where the pieces' views of their targets are kept from round to round (the
    receiver's, for its schedule)."""
    jobs: list[Job] = []
    patches: list[tuple[torch.Tensor, np.ndarray, np.ndarray]] = []  # host patches, C pass
    changed: set[int] = set()
    views = {} if views is None else views
    for bk, slot, offsets, _, sparse in staged:
        for k, (p, off) in enumerate(zip(bk.pieces, offsets, strict=True)):
            if off is None:
                continue
            target = targets[p.want]
            at = (target.data_ptr(), target.shape, target.stride())
            v = views.get((id(bk), k))
            if v is None or v.bk is not bk or v.target is not target or v.at != at:
                dst = target[p.box.within(wanted[p.want][2])]
                v = views[(id(bk), k)] = View(bk, target, at, dst, wire_dtype(p.dtype))
            dst, flat, dt = v.dst, v.flat, v.dt
            changed.add(p.want)
            if k in sparse and flat is not None:
                idx, vals = sparse[k]
                with torch.no_grad():  # raw bits: no cast
                    words = dst.view(-1).view(_SIGNED[dt.itemsize][0])
                if isinstance(idx, torch.Tensor) or not _host_patches_fit(words):
                    _torch_patch(words, idx, vals, undo)
                else:  # written below on the pool's threads, before the copies
                    patches.append((words, idx, vals))
                continue
            if undo is not None:
                undo.append((dst, None, keep_old(dst, spill)))
            if v.slot is not slot or v.off != off:
                v.slot, v.off, v.src = slot, off, slot[off : off + p.nbytes]
            src = v.src
            if flat is not None and slot.device == flat.device:  # raw bytes, copied together
                jobs.append((flat, src, True))
            else:
                jobs.append((dst, src.view(dt).view(p.box.size), False))
    # host patches: each piece in one C pass on the pool's threads (it releases the GIL; the
    # pieces are disjoint, so their undo entries may come in any order); those it refuses
    # (indices not increasing) go through torch's indexing after
    if pool is None or len(patches) < 2:
        refused = [p for p in patches if not _host_patch(*p, undo)]
    else:
        done = pool.map(lambda p: _host_patch(*p, undo), patches)
        refused = [p for p, ok in zip(patches, done, strict=True) if not ok]
    for words, idx, vals in refused:
        _torch_patch(words, idx, vals, undo)
    if pool is None or len(jobs) < 2:
        _copy_all(jobs)
        return changed
    n = pool._max_workers  # type: ignore[attr-defined]
    total = sum(src.numel() * src.element_size() for _, src, _ in jobs)
    runs: list[list[Job]] = [[]]
    acc = 0
    for job in jobs:  # runs of about equal bytes, one per thread
        if acc >= total * len(runs) / n and len(runs) < n:
            runs.append([])
        runs[-1].append(job)
        acc += job[1].numel() * job[1].element_size()
    # the pool's threads queue their copies on this thread's streams (a thread starts on the
    # default stream: a pull under a side stream, or the undo's copies queued above on it,
    # would not be ordered with them)
    streams = cuda.current_streams(dst.device for dst, _, _ in jobs)
    for f in [pool.submit(cuda.on_streams, streams, _copy_all, r) for r in runs]:
        f.result()
    return changed


def _host_patches_fit(words: torch.Tensor) -> bool:
    """Whether :func:`_host_patch` can write into ``words``: a host target, the C pass built."""
    return _native_apply is not None and words.device.type == "cpu"


def _torch_patch(
    words: torch.Tensor,
    idx: np.ndarray | torch.Tensor,
    vals: np.ndarray | torch.Tensor,
    undo: Undo | None,
) -> None:
    """Write a patch's elements into ``words`` with torch's indexing (a device patch, where
    its slot was; a host patch the C pass cannot take), the old values kept in ``undo``."""
    as_torch, as_numpy = _SIGNED[words.element_size()]
    with torch.no_grad():  # raw bits: no cast, no NaN compare
        if isinstance(idx, torch.Tensor):  # a device patch, where the slot was
            where = idx.to(device=words.device, dtype=torch.int64)
            new = vals.to(words.device).view(as_torch)  # type: ignore[union-attr]
        else:
            where = torch.from_numpy(idx.view(np.int64))
            new = torch.from_numpy(np.asarray(vals).view(as_numpy))
        if undo is not None:
            undo.append((words, where, words[where]))  # fancy indexing: a copy
        words[where] = new


def _host_patch(words: torch.Tensor, idx: np.ndarray, vals: np.ndarray, undo: Undo | None) -> bool:
    """Write a host patch's elements into ``words`` (a contiguous host target's elements as
    signed integers) in one C pass that keeps the old values as it goes
    (``_native.patch_apply``: each element read and written while its line is in cache; for an
    RL step's 2.3% of a bf16 gigabyte 1.6x torch's gather then scatter in 64 MiB pieces, 2.5x
    in one tensor, BENCHMARKS.md).
    False (nothing written) where that does not apply: no C extension, a device target, or
    indices the C loop refuses (not increasing): torch's indexing does it then."""
    if not _host_patches_fit(words):
        return False
    at = np.ascontiguousarray(idx).view(np.int64)
    old = torch.empty(at.size, dtype=words.dtype)
    try:
        _native_apply(
            words.detach().view(torch.uint8).numpy(),
            at,
            np.ascontiguousarray(vals).view(np.uint8),
            words.element_size(),
            old.view(torch.uint8).numpy(),
        )
    except ValueError:  # out of range or not increasing: nothing was written
        return False
    if undo is not None:
        undo.append((words, torch.from_numpy(at), old))
    return True


def revert(undo: Undo) -> None:
    """Put back what :func:`apply_round` overwrote (newest first), bit for bit."""
    with torch.no_grad():
        while undo:
            dst, at, old = undo.pop()
            if isinstance(old, Spilled):
                old.restore(dst)
            elif at is None:
                dst.copy_(old)
            else:
                dst[at] = old


def _copy_all(jobs: list[Job]) -> None:
    """Every copy of ``jobs``: the raw byte copies in one call (``torch._foreach_copy_``: on a
    GPU a few launches for all of them, not one per piece), the others (a cast, a box of a
    target, another device) one by one."""
    into: list[torch.Tensor] = []
    froms: list[torch.Tensor] = []
    with torch.no_grad():
        for dst, src, raw in jobs:
            if raw:
                into.append(dst)
                froms.append(src)
            else:
                wire.copy_into(dst, src)
        if into:
            torch._foreach_copy_(into, froms)

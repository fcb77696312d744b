"""The last step of a committed round on a receiver: copy every verified piece from the private
staging into its target tensor (the ``into`` parameter, or the receiver's own copy handed to
``load_weights``). Runs only after every rank voted to commit, so a failed round never gets
here and the model never holds half a round.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import torch

from deltackpt.sync import wire
from deltackpt.sync.dtypes import wire_dtype
from deltackpt.sync.schedule import LinkBucket
from deltackpt.sync.schedule_decl import Box, Wanted

__all__ = ["Staged", "apply_round"]

# a verified bucket: its slot, piece offsets (each piece whole there) and flags
Staged = tuple[LinkBucket, torch.Tensor, list[int | None], list[int]]


def apply_round(
    targets: Sequence[torch.Tensor],
    wanted: Sequence[tuple[Wanted, int, Box]],
    staged: list[Staged],
    pool: ThreadPoolExecutor | None,
) -> set[int]:
    """Copy every staged piece into its target; returns the wants touched. The copies run on
    ``pool`` (a copy releases the GIL): after the vote the senders are idle, so this rank may
    use the cores they used."""
    jobs: list[tuple[torch.Tensor, torch.Tensor]] = []
    changed: set[int] = set()
    for bk, slot, offsets, _ in staged:
        for p, off in zip(bk.pieces, offsets, strict=True):
            if off is None:
                continue
            dt = wire_dtype(p.dtype)
            src = slot[off : off + p.nbytes].view(dt).view(p.box.size)
            jobs.append((targets[p.want][p.box.within(wanted[p.want][2])], src))
            changed.add(p.want)
    if pool is None or len(jobs) < 2:
        _copy_all(jobs)
        return changed
    n = pool._max_workers  # type: ignore[attr-defined]
    total = sum(src.numel() * src.element_size() for _, src in jobs)
    runs: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[]]
    acc = 0
    for dst, src in jobs:  # runs of about equal bytes, one per thread
        if acc >= total * len(runs) / n and len(runs) < n:
            runs.append([])
        runs[-1].append((dst, src))
        acc += src.numel() * src.element_size()
    for f in [pool.submit(_copy_all, r) for r in runs]:
        f.result()
    return changed


def _copy_all(jobs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    with torch.no_grad():
        for dst, src in jobs:
            wire.copy_into(dst, src)

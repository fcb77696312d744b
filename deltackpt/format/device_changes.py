"""The changed elements of a buffer against its base, found where the buffers live (CPU or CUDA)
by torch operations: the same list :func:`deltackpt.format.changes.changed_elements` finds on
the host, so the packed payload (:func:`~deltackpt.format.changes.pack_changes`) is the same
bytes whichever side found it.

Why: a delta round of CUDA weights should not pull every tensor to the host to diff it (a
pageable copy runs at ~1 GB/s, a pinned one at ~50 GB/s, and an RL step changes 1-3% of the
elements). Here the comparison runs on the device, one small device-to-host copy brings the count,
and only the changed elements and their indices cross: (4 + itemsize) bytes each.

Elements are compared as integers of their width (bit patterns: a NaN equals itself, -0.0 differs
from 0.0), as the host encoder does. The base is the caller's: for a sender, a device copy of the
last committed version (its memory is the caller's cost to decide).
"""

from __future__ import annotations

import numpy as np
import torch

from deltackpt.format.changes import UINT

__all__ = ["changed_elements_on", "changed_many_on_device", "changed_on_device", "to_host"]

_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _elements(buf: torch.Tensor, itemsize: int) -> torch.Tensor:
    """``buf`` (flat uint8) as integers of ``itemsize`` bytes (a copy if misaligned)."""
    if buf.data_ptr() % itemsize:
        buf = buf.clone()
    return buf.view(_INT[itemsize])


def changed_on_device(
    new: torch.Tensor, base: torch.Tensor, itemsize: int, cap: int
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """:func:`changed_elements_on`'s list left where the buffers live: (element indices, as
    int32 below 2**31 elements else int64, and their new values as signed integers of
    ``itemsize`` bytes), both on the buffers' device, or None when more than ``cap`` elements
    differ. For a caller that also writes the changes into a device copy (a sender's base)."""
    return changed_many_on_device([(new, base, itemsize, cap)])[0]


def changed_many_on_device(
    pairs: list[tuple[torch.Tensor, torch.Tensor, int, int]],
) -> list[tuple[torch.Tensor, torch.Tensor] | None]:
    """:func:`changed_on_device` of each ``(new, base, itemsize, cap)``, with one wait for each
    device among them instead of two per pair: the counts of every pair are brought to the
    host together, then each list is taken with ``torch.nonzero_static`` at its known size (a
    plain ``nonzero`` waits for the device to learn its output's size). The comparison runs
    twice per listed pair (once to count, once to list: on a GPU a pass over the bytes costs
    less than a wait), and one pair's mask (one byte per element) is alive at a time."""
    for new, base, itemsize, _ in pairs:
        if new.numel() != base.numel() or new.numel() % itemsize or itemsize not in _INT:
            raise ValueError(
                f"changed_elements_on: buffers of {new.numel()} and {base.numel()} bytes with "
                f"itemsize {itemsize}: expected equal sizes, whole elements of 1, 2, 4 or 8 "
                "bytes"
            )
    views = [(_elements(n, i), _elements(b, i)) for n, b, i, _ in pairs]
    by_device: dict[torch.device, list[int]] = {}
    for j, (a, _) in enumerate(views):
        by_device.setdefault(a.device, []).append(j)
    counts = [0] * len(pairs)
    for js in by_device.values():
        sums = torch.stack([(views[j][0] != views[j][1]).sum() for j in js])
        for j, k in zip(js, sums.tolist(), strict=True):  # the one wait for this device
            counts[j] = int(k)
    out: list[tuple[torch.Tensor, torch.Tensor] | None] = []
    for (a, b), (_, _, _, cap), k in zip(views, pairs, counts, strict=True):
        if k > cap:
            out.append(None)
            continue
        idx = torch.nonzero_static(a != b, size=k).squeeze(1)
        narrow = torch.int32 if a.numel() < 1 << 31 else torch.int64
        out.append((idx.to(narrow), a[idx]))
    return out


def to_host(found: tuple[torch.Tensor, torch.Tensor]) -> tuple[np.ndarray, np.ndarray]:
    """A :func:`changed_on_device` list as :func:`changed_elements_on` returns it: host arrays,
    indices as uint32, values as unsigned integers of their width."""
    idx, vals = found
    idx_host = idx.cpu().numpy().astype(np.uint32, copy=False)
    return idx_host, vals.cpu().numpy().view(UINT[vals.element_size()])


def changed_elements_on(
    new: torch.Tensor, base: torch.Tensor, itemsize: int, cap: int
) -> tuple[np.ndarray, np.ndarray] | None:
    """(element indices as uint32, their new values) where the flat uint8 tensors ``new`` and
    ``base`` (same size and device, whole ``itemsize`` elements, < 2**32 of them) differ, or None
    when more than ``cap`` elements do: :func:`~deltackpt.format.changes.changed_elements`'s
    contract, computed on their device; the results are host arrays."""
    found = changed_on_device(new, base, itemsize, cap)
    return None if found is None else to_host(found)

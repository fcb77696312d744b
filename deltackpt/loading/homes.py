"""Tied storages read in place: when a load's ``into=`` targets include a tensor that can take a
whole shared storage's bytes (a tied embedding loaded into the same model), that storage is read
straight into it (no fresh buffer, no ``copy_``). Used by :mod:`deltackpt.loading.assemble`.
"""

from __future__ import annotations

import torch

from deltackpt.format.dtensor import is_dtensor
from deltackpt.format.manifest import Manifest, TensorEntry
from deltackpt.loading.plan import plain_cpu


def storage_homes(
    m: Manifest, wanted: list[int], targets: dict[str, torch.Tensor]
) -> dict[int, torch.Tensor]:
    """Per shared storage the ``wanted`` entries view, a target that can receive all of its
    bytes in place (a tied embedding loaded into the same model): no fresh buffer, no copy_."""
    users: dict[int, list[int]] = {}
    for i in wanted:
        sv = m.tensors[i].storage
        if sv is not None:
            users.setdefault(sv.id, []).append(i)
    homes = {}
    for sid, us in users.items():
        home = _storage_home(m, sid, us, targets)
        if home is not None:
            homes[sid] = home
    return homes


def _covers_storage(t: torch.Tensor, e: TensorEntry, nbytes: int) -> bool:
    """``t`` (the target of a tensor saved as a view of a shared storage) can receive the whole
    storage's bytes: a contiguous CPU tensor exactly as large, and the saved view is the whole
    storage in C order (so ``t`` equals the view once the bytes are in)."""
    assert e.storage is not None
    return (
        plain_cpu(t)
        and t.is_contiguous()
        and t.numel() * t.element_size() == nbytes
        and nbytes > 0
        # views of every dtype must start on an element boundary of the bytes read in place
        and t.storage_offset() * t.element_size() % 16 == 0
        and e.storage.offset == 0
        and tuple(e.storage.stride) == tuple(torch.empty(e.shape, device="meta").stride())
    )


def _storage_home(
    m: Manifest, sid: int, users: list[int], targets: dict[str, torch.Tensor]
) -> torch.Tensor | None:
    """A target that can receive the whole shared storage ``sid`` in place, or None. Refused
    when another target of the storage overlaps it other than as the very view the snapshot
    describes: reading in place would then change the bytes that target is copied from."""
    n = m.storages[sid][0]
    for k in users:
        home = targets[m.tensors[k].path]
        if not _covers_storage(home, m.tensors[k], n):
            continue
        base = home.untyped_storage().data_ptr()
        ok = True
        for j in users:
            t, sv = targets[m.tensors[j].path], m.tensors[j].storage
            assert sv is not None
            if is_dtensor(t) or t.device.type != "cpu" or t.untyped_storage().data_ptr() != base:
                continue  # separate memory: copied into after the read
            if not (
                t.data_ptr() == home.data_ptr() + sv.offset
                and tuple(t.shape) == m.tensors[j].shape
                and tuple(t.stride()) == tuple(sv.stride)
            ):
                ok = False
                break
        if ok:
            return home
    return None

"""Which keys of a snapshot changed since another, from the two manifests alone (nothing is
read): what a follower hands to ``load_weights`` after an incremental load."""

from __future__ import annotations

from typing import Any

from deltackpt.format.dcp_nesting import nested_manifest
from deltackpt.format.manifest import Manifest, TensorEntry
from deltackpt.loading.select import Select

__all__ = ["changed_keys"]


def changed_keys(m: Manifest, h: Manifest, select: Select | None = None) -> list[str]:
    """Key paths of ``m``'s tensors whose bytes may differ from ``h``'s, from the manifests only
    (nothing is read): new keys, another dtype or shape, other chunks. Equal chunk lists mean
    equal bytes (chunks are named by their digest); a small tensor that shares a group chunk with
    a changed one is listed too, as is a view of a shared storage whose storage changed."""
    m, h = nested_manifest(m), nested_manifest(h)
    before = {e.path: _signature(h, e) for e in h.tensors}
    return [
        e.path
        for e in m.tensors
        if (select is None or select(e.path)) and before.get(e.path) != _signature(m, e)
    ]


def _signature(m: Manifest, e: TensorEntry) -> tuple[Any, ...]:
    """What determines entry ``e``'s bytes: equal signatures, equal bytes."""
    if e.storage is not None:
        view = (e.storage.offset, e.storage.stride, m.storages[e.storage.id])
        return (e.dtype, e.shape, view)
    if e.shards is not None:
        return (e.dtype, e.shape, e.shards)
    return (e.dtype, e.shape, e.data)

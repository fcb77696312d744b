"""DCP read step 0: a manifest -> DCP ``Metadata``, and what each saved item is.

``StoreReader.read_metadata`` calls :func:`metadata_of`. Any manifest translates, whether
:class:`~deltackpt.dcp.StoreWriter` or ``deltackpt.save`` wrote it: the state tree is rebuilt with
meta-tensor placeholders and flattened the way DCP flattens (``flatten_state_dict``), so DCP's
planners see the fqns and ``planner_data`` they would have written themselves.

``Metadata.storage_data`` maps each DCP ``MetadataIndex`` to one of the small dataclasses below,
which :mod:`deltackpt.dcp.reader` turns into reads: a :class:`SavedBlock` (a whole tensor or one
saved shard), a :class:`SharedView` (a view of a shared storage: tied weights), a
:class:`ByteValue` (a value DCP stored as its ``torch.save`` bytes) or a :class:`Value` (a value
kept in the manifest tree, possibly holding :class:`TensorRef` placeholders of tensor entries).
DCP-specific facts (``planner_data``, ``storage_meta``, the version) come from
``manifest.metadata["dcp"]``, which the writer fills.
"""

from __future__ import annotations

import uuid
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from deltackpt.errors import StoreFormatError
from deltackpt.format.dcp_values import DCP_KEY, byte_value_paths
from deltackpt.format.dtypes import dtype_from_name
from deltackpt.format.manifest import Manifest, Slice
from deltackpt.format.tree import unflatten
from deltackpt.loading.reshard import entry_shards

DCP_INFO_VERSION = 1  # version of the manifest.metadata["dcp"] dict
DEFAULT_DCP_VERSION = "1.0.0"  # torch's FileSystemWriter writes this Metadata.version


@dataclass(frozen=True)
class SavedBlock:
    """A saved tensor chunk in DCP's sense: a C-order block (a whole tensor or one shard) of
    tensor entry ``entry``, whose bytes ``data`` describes."""

    entry: int
    shape: tuple[int, ...]
    data: tuple[Slice, ...]


@dataclass(frozen=True)
class SharedView:
    """Tensor entry ``entry``, a view of a shared storage (tied weights of a deltackpt.save)."""

    entry: int


@dataclass(frozen=True)
class ByteValue:
    """A value DCP serialised, stored as uint8 tensor entry ``entry`` (its torch.save bytes)."""

    entry: int


@dataclass(frozen=True)
class TensorRef:
    """Stands for tensor entry ``entry`` inside a non-tensor value."""

    entry: int


@dataclass(frozen=True)
class Value:
    """A non-tensor value; ``has_tensors`` when it holds :class:`TensorRef` to load first."""

    value: Any
    has_tensors: bool


Saved = SavedBlock | SharedView | ByteValue | Value  # what a MetadataIndex points at


def map_containers(value: Any, fn: Callable[[Any], Any]) -> Any:
    """Rebuild dict/OrderedDict/list/tuple containers with ``fn`` applied to their items."""
    if isinstance(value, OrderedDict):
        out: Any = OrderedDict((k, fn(v)) for k, v in value.items())
        meta = getattr(value, "_metadata", None)
        if meta is not None:
            out._metadata = meta
        return out
    if isinstance(value, dict):
        return {k: fn(v) for k, v in value.items()}
    if isinstance(value, list):
        return [fn(v) for v in value]
    if isinstance(value, tuple):
        return tuple(fn(v) for v in value)
    return value


def refs_in(v: Any) -> list[TensorRef]:
    """Every :class:`TensorRef` inside ``v``."""
    if isinstance(v, TensorRef):
        return [v]
    if isinstance(v, dict):
        return [t for x in v.values() for t in refs_in(x)]
    if isinstance(v, (list, tuple)):
        return [t for x in v for t in refs_in(x)]
    return []


def _swap_refs(v: Any, by_id: dict[int, int]) -> Any:
    """``v`` with every placeholder tensor replaced by a :class:`TensorRef`."""
    if isinstance(v, torch.Tensor):
        return TensorRef(by_id[id(v)])
    return map_containers(v, lambda x: _swap_refs(x, by_id))


def metadata_of(m: Manifest, allow_pickle: bool) -> Metadata:
    """DCP Metadata for any manifest (written through DCP or by deltackpt.save)."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    raw_info = m.metadata.get(DCP_KEY)
    info = raw_info if isinstance(raw_info, dict) else {}
    byte_paths = byte_value_paths(m)
    placeholders: list[torch.Tensor] = []
    by_id: dict[int, int] = {}

    def placeholder(i: int) -> torch.Tensor:
        e = m.tensors[i]
        t = torch.empty(e.shape, dtype=dtype_from_name(e.dtype), device="meta")
        placeholders.append(t)  # keep alive: ids stay unique
        by_id[id(t)] = i
        return t

    state = unflatten(m.tree, placeholder, allow_pickle=allow_pickle)
    if not isinstance(state, dict):
        raise StoreFormatError(
            f"snapshot {m.name!r} holds a {type(state).__name__}, not a dict; DCP loads dict "
            "state only (use deltackpt.load for it)"
        )
    flat, mappings = flatten_state_dict(state)
    sd_md: dict[str, Any] = {}
    storage: dict[MetadataIndex, Saved] = {}
    for fqn, v in flat.items():
        if not (isinstance(v, torch.Tensor) and id(v) in by_id):
            sd_md[fqn] = BytesStorageMetadata()
            value = _swap_refs(v, by_id)
            storage[MetadataIndex(fqn)] = Value(value, bool(refs_in(value)))
            continue
        i = by_id[id(v)]
        e = m.tensors[i]
        if e.path in byte_paths:
            sd_md[fqn] = BytesStorageMetadata()
            storage[MetadataIndex(fqn)] = ByteValue(i)
            continue
        props = TensorProperties(dtype=dtype_from_name(e.dtype), requires_grad=e.requires_grad)
        chunks = []
        if e.storage is not None:  # read whole, as the storage it views
            zero = (0,) * len(e.shape)
            chunks.append(ChunkStorageMetadata(torch.Size(zero), torch.Size(e.shape)))
            storage[MetadataIndex(fqn, zero)] = SharedView(i)
        for sh in entry_shards(e):  # the whole tensor, or each saved shard
            chunks.append(ChunkStorageMetadata(torch.Size(sh.offsets), torch.Size(sh.shape)))
            storage[MetadataIndex(fqn, sh.offsets)] = SavedBlock(i, sh.shape, sh.data)
        sd_md[fqn] = TensorStorageMetadata(props, torch.Size(e.shape), chunks)
    planner_data: dict[str, tuple[Any, ...]] = dict(mappings)
    if isinstance(info.get("planner_data"), dict):
        planner_data = {k: tuple(p) for k, p in info["planner_data"].items()}
    sm_raw = info.get("storage_meta") or {}
    return Metadata(
        state_dict_metadata=sd_md,
        planner_data=planner_data,
        storage_data=storage,
        storage_meta=StorageMeta(
            checkpoint_id=sm_raw.get("checkpoint_id", m.name),
            save_id=sm_raw.get("save_id"),
            load_id=uuid.uuid4().hex,
            modules=list(sm_raw.get("modules", ())),
        ),
        version=info.get("version", DEFAULT_DCP_VERSION),
    )

"""``torch.distributed.checkpoint`` (DCP) storage plug-in: DCP's planners, deltackpt's store.

::

    import torch.distributed.checkpoint as dcp
    from deltackpt.dcp import StoreReader, StoreWriter

    dcp.save(state, storage_writer=StoreWriter("ckpts", "step-100"))
    dcp.load(state, storage_reader=StoreReader("ckpts", "step-100"))   # or "latest"

DCP keeps doing what it does (flattening, planning, deduplicating replicated tensors, resharding
on load); deltackpt stores the bytes: chunked, content-addressed (a chunk any snapshot already
holds is not written again: incremental saves), encoded per :class:`~deltackpt.SaveOptions`,
checksummed, and committed crash-safely as one manifest. A DCP snapshot is an ordinary snapshot:
``deltackpt.load`` returns ``{fqn: full tensor or value}`` (shards assembled), and
``ls``/``verify``/``gc`` treat it like any other. ``StoreReader`` also reads snapshots written
by ``deltackpt.save``, so ``dcp.load`` can reshard any deltackpt snapshot.

How a save maps onto the store:

* ``set_up_storage_writer`` (every rank): take the store's shared lock, so gc cannot delete a
  chunk this save will reference; the coordinator refuses an existing name early.
* ``write_data`` (every rank): every tensor write item (a whole tensor or a local shard) and every
  serialised non-tensor value becomes a byte source; deltackpt chunks, hashes, dedupes, encodes
  and appends the new chunks to new packs, and fsyncs them. Small non-tensor values that are
  plain data (numbers, strings, lists, dicts, ...) are not stored as bytes at all: they travel to
  the coordinator as a JSON tree node and live inline in the manifest, so ``deltackpt.load``
  returns them as Python values. The ``WriteResult`` of each item carries its slices; the first
  one of each rank also carries the rank's chunk records and statistics.
* ``finish`` (coordinator, after every rank's packs are durable): build one manifest (sharded
  tensor entries with global offsets, the values, the chunk table) and commit it atomically.
  Nothing is visible before that point; a failure anywhere leaves no snapshot and only garbage
  that gc removes.

The manifest stays within the version-1 schema: DCP-specific facts (``planner_data``,
``storage_meta``, which entries hold raw serialised values) sit in ``metadata["dcp"]`` as JSON.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import math
import os
import time
import uuid
import warnings
import weakref
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
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
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    SavePlanner,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

from deltackpt.errors import SnapshotExistsError, StoreError, StoreFormatError
from deltackpt.format.dcp_values import DCP_KEY  # manifest metadata key of the DCP facts (JSON)
from deltackpt.format.dtypes import dtype_from_name, dtype_name
from deltackpt.format.manifest import ChunkRecord, Manifest, Shard, Slice, Stats, TensorEntry
from deltackpt.format.tree import flatten, unflatten
from deltackpt.loading.reshard import sub_slices
from deltackpt.options import LoadOptions, SaveOptions
from deltackpt.saving.plan import tensor_bytes
from deltackpt.saving.write import closure
from deltackpt.store.chunks import ChunkTargets, run_jobs
from deltackpt.store.durable import store_lock
from deltackpt.store.packs import PackReaders
from deltackpt.store.store import LATEST, SnapshotInfo, Store, open_store, validate_name

__all__ = ["StoreReader", "StoreWriter"]

DCP_INFO_VERSION = 1
DEFAULT_DCP_VERSION = "1.0.0"  # torch's FileSystemWriter writes this Metadata.version
INLINE_MAX_BYTES = 64 << 10  # serialised values up to this size may live inline in the manifest
READ_BATCH_BYTES = 256 << 20  # read_data buffers at most about this much before delivering

_Rec = tuple[str, int, int, int, str, int, "str | None"]  # ChunkRecord as a small tuple


def _rec_tuple(r: ChunkRecord) -> _Rec:
    return (r.pack, r.offset, r.length, r.size, r.codec, r.itemsize, r.base)


def _rec_from(t: _Rec) -> ChunkRecord:
    return ChunkRecord(*t)


# ------------------------------------------------------------------------------------ helpers


class _HeldLock:
    """The store's shared lock, held across DCP calls (acquired in one, released in another)."""

    def __init__(self) -> None:
        self._stack: contextlib.ExitStack | None = None

    def acquire(self, store: Store, timeout: float, what: str) -> None:
        self.release()
        stack = contextlib.ExitStack()
        stack.enter_context(
            store_lock(store.lock_path, exclusive=False, timeout=timeout, what=what)
        )
        self._stack = stack

    def release(self) -> None:
        stack, self._stack = self._stack, None
        if stack is not None:
            stack.close()


def _np(t: torch.Tensor) -> np.ndarray:
    return t.numpy() if t.numel() else np.empty(0, dtype=np.uint8)


_NOT_INLINE = object()


def _inline_node(raw: bytes) -> Any:
    """The JSON tree node of a value DCP serialised with torch.save, if it is plain data.

    Decoded with ``weights_only=True`` (no code runs). Values holding tensors, objects that need
    pickle, or big values give ``_NOT_INLINE`` and are stored as their raw bytes instead.
    """
    if len(raw) > INLINE_MAX_BYTES:
        return _NOT_INLINE
    try:
        value = torch.load(io.BytesIO(raw), weights_only=True)
        node, leaves = flatten(value, allow_pickle=False)
    except Exception:
        return _NOT_INLINE
    if leaves or len(json.dumps(node)) > INLINE_MAX_BYTES:
        return _NOT_INLINE
    return node


def _json_path(path: Any) -> list[Any] | None:
    if isinstance(path, (tuple, list)) and all(type(p) in (str, int) for p in path):
        return list(path)
    return None


# ------------------------------------------------------------------------------------- writer


@dataclass
class _RankInfo:
    """What the coordinator needs from each rank once (sent in its first WriteResult)."""

    rank: int
    records: dict[str, _Rec]  # every chunk this rank's items reference, with xor bases
    new: list[str]  # digests this rank wrote
    pack_bytes: int
    logical_bytes: int


class StoreWriter(StorageWriter):
    """A DCP ``StorageWriter`` that saves into a deltackpt store as snapshot ``name``.

    ``name`` may also come from ``dcp.save(..., checkpoint_id=name)``. Keyword options are the
    fields of :class:`~deltackpt.SaveOptions` (``overwrite``, ``encoding``, ``threads``,
    ``fsync``, ``lock_timeout``); ``metadata`` is a JSON dict kept in the manifest (``step``...).
    Use one writer per save, or pass a new ``checkpoint_id`` each time. After a successful save
    the coordinator's ``writer.info`` is the committed :class:`~deltackpt.SnapshotInfo`.

    >>> dcp.save(state, storage_writer=StoreWriter("ckpts", "step-100"))   # doctest: +SKIP
    """

    def __init__(
        self,
        store: str | os.PathLike[str] | Store,
        name: str | None = None,
        *,
        metadata: dict[str, Any] | None = None,
        options: SaveOptions | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__()
        from deltackpt.api import _check_metadata

        self.store = open_store(store)
        if name is not None:
            validate_name(name)
        self.name = name
        self.options = SaveOptions.from_kwargs(options, kwargs)
        self.user_metadata = _check_metadata(metadata)
        if DCP_KEY in self.user_metadata:
            raise ValueError(f"metadata key {DCP_KEY!r} is reserved for the DCP plug-in")
        self.info: SnapshotInfo | None = None
        self.save_id = uuid.uuid4().hex
        self._lock = _HeldLock()
        weakref.finalize(self, self._lock.release)
        self._reset_save()

    def _reset_save(self) -> None:
        self._lock.release()
        self.is_coordinator = False
        self.rank = 0
        self._t0 = time.perf_counter()

    # pickling (DCP's process-based async_save sends the writer to another process)
    def __getstate__(self) -> dict[str, Any]:
        return {
            "root": str(self.store.root),
            "name": self.name,
            "options": self.options,
            "user_metadata": self.user_metadata,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.store = open_store(state["root"], create=False)
        self.name = state["name"]
        self.options = state["options"]
        self.user_metadata = state["user_metadata"]
        self.info = None
        self.save_id = uuid.uuid4().hex
        self._lock = _HeldLock()
        weakref.finalize(self, self._lock.release)
        self._reset_save()

    def close(self) -> None:
        """Release the store lock if a failed save left it held (it is also released on GC)."""
        self._lock.release()

    @property
    def checkpoint_id(self) -> str | None:
        return self.name

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id is not None:
            name = os.fspath(checkpoint_id)
            validate_name(name)
            self.name = name
        self.info = None
        self.save_id = uuid.uuid4().hex
        self._reset_save()

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        try:
            validate_name(os.fspath(checkpoint_id))
        except (TypeError, ValueError):
            return False
        return True

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.name, save_id=self.save_id)

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self._reset_save()
        self.is_coordinator = is_coordinator
        rank = kwargs.get("rank")
        if rank is None:
            rank = (
                torch.distributed.get_rank()
                if torch.distributed.is_available() and torch.distributed.is_initialized()
                else 0
            )
        self.rank = int(rank)
        if not kwargs.get("use_collectives", True) and (
            torch.distributed.is_available()
            and torch.distributed.is_initialized()
            and torch.distributed.get_world_size() > 1
        ):
            raise NotImplementedError(
                "deltackpt.dcp.StoreWriter commits one manifest per save from the coordinator; "
                "dcp.save(use_collectives=False) on several ranks is not supported"
            )
        if self.name is None:
            raise ValueError(
                "StoreWriter needs a snapshot name: StoreWriter(store, name) or "
                "dcp.save(..., checkpoint_id=name)"
            )
        st = self.store
        if not st.packs_dir.is_dir():
            raise StoreError(
                f"store {str(st.root)!r} has no packs/ directory; it is damaged or not a store"
            )
        self._lock.acquire(st, self.options.lock_timeout, f"DCP-saving {self.name!r}")
        try:
            if is_coordinator and not self.options.overwrite and st.has(self.name):
                raise SnapshotExistsError(
                    f"store {str(st.root)!r} already has a committed snapshot {self.name!r}; "
                    "pick a new name, or pass overwrite=True (the old one stays loadable until "
                    "the new one commits)"
                )
        except BaseException:
            self._lock.release()
            raise

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return plans

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        try:
            results = self._write(plan, planner)
        except BaseException:
            self._lock.release()  # finish will not run
            raise
        finally:
            if not self.is_coordinator:
                self._lock.release()  # the coordinator keeps its lock until the commit
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def _write(self, plan: SavePlan, planner: SavePlanner) -> list[WriteResult]:
        from deltackpt.saving.engine import saver_for
        from deltackpt.saving.plan import SavePlan as DkPlan
        from deltackpt.saving.plan import Source, layout_chunks
        from deltackpt.saving.write import write_chunks

        st, opts = self.store, self.options
        sources: list[Source] = []
        kinds: list[tuple[Any, ...]] = []  # per item: ("value", node) or ("src", source index)
        sizes: list[int] = []
        for item in plan.items:
            fqn = item.index.fqn
            if item.type == WriteItemType.BYTE_IO:
                data = planner.resolve_data(item)
                raw = data.getvalue() if isinstance(data, io.BytesIO) else bytes(data.read())
                sizes.append(len(raw))
                node = _inline_node(raw)
                if node is not _NOT_INLINE:
                    kinds.append(("value", node))
                    continue
                u8 = (
                    torch.frombuffer(bytearray(raw), dtype=torch.uint8)
                    if raw
                    else torch.empty(0, dtype=torch.uint8)
                )
                kinds.append(("src", len(sources)))
                sources.append(Source(f"{fqn}:bytes", u8, 1))
                continue
            td = item.tensor_data
            if td is None:
                raise ValueError(f"DCP write item {fqn!r} is a tensor write without tensor_data")
            t = planner.resolve_data(item)
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"planner.resolve_data({fqn!r}) returned {type(t)}, not a tensor")
            t = t.detach()
            if t.device.type != "cpu":
                t = t.cpu()
            if t.dtype != td.properties.dtype:
                t = t.to(td.properties.dtype)
            if tuple(t.shape) != tuple(td.chunk.sizes):
                raise ValueError(
                    f"DCP write item {fqn!r}: resolved tensor has shape {tuple(t.shape)}, the "
                    f"plan says {tuple(td.chunk.sizes)}"
                )
            b = tensor_bytes(t)
            sizes.append(b.numel())
            kinds.append(("src", len(sources)))
            offsets = ",".join(str(o) for o in td.chunk.offsets)
            sources.append(Source(f"{fqn}@{offsets}", b, t.element_size()))

        chunks, slices = layout_chunks(
            [s.nbytes for s in sources],
            [s.itemsize for s in sources],
            [s.key for s in sources],
            st.chunk_bytes,
            st.small_bytes,
        )
        dk_plan = DkPlan(None, [], [], sources, chunks, slices)
        arrays = [_np(s.data) for s in sources]
        index = st.chunk_index()
        wr = write_chunks(
            st, dk_plan, arrays.__getitem__, opts, saver_for(st).pool(opts.threads), index, None
        )
        info = _RankInfo(
            rank=self.rank,
            records={d: _rec_tuple(r) for d, r in wr.records.items()},
            new=sorted(d for d in wr.records if d not in index),
            pack_bytes=wr.pack_bytes,
            logical_bytes=sum(src.nbytes for src in sources),
        )
        out: list[WriteResult] = []
        for k, (item, kind, size) in enumerate(zip(plan.items, kinds, sizes, strict=True)):
            sd: dict[str, Any]
            if kind[0] == "value":
                sd = {"value": kind[1]}
            else:
                si = kind[1]
                sd = {"slices": [(wr.digests[ci], s, n) for ci, s, n in slices[si]]}
                if item.type == WriteItemType.BYTE_IO:
                    sd["bytes"] = True
                else:
                    td = item.tensor_data
                    sd["offsets"] = tuple(td.chunk.offsets)
                    sd["shape"] = tuple(td.chunk.sizes)
            if k == 0:
                sd["rank"] = info
            out.append(WriteResult(index=item.index, size_in_bytes=size, storage_data=sd))
        return out

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        try:
            self._finish(metadata, results)
        finally:
            self._lock.release()

    def _finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        records: dict[str, ChunkRecord] = {}
        new: set[str] = set()
        pack_bytes = logical = 0
        world = len(results)
        pieces: dict[str, list[tuple[tuple[int, ...], tuple[int, ...], tuple[Slice, ...]]]] = {}
        values: dict[str, Any] = {}
        byte_items: dict[str, tuple[Slice, ...]] = {}
        for rank_results in results:
            for wr in rank_results:
                sd = wr.storage_data
                info = sd.get("rank")
                if info is not None:
                    for d, r in info.records.items():
                        records.setdefault(d, _rec_from(r))
                    new.update(info.new)
                    pack_bytes += info.pack_bytes
                    logical += info.logical_bytes
                fqn = wr.index.fqn
                if "value" in sd:
                    values[fqn] = sd["value"]
                elif sd.get("bytes"):
                    byte_items[fqn] = tuple(sd["slices"])
                else:
                    pieces.setdefault(fqn, []).append(
                        (tuple(sd["offsets"]), tuple(sd["shape"]), tuple(sd["slices"]))
                    )

        tensors: list[TensorEntry] = []
        tree_items: list[list[Any]] = []
        bytes_paths: list[str] = []
        for fqn, md in metadata.state_dict_metadata.items():
            if isinstance(md, TensorStorageMetadata):
                got = sorted(pieces.pop(fqn, []))
                if len(got) != len(md.chunks):
                    raise StoreError(
                        f"DCP save of {fqn!r}: the plan has {len(md.chunks)} chunk(s) but "
                        f"{len(got)} were written; not committed"
                    )
                shape = tuple(md.size)
                dt = dtype_name(md.properties.dtype, fqn)
                rg = bool(md.properties.requires_grad)
                if len(got) == 1 and got[0][1] == shape and not any(got[0][0]):
                    e = TensorEntry(fqn, dt, shape, data=got[0][2], requires_grad=rg)
                else:
                    shards = tuple(Shard(o, s, d) for o, s, d in got)
                    e = TensorEntry(fqn, dt, shape, shards=shards, requires_grad=rg)
                tree_items.append([fqn, {"tensor": len(tensors)}])
                tensors.append(e)
            elif fqn in values:
                tree_items.append([fqn, values.pop(fqn)])
            elif fqn in byte_items:
                data = byte_items.pop(fqn)
                nbytes = sum(n for _, _, n in data)
                tree_items.append([fqn, {"tensor": len(tensors)}])
                tensors.append(TensorEntry(fqn, "uint8", (nbytes,), data=data))
                bytes_paths.append(fqn)
            else:
                raise StoreError(f"DCP save: no rank wrote {fqn!r}; not committed")
        extra = sorted(set(pieces) | set(values) | set(byte_items))
        if extra:
            raise StoreError(f"DCP save: ranks wrote items the metadata lacks: {extra[:5]}")

        needed = {d for e in tensors for d, _, _ in e.all_slices()}
        chunks = closure(set(needed), records, {})
        dcp_info: dict[str, Any] = {
            "format": DCP_INFO_VERSION,
            "version": metadata.version or DEFAULT_DCP_VERSION,
            "world_size": world,
            "bytes": bytes_paths,
        }
        pd = metadata.planner_data
        if isinstance(pd, dict):
            paths = {k: _json_path(v) for k, v in pd.items() if isinstance(k, str)}
            if len(paths) == len(pd) and all(v is not None for v in paths.values()):
                dcp_info["planner_data"] = paths
            elif pd:
                warnings.warn(
                    "DCP planner_data is not a {fqn: path} mapping; it is not stored",
                    RuntimeWarning,
                    stacklevel=2,
                )
        sm = metadata.storage_meta or self.storage_meta()
        if sm is not None:
            dcp_info["storage_meta"] = {
                "checkpoint_id": None if sm.checkpoint_id is None else os.fspath(sm.checkpoint_id),
                "save_id": sm.save_id,
                "modules": [str(x) for x in sm.modules],
            }
        stats = Stats(
            logical_bytes=logical,
            pack_bytes=pack_bytes,
            chunks_new=len(new & set(chunks)),
            chunks_reused=len(needed) - len(new & needed),
            seconds=time.perf_counter() - self._t0,
        )
        assert self.name is not None
        m = Manifest(
            name=self.name,
            created_ns=time.time_ns(),
            tree={"dict": tree_items},
            tensors=tuple(tensors),
            storages=(),
            chunks=chunks,
            stats=stats,
            metadata={**self.user_metadata, DCP_KEY: dcp_info},
        )
        size = self.store.write_manifest(m, overwrite=self.options.overwrite)
        self.info = SnapshotInfo.from_manifest(m, size)
        self.save_id = uuid.uuid4().hex  # the next save through this writer is another save


# ------------------------------------------------------------------------------------- reader


@dataclass(frozen=True)
class _Piece:
    """A saved tensor chunk in DCP's sense: a C-order block of a tensor entry."""

    entry: int
    shape: tuple[int, ...]
    data: tuple[Slice, ...]


@dataclass(frozen=True)
class _Storage:
    """A tensor that views a shared storage (tied weights in a deltackpt.save snapshot)."""

    entry: int


@dataclass(frozen=True)
class _Value:
    """A non-tensor value; ``has_tensors`` when it holds :class:`_TensorRef` to load first."""

    value: Any
    has_tensors: bool


@dataclass(frozen=True)
class _RawBytes:
    """A value DCP serialised that is stored as a uint8 entry (its torch.save bytes)."""

    entry: int


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    out, acc = [], 1
    for n in reversed(shape):
        out.append(acc)
        acc *= n
    return tuple(reversed(out))


def _flat(idx: Iterable[int], strides: tuple[int, ...]) -> int:
    return sum(i * s for i, s in zip(idx, strides, strict=True))


def _metadata_of(m: Manifest, allow_pickle: bool) -> Metadata:
    """DCP Metadata for any manifest (written through DCP or by deltackpt.save)."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    raw_info = m.metadata.get(DCP_KEY)
    info = raw_info if isinstance(raw_info, dict) else {}
    byte_paths = set(info.get("bytes", ()))
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
    storage: dict[MetadataIndex, Any] = {}
    for fqn, v in flat.items():
        if isinstance(v, torch.Tensor) and id(v) in by_id:
            i = by_id[id(v)]
            e = m.tensors[i]
            if e.path in byte_paths:
                sd_md[fqn] = BytesStorageMetadata()
                storage[MetadataIndex(fqn)] = _RawBytes(i)
                continue
            props = TensorProperties(dtype=dtype_from_name(e.dtype), requires_grad=e.requires_grad)
            chunks = []
            if e.shards is not None:
                for sh in e.shards:
                    chunks.append(
                        ChunkStorageMetadata(torch.Size(sh.offsets), torch.Size(sh.shape))
                    )
                    storage[MetadataIndex(fqn, sh.offsets)] = _Piece(i, sh.shape, sh.data)
            else:
                zero = (0,) * len(e.shape)
                chunks.append(ChunkStorageMetadata(torch.Size(zero), torch.Size(e.shape)))
                storage[MetadataIndex(fqn, zero)] = (
                    _Piece(i, e.shape, e.data or ()) if e.storage is None else _Storage(i)
                )
            sd_md[fqn] = TensorStorageMetadata(props, torch.Size(e.shape), chunks)
        else:
            sd_md[fqn] = BytesStorageMetadata()
            value = _swap_refs(v, by_id)
            storage[MetadataIndex(fqn)] = _Value(value, bool(_refs_in(value)))
    planner_data: dict[str, tuple[Any, ...]] = dict(mappings)
    if isinstance(info.get("planner_data"), dict):
        planner_data = {k: tuple(p) for k, p in info["planner_data"].items()}
    sm_raw = info.get("storage_meta") or {}
    sm = StorageMeta(
        checkpoint_id=sm_raw.get("checkpoint_id", m.name),
        save_id=sm_raw.get("save_id"),
        load_id=uuid.uuid4().hex,
        modules=list(sm_raw.get("modules", ())),
    )
    md = Metadata(
        state_dict_metadata=sd_md,
        planner_data=planner_data,
        storage_data=storage,
        storage_meta=sm,
        version=info.get("version", DEFAULT_DCP_VERSION),
    )
    return md


def _swap_refs(v: Any, by_id: dict[int, int]) -> Any:
    """``v`` with every placeholder tensor replaced by a :class:`_TensorRef`."""
    if isinstance(v, torch.Tensor):
        return _TensorRef(by_id[id(v)])
    return _map_containers(v, lambda x: _swap_refs(x, by_id))


class StoreReader(StorageReader):
    """A DCP ``StorageReader`` over snapshot ``name`` (default ``"latest"``) of a deltackpt store.

    Reads snapshots written through :class:`StoreWriter` and by ``deltackpt.save``; DCP
    reshards them onto whatever the target state looks like. Each rank reads only the chunks
    covering the saved blocks it needs, and every chunk is checked against its digest unless
    ``verify=False``. ``allow_pickle=True`` is needed for snapshots saved with pickled values.

    >>> dcp.load(state, storage_reader=StoreReader("ckpts", "step-100"))   # doctest: +SKIP
    """

    def __init__(
        self,
        store: str | os.PathLike[str] | Store,
        name: str = LATEST,
        *,
        verify: bool = True,
        threads: int | None = None,
        allow_pickle: bool = False,
    ) -> None:
        super().__init__()
        self.store = open_store(store, create=False)
        self.name = name
        self.options = LoadOptions(verify=verify, allow_pickle=allow_pickle)
        if threads is not None:
            self.options = dataclasses.replace(self.options, threads=threads)
        self.manifest: Manifest | None = None
        self._storage: dict[MetadataIndex, Any] = {}

    @property
    def checkpoint_id(self) -> str:
        return self.name

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id is not None:
            self.name = os.fspath(checkpoint_id)
        self.manifest = None
        self._storage = {}

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return StoreWriter.validate_checkpoint_id(checkpoint_id) or checkpoint_id == LATEST

    def read_metadata(self) -> Metadata:
        m = self.store.manifest(self.name)  # "latest" resolved once, here
        md = _metadata_of(m, self.options.allow_pickle)
        self.manifest = m
        return md

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        if self.manifest is None or metadata.storage_data is None:
            raise AssertionError("StoreReader.read_metadata must run before set-up")
        self._storage = metadata.storage_data

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        assert self.manifest is not None
        # Which snapshot this rank resolved: the coordinator checks all ranks agree ("latest"
        # could move between ranks' read_metadata calls if a save commits meanwhile).
        return dataclasses.replace(
            plan, storage_data=(self.manifest.name, self.manifest.created_ns)
        )

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        seen = {p.storage_data for p in plans if p.storage_data is not None}
        if len(seen) > 1:
            raise StoreError(
                f"ranks resolved {self.name!r} to different snapshots {sorted(seen)} (a save "
                "committed while they read it); load an explicit snapshot name"
            )
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        groups: dict[MetadataIndex, list[ReadItem]] = {}
        for req in plan.items:
            groups.setdefault(req.storage_index, []).append(req)
        batch: list[tuple[Any, list[ReadItem]]] = []
        pending = 0
        with PackReaders(self.store.packs_dir) as packs:
            for idx, reqs in groups.items():
                src = self._storage.get(idx)
                if src is None:
                    raise StoreFormatError(
                        f"snapshot {self.manifest.name if self.manifest else self.name!r} has no "
                        f"saved item {idx.fqn!r} at offsets {idx.offset}"
                    )
                cost = self._cost(src)
                if batch and pending + cost > READ_BATCH_BYTES:
                    self._run_batch(packs, batch, planner)
                    batch, pending = [], 0
                batch.append((src, reqs))
                pending += cost
            if batch:
                self._run_batch(packs, batch, planner)
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    # -- reading

    def _entry(self, i: int) -> TensorEntry:
        assert self.manifest is not None
        return self.manifest.tensors[i]

    def _cost(self, src: Any) -> int:
        if isinstance(src, _Piece):
            return sum(n for _, _, n in src.data)
        if isinstance(src, (_Storage, _RawBytes)):
            return self._entry(src.entry).nbytes or 1
        return 1

    def _run_batch(
        self, packs: PackReaders, batch: list[tuple[Any, list[ReadItem]]], planner: LoadPlanner
    ) -> None:
        assert self.manifest is not None
        m = self.manifest
        jobs: dict[str, ChunkTargets] = {}
        storages: dict[int, torch.Tensor] = {}

        def want(path: str, slices: Iterable[Slice], dst: np.ndarray) -> None:
            pos = 0
            for d, start, n in slices:
                job = jobs.get(d)
                if job is None:
                    job = jobs[d] = ChunkTargets(d, where=f"snapshot {m.name!r} key {path!r}")
                job.targets.append((start, n, dst[pos : pos + n]))
                pos += n

        def storage_buf(sid: int, path: str) -> torch.Tensor:
            if sid not in storages:
                n, data = m.storages[sid]
                storages[sid] = torch.empty(n, dtype=torch.uint8)
                want(path, data, _np(storages[sid]))
            return storages[sid]

        deliveries: list[Any] = []
        for src, reqs in batch:
            if isinstance(src, _Piece):
                deliveries.append(self._plan_piece(src, reqs, want))
            elif isinstance(src, _Storage):
                e = self._entry(src.entry)
                assert e.storage is not None
                buf = storage_buf(e.storage.id, e.path)
                deliveries.append(("storage", src, reqs, buf))
            elif isinstance(src, _RawBytes):
                e = self._entry(src.entry)
                buf = torch.empty(e.nbytes, dtype=torch.uint8)
                want(e.path, e.data or (), _np(buf))
                deliveries.append(("bytes", src, reqs, buf))
            else:
                deliveries.append(("value", src, reqs, None))
                if src.has_tensors:
                    self._want_value_tensors(src.value, want, storage_buf, deliveries)

        self._fetch(packs, list(jobs.values()))

        for kind, src, reqs, payload in deliveries:
            if kind == "piece":
                self._deliver_piece(src, reqs, payload, planner)
            elif kind == "storage":
                self._deliver_tensor(reqs, self._storage_tensor(src.entry, payload), planner)
            elif kind == "bytes":
                for req in reqs:
                    planner.load_bytes(req, io.BytesIO(payload.numpy().tobytes()))
            elif kind == "value":
                value = src.value
                if src.has_tensors:
                    value = self._materialize(value, payload)
                for req in reqs:
                    bio = io.BytesIO()
                    torch.save(value, bio)
                    bio.seek(0)
                    planner.load_bytes(req, bio)

    def _fetch(self, packs: PackReaders, jobs: list[ChunkTargets]) -> None:
        assert self.manifest is not None
        # The load engine: coalesced scatter reads into the destinations, decode on the pool.
        run_jobs(
            packs,
            self.manifest.chunks,
            jobs,
            self.options.verify,
            self.options.threads,
            "deltackpt-dcp",
        )

    def _plan_piece(self, src: _Piece, reqs: list[ReadItem], want: Any) -> tuple[Any, ...]:
        """Read the element span [lo, hi) of the saved block that the requests touch."""
        e = self._entry(src.entry)
        dtype = dtype_from_name(e.dtype)
        isz = torch.empty(0, dtype=dtype).element_size()
        strides = _contiguous_strides(src.shape)
        lo, hi = None, None
        for req in reqs:
            if any(n == 0 for n in req.lengths):
                continue
            first = _flat(req.storage_offsets, strides)
            last = _flat(
                (o + n - 1 for o, n in zip(req.storage_offsets, req.lengths, strict=True)), strides
            )
            lo = first if lo is None else min(lo, first)
            hi = last + 1 if hi is None else max(hi, last + 1)
        if lo is None or hi is None:
            lo = hi = 0
        buf = torch.empty((hi - lo) * isz, dtype=torch.uint8)
        want(e.path, list(sub_slices(src.data, lo * isz, hi * isz)), _np(buf))
        return ("piece", src, reqs, (buf, lo, dtype, strides))

    def _deliver_piece(
        self, src: _Piece, reqs: list[ReadItem], payload: Any, planner: LoadPlanner
    ) -> None:
        buf, lo, dtype, strides = payload
        typed = buf.view(dtype) if buf.numel() else torch.empty(0, dtype=dtype)
        for req in reqs:
            lengths = tuple(req.lengths)
            if math.prod(lengths) == 0:
                region = torch.empty(lengths, dtype=dtype)
            else:
                off = _flat(req.storage_offsets, strides) - lo
                region = torch.as_strided(typed, lengths, strides, off)
            self._copy_into(req, region, planner)

    def _storage_tensor(self, i: int, buf: torch.Tensor) -> torch.Tensor:
        e = self._entry(i)
        assert e.storage is not None
        dtype = dtype_from_name(e.dtype)
        size = torch.empty(0, dtype=dtype).element_size()
        return torch.empty(0, dtype=dtype).set_(
            buf.untyped_storage(), e.storage.offset // size, e.shape, e.storage.stride
        )

    def _deliver_tensor(
        self, reqs: list[ReadItem], full: torch.Tensor, planner: LoadPlanner
    ) -> None:
        from torch.distributed._shard._utils import narrow_tensor_by_index

        for req in reqs:
            self._copy_into(
                req, narrow_tensor_by_index(full, req.storage_offsets, req.lengths), planner
            )

    @staticmethod
    def _copy_into(req: ReadItem, region: torch.Tensor, planner: LoadPlanner) -> None:
        if req.type != LoadItemType.TENSOR:
            raise StoreFormatError(f"{req.storage_index.fqn!r} is a tensor in the snapshot")
        target = planner.resolve_tensor(req).detach()
        if target.size() != region.size():
            raise StoreFormatError(
                f"read of {req.storage_index.fqn!r}: target block {tuple(target.size())} != "
                f"saved block {tuple(region.size())}"
            )
        with torch.no_grad():
            target.copy_(region)
        planner.commit_tensor(req, target)

    # -- non-tensor values that hold tensors (deltackpt.save snapshots: e.g. a tuple of tensors)

    def _want_value_tensors(
        self, value: Any, want: Any, storage_buf: Any, deliveries: list[Any]
    ) -> None:
        loaded: dict[int, Any] = {}
        for ref in _refs_in(value):
            e = self._entry(ref.entry)
            if ref.entry in loaded:
                continue
            if e.storage is not None:
                loaded[ref.entry] = ("storage", storage_buf(e.storage.id, e.path))
            else:
                pieces = []
                for sh in e.shards or (Shard((0,) * len(e.shape), e.shape, e.data or ()),):
                    buf = torch.empty(sum(n for _, _, n in sh.data), dtype=torch.uint8)
                    want(e.path, sh.data, _np(buf))
                    pieces.append((sh, buf))
                loaded[ref.entry] = ("pieces", pieces)
        kind, src, reqs, _ = deliveries[-1]
        deliveries[-1] = (kind, src, reqs, loaded)

    def _materialize(self, value: Any, loaded: dict[int, Any]) -> Any:
        if isinstance(value, _TensorRef):
            how = loaded[value.entry]
            if how[0] == "storage":
                return self._storage_tensor(value.entry, how[1]).clone()
            e = self._entry(value.entry)
            full = torch.empty(e.shape, dtype=dtype_from_name(e.dtype))
            for sh, buf in how[1]:
                block = full
                for d, (o, n) in enumerate(zip(sh.offsets, sh.shape, strict=True)):
                    block = block.narrow(d, o, n)
                if buf.numel():
                    block.copy_(buf.view(full.dtype).reshape(sh.shape))
            return full
        return _map_containers(value, lambda v: self._materialize(v, loaded))


@dataclass(frozen=True)
class _TensorRef:
    """Stands for tensor entry ``entry`` inside a non-tensor value."""

    entry: int


def _map_containers(value: Any, fn: Any) -> Any:
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


def _refs_in(v: Any) -> list[_TensorRef]:
    if isinstance(v, _TensorRef):
        return [v]
    if isinstance(v, dict):
        return [t for x in v.values() for t in _refs_in(x)]
    if isinstance(v, (list, tuple)):
        return [t for x in v for t in _refs_in(x)]
    return []

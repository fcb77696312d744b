"""DCP save into a deltackpt store: :class:`StoreWriter`, a DCP ``StorageWriter``.

What DCP calls, in order:

1. ``set_up_storage_writer`` (every rank): take the store's shared lock, so gc cannot delete a
   chunk this save will reference; the coordinator refuses an existing name when
   ``overwrite=False``, as DCP's ``FileSystemWriter`` does;
2. ``write_data`` (every rank): every tensor write item (a whole tensor or a local shard) and every
   serialised non-tensor value becomes a byte source, laid out in chunks
   (:func:`deltackpt.saving.plan.layout_chunks`), then hashed, deduplicated, encoded, appended to
   this rank's new packs and fsynced (:func:`deltackpt.saving.write.write_chunks`). Small values
   that are plain data travel to the coordinator as a JSON tree node instead (they live inline in
   the manifest, and ``deltackpt.load`` returns them as Python values). Each ``WriteResult``
   carries its item's slices; the first one of each rank also carries the rank's chunk records
   and statistics;
3. ``finish`` (coordinator, after every rank's packs are durable):
   :func:`deltackpt.dcp.commit.commit_dcp` turns every rank's results into the parts of one
   snapshot (sharded tensor entries with global offsets, the values, the chunks written) and
   commits them through the manifest builder every save shares
   (:func:`deltackpt.saving.commit.commit`), atomically. Nothing is visible before that point; a
   failure anywhere leaves no snapshot, only garbage that gc removes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import time
import uuid
import weakref
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from deltackpt.api import _check_metadata
from deltackpt.cuda import is_device
from deltackpt.dcp.commit import RankInfo, check_dcp_save, commit_dcp
from deltackpt.errors import CheckpointExistsError, InvalidArgumentError
from deltackpt.format.dcp_values import DCP_KEY  # manifest metadata key of the DCP facts (JSON)
from deltackpt.format.tree import flatten
from deltackpt.options import SaveOptions, default_device_scan
from deltackpt.saving.commit import Timing
from deltackpt.saving.engine import saver_for
from deltackpt.saving.on_device import scan
from deltackpt.saving.plan import SavePlan as DkPlan
from deltackpt.saving.plan import Source, layout_chunks, tensor_bytes
from deltackpt.saving.write import closure, write_chunks
from deltackpt.store.store import SnapshotInfo, Store, open_store, validate_name

__all__ = ["CheckpointExistsError", "StoreWriter"]  # the error's home is deltackpt.errors

INLINE_MAX_BYTES = 64 << 10  # serialised values up to this size may live inline in the manifest


class StoreWriter(StorageWriter):
    """A DCP ``StorageWriter`` that saves into a deltackpt store as snapshot ``name``.

    ``name`` may also come from ``dcp.save(..., checkpoint_id=name)``. Keyword options are the
    fields of :class:`~deltackpt.SaveOptions` (``encoding``, ``threads``, ``fsync``,
    ``lock_timeout``...); ``metadata`` is a JSON dict kept in the manifest (``step``...). After a
    successful save the coordinator's ``writer.info`` is the committed
    :class:`~deltackpt.SnapshotInfo`.

    ``dcp.FileSystemWriter``'s arguments are accepted with its meaning:

    * ``overwrite`` (default ``True``, as DCP; or ``options.overwrite`` when ``options`` is
      passed): re-saving to a ``checkpoint_id`` replaces that snapshot atomically: the new
      manifest is committed over the old one by one rename, so the old one stays loadable until
      the new one is durable. ``overwrite=False`` refuses an existing name with
      :class:`~deltackpt.errors.CheckpointExistsError`, DCP's "Checkpoint already exists"
      ``RuntimeError``;
    * ``thread_count`` is ``threads`` (hash, encode and write threads; default ``min(4, cpus)``:
      DCP's 1 would only slow hashing down);
    * ``sync_files`` is ``fsync``: ``False`` skips fsyncing the packs (the manifest is always
      made durable before it is published);
    * ``single_file_per_rank`` is ignored: each rank appends its new chunks to packs only it
      writes (one per writing thread), whatever the number of items;
    * ``per_thread_copy_ahead`` is ignored: it bounds how far ``FileSystemWriter`` copies ahead
      of its writer threads; ``write_data`` has every item of the rank on the CPU before the
      first chunk is written, so there is nothing ahead to bound;
    * ``cache_staged_state_dict`` is ignored: it is an option of ``FileSystemWriter``'s own
      stager. ``StoreWriter`` is not a stager, so ``dcp.async_save`` stages through DCP's
      ``DefaultStager`` (a new copy per call); to reuse one, pass
      ``async_stager=BlockingAsyncStager(cache_staged_state_dict=True)`` to ``dcp.async_save``.

    >>> dcp.save(state, storage_writer=StoreWriter("ckpts", "step-100"))   # doctest: +SKIP
    """

    def __init__(
        self,
        store: str | os.PathLike[str] | Store,
        name: str | None = None,
        *,
        metadata: dict[str, Any] | None = None,
        options: SaveOptions | None = None,
        overwrite: bool | None = None,
        thread_count: int | None = None,
        sync_files: bool | None = None,
        single_file_per_rank: bool = True,
        per_thread_copy_ahead: int = 10_000_000,
        cache_staged_state_dict: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__()
        if name is not None:
            validate_name(name)
        self.name = name
        self.options = _save_options(options, kwargs, overwrite, thread_count, sync_files)
        self.user_metadata = _check_metadata(metadata)
        if DCP_KEY in self.user_metadata:
            raise InvalidArgumentError(
                f"StoreWriter(metadata={{{DCP_KEY!r}: ...}}): the key {DCP_KEY!r} is reserved for "
                "the DCP plug-in's own record; rename yours"
            )
        self.single_file_per_rank = _flag("single_file_per_rank", single_file_per_rank)
        self.cache_staged_state_dict = _flag("cache_staged_state_dict", cache_staged_state_dict)
        if not isinstance(per_thread_copy_ahead, int) or per_thread_copy_ahead < 0:
            raise InvalidArgumentError(
                f"StoreWriter(per_thread_copy_ahead={per_thread_copy_ahead!r}) is invalid: "
                "expected an int >= 0 (it is accepted for DCP's sake and ignored)"
            )
        self.per_thread_copy_ahead = per_thread_copy_ahead
        # last: every argument checked before a new store is created for this writer
        self.store = open_store(store)
        self._init_save()

    def _init_save(self) -> None:
        self.info: SnapshotInfo | None = None
        self.save_id = uuid.uuid4().hex
        self._lock = _HeldLock()
        weakref.finalize(self, self._lock.release)
        self._reset_save()

    def _reset_save(self) -> None:
        self._lock.release()
        self.is_coordinator = False
        self.rank = 0
        self._packs: tuple[str, ...] = ()  # the coordinator's new packs
        self._t0 = time.perf_counter()

    @property
    def overwrite(self) -> bool:
        return self.options.overwrite

    @property
    def thread_count(self) -> int:
        return self.options.threads

    @property
    def sync_files(self) -> bool:
        return self.options.fsync

    # pickling (DCP's process-based async_save sends the writer to another process)
    _PICKLED = (
        "name",
        "options",
        "user_metadata",
        "single_file_per_rank",
        "per_thread_copy_ahead",
        "cache_staged_state_dict",
    )

    def __getstate__(self) -> dict[str, Any]:
        opts = getattr(self.store.storage, "storage_options", None)  # object stores
        return {
            "root": str(self.store.root),
            "storage_options": opts,
            **{k: getattr(self, k) for k in self._PICKLED},
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        opts = state.get("storage_options")
        self.store = open_store(state["root"], create=False, storage_options=opts)
        for k in self._PICKLED:
            setattr(self, k, state[k])
        self._init_save()

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
        dist = torch.distributed
        initialized = dist.is_available() and dist.is_initialized()
        rank = kwargs.get("rank")
        self.rank = int(rank if rank is not None else dist.get_rank() if initialized else 0)
        if not kwargs.get("use_collectives", True) and initialized and dist.get_world_size() > 1:
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
        self._lock.acquire(st, self.options.lock_timeout, f"DCP-saving {self.name!r}")
        try:
            check_dcp_save(
                st, self.name, overwrite=self.options.overwrite, is_coordinator=is_coordinator
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
        st, opts = self.store, self.options
        sources: list[Source] = []
        items: list[_Item] = []
        for item in plan.items:
            if item.type == WriteItemType.BYTE_IO:
                data = planner.resolve_data(item)
                raw = data.getvalue() if isinstance(data, io.BytesIO) else bytes(data.read())
                node = _inline_node(raw)
                if node is not _NOT_INLINE:
                    items.append(_Item(len(raw), node=node))
                    continue
                u8 = (
                    torch.frombuffer(bytearray(raw), dtype=torch.uint8)
                    if raw
                    else torch.empty(0, dtype=torch.uint8)
                )
                items.append(_Item(len(raw), source=len(sources)))
                sources.append(Source(f"{item.index.fqn}:bytes", u8, 1))
                continue
            t = _resolve_tensor(item, planner)
            b = tensor_bytes(t)
            items.append(_Item(b.numel(), source=len(sources)))
            offsets = ",".join(str(o) for o in item.tensor_data.chunk.offsets)
            sources.append(Source(f"{item.index.fqn}@{offsets}", b, t.element_size()))

        chunks, slices = layout_chunks(
            [s.nbytes for s in sources],
            [s.itemsize for s in sources],
            [s.key for s in sources],
            st.chunk_bytes,
            st.small_bytes,
        )
        dk_plan = DkPlan(None, [], [], sources, chunks, slices)
        index = st.chunk_index()
        how = default_device_scan()
        if how == "always" or any(is_device(s.data) for s in sources):
            wr = _write_from_device(st, dk_plan, opts, index, self.name, trust=how != "off")
        else:
            arrays = [s.data.numpy() if s.data.numel() else np.empty(0, np.uint8) for s in sources]
            pool = saver_for(st).pool(opts.threads)
            wr = write_chunks(st, dk_plan, arrays.__getitem__, opts, pool, index, None)
        if self.is_coordinator:
            self._packs = wr.packs  # removed if the commit certainly fails
        info = RankInfo.of(self.rank, wr, index)
        out: list[WriteResult] = []
        for k, (item, it) in enumerate(zip(plan.items, items, strict=True)):
            sd: dict[str, Any]
            if it.source is None:
                sd = {"value": it.node}
            else:
                sd = {"slices": [(wr.digests[ci], s, n) for ci, s, n in slices[it.source]]}
                if item.type == WriteItemType.BYTE_IO:
                    sd["bytes"] = True
                else:
                    sd["offsets"] = tuple(item.tensor_data.chunk.offsets)
                    sd["shape"] = tuple(item.tensor_data.chunk.sizes)
            if k == 0:
                sd["rank"] = info
            out.append(WriteResult(index=item.index, size_in_bytes=it.size, storage_data=sd))
        return out

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        try:
            self._finish(metadata, results)
        finally:
            self._lock.release()

    def _finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        assert self.name is not None
        self.info = commit_dcp(
            self.store,
            self.name,
            metadata,
            results,
            self.user_metadata,
            metadata.storage_meta or self.storage_meta(),
            Timing(self._t0),
            overwrite=self.options.overwrite,
            packs=self._packs,
        )
        self.save_id = uuid.uuid4().hex  # the next save through this writer is another save


# ------------------------------------------------------------------------------------ helpers


def _save_options(
    options: SaveOptions | None,
    kwargs: dict[str, Any],
    overwrite: bool | None,
    thread_count: int | None,
    sync_files: bool | None,
) -> SaveOptions:
    """SaveOptions from deltackpt's keywords and DCP's names for them."""
    dcp_names = [("thread_count", "threads", thread_count), ("sync_files", "fsync", sync_files)]
    for dcp_name, ours, value in dcp_names:
        if value is None:
            continue
        if ours in kwargs and kwargs[ours] != value:
            raise InvalidArgumentError(
                f"StoreWriter got {dcp_name}={value!r} and {ours}={kwargs[ours]!r}: they are one "
                f"option (DCP's name and deltackpt's). Pass only one of them"
            )
        kwargs = {**kwargs, ours: value}
    if overwrite is not None or options is None:
        kwargs = {**kwargs, "overwrite": True if overwrite is None else overwrite}
    return SaveOptions.from_kwargs(options, kwargs)


def _flag(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise InvalidArgumentError(
            f"StoreWriter({name}={value!r}) is invalid: expected True or False (it is accepted "
            "for DCP's sake and ignored)"
        )
    return value


def _write_from_device(
    st: Store, plan: DkPlan, opts: SaveOptions, index: dict[str, Any], name: str | None,
    trust: bool,
) -> Any:  # fmt: skip
    """A rank's write items in device memory (CUDA), as ``deltackpt.save`` of device state
    does (saving/on_device.py): every chunk fingerprinted where it lives, only the chunks that
    changed since this process's last DCP save of the store (``trust``; all of them with
    ``DELTACKPT_DEVICE_SCAN=off``) copied into reused pinned host buffers with one wait, hashed
    and written; an unchanged chunk keeps its digest and never crosses to the host. CPU items
    of the same save go the same way (their "copy" is a host copy)."""
    saver = saver_for(st)
    pool = saver.pool(opts.threads)
    saver.dcp_arena.retain({(s.key, s.nbytes) for s in plan.sources})
    bufs: dict[int, np.ndarray] = {}
    known = saver.dcp_fingerprints if trust else None
    found = scan(plan, st.chunk_bytes, known, index, saver.dcp_arena, pool, bufs)
    wr = write_chunks(
        st, plan, found.arrays.__getitem__, opts, pool, index, None, digests=found.digests,
        owned=found.copies.new, group_bufs=bufs, chunk_data=found.copies.data, name=name,
    )  # fmt: skip
    if trust:  # trusted next time only where its digest is committed by then (scan checks)
        saver.dcp_fingerprints = found.fingerprints
    # every chunk the items reference, the unchanged ones' records from the index
    return dataclasses.replace(wr, records=closure(set(wr.digests), wr.written, index))


def _resolve_tensor(item: Any, planner: SavePlanner) -> torch.Tensor:
    """The tensor of a DCP tensor write item where it lives (host or device), in the dtype
    and shape the plan says."""
    fqn, td = item.index.fqn, item.tensor_data
    if td is None:
        raise ValueError(f"DCP write item {fqn!r} is a tensor write without tensor_data")
    t = planner.resolve_data(item)
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"planner.resolve_data({fqn!r}) returned {type(t)}, not a tensor")
    t = t.detach()
    if t.dtype != td.properties.dtype:
        t = t.to(td.properties.dtype)
    if tuple(t.shape) != tuple(td.chunk.sizes):
        raise ValueError(
            f"DCP write item {fqn!r}: resolved tensor has shape {tuple(t.shape)}, the "
            f"plan says {tuple(td.chunk.sizes)}"
        )
    return t


@dataclass
class _Item:
    """How one DCP write item of this rank is stored: as byte source ``source`` (an index into
    the rank's sources), or inline in the manifest as the tree node ``node``."""

    size: int  # DCP's size_in_bytes: the tensor's or the serialised value's bytes
    source: int | None = None
    node: Any = None


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


class _HeldLock:
    """The store's shared lock, held across DCP calls (acquired in one, released in another)."""

    def __init__(self) -> None:
        self._stack: contextlib.ExitStack | None = None

    def acquire(self, store: Store, timeout: float, what: str) -> None:
        self.release()
        stack = contextlib.ExitStack()
        stack.enter_context(store.lock(exclusive=False, timeout=timeout, what=what))
        self._stack = stack

    def release(self) -> None:
        stack, self._stack = self._stack, None
        if stack is not None:
            stack.close()

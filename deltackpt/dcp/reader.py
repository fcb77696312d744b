"""DCP load through a deltackpt store: :class:`StoreReader`, a DCP ``StorageReader``.

What DCP calls, in order (every rank unless said otherwise):

1. ``read_metadata``: resolve the snapshot name once (``"latest"`` included) and translate its
   manifest into DCP ``Metadata`` (:mod:`deltackpt.dcp.metadata`);
2. ``set_up_storage_reader``; ``prepare_local_plan`` tags the plan with the snapshot resolved;
   ``prepare_global_plan`` (coordinator) refuses ranks that resolved different snapshots;
3. ``read_data``: DCP's read items, grouped per saved item and batched up to
   :data:`READ_BATCH_BYTES`, become chunk targets through :mod:`deltackpt.loading.plan` and are
   read, decoded and verified by :func:`deltackpt.store.chunks.run_jobs` (the load engine);
   then each item is delivered to DCP's planner (``resolve_tensor``/``commit_tensor`` or
   ``load_bytes``).

A saved block is read as the element span its requests touch, so a rank reads only the chunks
covering the rows it needs; DCP does the resharding (a target block is a narrow of a saved one).
"""

from __future__ import annotations

import dataclasses
import io
import math
import os
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from deltackpt.cuda import is_device
from deltackpt.dcp.metadata import (
    ByteValue,
    Saved,
    SavedBlock,
    SharedView,
    TensorRef,
    Value,
    map_containers,
    metadata_of,
    refs_in,
)
from deltackpt.errors import InvalidArgumentError, StoreError, StoreFormatError
from deltackpt.format.dtypes import dtype_from_name
from deltackpt.format.manifest import Manifest
from deltackpt.loading import to_device
from deltackpt.loading.plan import Reads, read_entry
from deltackpt.loading.select import KeySelection, key_filter
from deltackpt.options import LoadOptions, default_device_scan
from deltackpt.store.packs import PackReaders
from deltackpt.store.store import LATEST, Store, open_store, validate_name

READ_BATCH_BYTES = 256 << 20  # read_data buffers at most about this much before delivering


class StoreReader(StorageReader):
    """A DCP ``StorageReader`` over snapshot ``name`` (default ``"latest"``) of a deltackpt store.

    Reads snapshots written through :class:`~deltackpt.dcp.StoreWriter` and by
    ``deltackpt.save``; DCP reshards them onto whatever the target state looks like. Each rank
    reads only the chunks covering the saved blocks it needs, and every chunk is checked against
    its digest unless ``verify=False``. ``threads`` read and decode in parallel (default
    ``min(4, cpus)``). ``allow_pickle=True`` is needed for snapshots saved with pickled values.

    ``keys`` (DCP key names or prefixes, e.g. ``["model.layers.0"]``, or a predicate on DCP's
    dotted fully qualified name) drops the read items of every other key in
    ``prepare_local_plan``, before anything is read: their values in the state dict passed to
    ``dcp.load`` are left as they were. (Passing ``dcp.load`` a state dict holding only the wanted
    keys filters the same way: DCP plans reads only for the keys it is given.)

    ``dcp.FileSystemReader``'s own argument is accepted too: ``_extension_registry`` (stream
    transforms applied to files it reads) must be ``None``, because deltackpt stores no DCP files:
    its chunks carry their own codec and are decoded whatever wrote them.

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
        keys: KeySelection = None,
        _extension_registry: Any = None,
    ) -> None:
        super().__init__()
        self.select = key_filter(keys)
        if _extension_registry is not None:
            raise InvalidArgumentError(
                "StoreReader(_extension_registry=...) is not supported: deltackpt chunks carry "
                "their own codec (zstd, xor deltas) and need no DCP stream transforms. Leave "
                "it out"
            )
        self.store = open_store(store, create=False)
        self.name = name
        self.options = LoadOptions(verify=verify, allow_pickle=allow_pickle)
        if threads is not None:
            self.options = dataclasses.replace(self.options, threads=threads)
        self.manifest: Manifest | None = None
        self._storage: dict[MetadataIndex, Saved] = {}

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
        if checkpoint_id == LATEST:
            return True
        try:
            validate_name(os.fspath(checkpoint_id))
        except (TypeError, ValueError):
            return False
        return True

    def read_metadata(self) -> Metadata:
        m = self.store.manifest(self.name)  # "latest" resolved once, here
        md = metadata_of(m, self.options.allow_pickle)
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
        if self.select is not None:
            select = self.select
            plan = dataclasses.replace(
                plan, items=[i for i in plan.items if select(i.storage_index.fqn)]
            )
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
        assert self.manifest is not None
        groups: dict[MetadataIndex, list[ReadItem]] = {}
        for req in plan.items:
            groups.setdefault(req.storage_index, []).append(req)
        batch: list[tuple[Saved, list[ReadItem]]] = []
        pending = 0
        with self.store.pack_readers() as packs:
            for idx, reqs in groups.items():
                src = self._storage.get(idx)
                if src is None:
                    raise StoreFormatError(
                        f"snapshot {self.manifest.name!r} has no saved item {idx.fqn!r} at "
                        f"offsets {idx.offset}"
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

    def _cost(self, src: Saved) -> int:
        assert self.manifest is not None
        if isinstance(src, SavedBlock):
            return sum(n for _, _, n in src.data)
        if isinstance(src, (SharedView, ByteValue)):
            return self.manifest.tensors[src.entry].nbytes or 1
        return 1

    def _run_batch(
        self, packs: PackReaders, batch: list[tuple[Saved, list[ReadItem]]], planner: LoadPlanner
    ) -> None:
        """Plan every item of ``batch``, read all their chunks in one pass, then deliver."""
        assert self.manifest is not None
        m = self.manifest
        r = Reads(m)
        deliveries: list[_Delivery] = []
        for src, reqs in batch:
            if isinstance(src, SavedBlock):
                deliveries.append(_plan_block(r, m, src, reqs))
            elif isinstance(src, SharedView):
                deliveries.append(_Narrowed(reqs, read_entry(r, m.tensors[src.entry])))
            elif isinstance(src, ByteValue):
                deliveries.append(_Bytes(reqs, read_entry(r, m.tensors[src.entry])))
            else:
                refs = dict.fromkeys(x.entry for x in refs_in(src.value)) if src.has_tensors else {}
                tensors = {i: read_entry(r, m.tensors[i]) for i in refs}
                deliveries.append(_ValueItem(reqs, src, tensors))
        opts = self.options
        r.run(packs, opts.verify, opts.threads, "deltackpt-dcp")
        to_dev = _ToDevice(default_device_scan() == "always")
        for d in deliveries:
            d.deliver(planner, to_dev)
        to_dev.run(planner)


# ----------------------------------------------------------------------------------- delivery


class _Delivery(Protocol):
    def deliver(self, planner: LoadPlanner, to_dev: _ToDevice) -> None: ...


class _ToDevice:
    """A batch's copies into targets in device memory (``forced``: CPU targets standing in for
    them, the CPU suite), queued by :func:`_copy_into` and run by :meth:`run`: through two
    reused pinned buffers, each copied to the device on a side stream while the next is filled
    (``to_device.copy_through``), instead of a pageable, waiting ``copy_`` per read item; every
    item is committed to the planner once all have landed."""

    def __init__(self, forced: bool) -> None:
        self.forced = forced
        self.items: list[tuple[ReadItem, torch.Tensor, torch.Tensor]] = []

    def takes(self, target: torch.Tensor) -> bool:
        return is_device(target) or (self.forced and target.device.type == "cpu")

    def run(self, planner: LoadPlanner) -> None:
        with torch.no_grad():
            to_device.copy_through([(target, region) for _, target, region in self.items])
        for req, target, _ in self.items:
            planner.commit_tensor(req, target)
        self.items.clear()


def _copy_into(
    req: ReadItem, region: torch.Tensor, planner: LoadPlanner, to_dev: _ToDevice
) -> None:
    if req.type != LoadItemType.TENSOR:
        raise StoreFormatError(f"{req.storage_index.fqn!r} is a tensor in the snapshot")
    target = planner.resolve_tensor(req).detach()
    if target.size() != region.size():
        raise StoreFormatError(
            f"read of {req.storage_index.fqn!r}: target block {tuple(target.size())} != "
            f"saved block {tuple(region.size())}"
        )
    if to_dev.takes(target) and target.dtype == region.dtype:
        to_dev.items.append((req, target, region))  # copied and committed with the batch
        return
    with torch.no_grad():
        target.copy_(region)
    planner.commit_tensor(req, target)


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    out, acc = [], 1
    for n in reversed(shape):
        out.append(acc)
        acc *= n
    return tuple(reversed(out))


def _flat(idx: Iterable[int], strides: tuple[int, ...]) -> int:
    return sum(i * s for i, s in zip(idx, strides, strict=True))


@dataclass
class _BlockSpan:
    """Requests into one saved block, read as the element span [lo, ...) they touch."""

    reqs: list[ReadItem]
    span: torch.Tensor  # uint8: the span's bytes
    lo: int  # first element of the span, in the block
    dtype: torch.dtype
    strides: tuple[int, ...]  # of the block, C order

    def deliver(self, planner: LoadPlanner, to_dev: _ToDevice) -> None:
        typed = (
            self.span.view(self.dtype) if self.span.numel() else torch.empty(0, dtype=self.dtype)
        )
        for req in self.reqs:
            lengths = tuple(req.lengths)
            if math.prod(lengths) == 0:
                region = torch.empty(lengths, dtype=self.dtype)
            else:
                off = _flat(req.storage_offsets, self.strides) - self.lo
                region = torch.as_strided(typed, lengths, self.strides, off)
            _copy_into(req, region, planner, to_dev)


def _plan_block(r: Reads, m: Manifest, src: SavedBlock, reqs: list[ReadItem]) -> _BlockSpan:
    """Read the element span [lo, hi) of the saved block that the requests touch."""
    e = m.tensors[src.entry]
    dtype = dtype_from_name(e.dtype)
    isz = dtype.itemsize
    strides = _contiguous_strides(src.shape)
    lo, hi = None, None
    for req in reqs:
        if any(n == 0 for n in req.lengths):
            continue
        first = _flat(req.storage_offsets, strides)
        ends = (o + n - 1 for o, n in zip(req.storage_offsets, req.lengths, strict=True))
        last = _flat(ends, strides)
        lo = first if lo is None else min(lo, first)
        hi = last + 1 if hi is None else max(hi, last + 1)
    if lo is None or hi is None:
        lo = hi = 0
    return _BlockSpan(reqs, r.span(e.path, src.data, lo * isz, hi * isz), lo, dtype, strides)


@dataclass
class _Narrowed:
    """Requests for blocks of a whole tensor (a view of a shared storage)."""

    reqs: list[ReadItem]
    tensor: torch.Tensor

    def deliver(self, planner: LoadPlanner, to_dev: _ToDevice) -> None:
        from torch.distributed._shard._utils import narrow_tensor_by_index

        for req in self.reqs:
            block = narrow_tensor_by_index(self.tensor, req.storage_offsets, req.lengths)
            _copy_into(req, block, planner, to_dev)


@dataclass
class _Bytes:
    """Requests for a value DCP stored as its torch.save bytes: handed back as they are."""

    reqs: list[ReadItem]
    u8: torch.Tensor

    def deliver(self, planner: LoadPlanner, to_dev: _ToDevice) -> None:
        for req in self.reqs:
            planner.load_bytes(req, io.BytesIO(self.u8.numpy().tobytes()))


@dataclass
class _ValueItem:
    """Requests for a value of the manifest tree, with the tensors it holds (by entry)."""

    reqs: list[ReadItem]
    src: Value
    tensors: dict[int, torch.Tensor]

    def deliver(self, planner: LoadPlanner, to_dev: _ToDevice) -> None:
        value = self._materialize(self.src.value) if self.src.has_tensors else self.src.value
        for req in self.reqs:
            bio = io.BytesIO()
            torch.save(value, bio)
            bio.seek(0)
            planner.load_bytes(req, bio)

    def _materialize(self, value: Any) -> Any:
        if isinstance(value, TensorRef):
            t = self.tensors[value.entry]
            if t.is_contiguous() and t.untyped_storage().nbytes() == t.nbytes:
                return t  # a new tensor that owns exactly its memory
            return t.clone()  # a view of a shared storage: torch.save only its own bytes
        return map_containers(value, self._materialize)

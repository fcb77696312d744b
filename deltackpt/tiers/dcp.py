"""Tiered checkpoints through ``torch.distributed.checkpoint``: a DCP storage writer and reader
over a :class:`~deltackpt.tiers.TieredCheckpointer`'s tiers.

::

    ckpt = TieredCheckpointer(Tiers(local="/dev/shm/run", durable="ckpts", replicas=1,
                                    persist_every=100), process_group=pg)
    dcp.load(state_dict, storage_reader=TieredReader(ckpt))      # newest step any tier holds
    for step in range(ckpt.last_restore.step + 1 if ... else 0, total):
        train_step()
        dcp.save(state_dict, storage_writer=TieredWriter(ckpt, step))

**Save** (:class:`TieredWriter`): every rank writes *all* the items of its own local plan (DCP's
plan before its global deduplication: a replicated tensor is kept by every rank, so each rank
can restore alone) into its local tier as one snapshot of a world of one, ``step-<step:08d>``,
in the DCP snapshot format of :class:`deltackpt.dcp.StoreWriter` (raw chunks; a chunk the tier
already holds is not written again); the checkpointer's background thread then replicates it
to the rank's peers (every chunk checked on receipt) and applies retention, as for
:meth:`TieredCheckpointer.save`. On a persist step (``Tiers.persist_every``, or
``persist=True``) the same ``dcp.save`` also writes a normal DCP snapshot to the durable tier
through :class:`~deltackpt.dcp.StoreWriter` (DCP's deduplicated plan; committed by the
coordinator; the durable checkpointer's retention applied), which ``dcp.load`` with
``StoreReader`` or a :class:`~deltackpt.Checkpointer` of any world size can read and reshard.
``dcp.save`` returns once the local snapshot (and the durable one on a persist step) is
committed; ``dcp.async_save`` runs the same writes in DCP's background thread.

**Load** (:class:`TieredReader`): ``read_metadata`` (every rank) runs the tiers' restore
agreement (:mod:`deltackpt.tiers.restore`): the newest step every rank can assemble from its
own local tier or a peer's replica (fetched and verified first), else the durable tier. From
the local tiers, DCP's metadata is the union of every rank's pieces and each rank reads only its
own snapshot, which must hold every piece its plan asks for: the same world size and sharding as
the save (another sharding raises :class:`~deltackpt.errors.StateMismatchError` in
``prepare_local_plan``; pass ``TieredReader(ckpt, tier="durable")`` to reshard from the durable
tier). ``ckpt.last_restore`` says what was used.

Differences from DCP with a file system writer, by design: a plain (non-DTensor) tensor whose
value differs between ranks comes back on each rank as that rank saved it (DCP keeps only one
rank's copy: that is what the durable tier gives back too); the writer holds process groups, so
``dcp.async_save(..., async_checkpointer_type=PROCESS)`` cannot pickle it.
"""

from __future__ import annotations

import io
import math
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    SavePlan,
    SavePlanner,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future as TorchFuture

from deltackpt.checkpointer import OWNER_KEY
from deltackpt.dcp import StoreReader, StoreWriter
from deltackpt.dcp.reader import READ_BATCH_BYTES
from deltackpt.dcp.writer import _resolve_tensor
from deltackpt.errors import (
    InvalidArgumentError,
    ManifestError,
    SnapshotNotFoundError,
    StateMismatchError,
)
from deltackpt.format.boxes import Box
from deltackpt.format.dtypes import dtype_from_name, dtype_name
from deltackpt.format.manifest import TensorEntry
from deltackpt.loading.lazy import SnapshotReader, open_snapshot
from deltackpt.store.store import Store
from deltackpt.tiers.checkpointer import TieredCheckpointer
from deltackpt.tiers.config import local_name
from deltackpt.tiers.localize import localize
from deltackpt.tiers.restore import DURABLE, restore

# A DCP local snapshot holds plain pieces (no DTensor), so its layout digest is that of an
# empty layout; whether the pieces fit the live state is checked in prepare_local_plan.
DCP_LAYOUT = localize({})[1]
PIECES_KEY = "deltackpt.tiers.dcp"  # local snapshot metadata: what each piece is in DCP terms


def _check_ckpt(ckpt: Any, what: str) -> None:
    if not isinstance(ckpt, TieredCheckpointer):
        raise InvalidArgumentError(
            f"{what}(ckpt={ckpt!r:.60}) is invalid: expected a deltackpt.tiers."
            "TieredCheckpointer, e.g. TieredCheckpointer(Tiers(local='/dev/shm/run'), "
            "process_group=pg)"
        )


def _key(fqn: str, offsets: Any) -> str:
    return f"{fqn}@{','.join(str(int(o)) for o in offsets)}"


def _pieces(plan: SavePlan, planner: SavePlanner) -> tuple[dict[str, Any], dict[str, Any]]:
    """This rank's items as a flat state (``fqn@offsets``: its piece of a tensor, or the bytes
    of a byte item as uint8) and their JSON description: ``{fqn: {"dtype", "size",
    "requires_grad", "pieces": [offsets, ...]}}`` or ``{fqn: {"bytes": true}}``."""
    items: dict[str, Any] = {}
    pieces: dict[str, Any] = {}
    for item in plan.items:
        fqn = item.index.fqn
        if item.type == WriteItemType.BYTE_IO:
            data = planner.resolve_data(item)
            raw = data.getvalue() if isinstance(data, io.BytesIO) else bytes(data.read())
            items[fqn] = (
                torch.frombuffer(bytearray(raw), dtype=torch.uint8)
                if raw
                else (torch.empty(0, dtype=torch.uint8))
            )
            pieces[fqn] = {"bytes": True}
            continue
        td = item.tensor_data
        assert td is not None
        items[_key(fqn, td.chunk.offsets)] = _resolve_tensor(item, planner)
        cur = pieces.setdefault(
            fqn,
            {
                "dtype": dtype_name(td.properties.dtype, fqn),
                "size": [int(n) for n in td.size],
                "requires_grad": bool(td.properties.requires_grad),
                "pieces": [],
            },
        )
        cur["pieces"].append([int(o) for o in td.chunk.offsets])
    return items, pieces


def _metadata_of(reader: SnapshotReader, where: str) -> tuple[dict[str, Any], dict[Any, str]]:
    """DCP's ``state_dict_metadata`` of one local snapshot's pieces, and ``MetadataIndex ->
    key``; every field checked against the snapshot's own entries (the store is untrusted)."""
    meta = reader.manifest.metadata if isinstance(reader.manifest.metadata, dict) else {}
    desc = meta.get(PIECES_KEY)
    if not isinstance(desc, dict):
        raise ManifestError(f"{where}: no {PIECES_KEY!r} record: not saved by TieredWriter")
    md: dict[str, Any] = {}
    storage: dict[Any, str] = {}
    for fqn, d in desc.items():
        bad = ManifestError(f"{where}: {PIECES_KEY}[{fqn!r}] = {d!r:.120} is malformed")
        if not isinstance(d, dict):
            raise bad
        if d.get("bytes") is True:
            if reader.entry(fqn).dtype != "uint8":
                raise bad
            md[fqn] = BytesStorageMetadata()
            storage[MetadataIndex(fqn)] = fqn
            continue
        size, offs = d.get("size"), d.get("pieces")
        if not (
            isinstance(size, list)
            and all(type(n) is int and n >= 0 for n in size)
            and isinstance(offs, list)
            and type(d.get("requires_grad")) is bool
        ):
            raise bad
        try:
            dtype = dtype_from_name(d.get("dtype"))  # type: ignore[arg-type]
        except Exception:
            raise bad from None
        chunks = []
        for o in offs:
            if not (isinstance(o, list) and len(o) == len(size)):
                raise bad
            e = reader.entry(_key(fqn, o))
            if e.dtype != d["dtype"] or any(
                type(a) is not int or a < 0 or a + n > s
                for a, n, s in zip(o, e.shape, size, strict=True)
            ):
                raise bad
            chunks.append(ChunkStorageMetadata(torch.Size(o), torch.Size(e.shape)))
            storage[MetadataIndex(fqn, o)] = _key(fqn, o)
        props = TensorProperties(dtype=dtype, requires_grad=d["requires_grad"])
        md[fqn] = TensorStorageMetadata(props, torch.Size(size), chunks)
    return md, storage


class TieredWriter(StorageWriter):
    """``dcp.save(state, storage_writer=TieredWriter(ckpt, step))``: step ``step`` into the
    local tier of every rank (replicated in the background) and, on persist steps, the durable
    tier (module docstring). ``persist``: None (default: ``Tiers.persist_every`` decides), True
    (persist this step too: the SIGTERM path) or False."""

    def __init__(self, ckpt: TieredCheckpointer, step: int, *, persist: bool | None = None):
        super().__init__()
        _check_ckpt(ckpt, "TieredWriter")
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise InvalidArgumentError(
                f"TieredWriter(step={step!r}) is invalid: expected an int >= 0 (the step)"
            )
        if persist not in (None, True, False):
            raise InvalidArgumentError(
                f"TieredWriter(persist={persist!r}) is invalid: expected None, True or False"
            )
        self.ckpt, self.step = ckpt, step
        pe = ckpt.tiers.persist_every
        if persist is None:
            persist = pe is not None and (step + 1) % pe == 0
        if persist and ckpt.durable is None:
            raise InvalidArgumentError(
                "TieredWriter(persist=True): Tiers(durable=None) has no durable tier; pass "
                "Tiers(durable=<dir or s3://...>)"
            )
        self.durable: StoreWriter | None = None
        if persist:
            d = ckpt.durable
            assert d is not None
            meta = {"step": step, OWNER_KEY: {"name_format": d.name_format, "step": step}}
            self.durable = StoreWriter(d.store, d.name(step), metadata=meta)
        self._own: SavePlan | None = None

    @property
    def checkpoint_id(self) -> str:
        return local_name(self.step)

    def reset(self, checkpoint_id: Any = None) -> None:
        if self.durable is not None:
            self.durable.reset()
        self._own = None

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return False  # a TieredWriter names its snapshots from its step

    def storage_meta(self) -> Any:
        return None if self.durable is None else self.durable.storage_meta()

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.ckpt._collect()  # the previous save's replication and retention are done
        self.is_coordinator = is_coordinator
        if self.durable is not None:
            self.durable.set_up_storage_writer(is_coordinator, *args, **kwargs)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        self._own = plan  # every item of this rank, before DCP drops replicated duplicates
        return plan if self.durable is None else self.durable.prepare_local_plan(plan)

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return plans if self.durable is None else self.durable.prepare_global_plan(plans)

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> TorchFuture[list[WriteResult]]:
        own = self._own if self._own is not None else plan
        items, pieces = _pieces(own, planner)
        self.ckpt.save(self.step, items, metadata={PIECES_KEY: pieces})
        if self.durable is not None:
            return self.durable.write_data(plan, planner)
        fut: TorchFuture[list[WriteResult]] = TorchFuture()
        fut.set_result([WriteResult(i.index, 0, None) for i in plan.items])
        return fut

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        if self.durable is None:
            return
        self.durable.finish(metadata, results)
        d = self.ckpt.durable
        assert d is not None
        d._apply_retention()  # the coordinator: durable_keep_last
        self.ckpt.stats.persisted += 1


class TieredReader(StorageReader):
    """``dcp.load(state, storage_reader=TieredReader(ckpt))``: the newest step every rank can
    assemble from the tiers (module docstring). ``tier="durable"``: only the durable tier (e.g.
    to reshard onto another sharding with the same world size)."""

    def __init__(self, ckpt: TieredCheckpointer, *, tier: str | None = None) -> None:
        super().__init__()
        _check_ckpt(ckpt, "TieredReader")
        if tier not in (None, DURABLE):
            raise InvalidArgumentError(
                f"TieredReader(tier={tier!r}) is invalid: expected None (any tier) or 'durable'"
            )
        if tier == DURABLE and ckpt.durable is None:
            raise InvalidArgumentError(
                "TieredReader(tier='durable'): Tiers(durable=None) has no durable tier"
            )
        self.ckpt, self.tier = ckpt, tier
        self.reset()

    @property
    def checkpoint_id(self) -> str:
        return "tiers"

    def reset(self, checkpoint_id: Any = None) -> None:
        self._durable: StoreReader | None = None
        self._durable_md: Metadata | None = None
        self._local: SnapshotReader | None = None
        self._storage: dict[Any, str] = {}

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return False

    def read_metadata(self) -> Metadata:
        ck = self.ckpt
        ck._collect()
        self.reset()
        durable = ck.durable_steps() if ck.rank == 0 else []
        local_md: dict[str, Any] = {}

        def at_local(store: Store, name: str) -> None:
            r = open_snapshot(store, name)
            md, storage = _metadata_of(r, f"rank {ck.rank}'s local snapshot {name!r}")
            self._local, self._storage, self._durable = r, storage, None
            local_md.clear()
            local_md.update(md)

        def at_durable(step: int) -> None:
            d = ck.durable
            assert d is not None
            r = StoreReader(d.store, d.name(step))
            self._durable_md = r.read_metadata()
            self._durable, self._local = r, None

        if self.tier == DURABLE:
            report = ck._restore_durable_only(durable, at_durable)
        else:
            report = restore(ck._fg, ck.tiers, durable, at_local, at_durable, DCP_LAYOUT)
        ck.last_restore = report
        if report.step is None:
            raise SnapshotNotFoundError(
                f"TieredReader: no tier holds a step to restore (local {ck.tiers.root}, durable "
                f"{ck.tiers.durable}); refused: {list(report.refused) or 'nothing'}. On a fresh "
                "run, start from scratch"
            )
        if self._durable is not None:
            assert self._durable_md is not None
            return self._durable_md
        parts = ck._fg.all_gather(local_md) if ck._fg is not None else [local_md]
        return Metadata(state_dict_metadata=_union(parts))

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *a: Any, **k: Any):
        if self._durable is not None:
            assert self._durable_md is not None
            self._durable.set_up_storage_reader(self._durable_md, is_coordinator, *a, **k)

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        if self._durable is not None:
            return self._durable.prepare_local_plan(plan)
        missing = [r.storage_index for r in plan.items if r.storage_index not in self._storage]
        if missing:
            step = self.ckpt.last_restore.step if self.ckpt.last_restore else "?"
            raise StateMismatchError(
                f"TieredReader: rank {self.ckpt.rank}'s local snapshot of step {step} lacks "
                f"{len(missing)} piece(s) this load needs, e.g. {missing[0].fqn!r} at offsets "
                f"{list(missing[0].offset or ())}: it was saved with another sharding. Load "
                "with TieredReader(ckpt, tier='durable') to reshard from the durable tier"
            )
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans if self._durable is None else self._durable.prepare_global_plan(plans)

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> TorchFuture[None]:
        if self._durable is not None:
            return self._durable.read_data(plan, planner)
        r = self._local
        assert r is not None
        batch: list[tuple[Any, TensorEntry, Box]] = []
        pending = 0
        for req in plan.items:
            key = self._storage[req.storage_index]
            if req.type == LoadItemType.BYTE_IO:
                planner.load_bytes(req, io.BytesIO(r.get_tensor(key).numpy().tobytes()))
                continue
            box = (tuple(int(o) for o in req.storage_offsets), tuple(int(n) for n in req.lengths))
            e = r.entry(key)
            cost = math.prod(box[1]) * dtype_from_name(e.dtype).itemsize
            if batch and pending + cost > READ_BATCH_BYTES:
                self._deliver(r, batch, planner)
                batch, pending = [], 0
            batch.append((req, e, box))
            pending += cost
        if batch:
            self._deliver(r, batch, planner)
        fut: TorchFuture[None] = TorchFuture()
        fut.set_result(None)
        return fut

    @staticmethod
    def _deliver(r: Any, batch: list[tuple[Any, TensorEntry, Box]], planner: LoadPlanner) -> None:
        """Read the boxes of ``batch`` in one pass (a group chunk several small items share is
        read and checked once: per item it was read once per item), then hand each to DCP."""
        srcs = r.read_boxes([(e, box) for _, e, box in batch])  # only their bytes, checked
        for (req, _, box), src in zip(batch, srcs, strict=True):
            dest = planner.resolve_tensor(req).detach()
            if tuple(dest.shape) != box[1]:
                raise StateMismatchError(
                    f"TieredReader: DCP's target for {req.dest_index.fqn!r} has shape "
                    f"{tuple(dest.shape)}, the read item {box[1]}"
                )
            dest.copy_(src)
            planner.commit_tensor(req, dest)


def _union(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """DCP metadata of every rank's pieces: each tensor's chunks from all ranks, once each."""
    out: dict[str, Any] = {}
    for part in parts:
        for fqn, md in part.items():
            if not isinstance(md, TensorStorageMetadata):
                out.setdefault(fqn, md)
                continue
            cur = out.get(fqn)
            if cur is None:
                out[fqn] = TensorStorageMetadata(md.properties, md.size, list(md.chunks))
                continue
            seen = {tuple(c.offsets) for c in cur.chunks}
            cur.chunks.extend(c for c in md.chunks if tuple(c.offsets) not in seen)
    return out

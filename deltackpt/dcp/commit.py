"""DCP save steps 1 and 3 on the store: the checks before writing, and every rank's
``WriteResult`` -> one committed snapshot.

:func:`check_dcp_save` (every rank, in ``set_up_storage_writer``) runs the checks every save runs
(:func:`deltackpt.saving.commit.check_can_save`) and refuses an existing name as DCP's
``FileSystemWriter`` does. In ``StoreWriter.finish`` (the coordinator), each rank's first
``WriteResult`` carries a :class:`RankInfo` (its chunk records and byte counts), every result its
item's slices or inline value; :meth:`Written.gather` collects them by item kind and
:func:`snapshot_parts` turns them, with DCP's ``Metadata``, into
:class:`~deltackpt.saving.commit.SnapshotParts`: tensor entries (whole or sharded, global
offsets), the tree of values, the chunks this save wrote and DCP's facts under
``metadata["dcp"]``. :func:`commit_dcp` hands them to the one manifest builder
(:func:`deltackpt.saving.commit.commit`), as the local and distributed saves do.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass, field
from typing import Any

from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.storage import WriteResult as DcpWriteResult

from deltackpt.dcp.metadata import DCP_INFO_VERSION, DEFAULT_DCP_VERSION
from deltackpt.errors import CheckpointExistsError, SnapshotExistsError, StoreError
from deltackpt.format.dcp_values import DCP_KEY
from deltackpt.format.dtypes import dtype_name
from deltackpt.format.manifest import ChunkRecord, Shard, Slice, TensorEntry
from deltackpt.saving.commit import SnapshotParts, Timing, check_can_save, commit
from deltackpt.saving.write import WriteResult as WrittenChunks
from deltackpt.store.store import SnapshotInfo, Store

_Rec = tuple[str, int, int, int, str, int, "str | None", "str | None"]  # ChunkRecord as a tuple


def _json_path(path: Any) -> list[Any] | None:
    if isinstance(path, (tuple, list)) and all(type(p) in (str, int) for p in path):
        return list(path)
    return None


@dataclass
class RankInfo:
    """What the coordinator needs from each rank once (sent in its first WriteResult)."""

    rank: int
    records: dict[str, _Rec]  # every chunk this rank's items reference, with xor bases
    new: list[str]  # digests this rank wrote
    pack_bytes: int

    @staticmethod
    def of(rank: int, wr: WrittenChunks, index: dict[str, ChunkRecord]) -> RankInfo:
        """From this rank's :func:`~deltackpt.saving.write.write_chunks` result; ``index`` is
        the store's chunk index before the write (what is not in it is new)."""
        return RankInfo(
            rank=rank,
            records={
                d: (r.pack, r.offset, r.length, r.size, r.codec, r.itemsize, r.base, r.lin)
                for d, r in wr.records.items()
            },
            new=sorted(d for d in wr.records if d not in index),
            pack_bytes=wr.pack_bytes,
        )


Block = tuple[tuple[int, ...], tuple[int, ...], tuple[Slice, ...]]  # offsets, shape, slices


@dataclass
class Written:
    """Every rank's write results, gathered by item kind on the coordinator."""

    records: dict[str, ChunkRecord] = field(default_factory=dict)
    new: set[str] = field(default_factory=set)
    pack_bytes: int = 0
    world_size: int = 0
    blocks: dict[str, list[Block]] = field(default_factory=dict)  # tensor pieces by fqn
    values: dict[str, Any] = field(default_factory=dict)  # inline tree nodes by fqn
    byte_items: dict[str, tuple[Slice, ...]] = field(default_factory=dict)  # torch.save bytes

    @staticmethod
    def gather(results: list[list[DcpWriteResult]]) -> Written:
        w = Written(world_size=len(results))
        for rank_results in results:
            for wr in rank_results:
                sd = wr.storage_data
                info = sd.get("rank")
                if info is not None:
                    for d, r in info.records.items():
                        w.records.setdefault(d, ChunkRecord(*r))
                    w.new.update(info.new)
                    w.pack_bytes += info.pack_bytes
                fqn = wr.index.fqn
                if "value" in sd:
                    w.values[fqn] = sd["value"]
                elif sd.get("bytes"):
                    w.byte_items[fqn] = tuple(sd["slices"])
                else:
                    block = (tuple(sd["offsets"]), tuple(sd["shape"]), tuple(sd["slices"]))
                    w.blocks.setdefault(fqn, []).append(block)
        return w


def check_dcp_save(st: Store, name: str, *, overwrite: bool, is_coordinator: bool) -> None:
    """The checks every save runs before writing (store lock held; only the coordinator checks
    the name), with an existing name refused as :class:`CheckpointExistsError`: DCP's "Checkpoint
    already exists" ``RuntimeError`` and deltackpt's ``SnapshotExistsError``."""
    try:
        check_can_save(st, name, overwrite=overwrite, check_name=is_coordinator)
    except SnapshotExistsError:
        raise CheckpointExistsError(
            "Checkpoint already exists and self.overwrite=False. Store "
            f"{str(st.root)!r} already has a committed snapshot {name!r}; pick a "
            "new checkpoint_id, or pass overwrite=True (the default) to replace it "
            "atomically: the old one stays loadable until the new one commits"
        ) from None


def commit_dcp(
    st: Store,
    name: str,
    metadata: Metadata,
    results: list[list[DcpWriteResult]],
    user_metadata: dict[str, Any],
    sm: StorageMeta | None,
    timing: Timing,
    *,
    overwrite: bool,
    packs: tuple[str, ...] = (),
) -> SnapshotInfo:
    """Coordinator, after every rank's packs are durable: commit the snapshot of ``results``
    through the one manifest builder. ``packs`` (the coordinator's own) are removed if the
    commit certainly failed."""
    w = Written.gather(results)
    parts = snapshot_parts(name, metadata, w, user_metadata, sm)
    return commit(st, parts, w.records, timing, overwrite=overwrite, packs=packs)


def snapshot_parts(
    name: str,
    metadata: Metadata,
    w: Written,
    user_metadata: dict[str, Any],
    sm: StorageMeta | None,
) -> SnapshotParts:
    """A DCP save as :class:`SnapshotParts`: one entry per fqn of DCP's metadata (in its
    order), the chunks the ranks wrote, and DCP's own facts under ``metadata["dcp"]``."""
    tensors: list[TensorEntry] = []
    tree_items: list[list[Any]] = []
    bytes_paths: list[str] = []
    blocks, values, byte_items = dict(w.blocks), dict(w.values), dict(w.byte_items)
    for fqn, md in metadata.state_dict_metadata.items():
        if isinstance(md, TensorStorageMetadata):
            got = sorted(blocks.pop(fqn, []))
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
    extra = sorted(set(blocks) | set(values) | set(byte_items))
    if extra:
        raise StoreError(f"DCP save: ranks wrote items the metadata lacks: {extra[:5]}")

    dcp_info: dict[str, Any] = {
        "format": DCP_INFO_VERSION,
        "version": metadata.version or DEFAULT_DCP_VERSION,
        "world_size": w.world_size,
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
                stacklevel=4,  # StoreWriter.finish
            )
    if sm is not None:
        dcp_info["storage_meta"] = {
            "checkpoint_id": None if sm.checkpoint_id is None else os.fspath(sm.checkpoint_id),
            "save_id": sm.save_id,
            "modules": [str(x) for x in sm.modules],
        }
    return SnapshotParts(
        name=name,
        tree={"dict": tree_items},
        tensors=tuple(tensors),
        storages=(),
        written={d: w.records[d] for d in sorted(w.new)},
        pack_bytes=w.pack_bytes,
        metadata={**user_metadata, DCP_KEY: dcp_info},
    )

"""DCP save step 3 (coordinator, in ``StoreWriter.finish``): every rank's ``WriteResult`` -> one
manifest.

Each rank's first ``WriteResult`` carries a :class:`RankInfo` (its chunk records and byte
counts), every result its item's slices or inline value. :meth:`Written.gather` collects them by
item kind; :func:`build_manifest` is the one place that turns them, with DCP's ``Metadata``, into
the manifest the store commits: tensor entries (whole or sharded, global offsets), the tree of
values, the closure of chunk records, the statistics and DCP's facts under ``metadata["dcp"]``.
"""

from __future__ import annotations

import os
import time
import warnings
from dataclasses import dataclass, field
from typing import Any

from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.storage import WriteResult as DcpWriteResult

from deltackpt.dcp.metadata import DCP_INFO_VERSION, DEFAULT_DCP_VERSION
from deltackpt.errors import StoreError
from deltackpt.format.dcp_values import DCP_KEY
from deltackpt.format.dtypes import dtype_name
from deltackpt.format.manifest import ChunkRecord, Manifest, Shard, Slice, Stats, TensorEntry
from deltackpt.saving.write import WriteResult as WrittenChunks
from deltackpt.saving.write import closure

_Rec = tuple[str, int, int, int, str, int, "str | None"]  # ChunkRecord as a small tuple


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
    logical_bytes: int

    @staticmethod
    def of(rank: int, wr: WrittenChunks, index: dict[str, ChunkRecord], logical: int) -> RankInfo:
        """From this rank's :func:`~deltackpt.saving.write.write_chunks` result; ``index`` is
        the store's chunk index before the write (what is not in it is new)."""
        return RankInfo(
            rank=rank,
            records={
                d: (r.pack, r.offset, r.length, r.size, r.codec, r.itemsize, r.base)
                for d, r in wr.records.items()
            },
            new=sorted(d for d in wr.records if d not in index),
            pack_bytes=wr.pack_bytes,
            logical_bytes=logical,
        )


Block = tuple[tuple[int, ...], tuple[int, ...], tuple[Slice, ...]]  # offsets, shape, slices


@dataclass
class Written:
    """Every rank's write results, gathered by item kind on the coordinator."""

    records: dict[str, ChunkRecord] = field(default_factory=dict)
    new: set[str] = field(default_factory=set)
    pack_bytes: int = 0
    logical_bytes: int = 0
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
                    w.logical_bytes += info.logical_bytes
                fqn = wr.index.fqn
                if "value" in sd:
                    w.values[fqn] = sd["value"]
                elif sd.get("bytes"):
                    w.byte_items[fqn] = tuple(sd["slices"])
                else:
                    block = (tuple(sd["offsets"]), tuple(sd["shape"]), tuple(sd["slices"]))
                    w.blocks.setdefault(fqn, []).append(block)
        return w


def build_manifest(
    name: str,
    metadata: Metadata,
    w: Written,
    user_metadata: dict[str, Any],
    sm: StorageMeta | None,
    seconds: float,
) -> Manifest:
    """THE manifest of a DCP save: one entry per fqn of DCP's metadata (in its order), the chunk
    closure, the statistics, and DCP's own facts under ``metadata["dcp"]``."""
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

    needed = {d for e in tensors for d, _, _ in e.all_slices()}
    chunks = closure(set(needed), w.records, {})
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
                stacklevel=3,
            )
    if sm is not None:
        dcp_info["storage_meta"] = {
            "checkpoint_id": None if sm.checkpoint_id is None else os.fspath(sm.checkpoint_id),
            "save_id": sm.save_id,
            "modules": [str(x) for x in sm.modules],
        }
    stats = Stats(
        logical_bytes=w.logical_bytes,
        pack_bytes=w.pack_bytes,
        chunks_new=len(w.new & set(chunks)),
        chunks_reused=len(needed) - len(w.new & needed),
        seconds=seconds,
    )
    return Manifest(
        name=name,
        created_ns=time.time_ns(),
        tree={"dict": tree_items},
        tensors=tuple(tensors),
        storages=(),
        chunks=chunks,
        stats=stats,
        metadata={**user_metadata, DCP_KEY: dcp_info},
    )

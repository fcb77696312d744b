"""Manifest records (no I/O): what one committed snapshot holds and where its bytes live.

The JSON form is specified in ``docs/format.md`` and ``deltackpt/schema/manifest.schema.json``.
Serialisation is deterministic (sorted keys, no spaces) because tests pin its bytes and because two
saves of the same state must produce the same manifest up to names and times.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from deltackpt._hashing import DIGEST_NAME
from deltackpt.errors import StoreFormatError

MANIFEST_FORMAT = "deltackpt.manifest"
MANIFEST_VERSION = 1

Slice = tuple[str, int, int]  # (chunk digest, start in the chunk's raw bytes, length)


@dataclass(frozen=True)
class ChunkRecord:
    """Where a chunk's stored bytes live and how to turn them back into raw bytes."""

    pack: str
    offset: int
    length: int  # stored (encoded) bytes in the pack
    size: int  # raw bytes after decoding; the digest covers these
    codec: str = "raw"
    itemsize: int = 1  # byte-grouping width for the zstd/xor codecs
    base: str | None = None  # xor codec: digest of the chunk this one is a delta against

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "pack": self.pack,
            "offset": self.offset,
            "length": self.length,
            "size": self.size,
            "codec": self.codec,
        }
        if self.itemsize != 1:
            d["itemsize"] = self.itemsize
        if self.base is not None:
            d["base"] = self.base
        return d

    @staticmethod
    def from_json(d: dict[str, Any]) -> ChunkRecord:
        return ChunkRecord(
            pack=d["pack"],
            offset=int(d["offset"]),
            length=int(d["length"]),
            size=int(d["size"]),
            codec=d.get("codec", "raw"),
            itemsize=int(d.get("itemsize", 1)),
            base=d.get("base"),
        )


@dataclass(frozen=True)
class Shard:
    """One piece of a sharded tensor: its place in the global tensor and its bytes."""

    offsets: tuple[int, ...]
    shape: tuple[int, ...]
    data: tuple[Slice, ...]

    def to_json(self) -> dict[str, Any]:
        return {
            "offsets": list(self.offsets),
            "shape": list(self.shape),
            "data": [list(s) for s in self.data],
        }

    @staticmethod
    def from_json(d: dict[str, Any]) -> Shard:
        return Shard(tuple(d["offsets"]), tuple(d["shape"]), _slices(d["data"]))


@dataclass(frozen=True)
class StorageView:
    """A tensor that is a view of a storage shared with other tensors (tied weights)."""

    id: int
    offset: int  # byte offset into the storage
    stride: tuple[int, ...]


@dataclass(frozen=True)
class TensorEntry:
    """One tensor leaf of the state. Exactly one of data/shards/storage is set."""

    path: str
    dtype: str
    shape: tuple[int, ...]
    data: tuple[Slice, ...] | None = None
    shards: tuple[Shard, ...] | None = None
    storage: StorageView | None = None
    parameter: bool = False
    requires_grad: bool = False

    @property
    def nbytes(self) -> int:
        return sum(length for _, _, length in self.all_slices())

    def all_slices(self) -> list[Slice]:
        if self.data is not None:
            return list(self.data)
        if self.shards is not None:
            return [s for sh in self.shards for s in sh.data]
        return []

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {"path": self.path, "dtype": self.dtype, "shape": list(self.shape)}
        if self.data is not None:
            d["data"] = [list(s) for s in self.data]
        if self.shards is not None:
            d["shards"] = [s.to_json() for s in self.shards]
        if self.storage is not None:
            d["storage"] = {
                "id": self.storage.id,
                "offset": self.storage.offset,
                "stride": list(self.storage.stride),
            }
        if self.parameter:
            d["parameter"] = True
        if self.requires_grad:
            d["requires_grad"] = True
        return d

    @staticmethod
    def from_json(d: dict[str, Any]) -> TensorEntry:
        st = d.get("storage")
        return TensorEntry(
            path=d["path"],
            dtype=d["dtype"],
            shape=tuple(d["shape"]),
            data=_slices(d["data"]) if "data" in d else None,
            shards=tuple(Shard.from_json(s) for s in d["shards"]) if "shards" in d else None,
            storage=StorageView(int(st["id"]), int(st["offset"]), tuple(st["stride"]))
            if st
            else None,
            parameter=bool(d.get("parameter", False)),
            requires_grad=bool(d.get("requires_grad", False)),
        )


@dataclass(frozen=True)
class Stats:
    logical_bytes: int = 0
    pack_bytes: int = 0
    chunks_new: int = 0
    chunks_reused: int = 0
    seconds: float = 0.0
    blocked_seconds: float = 0.0
    waited_seconds: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return {
            "logical_bytes": self.logical_bytes,
            "pack_bytes": self.pack_bytes,
            "chunks_new": self.chunks_new,
            "chunks_reused": self.chunks_reused,
            "seconds": round(self.seconds, 6),
            "blocked_seconds": round(self.blocked_seconds, 6),
            "waited_seconds": round(self.waited_seconds, 6),
        }

    @staticmethod
    def from_json(d: dict[str, Any]) -> Stats:
        return Stats(**{k: d[k] for k in Stats.__dataclass_fields__ if k in d})


@dataclass(frozen=True)
class Manifest:
    name: str
    created_ns: int
    tree: Any
    tensors: tuple[TensorEntry, ...]
    storages: tuple[tuple[int, tuple[Slice, ...]], ...]  # (nbytes, data) per shared storage
    chunks: dict[str, ChunkRecord]
    stats: Stats = field(default_factory=Stats)
    metadata: dict[str, Any] = field(default_factory=dict)
    dist: dict[str, Any] | None = None  # distributed saves: world size, planning bytes

    def referenced_digests(self) -> set[str]:
        """Every chunk this snapshot needs, including the bases of delta chunks."""
        return set(self.chunks)

    def to_json_bytes(self) -> bytes:
        doc = {
            "format": MANIFEST_FORMAT,
            "version": MANIFEST_VERSION,
            "hash": DIGEST_NAME,
            "name": self.name,
            "created_ns": self.created_ns,
            "tree": self.tree,
            "tensors": [t.to_json() for t in self.tensors],
            "storages": [
                {"nbytes": n, "data": [list(s) for s in data]} for n, data in self.storages
            ],
            "chunks": {d: r.to_json() for d, r in self.chunks.items()},
            "stats": self.stats.to_json(),
            "metadata": self.metadata,
        }
        if self.dist is not None:
            doc["dist"] = self.dist
        return (
            json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()
            + b"\n"
        )

    @staticmethod
    def from_json_bytes(raw: bytes, where: str = "manifest") -> Manifest:
        try:
            doc = json.loads(raw)
        except ValueError as e:
            raise StoreFormatError(f"{where} is not valid JSON ({e}); the file is damaged") from e
        if not isinstance(doc, dict) or doc.get("format") != MANIFEST_FORMAT:
            raise StoreFormatError(
                f"{where} is not a deltackpt manifest (format={doc.get('format') if isinstance(doc, dict) else None!r})"
            )
        if doc.get("version") != MANIFEST_VERSION:
            raise StoreFormatError(
                f"{where} has manifest version {doc.get('version')!r}; this deltackpt reads "
                f"version {MANIFEST_VERSION}. Upgrade deltackpt to read it"
            )
        if doc.get("hash") != DIGEST_NAME:
            raise StoreFormatError(
                f"{where} uses hash {doc.get('hash')!r}; expected {DIGEST_NAME!r}"
            )
        try:
            return Manifest(
                name=doc["name"],
                created_ns=int(doc["created_ns"]),
                tree=doc["tree"],
                tensors=tuple(TensorEntry.from_json(t) for t in doc["tensors"]),
                storages=tuple((int(s["nbytes"]), _slices(s["data"])) for s in doc["storages"]),
                chunks={d: ChunkRecord.from_json(r) for d, r in doc["chunks"].items()},
                stats=Stats.from_json(doc.get("stats", {})),
                metadata=doc.get("metadata", {}),
                dist=doc.get("dist"),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise StoreFormatError(f"{where} is missing or has a malformed field: {e!r}") from e


def _slices(raw: list[list[Any]]) -> tuple[Slice, ...]:
    return tuple((str(d), int(s), int(n)) for d, s, n in raw)

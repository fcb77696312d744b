"""Manifest records (no I/O): what one committed snapshot holds and where its bytes live.

The JSON form is specified in ``docs/format.md`` and ``deltackpt/format/schema/manifest.schema.json``.
Serialisation is deterministic (sorted keys, no spaces) because tests pin its bytes and because two
saves of the same state must produce the same manifest up to names and times.

A manifest on disk is untrusted input. Parsing here is strict about types (an int field must be a
JSON integer, never a string or a bool) and version 2 manifests carry ``digest``, the xxh3-128 of
the canonical bytes of the document without that field, checked on every read: it detects damage
(a flipped digit in a shape or slice), not attacks. Bounds, references and coverage are checked
by :mod:`deltackpt.format.validate` before anything is allocated.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

import xxhash

from deltackpt.errors import ManifestError, StoreFormatError
from deltackpt.format.hashing import DIGEST_NAME

MANIFEST_FORMAT = "deltackpt.manifest"
MANIFEST_VERSION = 2  # 2: adds "digest"; version 1 manifests (no digest) are still read
READ_VERSIONS = (1, 2)
DIGEST_RE = re.compile(r"^[0-9a-f]{32}$")
PACK_ID_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # a pack file name is "<id>.pack" in packs/

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
    # the raw bytes' linear digest (format/lindigest.py), where the save computed one: what a
    # catch-up checks a patched chunk against at the cost of the patch
    lin: str | None = None

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
        if self.lin is not None:
            d["lin"] = self.lin
        return d

    @staticmethod
    def from_json(d: Any, where: str = "chunk") -> ChunkRecord:
        _obj(d, where, {"pack", "offset", "length", "size", "codec", "itemsize", "base", "lin"})
        pack = _str(d.get("pack"), f"{where}.pack")
        if not PACK_ID_RE.match(pack):
            raise ManifestError(
                f"{where}.pack is {pack[:80]!r}: a pack id is 1-64 characters of letters, digits, "
                "'_' and '-' (no path separators); the manifest is damaged or hostile",
                field=f"{where}.pack",
            )
        base = d.get("base")
        if base is not None:
            _digest(base, f"{where}.base")
        lin = d.get("lin")
        if lin is not None:
            _digest(lin, f"{where}.lin")
        return ChunkRecord(
            pack=pack,
            offset=_int(d.get("offset"), f"{where}.offset"),
            length=_int(d.get("length"), f"{where}.length"),
            size=_int(d.get("size"), f"{where}.size"),
            codec=_str(d.get("codec", "raw"), f"{where}.codec"),
            itemsize=_int(d.get("itemsize", 1), f"{where}.itemsize", lo=1, hi=64),
            base=base,
            lin=lin,
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
    def from_json(d: Any, where: str = "shard") -> Shard:
        _obj(d, where, {"offsets", "shape", "data"})
        return Shard(
            _ints(d.get("offsets"), f"{where}.offsets"),
            _ints(d.get("shape"), f"{where}.shape"),
            _slices(d.get("data"), f"{where}.data"),
        )


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
    def from_json(d: Any, where: str = "tensor") -> TensorEntry:
        _obj(
            d,
            where,
            {"path", "dtype", "shape", "data", "shards", "storage", "parameter", "requires_grad"},
        )
        present = [k for k in ("data", "shards", "storage") if k in d]
        if len(present) != 1:
            raise ManifestError(
                f"{where} must have exactly one of data/shards/storage, has {present}",
                field=where,
            )
        storage = None
        if "storage" in d:
            st = d["storage"]
            _obj(st, f"{where}.storage", {"id", "offset", "stride"})
            storage = StorageView(
                _int(st.get("id"), f"{where}.storage.id"),
                _int(st.get("offset"), f"{where}.storage.offset"),
                _ints(st.get("stride"), f"{where}.storage.stride"),
            )
        shards = None
        if "shards" in d:
            raw = _list(d["shards"], f"{where}.shards")
            shards = tuple(Shard.from_json(s, f"{where}.shards[{i}]") for i, s in enumerate(raw))
        return TensorEntry(
            path=_str(d.get("path"), f"{where}.path"),
            dtype=_str(d.get("dtype"), f"{where}.dtype"),
            shape=_ints(d.get("shape"), f"{where}.shape"),
            data=_slices(d["data"], f"{where}.data") if "data" in d else None,
            shards=shards,
            storage=storage,
            parameter=_bool(d.get("parameter", False), f"{where}.parameter"),
            requires_grad=_bool(d.get("requires_grad", False), f"{where}.requires_grad"),
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
    def from_json(d: Any, where: str = "stats") -> Stats:
        _obj(d, where, None)
        out: dict[str, Any] = {}
        for k, f in Stats.__dataclass_fields__.items():
            if k not in d:
                continue
            v = d[k]
            if f.type == "int":
                out[k] = _int(v, f"{where}.{k}")
            elif isinstance(v, (int, float)) and not isinstance(v, bool):
                out[k] = float(v)
            else:
                raise ManifestError(f"{where}.{k} must be a number, got {v!r:.40}", field=k)
        return Stats(**out)


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
    # False for a version 1 manifest read from disk (written before manifests had a digest)
    has_digest: bool = True

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
        doc["digest"] = document_digest(doc)
        return _canonical(doc) + b"\n"

    @staticmethod
    def from_json_bytes(raw: bytes, where: str = "manifest") -> Manifest:
        """Parse and integrity-check a manifest; raise :class:`ManifestError` naming the field.

        Only the form is checked here (types, digest); references and bounds are checked by
        :func:`deltackpt.format.validate.validate_manifest`, which needs the store's chunk size."""
        try:
            doc = json.loads(raw, parse_constant=_no_constant)
        except (ValueError, RecursionError) as e:
            raise ManifestError(f"{where} is not valid JSON ({e}); the file is damaged") from e
        if not isinstance(doc, dict) or doc.get("format") != MANIFEST_FORMAT:
            found = doc.get("format") if isinstance(doc, dict) else type(doc).__name__
            raise ManifestError(f"{where} is not a deltackpt manifest (format={found!r:.60})")
        version = doc.get("version")
        if type(version) is not int:  # not a format a writer could name: damaged
            raise ManifestError(
                f"{where} has manifest version {version!r:.40}, not an integer; the file is "
                "damaged",
                field="version",
            )
        if version not in READ_VERSIONS:  # a newer writer's format
            raise StoreFormatError(
                f"{where} has manifest version {version!r:.40}; this deltackpt reads versions "
                f"{list(READ_VERSIONS)}. Upgrade deltackpt to read it"
            )
        if doc.get("hash") != DIGEST_NAME:
            raise ManifestError(
                f"{where} uses hash {doc.get('hash')!r:.40}; expected {DIGEST_NAME!r}"
            )
        has_digest = version >= 2
        if has_digest:
            stored = doc.pop("digest", None)
            try:
                actual = document_digest(doc)
            except RecursionError:
                raise ManifestError(f"{where} nests too deep to be a manifest") from None
            if stored != actual:
                raise ManifestError(
                    f"{where} does not match its digest (stored {stored!r:.40}, computed "
                    f"{actual}): the file was damaged after it was written. Delete the snapshot "
                    "or restore the file from a copy",
                    field="digest",
                )
        _obj(
            doc,
            where,
            {"format", "version", "hash", "name", "created_ns", "tree", "tensors", "storages",
             "chunks", "stats", "metadata", "dist"},
        )  # fmt: skip
        tensors = _list(doc.get("tensors"), "tensors")
        storages = _list(doc.get("storages"), "storages")
        chunks = doc.get("chunks")
        _obj(chunks, "chunks", None)
        for i, s_ in enumerate(storages):
            _obj(s_, f"storages[{i}]", {"nbytes", "data"})
        metadata = doc.get("metadata", {})
        _obj(metadata, "metadata", None)
        dist = doc.get("dist")
        if dist is not None:
            _obj(dist, "dist", None)
            for k in ("world_size", "plan_bytes"):
                if k in dist:
                    _int(dist[k], f"dist.{k}")
        return Manifest(
            name=_str(doc.get("name"), "name"),
            created_ns=_int(doc.get("created_ns"), "created_ns"),
            tree=doc.get("tree"),
            tensors=tuple(TensorEntry.from_json(t, f"tensors[{i}]") for i, t in enumerate(tensors)),
            storages=tuple(
                (
                    _int(s_.get("nbytes"), f"storages[{i}].nbytes"),
                    _slices(s_.get("data"), f"storages[{i}].data"),
                )
                for i, s_ in enumerate(storages)
            ),
            chunks={
                _digest(d, "chunks key"): ChunkRecord.from_json(r, f"chunks[{d}]")
                for d, r in chunks.items()
            },
            stats=Stats.from_json(doc.get("stats", {})),
            metadata=metadata,
            dist=dist,
            has_digest=has_digest,
        )


def _canonical(doc: dict[str, Any]) -> bytes:
    return json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def document_digest(doc: dict[str, Any]) -> str:
    """xxh3-128 of the canonical bytes of ``doc`` without its ``digest`` field."""
    return xxhash.xxh3_128_hexdigest(_canonical({k: v for k, v in doc.items() if k != "digest"}))


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")  # json.loads would accept NaN/Infinity otherwise


# Strict readers for untrusted JSON: the right type or a ManifestError naming the field.
_MAX_INT = (1 << 63) - 1


def _bad(field: str, want: str, v: Any) -> ManifestError:
    return ManifestError(
        f"manifest field {field} must be {want}, got {v!r:.60}; the manifest is damaged",
        field=field,
    )


def _obj(v: Any, field: str, keys: set[str] | None) -> None:
    if not isinstance(v, dict):
        raise _bad(field, "an object", v)
    if keys is not None and not keys.issuperset(v):
        raise _bad(field, f"an object with keys from {sorted(keys)}", sorted(set(v) - keys))


def _list(v: Any, field: str) -> list[Any]:
    if not isinstance(v, list):
        raise _bad(field, "a list", v)
    return v


def _int(v: Any, field: str, lo: int = 0, hi: int = _MAX_INT) -> int:
    if type(v) is not int or not lo <= v <= hi:
        raise _bad(field, f"an integer in [{lo}, {hi}]", v)
    return v


def _ints(v: Any, field: str) -> tuple[int, ...]:
    if not isinstance(v, list) or len(v) > 64:
        raise _bad(field, "a list of at most 64 integers", v)
    return tuple(_int(x, f"{field}[{i}]") for i, x in enumerate(v))


def _str(v: Any, field: str) -> str:
    if not isinstance(v, str):
        raise _bad(field, "a string", v)
    return v


def _bool(v: Any, field: str) -> bool:
    if not isinstance(v, bool):
        raise _bad(field, "true or false", v)
    return v


def _digest(v: Any, field: str) -> str:
    if not isinstance(v, str) or not DIGEST_RE.match(v):
        raise _bad(field, "a digest (32 lowercase hex digits)", v)
    return v


def _slices(raw: Any, field: str) -> tuple[Slice, ...]:
    out = []
    for i, sl in enumerate(_list(raw, field)):
        if not isinstance(sl, list) or len(sl) != 3:
            raise _bad(f"{field}[{i}]", "[digest, start, length]", sl)
        out.append(
            (
                _digest(sl[0], f"{field}[{i}][0]"),
                _int(sl[1], f"{field}[{i}][1]"),
                _int(sl[2], f"{field}[{i}][2]"),
            )
        )
    return tuple(out)

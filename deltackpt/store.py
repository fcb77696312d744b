"""The store: a directory of snapshots sharing content-addressed chunks in pack files.

::

    STORE.json                      format version, hash and chunking parameters; written once
    STORE.lock                      flock: saves hold it shared, gc exclusive
    snapshots/<name>/MANIFEST.json  one committed snapshot; its presence *is* the commit
    packs/<id>.pack                 chunk bytes, appended by saves, never modified in place
    tmp/                            in-flight manifests; never read; swept by gc

Manifests are the only source of truth: the chunk index used for dedupe is the union of the chunk
tables of committed manifests, so there is no second index that could disagree with them.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from deltackpt._fsutil import fsync_dir, publish, write_durable
from deltackpt._hashing import DIGEST_NAME
from deltackpt.errors import (
    InvalidNameError,
    SnapshotNotFoundError,
    StoreError,
    StoreFormatError,
)
from deltackpt.manifest import ChunkRecord, Manifest

STORE_FORMAT = "deltackpt.store"
STORE_VERSION = 1
DEFAULT_CHUNK_BYTES = 4 << 20
DEFAULT_SMALL_BYTES = 1 << 20  # tensors below this are grouped into shared chunks
PACK_ALIGN = 4096  # chunk payloads start at multiples of this (O_DIRECT-friendly)
PACK_MAGIC = b"DCKPACK\x01"
LATEST = "latest"
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._=+@-]{0,199}$")


@dataclass(frozen=True)
class SnapshotInfo:
    """What one committed snapshot holds and what its save cost."""

    name: str
    created: datetime
    logical_bytes: int  # tensor bytes in the state
    bytes_written: int  # what the save added to the store: pack bytes plus the manifest
    chunks_new: int
    chunks_reused: int
    seconds: float  # wall time of the save, from call to commit
    tensors: int = 0
    blocked_seconds: float = 0.0  # how long the caller was blocked (async saves: staging)
    waited_seconds: float = 0.0  # back-pressure: time spent waiting for the previous save
    metadata: dict[str, Any] = field(default_factory=dict)
    world_size: int = 1  # ranks that wrote the snapshot
    plan_bytes: int = 0  # distributed saves: bytes of plan messages gathered on rank 0

    @staticmethod
    def from_manifest(m: Manifest, manifest_bytes: int) -> SnapshotInfo:
        s = m.stats
        return SnapshotInfo(
            name=m.name,
            created=datetime.fromtimestamp(m.created_ns / 1e9, tz=timezone.utc),
            logical_bytes=s.logical_bytes,
            bytes_written=s.pack_bytes + manifest_bytes,
            chunks_new=s.chunks_new,
            chunks_reused=s.chunks_reused,
            seconds=s.seconds,
            tensors=len(m.tensors),
            blocked_seconds=s.blocked_seconds,
            waited_seconds=s.waited_seconds,
            metadata=dict(m.metadata),
            world_size=int((m.dist or {}).get("world_size", 1)),
            plan_bytes=int((m.dist or {}).get("plan_bytes", 0)),
        )


def validate_name(name: str) -> None:
    if not isinstance(name, str) or not _NAME_RE.match(name) or name == LATEST or ".." in name:
        raise InvalidNameError(
            f"snapshot name {name!r} is not allowed: use 1-200 characters from letters, digits "
            "and ._=+@- starting with a letter or digit, not 'latest' and without '..' "
            "(e.g. 'step-100')"
        )


class Store:
    """A local store directory. Create or open one with :func:`open_store`."""

    def __init__(self, root: Path, config: dict[str, Any]) -> None:
        self.root = root
        self.chunk_bytes = int(config["chunk_bytes"])
        self.small_bytes = int(config["small_bytes"])
        self._cache: dict[str, tuple[tuple[int, int, int], Manifest]] = {}
        self._cache_lock = threading.Lock()
        # Raw bytes of the chunks this process saved last, per tensor key: the bases of xor
        # deltas (see deltackpt._save). Lives with the Store so repeated saves share it.
        self.delta_refs: dict[str, Any] = {}

    def __repr__(self) -> str:
        return f"Store({str(self.root)!r})"

    # paths
    @property
    def snapshots_dir(self) -> Path:
        return self.root / "snapshots"

    @property
    def packs_dir(self) -> Path:
        return self.root / "packs"

    @property
    def tmp_dir(self) -> Path:
        return self.root / "tmp"

    @property
    def lock_path(self) -> Path:
        return self.root / "STORE.lock"

    def pack_path(self, pack: str) -> Path:
        return self.packs_dir / f"{pack}.pack"

    def manifest_path(self, name: str) -> Path:
        return self.snapshots_dir / name / "MANIFEST.json"

    # snapshots
    def names(self) -> list[str]:
        """Names of committed snapshots, oldest first (by commit time, then name)."""
        ms = self.manifests()
        return [m.name for m in ms]

    def manifests(self) -> list[Manifest]:
        out = []
        try:
            entries = list(os.scandir(self.snapshots_dir))
        except FileNotFoundError:
            return []
        for e in entries:
            if not e.is_dir():
                continue
            m = self._read_cached(e.name)
            if m is not None:
                out.append(m)
        out.sort(key=lambda m: (m.created_ns, m.name))
        return out

    def has(self, name: str) -> bool:
        return self.manifest_path(name).exists()

    def resolve(self, name: str) -> str:
        if name == LATEST:
            names = self.names()
            if not names:
                raise SnapshotNotFoundError(
                    f"store {str(self.root)!r} has no committed snapshot, so 'latest' does not "
                    "exist; save one first (a crashed save never counts)"
                )
            return names[-1]
        validate_name(name)
        return name

    def manifest(self, name: str) -> Manifest:
        name = self.resolve(name)
        m = self._read_cached(name)
        if m is None:
            have = self.names()
            raise SnapshotNotFoundError(
                f"store {str(self.root)!r} has no committed snapshot {name!r}; it has "
                f"{have[-5:] if have else 'none'}{' (last 5)' if len(have) > 5 else ''}. "
                "Check the name with `deltackpt ls`"
            )
        return m

    def info(self, name: str) -> SnapshotInfo:
        m = self.manifest(name)
        return SnapshotInfo.from_manifest(m, self.manifest_path(m.name).stat().st_size)

    def _read_cached(self, name: str) -> Manifest | None:
        path = self.manifest_path(name)
        try:
            st = path.stat()
        except FileNotFoundError:
            return None
        key = (st.st_ino, st.st_mtime_ns, st.st_size)
        with self._cache_lock:
            hit = self._cache.get(name)
        if hit is not None and hit[0] == key:
            return hit[1]
        try:
            raw = path.read_bytes()
        except FileNotFoundError:  # deleted between stat and read
            return None
        m = Manifest.from_json_bytes(raw, where=str(path))
        with self._cache_lock:
            self._cache[name] = (key, m)
        return m

    def chunk_index(self) -> dict[str, ChunkRecord]:
        """digest -> where it lives, over all committed snapshots (dedupe on save)."""
        index: dict[str, ChunkRecord] = {}
        for m in self.manifests():
            index.update(m.chunks)
        return index

    def write_manifest(self, m: Manifest, overwrite: bool) -> int:
        """Commit ``m``: durable temp file, then atomic publish. Returns the manifest's size."""
        data = m.to_json_bytes()
        self.tmp_dir.mkdir(exist_ok=True)
        tmp = self.tmp_dir / f"{m.name}.{os.getpid()}.{time.monotonic_ns()}.json"
        write_durable(tmp, data)
        d = self.snapshots_dir / m.name
        d.mkdir(parents=True, exist_ok=True)
        # Always: a crash between an earlier mkdir and its fsync leaves the entry undurable.
        fsync_dir(self.snapshots_dir)
        publish(tmp, self.manifest_path(m.name), overwrite=overwrite)
        return len(data)


_STORES: dict[Path, Store] = {}
_STORES_LOCK = threading.Lock()


def open_store(
    path: str | os.PathLike[str] | Store,
    *,
    create: bool = True,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    small_bytes: int | None = None,
) -> Store:
    """Open the store at ``path``, creating it if missing (unless ``create=False``).

    ``chunk_bytes`` and ``small_bytes`` apply only when the store is created; afterwards they are
    read from STORE.json so every save of the store chunks alike.

    >>> store = open_store("ckpts")            # doctest: +SKIP
    """
    if isinstance(path, Store):
        return path
    root = Path(path).expanduser().absolute()
    with _STORES_LOCK:
        cached = _STORES.get(root)
        if cached is not None and (root / "STORE.json").exists():
            return cached
        cfg_path = root / "STORE.json"
        if not cfg_path.exists():
            if not create:
                raise StoreError(
                    f"no deltackpt store at {str(root)!r} (STORE.json missing); pass "
                    "create=True or check the path"
                )
            if root.exists() and any(root.iterdir()) and not (root / "snapshots").exists():
                raise StoreError(
                    f"{str(root)!r} exists, is not empty and is not a deltackpt store; "
                    "use an empty or new directory"
                )
            if small_bytes is None:
                small_bytes = min(DEFAULT_SMALL_BYTES, chunk_bytes // 4)
            _create(root, chunk_bytes, small_bytes)
        cfg = _read_config(cfg_path)
        store = Store(root, cfg)
        _STORES[root] = store
        return store


def _create(root: Path, chunk_bytes: int, small_bytes: int) -> None:
    if chunk_bytes < PACK_ALIGN or chunk_bytes % PACK_ALIGN:
        raise ValueError(f"chunk_bytes={chunk_bytes} must be a positive multiple of {PACK_ALIGN}")
    if not 0 <= small_bytes <= chunk_bytes:
        raise ValueError(
            f"small_bytes={small_bytes} must be between 0 and chunk_bytes={chunk_bytes}"
        )
    root.mkdir(parents=True, exist_ok=True)
    for sub in ("snapshots", "packs", "tmp"):
        (root / sub).mkdir(exist_ok=True)
    cfg = {
        "format": STORE_FORMAT,
        "version": STORE_VERSION,
        "hash": DIGEST_NAME,
        "chunk_bytes": chunk_bytes,
        "small_bytes": small_bytes,
        "pack_align": PACK_ALIGN,
    }
    tmp = root / "tmp" / f"STORE.json.{os.getpid()}.{time.monotonic_ns()}"
    write_durable(tmp, json.dumps(cfg, sort_keys=True, indent=1).encode() + b"\n")
    with contextlib.suppress(FileExistsError):  # another process created it first: read theirs
        publish(tmp, root / "STORE.json")
    fsync_dir(root)


def _read_config(path: Path) -> dict[str, Any]:
    try:
        cfg = json.loads(path.read_bytes())
    except ValueError as e:
        raise StoreFormatError(f"{path} is not valid JSON ({e}); the store is damaged") from e
    if cfg.get("format") != STORE_FORMAT or cfg.get("version") != STORE_VERSION:
        raise StoreFormatError(
            f"{path} says format={cfg.get('format')!r} version={cfg.get('version')!r}; this "
            f"deltackpt reads {STORE_FORMAT!r} version {STORE_VERSION}"
        )
    if cfg.get("hash") != DIGEST_NAME:
        raise StoreFormatError(f"{path} uses hash {cfg.get('hash')!r}; expected {DIGEST_NAME!r}")
    return cfg

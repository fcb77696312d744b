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
import errno
import json
import os
import re
import shutil
import stat
import threading
import time
import urllib.parse
import warnings
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from deltackpt.errors import (
    DamagedSnapshotWarning,
    DeltackptError,
    InvalidArgumentError,
    InvalidNameError,
    ManifestError,
    SnapshotNotFoundError,
    StoreError,
    StoreFormatError,
    StoreIOError,
    UnsafePathError,
    UnsupportedURLError,
)
from deltackpt.format.hashing import DIGEST_NAME
from deltackpt.format.manifest import ChunkRecord, Manifest
from deltackpt.format.validate import validate_manifest
from deltackpt.store.durable import fsync_dir, open_dir, publish, write_durable

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


@dataclass(frozen=True)
class Damaged:
    """A committed-looking snapshot that cannot be used: its directory name and why."""

    name: str
    reason: str


MAX_MANIFEST_BYTES = 1 << 31  # a larger MANIFEST.json is refused before it is read


def check_dir(path: Path) -> None:
    """Refuse a store sub-directory (``snapshots/``, ``packs/``, ``tmp/``) that is a symlink."""
    st = os.lstat(path)  # FileNotFoundError passes through: callers treat it as "empty"
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise UnsafePathError(
            f"{path} is {'a symlink' if stat.S_ISLNK(st.st_mode) else 'not a directory'}; "
            "deltackpt never follows links inside a store. Replace it with a real directory"
        )


def _read_manifest_file(
    snapshots: Path, name: str, known: tuple[int, int, int] | None
) -> tuple[bytes | None, tuple[int, int, int]]:
    """Bytes of ``snapshots/<name>/MANIFEST.json`` and its (inode, mtime, size), opened without
    following symlinks at any level; the bytes are None when the key equals ``known`` (the
    caller's cached copy is current: every save and every ``latest`` scans all manifests, so a
    hit must not read them). Raises FileNotFoundError when there is none."""
    fds: list[int] = []
    try:
        try:
            fds.append(open_dir(snapshots))
            fds.append(open_dir(name, dir_fd=fds[-1]))
            fds.append(os.open("MANIFEST.json", os.O_RDONLY | os.O_NOFOLLOW, dir_fd=fds[-1]))
        except OSError as e:
            # O_NOFOLLOW on a link gives ELOOP, or ENOTDIR together with O_DIRECTORY
            if e.errno in (errno.ELOOP, errno.ENOTDIR) and not _is_link(snapshots, name):
                raise FileNotFoundError(name) from None  # a stray file: not a snapshot
            if e.errno in (errno.ELOOP, errno.ENOTDIR):
                raise UnsafePathError(
                    f"{snapshots / name} or its MANIFEST.json is a symlink; deltackpt never "
                    "follows links inside a store"
                ) from None
            if isinstance(e, FileNotFoundError):
                raise
            raise StoreIOError(
                e.errno, f"cannot open {snapshots / name / 'MANIFEST.json'}: {e.strerror}"
            ) from e
        fd = fds[-1]
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UnsafePathError(f"{snapshots / name / 'MANIFEST.json'} is not a regular file")
        if st.st_size > MAX_MANIFEST_BYTES:
            raise ManifestError(
                f"{snapshots / name / 'MANIFEST.json'} is {st.st_size} bytes, over the "
                f"{MAX_MANIFEST_BYTES} a manifest may have",
                snapshot=name,
            )
        key = (st.st_ino, st.st_mtime_ns, st.st_size)
        if key == known:
            return None, key
        chunks = []
        while True:
            b = os.read(fd, 1 << 20)
            if not b:
                break
            chunks.append(b)
        return b"".join(chunks), key
    finally:
        for fd in fds:
            os.close(fd)


def _is_link(snapshots: Path, name: str) -> bool:
    for p in (snapshots, snapshots / name, snapshots / name / "MANIFEST.json"):
        with contextlib.suppress(OSError):
            if stat.S_ISLNK(os.lstat(p).st_mode):
                return True
    return False


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
        # deltas (see deltackpt.saving.write). Lives with the Store so repeated saves share it.
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
        """Names of committed, readable snapshots, oldest first (by commit time, then name)."""
        return [m.name for m in self.manifests()]

    def manifests(self) -> list[Manifest]:
        """Readable committed manifests, oldest first. Damaged ones are skipped (see
        :meth:`scan`): one bad manifest never takes the rest of the store down."""
        return self.scan()[0]

    def damaged(self) -> list[Damaged]:
        """Entries under ``snapshots/`` that look committed but cannot be used, with why."""
        return self.scan()[1]

    def scan(self) -> tuple[list[Manifest], list[Damaged]]:
        """Every committed snapshot: the readable manifests (oldest first) and the damaged ones.

        Symlinks are never followed, names that a save could not have written are refused, and a
        directory without ``MANIFEST.json`` is a crashed save's leftover (not listed)."""
        good: list[Manifest] = []
        bad: list[Damaged] = []
        try:
            check_dir(self.snapshots_dir)
            entries = list(os.scandir(self.snapshots_dir))
        except FileNotFoundError:
            return [], []
        for e in entries:
            if e.is_symlink():
                bad.append(
                    Damaged(e.name, "is a symlink; deltackpt never follows links in a store")
                )
                continue
            if not e.is_dir(follow_symlinks=False):
                continue  # a stray file: not a snapshot
            try:
                validate_name(e.name)
            except InvalidNameError:
                bad.append(Damaged(e.name, "is not a name a save could have written"))
                continue
            try:
                m = self._read_cached(e.name)
            except (ManifestError, UnsafePathError, StoreIOError) as err:
                bad.append(Damaged(e.name, str(err)))
                continue
            if m is not None:
                good.append(m)
        good.sort(key=lambda m: (m.created_ns, m.name))
        bad.sort(key=lambda d: d.name)
        return good, bad

    def has(self, name: str) -> bool:
        """Whether ``snapshots/<name>/MANIFEST.json`` exists (readable or not: reading it is
        where links are refused)."""
        validate_name(name)
        try:
            os.lstat(self.manifest_path(name))
        except (FileNotFoundError, NotADirectoryError):
            return False
        return True

    def resolve(self, name: str) -> str:
        if name == LATEST:
            good, damaged = self.scan()
            names = [m.name for m in good]
            if damaged:  # one of them may have been the newest: say what 'latest' skipped
                warnings.warn(
                    f"store {str(self.root)!r}: 'latest' skips {len(damaged)} damaged "
                    f"snapshot(s) ({', '.join(d.name for d in damaged[:5])}); run `deltackpt "
                    "verify` for the details",
                    DamagedSnapshotWarning,
                    stacklevel=3,
                )
            if not names:
                raise SnapshotNotFoundError(
                    f"store {str(self.root)!r} has no committed snapshot (none readable), so 'latest' "
                    "does not exist; save one first (a crashed save never counts)"
                    + (f". Damaged: {[d.name for d in damaged[:5]]}" if damaged else "")
                )
            return names[-1]
        validate_name(name)
        return name

    def manifest(self, name: str) -> Manifest:
        """The manifest of ``name`` (or ``"latest"``, the newest *readable* one).

        Raises :class:`SnapshotNotFoundError` when there is none, and :class:`ManifestError` or
        :class:`UnsafePathError` when it exists but is damaged or unsafe."""
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
        return SnapshotInfo.from_manifest(m, self.manifest_size(m.name))

    def manifest_size(self, name: str) -> int:
        with self._cache_lock:
            hit = self._cache.get(name)
        return hit[0][2] if hit is not None else 0

    def _read_cached(self, name: str) -> Manifest | None:
        """Read, integrity-check and validate ``snapshots/<name>/MANIFEST.json``; None if absent.

        Opened relative to directory descriptors with O_NOFOLLOW at every level, so a symlink
        (or one swapped in while we read) is refused, never followed."""
        with self._cache_lock:
            hit = self._cache.get(name)
        try:
            raw, key = _read_manifest_file(self.snapshots_dir, name, hit[0] if hit else None)
        except FileNotFoundError:
            return None
        if raw is None:
            assert hit is not None  # only returned for the key we passed
            return hit[1]
        where = f"snapshot {name!r} ({self.manifest_path(name)})"
        try:
            m = Manifest.from_json_bytes(raw, where=where)
        except ManifestError as e:
            if e.snapshot is not None:
                raise
            msg = str(e) if where in str(e) else f"{where}: {e}"
            raise ManifestError(msg, snapshot=name, field=e.field) from e
        if m.name != name:
            raise ManifestError(
                f"{where} says its name is {m.name[:80]!r}; a manifest must live in the "
                "directory of its own name (was it copied or renamed by hand?)",
                snapshot=name,
                field="name",
            )
        validate_manifest(m, self.chunk_bytes, where)
        with self._cache_lock:
            self._cache[name] = (key, m)
        return m

    def chunk_index(self) -> dict[str, ChunkRecord]:
        """digest -> where it lives, over all committed snapshots (dedupe on save)."""
        index: dict[str, ChunkRecord] = {}
        for m in self.manifests():
            index.update(m.chunks)
        return index

    def remove_snapshot(self, name: str) -> None:
        """Un-commit ``name``: unlink its manifest (durably), then remove its directory.

        Works on a damaged manifest (it is never parsed). Everything is opened relative to
        directory descriptors with O_NOFOLLOW: a ``snapshots/<name>`` that is a symlink raises
        :class:`UnsafePathError` and nothing outside the store is touched."""
        validate_name(name)
        check_dir(self.snapshots_dir)
        snap_fd = open_dir(self.snapshots_dir)
        try:
            try:
                fd = open_dir(name, dir_fd=snap_fd)
            except OSError as e:
                if e.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise UnsafePathError(
                        f"{self.snapshots_dir / name} is not a real directory (a symlink?); "
                        "deltackpt does not follow it. Remove it by hand if it is yours"
                    ) from None
                raise
            try:
                os.unlink("MANIFEST.json", dir_fd=fd)
                os.fsync(fd)
            finally:
                os.close(fd)
            # rmtree with dir_fd never follows symlinks inside the tree
            shutil.rmtree(name, dir_fd=snap_fd, ignore_errors=True)
            os.fsync(snap_fd)
        finally:
            os.close(snap_fd)
        with self._cache_lock:
            self._cache.pop(name, None)

    def write_manifest(self, m: Manifest, overwrite: bool) -> int:
        """Commit ``m``: durable temp file, then atomic publish. Returns the manifest's size."""
        data = m.to_json_bytes()
        self.tmp_dir.mkdir(exist_ok=True)
        check_dir(self.tmp_dir)
        check_dir(self.snapshots_dir)
        tmp = self.tmp_dir / f"{m.name}.{os.getpid()}.{time.monotonic_ns()}.json"
        write_durable(tmp, data)
        d = self.snapshots_dir / m.name
        d.mkdir(parents=True, exist_ok=True)
        check_dir(d)  # a symlink planted at snapshots/<name> would publish outside the store
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
    chunk_bytes: int | None = None,
    small_bytes: int | None = None,
) -> Store:
    """Open the store at ``path``, creating it if missing (unless ``create=False``).

    ``path`` is a local directory (``~`` is expanded). A ``file:///abs/path`` URL names the same
    local directory; any other URL scheme (``s3://``, ``gs://``, ``az://``, ``http://``, ...)
    raises :class:`~deltackpt.errors.UnsupportedURLError`: object stores are not supported yet.

    ``chunk_bytes`` (default 4 MiB; a multiple of 4096, at most 1 GiB) and ``small_bytes``
    (default ``min(1 MiB, chunk_bytes // 4)``; 0..chunk_bytes) apply when the store is created;
    afterwards they are read from STORE.json so every save of the store chunks alike. Passing a
    value that differs from an existing store's raises
    :class:`~deltackpt.errors.InvalidArgumentError` instead of being silently ignored.

    >>> store = open_store("ckpts")            # doctest: +SKIP
    """
    _check_chunk_args(chunk_bytes, small_bytes)
    if not isinstance(create, bool):
        raise InvalidArgumentError(
            f"open_store(create={create!r}) is invalid: expected True or False, got "
            f"{type(create).__name__}. Pass create=False to refuse creating a missing store"
        )
    if isinstance(path, Store):
        _check_fixed(path, chunk_bytes, small_bytes)
        return path
    root = _local_root(path)
    try:
        with _STORES_LOCK:
            cfg_path = root / "STORE.json"
            cached = _STORES.get(root)
            if cached is not None and cfg_path.exists():
                _check_fixed(cached, chunk_bytes, small_bytes)
                return cached
            if not cfg_path.exists():
                _check_location(root)
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
                cb = DEFAULT_CHUNK_BYTES if chunk_bytes is None else chunk_bytes
                sb = min(DEFAULT_SMALL_BYTES, cb // 4) if small_bytes is None else small_bytes
                _create(root, cb, sb)
            cfg = _read_config(cfg_path)
            store = Store(root, cfg)
            # also when another process created it first with other values
            _check_fixed(store, chunk_bytes, small_bytes)
            _STORES[root] = store
            return store
    except OSError as e:
        if isinstance(e, DeltackptError):  # e.g. StoreLockedError, SnapshotExistsError
            raise
        raise store_io_error(
            e,
            f"cannot open or create the store at {str(root)!r}: {e}. No snapshot was touched; "
            "fix the cause (permissions, free space, the disk) and retry",
        ) from e


# ---------------------------------------------------------------------------- argument checks

MAX_CHUNK_BYTES = 1 << 30  # one chunk is hashed, encoded and staged as a unit: keep it sane
_URL_RE = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]+)://")
# Path("s3://bucket/run") collapses "//" into "s3:/bucket/run": such a path is a mangled URL,
# not a local folder named "s3:" (which is what a plain mkdir would silently create).
_MANGLED_URL_RE = re.compile(
    r"^(s3|s3a|s3n|gs|gcs|az|abfs|abfss|adl|wasb|wasbs|hdfs|webhdfs|http|https|ftp|sftp|"
    r"memory|hf|oss|r2|file):/",
    re.IGNORECASE,
)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _local_root(path: Any) -> Path:
    """The absolute local directory that ``path`` names; refuses None, non-paths and URLs."""
    if (
        path is None
        or isinstance(path, (bytes, bytearray))
        or not isinstance(path, (str, os.PathLike))
    ):
        hint = " (decode it: store=path.decode())" if isinstance(path, (bytes, bytearray)) else ""
        raise InvalidArgumentError(
            f"store={path!r} is invalid: expected a directory path (str or os.PathLike) or a "
            f"deltackpt Store, got {type(path).__name__}{hint}. Pass e.g. store='ckpts'"
        )
    raw = os.fspath(path)
    if not isinstance(raw, str):
        raise InvalidArgumentError(
            f"store={path!r} is a bytes path; expected a str path. Pass os.fsdecode(path)"
        )
    if not raw.strip() or "\0" in raw:
        raise InvalidArgumentError(
            f"store={raw!r} is invalid: expected a non-empty directory path without NUL "
            "characters. Pass e.g. store='ckpts' (use '.' for the current directory)"
        )
    m = _URL_RE.match(raw) or _MANGLED_URL_RE.match(raw)
    if m:
        scheme = m.group(1).lower()
        if scheme == "file" and raw.startswith("file://"):
            raw = _file_url_path(raw)
        else:
            mangled = (
                ""
                if raw.startswith(f"{m.group(1)}://")
                else (" (a pathlib.Path turned '//' into '/'; pass URLs as str)")
            )
            raise UnsupportedURLError(
                f"store={str(path)!r} is a {scheme}:// URL{mangled}; deltackpt stores are local "
                f"directories and object stores ({scheme}://) are not supported yet. Save to a "
                "local (or mounted, e.g. s3fs/gcsfuse) directory and sync it; file:///abs/path "
                "URLs are accepted for local directories"
            )
    return Path(raw).expanduser().absolute()


def _file_url_path(url: str) -> str:
    """``file:///abs/path`` (or ``file://localhost/abs/path``) -> ``/abs/path``."""
    parts = urllib.parse.urlsplit(url)
    if parts.netloc not in ("", "localhost") or parts.query or parts.fragment or not parts.path:
        raise UnsupportedURLError(
            f"store={url!r} is a file:// URL that does not name a local directory (host "
            f"{parts.netloc!r}, query {parts.query!r}); expected file:///abs/path. Pass the local "
            "path itself, e.g. store='/data/ckpts'"
        )
    return urllib.parse.unquote(parts.path)


def _check_location(root: Path) -> None:
    """A store is a directory: refuse a path that is a file, or lies below one."""
    p = root
    while not p.exists() and p != p.parent:
        p = p.parent
    if not p.is_dir():
        what = "is a file" if p == root else f"lies inside {str(p)!r}, which is a file"
        raise InvalidArgumentError(
            f"store={str(root)!r} {what}, not a directory; expected a new, empty or existing "
            "store directory. Pass another path"
        )


def _chunk_bytes_problem(value: Any) -> str | None:
    if not _is_int(value):
        return f"expected an int, got {type(value).__name__} {value!r}"
    if not PACK_ALIGN <= value <= MAX_CHUNK_BYTES or value % PACK_ALIGN:
        return (
            f"expected a multiple of {PACK_ALIGN} between {PACK_ALIGN} and {MAX_CHUNK_BYTES} "
            f"(1 GiB), got {value!r}"
        )
    return None


def _small_bytes_problem(value: Any, chunk_bytes: int | None) -> str | None:
    if not _is_int(value):
        return f"expected an int, got {type(value).__name__} {value!r}"
    if chunk_bytes is None:  # checked against the store's chunk_bytes once that is known
        return None if value >= 0 else f"expected an int >= 0 (at most chunk_bytes), got {value!r}"
    if not 0 <= value <= chunk_bytes:
        return f"expected an int between 0 and chunk_bytes={chunk_bytes}, got {value!r}"
    return None


def _check_chunk_args(chunk_bytes: Any, small_bytes: Any) -> None:
    if chunk_bytes is not None:
        problem = _chunk_bytes_problem(chunk_bytes)
        if problem:
            raise InvalidArgumentError(
                f"open_store(chunk_bytes={chunk_bytes!r}) is invalid: {problem}. Pass e.g. "
                f"chunk_bytes=4 << 20 (the default), or leave it out"
            )
    if small_bytes is not None:
        problem = _small_bytes_problem(small_bytes, chunk_bytes)
        if problem:
            raise InvalidArgumentError(
                f"open_store(small_bytes={small_bytes!r}) is invalid: {problem}. Pass e.g. "
                f"small_bytes=1 << 20 (tensors below it share chunks; 0 turns grouping off), or "
                "leave it out"
            )


def _check_fixed(store: Store, chunk_bytes: int | None, small_bytes: int | None) -> None:
    """Chunking is fixed at creation: an explicit, different value must not be ignored."""
    for name, given, have in (
        ("chunk_bytes", chunk_bytes, store.chunk_bytes),
        ("small_bytes", small_bytes, store.small_bytes),
    ):
        if given is not None and given != have:
            raise InvalidArgumentError(
                f"open_store({name}={given}) differs from the existing store's {name}={have} "
                f"({str(store.root)!r}/STORE.json): chunking is fixed when a store is created, "
                f"or dedupe would stop matching. Leave {name} out (or pass {name}={have}) to "
                "open it, or use a new directory for a store with other chunking"
            )


def store_io_error(e: OSError, message: str) -> StoreIOError:
    """A :class:`StoreIOError` that keeps ``e.errno`` (raise it ``from e``)."""
    return StoreIOError(e.errno, message) if e.errno is not None else StoreIOError(message)


def _create(root: Path, chunk_bytes: int, small_bytes: int) -> None:
    # open_store checked explicit arguments; this guards defaults derived from them
    problem = _chunk_bytes_problem(chunk_bytes) or _small_bytes_problem(small_bytes, chunk_bytes)
    if problem:
        raise InvalidArgumentError(
            f"cannot create a store with chunk_bytes={chunk_bytes!r}, "
            f"small_bytes={small_bytes!r}: {problem}"
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
    """Read and fully validate STORE.json: every field a save or load relies on."""
    try:
        cfg = json.loads(path.read_bytes())
    except ValueError as e:  # also UnicodeDecodeError
        raise StoreFormatError(f"{path} is not valid JSON ({e}); the store is damaged") from e
    fix = (
        "The store is damaged or was not written by deltackpt; restore STORE.json from a copy "
        "(its chunking must match the existing snapshots)"
    )
    if not isinstance(cfg, dict):
        raise StoreFormatError(
            f"{path} holds a JSON {type(cfg).__name__}; expected an object with format, version, "
            f"hash, chunk_bytes, small_bytes and pack_align. {fix}"
        )
    version = cfg.get("version")
    if cfg.get("format") != STORE_FORMAT or not _is_int(version) or version != STORE_VERSION:
        raise StoreFormatError(
            f"{path} says format={cfg.get('format')!r} version={cfg.get('version')!r}; this "
            f"deltackpt reads {STORE_FORMAT!r} version {STORE_VERSION}"
        )
    if cfg.get("hash") != DIGEST_NAME:
        raise StoreFormatError(f"{path} uses hash {cfg.get('hash')!r}; expected {DIGEST_NAME!r}")
    if not _is_int(cfg.get("pack_align")) or cfg["pack_align"] != PACK_ALIGN:
        raise StoreFormatError(
            f"{path}: field 'pack_align' is {cfg.get('pack_align')!r}; expected {PACK_ALIGN}. {fix}"
        )
    problem = _chunk_bytes_problem(cfg.get("chunk_bytes"))
    if problem is None:
        problem = _small_bytes_problem(cfg.get("small_bytes"), cfg["chunk_bytes"])
        field_name = "small_bytes"
    else:
        field_name = "chunk_bytes"
    if problem:
        raise StoreFormatError(
            f"{path}: field {field_name!r} is {cfg.get(field_name)!r}: {problem}. {fix}"
        )
    return cfg

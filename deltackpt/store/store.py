"""The store: snapshots sharing content-addressed chunks in packs, over a Storage.

::

    STORE.json                      format version, hash and chunking parameters; written once
    STORE.lock                      the store lock: saves and deletes hold it shared, gc exclusive
    snapshots/<name>/MANIFEST.json  one committed snapshot; its presence *is* the commit
    packs/<id>.pack                 chunk bytes, appended by saves, never modified in place
    tmp/                            in-flight writes; never read; swept by gc

Manifests are the only source of truth: the chunk index used for dedupe is the union of the chunk
tables of committed manifests, so there is no second index that could disagree with them.

This file holds :class:`Store` (snapshot names, the manifest cache, commit) and
:func:`open_store`. The keys above are built in ``storage.py`` (``packs.pack_key`` for packs);
every byte goes through ``Store.storage`` (``storage.Storage``: ``local.LocalStorage`` for a
directory, ``objstore.FsspecStorage`` for an object-store URL, whose ``root`` is that URL).
"""

from __future__ import annotations

import contextlib
import os
import threading
import warnings
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
)
from deltackpt.format.manifest import ChunkRecord, Manifest
from deltackpt.format.validate import validate_manifest
from deltackpt.store.config import (
    DEFAULT_CHUNK_BYTES,
    DEFAULT_SMALL_BYTES,
    check_chunk_args,
    check_fixed,
    chunk_bytes_problem,
    config_bytes,
    parse_config,
    small_bytes_problem,
)
from deltackpt.store.local import LocalStorage
from deltackpt.store.location import check_location, default_storage, store_key, store_root
from deltackpt.store.packs import PACK_ALIGN, PACK_MAGIC, PackReaders, PackWriter, pack_key
from deltackpt.store.snapshot import LATEST, Damaged, SnapshotInfo, validate_name
from deltackpt.store.storage import (
    LOCK_FILE,
    PACKS,
    SNAPSHOTS,
    STORE_JSON,
    TMP,
    ObjectTooLargeError,
    Storage,
    manifest_key,
    snapshot_key,
)

__all__ = [  # PACK_ALIGN, PACK_MAGIC and the defaults are imported from here by older code
    "DEFAULT_CHUNK_BYTES",
    "DEFAULT_SMALL_BYTES",
    "LATEST",
    "PACK_ALIGN",
    "PACK_MAGIC",
    "Damaged",
    "SnapshotInfo",
    "Store",
    "open_store",
    "store_io_error",
    "validate_name",
]

MAX_MANIFEST_BYTES = 1 << 31  # a larger MANIFEST.json is refused before it is read


class Store:
    """A store: committed snapshots and the packs they share. Create or open one with
    :func:`open_store`. Every byte goes through ``self.storage`` (a
    :class:`~deltackpt.store.local.LocalStorage` of ``root`` unless one is given)."""

    def __init__(
        self, root: Path | str, config: dict[str, Any], storage: Storage | None = None
    ) -> None:
        self.root = root  # a local directory, or an object store's URL (a str)
        if storage is None:
            storage = LocalStorage(self._local("storage"))
        self.storage: Storage = storage
        self.chunk_bytes = int(config["chunk_bytes"])
        self.small_bytes = int(config["small_bytes"])
        # name -> (version, size, manifest) of the last read of its MANIFEST.json
        self._cache: dict[str, tuple[tuple[int, ...], int, Manifest]] = {}
        self._cache_lock = threading.Lock()

    def __repr__(self) -> str:
        return f"Store({str(self.root)!r})"

    # local paths (for messages and tools; the store itself reads and writes through storage)
    def _local(self, what: str) -> Path:
        if not isinstance(self.root, Path):
            raise StoreError(
                f"store {self.root!r} is an object store: it has no local {what}; go through "
                "store.storage (keys such as 'packs/<id>.pack')"
            )
        return self.root

    @property
    def snapshots_dir(self) -> Path:
        return self._local("snapshots directory") / SNAPSHOTS

    @property
    def packs_dir(self) -> Path:
        return self._local("packs directory") / PACKS

    @property
    def tmp_dir(self) -> Path:
        return self._local("tmp directory") / TMP

    @property
    def lock_path(self) -> Path:
        return self._local("lock file") / LOCK_FILE

    def pack_path(self, pack: str) -> Path:
        return self._local("pack file") / pack_key(pack)

    def manifest_path(self, name: str) -> Path:
        return self._local("manifest file") / manifest_key(name)

    # storage
    def lock(
        self, *, exclusive: bool, timeout: float, what: str
    ) -> contextlib.AbstractContextManager[None]:
        """The store lock: shared for saves and deletes, exclusive for gc (see lifecycle.py)."""
        return self.storage.lock(exclusive=exclusive, timeout=timeout, what=what)

    def pack_writer(self, fsync: bool = True) -> PackWriter:
        """A new pack of this store (one per writer thread)."""
        return PackWriter(self.storage, fsync=fsync)

    def pack_readers(self) -> PackReaders:
        """Readers of this store's packs, for one load (close them, or use ``with``)."""
        return PackReaders(self.storage)

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
        for e in self.storage.list(SNAPSHOTS):  # [] when missing; a symlink is refused
            if e.kind == "link":
                bad.append(
                    Damaged(e.name, "is a symlink; deltackpt never follows links in a store")
                )
                continue
            if e.kind != "dir":
                continue  # a stray file: not a snapshot
            try:
                validate_name(e.name)
            except InvalidNameError:
                bad.append(Damaged(e.name, "is not a name a save could have written"))
                continue
            try:
                m = self._read_cached(e.name)
            except (StoreFormatError, StoreIOError) as err:  # damaged, unsafe, or newer
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
        return self.storage.exists(manifest_key(name))

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
        return hit[1] if hit is not None else 0

    def _read_cached(self, name: str) -> Manifest | None:
        """Read, integrity-check and validate ``snapshots/<name>/MANIFEST.json``; None if absent.

        The storage never follows a symlink at any level, so one (or one swapped in while we
        read) is refused. An unchanged manifest (same version) is not read again."""
        with self._cache_lock:
            hit = self._cache.get(name)
        key = manifest_key(name)
        try:
            blob = self.storage.read(
                key, max_bytes=MAX_MANIFEST_BYTES, known=hit[0] if hit else None
            )
        except FileNotFoundError:
            return None
        except ObjectTooLargeError as e:
            raise ManifestError(
                f"{e.where} is {e.size} bytes, over the {MAX_MANIFEST_BYTES} a manifest may have",
                snapshot=name,
            ) from None
        except OSError as e:
            if isinstance(e, DeltackptError):
                raise
            raise StoreIOError(
                e.errno, f"cannot open {self.storage.where(key)}: {e.strerror}"
            ) from e
        if blob.data is None:
            assert hit is not None  # only returned for the version we passed
            return hit[2]
        where = f"snapshot {name!r} ({self.storage.where(key)})"
        try:
            m = Manifest.from_json_bytes(blob.data, where=where)
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
            self._cache[name] = (blob.version, blob.size, m)
        return m

    def chunk_index(self) -> dict[str, ChunkRecord]:
        """digest -> where it lives, over all committed snapshots (dedupe on save)."""
        index: dict[str, ChunkRecord] = {}
        for m in self.manifests():
            index.update(m.chunks)
        return index

    def remove_snapshot(self, name: str) -> None:
        """Un-commit ``name``: delete its manifest (durably), then the rest of its directory.

        Works on a damaged manifest (it is never parsed). The storage never follows links: a
        ``snapshots/<name>`` that is a symlink raises :class:`UnsafePathError` and nothing outside
        the store is touched."""
        validate_name(name)
        self.storage.delete(manifest_key(name))
        self.storage.sync(snapshot_key(name))
        with contextlib.suppress(FileNotFoundError):
            self.storage.delete(snapshot_key(name), recursive=True)
        self.storage.sync(SNAPSHOTS)
        with self._cache_lock:
            self._cache.pop(name, None)

    def write_manifest(self, m: Manifest, overwrite: bool) -> int:
        """Commit ``m``: publish its manifest atomically (only if the name is free, unless
        ``overwrite``) and durably. Returns the manifest's size."""
        data = m.to_json_bytes()
        if overwrite:
            self.storage.replace(manifest_key(m.name), data)
        else:
            self.storage.publish(manifest_key(m.name), data)
        return len(data)


_STORES: dict[Path | str, Store] = {}
_STORES_LOCK = threading.Lock()


def open_store(
    path: str | os.PathLike[str] | Store,
    *,
    create: bool = True,
    chunk_bytes: int | None = None,
    small_bytes: int | None = None,
    storage: Storage | None = None,
    storage_options: dict[str, Any] | None = None,
) -> Store:
    """Open the store at ``path``, creating it if missing (unless ``create=False``).

    ``path`` is a local directory (``~`` is expanded). A ``file:///abs/path`` URL names the same
    local directory. ``s3://bucket/prefix`` (needs ``pip install s3fs``) and ``memory://name``
    are object stores (:class:`~deltackpt.store.objstore.FsspecStorage`, whose docstring says
    what each guarantees; gc on them needs ``no_concurrent_saves=True``), configured by
    ``storage_options`` (s3fs: ``key``, ``secret``, ``endpoint_url``, ``client_kwargs``...; or
    the usual AWS environment). Any other scheme (``gs://``, ``az://``, ``http://``, ...) raises
    :class:`~deltackpt.errors.UnsupportedURLError`.

    ``chunk_bytes`` (default 4 MiB; a multiple of 4096, at most 1 GiB) and ``small_bytes``
    (default ``min(1 MiB, chunk_bytes // 4)``; 0..chunk_bytes) apply when the store is created;
    afterwards they are read from STORE.json so every save of the store chunks alike. Passing a
    value that differs from an existing store's raises
    :class:`~deltackpt.errors.InvalidArgumentError` instead of being silently ignored.

    ``storage`` is the :class:`~deltackpt.store.storage.Storage` the store's bytes go through
    (default: ``LocalStorage(path)``). Pass one to wrap or replace the file system: a
    ``LocalStorage(path, ops=DurableOps(...))`` whose commit steps fail (fault injection), a
    wrapper that counts or delays I/O, another backend. ``path`` still names the store (its
    root, in messages). Such a store is the caller's own: every call returns a new
    :class:`Store` (with its own save engine), and ``open_store(path)`` without ``storage`` keeps
    returning the shared store of the plain local directory. Saves, loads, gc and the DCP
    plug-in all accept the returned Store in place of a path.

    >>> store = open_store("ckpts")            # doctest: +SKIP
    """
    check_chunk_args(chunk_bytes, small_bytes)
    if not isinstance(create, bool):
        raise InvalidArgumentError(
            f"open_store(create={create!r}) is invalid: expected True or False, got "
            f"{type(create).__name__}. Pass create=False to refuse creating a missing store"
        )
    if isinstance(path, Store):
        if storage is not None and storage is not path.storage:
            raise InvalidArgumentError(
                f"open_store({path!r}, storage={storage!r}): a Store already has its storage; "
                "pass the store's path with storage="
            )
        check_fixed(path, chunk_bytes, small_bytes)
        return path
    root = store_root(path)
    cache_key = store_key(path, root, storage_options)
    shared = storage is None  # the one Store of a plain directory or URL, kept in _STORES
    try:
        with _STORES_LOCK:
            if storage is None:
                storage = default_storage(root, storage_options)
            cached = _STORES.get(cache_key) if shared else None
            if cached is not None and storage.exists(STORE_JSON):
                check_fixed(cached, chunk_bytes, small_bytes)
                return cached
            if not storage.exists(STORE_JSON):
                if isinstance(root, Path):
                    check_location(root)
                if not create:
                    raise StoreError(
                        f"no deltackpt store at {str(root)!r} (STORE.json missing); pass "
                        "create=True or check the path"
                    )
                if storage.list("") and not storage.exists(SNAPSHOTS):
                    raise StoreError(
                        f"{str(root)!r} exists, is not empty and is not a deltackpt store; "
                        "use an empty or new directory"
                    )
                cb = DEFAULT_CHUNK_BYTES if chunk_bytes is None else chunk_bytes
                sb = min(DEFAULT_SMALL_BYTES, cb // 4) if small_bytes is None else small_bytes
                _create(storage, cb, sb)
            cfg = parse_config(storage.read(STORE_JSON).data or b"", storage.where(STORE_JSON))
            store = Store(root, cfg, storage)
            # also when another process created it first with other values
            check_fixed(store, chunk_bytes, small_bytes)
            if shared:
                _STORES[cache_key] = store
            return store
    except OSError as e:
        if isinstance(e, DeltackptError):  # e.g. StoreLockedError, SnapshotExistsError
            raise
        raise store_io_error(
            e,
            f"cannot open or create the store at {str(root)!r}: {e}. No snapshot was touched; "
            "fix the cause (permissions, free space, the disk) and retry",
        ) from e


def store_io_error(e: OSError, message: str) -> StoreIOError:
    """A :class:`StoreIOError` that keeps ``e.errno`` (raise it ``from e``)."""
    return StoreIOError(e.errno, message) if e.errno is not None else StoreIOError(message)


def _create(storage: Storage, chunk_bytes: int, small_bytes: int) -> None:
    # open_store checked explicit arguments; this guards defaults derived from them
    problem = chunk_bytes_problem(chunk_bytes) or small_bytes_problem(small_bytes, chunk_bytes)
    if problem:
        raise InvalidArgumentError(
            f"cannot create a store with chunk_bytes={chunk_bytes!r}, "
            f"small_bytes={small_bytes!r}: {problem}"
        )
    storage.make_dirs((SNAPSHOTS, PACKS, TMP))
    with contextlib.suppress(FileExistsError):  # another process created it first: read theirs
        storage.publish(STORE_JSON, config_bytes(chunk_bytes, small_bytes))

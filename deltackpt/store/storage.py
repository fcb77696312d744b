"""The storage seam: every operation the store asks of the medium its bytes live on.

The store (``store.py``, ``packs.py``, ``chunks.py``, ``lifecycle.py``, ``verify.py``) never
opens a file itself: it names objects by *key* and calls a :class:`Storage`. A key is a
``/``-separated path relative to the store's root (``"STORE.json"``,
``"snapshots/step-1/MANIFEST.json"``, ``"packs/<id>.pack"``); the key vocabulary of a store is
defined here too, so the layout lives in one place. :class:`~deltackpt.store.local.LocalStorage`
(a directory on a local or mounted file system) is the first backend;
:class:`~deltackpt.store.objstore.FsspecStorage` (``s3://``, ``memory://``) the second.

Rules every backend keeps:

- **Keys are untrusted** when built from stored data (pack ids, snapshot names read from
  manifests). A backend refuses a key with an empty, ``.`` or ``..`` component (:func:`parts`)
  and never follows a symlink (or the object store's equivalent) inside the store: either raises
  :class:`~deltackpt.errors.UnsafePathError`.
- **Missing is FileNotFoundError**: reading, opening or deleting an absent object raises
  ``FileNotFoundError`` (the store turns it into "not a snapshot" or "pack is missing").
- **Durability**: ``publish`` and ``replace`` are durable when they return. Objects written with
  ``create`` are durable after ``finish(durable=True)``; their *names* (and deletions) are durable
  after ``sync`` of their prefix, so a save of many packs pays for one directory sync, not one per
  pack. A backend whose writes are durable on return (object stores) makes ``sync`` a no-op.
- **Atomic commit**: ``publish`` is the commit point of a snapshot (docs/format.md): readers see
  either no object or the whole of it, and of two publishers of one key exactly one wins.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Literal, Protocol

from deltackpt.errors import StoreError, UnsafePathError

# ------------------------------------------------------------------------------ the store's keys

STORE_JSON = "STORE.json"  # format version, hash and chunking parameters; written once
LOCK_FILE = "STORE.lock"  # the store lock (local file systems: flock)
SNAPSHOTS = "snapshots"  # snapshots/<name>/MANIFEST.json: one committed snapshot each
PACKS = "packs"  # packs/<id>.pack: chunk bytes (see packs.pack_name)
TMP = "tmp"  # in-flight writes; never read; swept by gc
MANIFEST = "MANIFEST.json"


def snapshot_key(name: str) -> str:
    """The prefix holding snapshot ``name`` (one key component: UnsafePathError otherwise)."""
    return f"{SNAPSHOTS}/{check_component(name, 'snapshot name')}"


def manifest_key(name: str) -> str:
    """The key whose presence *is* the commit of snapshot ``name``."""
    return f"{snapshot_key(name)}/{MANIFEST}"


def parts(key: str) -> list[str]:
    """The components of ``key``; refuses keys that could leave the store or name it twice.

    ``""`` is the store's root (no components). Refused with UnsafePathError: a leading or
    doubled ``/``, a ``.`` or ``..`` component, a NUL byte."""
    if key == "":
        return []
    out = key.split("/")
    if any(p in ("", ".", "..") or "\0" in p for p in out):
        raise UnsafePathError(
            f"{key[:120]!r} is not a key inside the store (empty, '.' or '..' components, or a "
            "leading '/'); refusing to build a path from it"
        )
    return out


def check_component(name: str, what: str) -> str:
    """``name`` if it is one safe key component, else UnsafePathError naming ``what``: not empty,
    not ``.`` or ``..``, without ``/`` or NUL."""
    if not isinstance(name, str) or name in ("", ".", "..") or "/" in name or "\0" in name:
        raise UnsafePathError(
            f"{what} {str(name)[:80]!r} is not a single name inside the store (empty, '.', '..', "
            "or containing '/'); refusing to build a path from it"
        )
    return name


# ------------------------------------------------------------------------------------ the seam

Kind = Literal["file", "dir", "link", "other"]


@dataclass(frozen=True)
class Entry:
    """One name directly under a listed prefix. ``kind`` is what the name itself is (a link is
    ``"link"``, never what it points to); ``size`` is in bytes for files, else 0."""

    name: str
    kind: Kind
    size: int = 0


@dataclass(frozen=True)
class Blob:
    """A whole small object: its bytes (None when unchanged since the caller's ``known``
    version), its version (opaque; equal exactly when the object is unchanged) and size."""

    data: bytes | None
    version: tuple[int, ...]
    size: int


class ObjectTooLargeError(StoreError, ValueError):
    """``Storage.read`` refused an object larger than ``max_bytes`` before reading it."""

    def __init__(self, where: str, size: int, max_bytes: int) -> None:
        super().__init__(f"{where} is {size} bytes, over the {max_bytes} allowed")
        self.where = where
        self.size = size
        self.max_bytes = max_bytes


class RangeReader(Protocol):
    """An open object for ranged reads (a pack during a load, verify or compaction)."""

    def read_into(self, offset: int, bufs: Sequence[memoryview]) -> int:
        """Fill ``bufs`` (byte memoryviews) in order from ``offset``; return the bytes read,
        less than their total only where the object ends. Safe to call from many threads."""
        ...

    def close(self) -> None:
        """Release the object (mappings, descriptors, connections)."""
        ...


class ObjectWriter(Protocol):
    """A new object being written front to back (a pack during a save or a compaction)."""

    def write(self, bufs: Sequence[memoryview]) -> None:
        """Append all of ``bufs`` in order (retrying short writes). One thread at a time."""
        ...

    def finish(self, durable: bool) -> None:
        """Complete the object; its bytes are durable on return when ``durable``. Its name
        becomes durable with ``Storage.sync`` of its prefix."""
        ...

    def abort(self) -> None:
        """Stop writing and release resources. What was written may stay behind until the
        caller deletes the key (local files), or vanish (an unfinished upload)."""
        ...


class Storage(Protocol):
    """What the store asks of storage. Callers named per method; see the module docstring for
    the rules on keys, missing objects, durability and atomicity every backend keeps."""

    #: Whether bytes cross a network (object stores): ``encoding="auto"`` then writes xor
    #: deltas (``SaveOptions.for_storage``); a local disk is False.
    remote: bool

    def where(self, key: str = "") -> str:
        """A human-readable location of ``key`` (or of the store) for error messages."""
        ...

    def open_reader(self, key: str) -> RangeReader:
        """Open ``key`` for ranged reads. Caller: ``packs.PackReaders`` (load, verify, DCP
        reader, gc compaction). FileNotFoundError when absent; UnsafePathError when ``key`` is
        a link or not a regular object. The local backend copies out of a read-only memory map
        (about 5x faster than pread here) and falls back to preadv where it cannot map."""
        ...

    def read(
        self, key: str, *, max_bytes: int | None = None, known: tuple[int, ...] | None = None
    ) -> Blob:
        """The whole of a small object. Callers: ``Store`` (manifests, STORE.json). Returns
        ``data=None`` without reading when the object's version equals ``known`` (the manifest
        cache: every save and every ``latest`` scans all manifests). Raises
        :class:`ObjectTooLargeError` past ``max_bytes``, FileNotFoundError when absent (also
        when a component of ``key`` is a plain file: a stray file is not a snapshot)."""
        ...

    def exists(self, key: str) -> bool:
        """Whether an entry exists at ``key``; the entry itself is not followed (a link counts).
        Callers: ``Store.has`` (is a name committed), open_store, gc's leftover sweep."""
        ...

    def list(self, prefix: str) -> list[Entry]:
        """The names directly under ``prefix``, in no particular order; ``[]`` when it does not
        exist. UnsafePathError when ``prefix`` is a link or not a directory. Callers: ``Store``
        (snapshots), gc (tmp, snapshots, packs), open_store (is a new root empty)."""
        ...

    def create(self, key: str) -> ObjectWriter:
        """Start a new object at ``key``; FileExistsError if one exists (pack ids are random,
        so that is a bug, never a race to resolve). Callers: ``packs.PackWriter`` (saves and
        gc compaction). Not visible as complete, nor durable, before ``finish``."""
        ...

    def publish(self, key: str, data: bytes) -> None:
        """Atomically create ``key`` holding ``data``, only if absent, durably: the snapshot
        commit (``Store.write_manifest``) and the creation of STORE.json. Raises
        :class:`~deltackpt.errors.SnapshotExistsError` (a FileExistsError) when ``key`` exists:
        of two concurrent publishers exactly one wins. Local: durable temp file under ``tmp/``,
        ``link`` to the key, directory fsync; object stores: a conditional create."""
        ...

    def replace(self, key: str, data: bytes) -> None:
        """Atomically replace (or create) ``key`` with ``data``, durably: readers see the old or
        the new bytes, never a mix. Callers: ``save(overwrite=True)``, gc compaction repointing
        manifests."""
        ...

    def make_dirs(self, prefixes: Sequence[str]) -> None:
        """Create the store's root and these prefixes if missing, durably. Caller: open_store
        creating a store. Backends without directories (object stores) do nothing."""
        ...

    def delete(self, key: str, *, recursive: bool = False) -> None:
        """Remove ``key``: an object, or a link itself (never its target); with ``recursive``
        also a prefix and everything under it (best effort: what cannot be removed stays for
        the next gc). FileNotFoundError when absent. Durable after ``sync`` of the parent.
        Callers: ``Store.remove_snapshot``, gc (packs, leftovers), a failed save's packs."""
        ...

    def sync(self, prefix: str) -> None:
        """Make the names created or deleted directly under ``prefix`` durable (local: fsync the
        directory). Callers: saves after their packs, gc, remove_snapshot."""
        ...

    def lock(self, *, exclusive: bool, timeout: float, what: str) -> AbstractContextManager[None]:
        """Hold the store lock: shared by saves and deletes, exclusive by gc. Raises
        :class:`~deltackpt.errors.StoreLockedError` after ``timeout`` seconds. Local: flock on
        ``STORE.lock``. A backend that cannot lock (most object stores) must say so by raising
        rather than pretend: gc relies on the lock to never delete what a save is writing."""
        ...

    def abandon_uploads(self, older_than_s: float = 0.0, *, dry_run: bool = False) -> list[str]:
        """Abort the unfinished uploads (object stores: multipart uploads of killed saves) under
        the store older than ``older_than_s``, unless ``dry_run``; return their keys. Caller: gc,
        under the exclusive lock. Local: none (a killed save's partial files are in ``tmp/``)."""
        ...

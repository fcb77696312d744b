"""FsspecStorage: the :class:`~deltackpt.store.storage.Storage` of a store in an object store.

``open_store("s3://bucket/prefix", storage_options={...})`` (s3fs), ``gs://`` (gcsfs), ``az://``
(adlfs) and ``memory://name`` (fsspec's in-process memory file system, for tests) use it;
``file://`` stays :class:`~deltackpt.store.local.LocalStorage`. Keys map to objects under the
URL's prefix; keys built from stored data are checked with
:func:`~deltackpt.store.storage.parts` as everywhere.

What each backend guarantees:

- **Commit** (``publish``): a create-only put, so the manifest object exists whole or not at all
  and of two publishers of one key exactly one wins (the other gets
  :class:`~deltackpt.errors.SnapshotExistsError`). S3: ``PutObject`` with ``If-None-Match: *``
  (tested against a real S3 API server). GCS: ``ifGenerationMatch=0``; Azure: an upload without
  overwrite (``If-None-Match: *``): both through fsspec's ``pipe_file(mode="create")``, the
  same call, not run against a server here. ``memory://``: a lock-protected check-and-put,
  exclusive within one process only (it is one process's memory). A create whose answer was
  lost is retried and finds the object taken: ``publish`` then reads it back, and bytes equal
  to its own mean it won (a lost answer must not turn a committed save into a failed one).
- **Deadlines** (:mod:`deltackpt.store.objcalls`): every call runs under ``connect_timeout``,
  ``read_timeout``, ``request_timeout`` and ``operation_timeout`` (``storage_options`` keys or
  ``timeouts=``), so a dead or silent store raises :class:`~deltackpt.errors.StoreIOError`
  naming the URL instead of hanging.
- **Packs** (``create``, :mod:`deltackpt.store.uploads`): S3 streams a multipart upload of
  ``block_size`` parts, ``parts_in_flight`` at once; GCS a resumable upload and Azure staged
  blocks (the file system's writer). The object appears only when ``finish`` completes the
  upload, and ``abort`` aborts it (nothing listed). A process killed mid-upload leaves an
  unfinished upload (invisible to listings): on S3 gc aborts those under the store's prefix
  (``abandon_uploads``; a bucket lifecycle rule ``AbortIncompleteMultipartUpload`` is a good
  second line); GCS resumable sessions and Azure uncommitted blocks expire by themselves
  (a week).
- **Durability**: a put is durable when it returns, so ``sync`` and ``make_dirs`` do nothing.
  Object stores have no empty directories: ``snapshots/``, ``packs/`` and ``tmp/`` exist exactly
  when ``STORE.json`` does.
- **Reads**: ranged GETs; a read of more than ``part_bytes`` is split into parallel GETs
  (``cat_ranges``) and copied into the caller's buffers.
- **Encoding**: ``remote`` is true (but for ``memory://``), so ``encoding="auto"`` writes xor
  deltas here (:data:`~deltackpt.format.policy.AUTO_REMOTE`): bytes over a network cost more
  than decoding them.

**Locking.** Object stores have no locks. Shared locks (saves, deletes) are free, so saves,
loads and deletes of different snapshots may run concurrently, from any number of processes.
gc needs the exclusive lock: it deletes packs that no committed manifest references, which would
break a save in flight (its packs are not referenced until it commits, and it may dedupe against
a pack gc is removing). So gc on an object store is refused with :class:`NoLockError` unless the
storage is made with ``no_concurrent_saves=True``, the caller's promise that no save (nor a load
of a snapshot gc deletes) runs while gc does::

    st = open_store(url, storage=FsspecStorage(url, opts, no_concurrent_saves=True))
    deltackpt.gc(st, keep_last=3)
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from deltackpt.errors import (
    SnapshotExistsError,
    StoreError,
    StoreIOError,
    UnsafePathError,
    UnsupportedURLError,
)
from deltackpt.store.objcalls import (
    Caller,
    DeadlineExceeded,
    StoreTimeouts,
    deadline_error,
    is_checksum_error,
    precondition_failed,
    split_options,
)
from deltackpt.store.objreads import FsspecReader
from deltackpt.store.storage import (
    PACKS,
    SNAPSHOTS,
    STORE_JSON,
    TMP,
    Blob,
    Entry,
    ObjectTooLargeError,
    parts,
)
from deltackpt.store.uploads import PartsUpload, UploadWriter, WholeWriter

SCHEMES = {  # URL scheme -> fsspec protocol
    "s3": "s3",
    "s3a": "s3",
    "gs": "gcs",
    "gcs": "gcs",
    "az": "abfs",
    "abfs": "abfs",
    "memory": "memory",
}
_PIP = {"s3": "s3fs", "gcs": "gcsfs", "abfs": "adlfs"}
_MEMORY_LOCK = threading.Lock()  # memory:// publish: check-and-put, one process


class NoLockError(StoreError, NotImplementedError):
    """An exclusive store lock (gc) was asked of an object store, which has none."""


class FsspecStorage:
    """A store's bytes under ``url`` in an fsspec file system (see the module docstring).

    ``storage_options`` go to the file system (s3fs: ``key``, ``secret``, ``endpoint_url``,
    ``client_kwargs``, ...). ``block_size`` is the multipart part size of uploads (>= 5 MiB), of
    which up to ``parts_in_flight`` upload at once per pack (memory per pack writer: about
    ``(parts_in_flight + 1) * block_size``); ``part_bytes`` is the size of each parallel ranged
    GET. ``no_concurrent_saves=True`` allows gc
    (the exclusive lock) on the caller's promise that nothing else writes the store meanwhile.
    ``timeouts`` (or the ``storage_options`` keys ``connect_timeout``, ``read_timeout``,
    ``request_timeout``, ``operation_timeout``, in seconds; not both) bound every call of the
    store (:mod:`deltackpt.store.objcalls`)."""

    def __init__(
        self,
        url: str,
        storage_options: dict[str, Any] | None = None,
        *,
        no_concurrent_saves: bool = False,
        block_size: int = 64 << 20,
        part_bytes: int = 16 << 20,
        parts_in_flight: int = 4,
        timeouts: StoreTimeouts | None = None,
    ) -> None:
        scheme = url.split("://", 1)[0].lower() if "://" in url else ""
        protocol = SCHEMES.get(scheme)
        if protocol is None:
            raise UnsupportedURLError(
                f"store={url!r}: {scheme or 'no'}:// is not a supported object store; "
                f"supported: {', '.join(s + '://' for s in SCHEMES)} and local directories"
            )
        if protocol != "memory" and not url.split("://", 1)[1].strip("/"):
            raise UnsupportedURLError(
                f"store={url!r} names no bucket; pass {scheme}://bucket/prefix"
            )
        self.url = url.rstrip("/")
        self.storage_options = dict(storage_options or {})
        self.timeouts, fs_options = split_options(
            self.storage_options, timeouts, s3=protocol == "s3"
        )
        self.no_concurrent_saves = bool(no_concurrent_saves)
        self.block_size = max(int(block_size), 5 << 20)
        self.part_bytes = max(int(part_bytes), 1 << 20)
        self.parts_in_flight = max(int(parts_in_flight), 1)
        self.protocol = protocol
        self.remote = protocol != "memory"  # memory:// is this process's memory, no network
        try:
            import fsspec

            self.fs = fsspec.filesystem(protocol, **fs_options)
        except ImportError as e:
            pkg = _PIP.get(protocol, protocol)
            raise UnsupportedURLError(
                f"store={url!r} needs the {pkg} package, which is not installed ({e}). Install "
                f"it: pip install {pkg} (or pip install 'deltackpt[s3]')"
            ) from None
        except Exception as e:  # bad storage_options
            raise UnsupportedURLError(
                f"store={url!r}: cannot set up {protocol}:// with storage_options="
                f"{sorted(self.storage_options)}: {type(e).__name__}: {e}"
            ) from e
        self.call = Caller(self.fs, self.timeouts)
        self.root = self.fs._strip_protocol(self.url).rstrip("/")
        self._uploads: ThreadPoolExecutor | None = None
        self._uploads_lock = threading.Lock()

    def __repr__(self) -> str:
        return f"FsspecStorage({self.url!r})"

    def path(self, key: str) -> str:
        ps = parts(key)
        return "/".join([self.root, *ps]) if ps else self.root

    def where(self, key: str = "") -> str:
        return f"{self.url}/{key}" if key else self.url

    @contextlib.contextmanager
    def _io(self, what: str, key: str = "") -> Iterator[None]:
        """Errors of the client library (credentials, network, HTTP, a missed deadline) as
        StoreIOError naming the URL; OSErrors (FileNotFoundError, FileExistsError, ...) and ours
        pass through."""
        try:
            yield
        except DeadlineExceeded as e:
            raise deadline_error(e, what, self.where(key), self.timeouts) from e
        except StoreError:
            raise
        except Exception as e:
            if is_checksum_error(e):
                raise StoreIOError(
                    errno.EIO,
                    f"{what} {self.where(key)} failed: the bytes received do not match the "
                    f"checksum the store keeps for that object ({type(e).__name__}: {e}). The "
                    "object is corrupt, or was corrupted on the way: retry; if it persists the "
                    "object is damaged (run `deltackpt verify`; a damaged manifest loses only its "
                    "snapshot: delete it and load another)",
                ) from e
            if isinstance(e, OSError) and not isinstance(e, TimeoutError):
                raise
            raise StoreIOError(
                errno.ETIMEDOUT if isinstance(e, TimeoutError) else errno.EIO,
                f"{what} {self.where(key)} failed: {type(e).__name__}: {e}. Check the URL, the "
                "credentials (storage_options or the environment) and the network",
            ) from e

    def _info(self, key: str) -> dict[str, Any]:
        path = self.path(key)
        with self._io("reading", key):
            self.fs.invalidate_cache(path)
            info = self.call("info", path)
        if info.get("type") != "file":
            if key == "" or info.get("type") == "directory":
                raise FileNotFoundError(errno.ENOENT, "not an object", self.where(key))
            raise UnsafePathError(f"{self.where(key)} is not an object")
        return info

    # --------------------------------------------------------------------------------- reads

    def open_reader(self, key: str) -> FsspecReader:
        info = self._info(key)
        return FsspecReader(self, key, int(info["size"]))

    def read(
        self, key: str, *, max_bytes: int | None = None, known: tuple[int, ...] | None = None
    ) -> Blob:
        info = self._info(key)
        size = int(info["size"])
        if max_bytes is not None and size > max_bytes:
            raise ObjectTooLargeError(self.where(key), size, max_bytes)
        tag = next(
            (str(info[k]) for k in ("ETag", "etag", "LastModified", "created") if k in info), ""
        )
        h = int.from_bytes(hashlib.blake2b(tag.encode(), digest_size=8).digest(), "little")
        version = (h, size)
        if version == known and tag:
            return Blob(None, version, size)
        with self._io("reading", key):
            data = self.call("cat_file", self.path(key))
        return Blob(bytes(data), version, len(data))

    def exists(self, key: str) -> bool:
        if key in (PACKS, SNAPSHOTS, TMP):  # no empty directories: they come with the store
            key = STORE_JSON
        path = self.path(key)
        with self._io("checking", key):
            self.fs.invalidate_cache(path)
            return bool(self.call("exists", path))

    def list(self, prefix: str) -> list[Entry]:
        path = self.path(prefix)
        with self._io("listing", prefix):
            self.fs.invalidate_cache(path)
            try:
                infos = self.call("ls", path, detail=True)
            except FileNotFoundError:
                return []
        out: list[Entry] = []
        for info in infos:
            name = str(info["name"]).rstrip("/")
            if name.lstrip("/") == path.lstrip("/"):
                if info.get("type") == "file":
                    raise UnsafePathError(f"{self.where(prefix)} is an object, not a prefix")
                continue  # a directory marker
            base = name.rsplit("/", 1)[-1]
            if info.get("type") == "directory":
                out.append(Entry(base, "dir"))
            elif info.get("type") == "file":
                out.append(Entry(base, "file", int(info.get("size") or 0)))
            else:
                out.append(Entry(base, "other"))
        return out

    # -------------------------------------------------------------------------------- writes

    def create(self, key: str) -> PartsUpload | UploadWriter | WholeWriter:
        path = self.path(key)
        if self.protocol == "memory":
            if self.exists(key):
                raise FileExistsError(errno.EEXIST, "exists", self.where(key))
            return WholeWriter(self, key)
        if self.protocol == "s3":
            return PartsUpload(self, key)
        with self._io("uploading", key):
            f = self.fs.open(path, "wb", block_size=self.block_size)
        return UploadWriter(self, key, f)

    def _upload_pool(self) -> ThreadPoolExecutor:
        """The threads that upload S3 parts (shared by this storage's pack writers)."""
        with self._uploads_lock:
            if self._uploads is None:
                self._uploads = ThreadPoolExecutor(
                    max_workers=2 * self.parts_in_flight, thread_name_prefix="deltackpt-upload"
                )
            return self._uploads

    def publish(self, key: str, data: bytes) -> None:
        path = self.path(key)
        if self.protocol == "memory":
            with _MEMORY_LOCK:
                if self.fs.exists(path):
                    raise SnapshotExistsError(f"{self.where(key)} already exists")
                self.fs.pipe_file(path, bytes(data))
            return
        data = bytes(data)
        try:
            with self._io("publishing", key):
                self.call("pipe_file", path, data, mode="create", body=True)
            return
        except FileExistsError:
            pass
        except OSError as e:
            if not precondition_failed(e):
                raise self._write_error(e, key) from e
        # Taken: by another writer, or by this one when the answer to a try that landed was
        # lost and the retry found our own object. Its bytes tell: a manifest holds its name,
        # its creation time in ns and the digest of every chunk, so no other save's equals it.
        try:
            with self._io("reading back", key):
                theirs = bytes(self.call("cat_file", path))
        except OSError as e:
            raise StoreIOError(
                e.errno or errno.EIO,
                f"publishing {self.where(key)}: the store answered that it already exists, and "
                f"reading it back to tell whether it is this save's failed: {e}. Check with "
                "`deltackpt ls`",
            ) from e
        if theirs != data:
            raise SnapshotExistsError(
                f"{self.where(key)} already exists ({len(theirs)} bytes written by another "
                "save); save under another name or pass overwrite=True"
            )

    def replace(self, key: str, data: bytes) -> None:
        try:
            with self._io("writing", key):
                self.call("pipe_file", self.path(key), bytes(data), body=True)
        except OSError as e:
            raise self._write_error(e, key) from e

    def _write_error(self, e: OSError, key: str) -> OSError:
        if isinstance(e, StoreError):
            return e
        if isinstance(e, FileNotFoundError):
            return StoreIOError(
                errno.ENOENT,
                f"cannot write {self.where(key)}: the bucket does not exist ({e}); create it "
                "first or fix the URL",
            )
        return StoreIOError(e.errno or errno.EIO, f"cannot write {self.where(key)}: {e}")

    def make_dirs(self, prefixes: Sequence[str]) -> None:
        pass  # object stores have no directories

    def delete(self, key: str, *, recursive: bool = False) -> None:
        if not parts(key):
            raise UnsafePathError("refusing to delete the store's root")
        path = self.path(key)
        with self._io("deleting", key):
            self.fs.invalidate_cache(path)
            if recursive:
                found = [
                    p for p in self.call("find", path) if p.startswith(path + "/") or p == path
                ]
                if not found:
                    raise FileNotFoundError(errno.ENOENT, "no such object", self.where(key))
                self.call("rm", found)
            else:
                if not self.call("isfile", path):  # S3 deletes of absent keys succeed silently
                    raise FileNotFoundError(errno.ENOENT, "no such object", self.where(key))
                self.call("rm_file", path)
            self.fs.invalidate_cache(path)

    def sync(self, prefix: str) -> None:
        pass  # every put is durable when it returns

    def abandon_uploads(self, older_than_s: float = 0.0, *, dry_run: bool = False) -> list[str]:
        """Abort the unfinished multipart uploads under this store's prefix (those of saves that
        were killed mid-upload) started more than ``older_than_s`` seconds ago; return their
        keys. gc calls it with 0 under the exclusive lock (``no_concurrent_saves``): an upload
        of a save in flight would be aborted too. ``memory://`` has no multipart uploads."""
        if self.protocol != "s3":
            return []
        bucket, _, prefix = self.root.partition("/")
        prefix = f"{prefix}/" if prefix else ""
        cutoff = time.time() - float(older_than_s)
        found: list[tuple[str, str]] = []
        kw: dict[str, Any] = {"Bucket": bucket, "Prefix": prefix}
        with self._io("listing the multipart uploads of"):
            while True:
                out = self.call("call_s3", "list_multipart_uploads", **kw)
                for u in out.get("Uploads", []):
                    started = u.get("Initiated")
                    ts = started.timestamp() if hasattr(started, "timestamp") else 0.0
                    if ts <= cutoff and str(u["Key"]).startswith(prefix):
                        found.append((str(u["Key"]), str(u["UploadId"])))
                if not out.get("IsTruncated"):
                    break
                kw["KeyMarker"] = out.get("NextKeyMarker", "")
                kw["UploadIdMarker"] = out.get("NextUploadIdMarker", "")
        if not dry_run:
            for key, upload_id in found:
                with self._io("aborting", key[len(prefix) :]), contextlib.suppress(OSError):
                    self.call(  # OSError: completed or aborted meanwhile
                        "call_s3",
                        "abort_multipart_upload",
                        Bucket=bucket,
                        Key=key,
                        UploadId=upload_id,
                    )
        return [k[len(prefix) :] for k, _ in found]

    @contextlib.contextmanager
    def lock(self, *, exclusive: bool, timeout: float, what: str) -> Iterator[None]:
        if exclusive and not self.no_concurrent_saves:
            raise NoLockError(
                f"{what} on {self.url} needs the exclusive store lock, and object stores have "
                "no locks: gc could delete packs a concurrent save is writing. Run it when no "
                f"save runs, with open_store({self.url!r}, storage=FsspecStorage({self.url!r}, "
                "storage_options, no_concurrent_saves=True))"
            )
        yield

"""How :class:`~deltackpt.store.objstore.FsspecStorage` writes an object (``Storage.create``):
S3 packs as multipart uploads with several parts in flight, other object stores through their
file system's buffered writer, ``memory://`` whole. Nothing is listed before ``finish``
completes, and ``abort`` leaves nothing listed."""

from __future__ import annotations

import contextlib
import hashlib
import threading
from collections.abc import Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from deltackpt.store.objstore import FsspecStorage


class PartsUpload:
    """An S3 multipart upload whose parts (``block_size`` bytes each) go out while later ones
    fill: up to ``parts_in_flight`` at once on the storage's upload threads, so one pack streams
    at more than one request's speed and memory stays bounded (``write`` waits for a free slot).
    An object smaller than one part is a single ``PutObject``. ``finish`` completes the upload
    after every part has landed; any failure, or ``abort``, aborts it (nothing is listed)."""

    def __init__(self, storage: FsspecStorage, key: str) -> None:
        self._s, self._key = storage, key
        self._bucket, _, self._obj = storage.path(key).partition("/")
        self._buf = bytearray()
        self._upload_id: str | None = None
        self._parts: list[Future[dict[str, Any]]] = []
        self._slots = threading.BoundedSemaphore(storage.parts_in_flight)
        self._open = True

    def _call(self, what: str, method: str, **kw: Any) -> dict[str, Any]:
        body = "Body" in kw  # a try that sends bytes gets request_timeout (objcalls.py)
        with self._s._io(what, self._key):
            return self._s.call(
                "call_s3", method, Bucket=self._bucket, Key=self._obj, body=body, **kw
            )

    def write(self, bufs: Sequence[memoryview]) -> None:
        assert self._open, "write after finish or abort"
        size = self._s.block_size
        try:
            for b in bufs:
                self._buf += b
                while len(self._buf) >= size:
                    self._send(bytes(self._buf[:size]))
                    del self._buf[:size]
        except BaseException:
            self.abort()
            raise

    def _send(self, data: bytes) -> None:
        for f in self._parts:  # fail early: a part that failed fails the upload
            if f.done() and f.exception() is not None:
                raise f.exception()  # type: ignore[misc]
        if self._upload_id is None:
            self._upload_id = str(self._call("uploading", "create_multipart_upload")["UploadId"])
        self._slots.acquire()  # at most parts_in_flight parts in memory and on the wire
        number = len(self._parts) + 1
        try:
            fut = self._s._upload_pool().submit(self._upload_part, number, data)
        except BaseException:
            self._slots.release()
            raise
        fut.add_done_callback(lambda _: self._slots.release())
        self._parts.append(fut)

    def _upload_part(self, number: int, data: bytes) -> dict[str, Any]:
        out = self._call(
            "uploading", "upload_part", PartNumber=number, UploadId=self._upload_id, Body=data
        )
        return {"PartNumber": number, "ETag": out["ETag"]}

    def finish(self, durable: bool) -> None:
        assert self._open, "finish after finish or abort"
        try:
            if self._upload_id is None:
                self._call("uploading", "put_object", Body=bytes(self._buf))
            else:
                if self._buf:
                    self._send(bytes(self._buf))
                done = [f.result() for f in self._parts]
                try:
                    self._call(
                        "uploading",
                        "complete_multipart_upload",
                        UploadId=self._upload_id,
                        MultipartUpload={"Parts": done},
                    )
                except FileNotFoundError:  # NoSuchUpload: gone, or completed by a lost try
                    if not self._completed(done):
                        raise
        except OSError as e:
            self.abort()
            raise self._s._write_error(e, self._key) from e
        except BaseException:
            self.abort()
            raise
        self._open = False
        self._buf = bytearray()

    def _completed(self, done: list[dict[str, Any]]) -> bool:
        """Whether the object is this upload, completed: a retried complete whose first try
        landed (its answer lost) finds the upload gone. S3 names a multipart object by the MD5
        of its parts' MD5s and their count, so the ETag tells whether the object is ours."""
        try:
            head = self._call("checking", "head_object")
        except OSError:
            return False
        md5s = b"".join(bytes.fromhex(str(p["ETag"]).strip('"')) for p in done)
        want = f"{hashlib.md5(md5s, usedforsecurity=False).hexdigest()}-{len(done)}"
        return str(head.get("ETag", "")).strip('"') == want

    def abort(self) -> None:
        if not self._open:
            return
        self._open = False
        self._buf = bytearray()
        for f in self._parts:
            f.cancel()
        for f in self._parts:
            with contextlib.suppress(BaseException):
                f.result()
        if self._upload_id is not None:
            with contextlib.suppress(Exception):
                self._call("aborting", "abort_multipart_upload", UploadId=self._upload_id)


class UploadWriter:
    """A multipart upload (s3fs): parts of ``block_size`` go out as they fill; ``finish``
    completes the upload, ``abort`` aborts it so nothing is listed."""

    def __init__(self, storage: FsspecStorage, key: str, f: Any) -> None:
        self._s, self._key, self._f = storage, key, f

    def write(self, bufs: Sequence[memoryview]) -> None:
        with self._s._io("uploading", self._key):
            for b in bufs:
                self._f.write(b)

    def finish(self, durable: bool) -> None:
        try:
            with self._s._io("uploading", self._key):
                self._f.close()
        except OSError as e:
            self.abort()
            raise self._s._write_error(e, self._key) from e

    def abort(self) -> None:
        f = self._f
        if f is None or f.closed:
            return
        self._f = None
        with contextlib.suppress(Exception):
            f.discard()  # s3fs: AbortMultipartUpload
        f.closed = True  # never complete the upload (close(), or __del__, would)


class WholeWriter:
    """memory://: the object is put whole by ``finish``."""

    def __init__(self, storage: FsspecStorage, key: str) -> None:
        self._s, self._key = storage, key
        self._parts: list[bytes] | None = []

    def write(self, bufs: Sequence[memoryview]) -> None:
        assert self._parts is not None, "write after finish or abort"
        self._parts.extend(bytes(b) for b in bufs)

    def finish(self, durable: bool) -> None:
        assert self._parts is not None, "finish after finish or abort"
        data, self._parts = b"".join(self._parts), None
        self._s.fs.pipe_file(self._s.path(self._key), data)

    def abort(self) -> None:
        self._parts = None

"""Framework checkpoint *paths* <-> snapshot names, and the marker files left at those paths.

Lightning's ``ModelCheckpoint`` decides what to keep by file path (``<dirpath>/epoch=0-step=10.ckpt``,
``last.ckpt``) and looks at the file system itself: ``ckpt_path="last"`` lists ``dirpath`` for
``last*.ckpt`` and picks the newest by modification time, and its version counter
(``-v1``) asks whether a path exists. So every checkpoint saved into a store also leaves a small
JSON *marker* file at its path, written only after the snapshot is committed (a marker never
names a snapshot that is not there; a crash between the two leaves a snapshot without marker,
which a resume simply does not see).

The snapshot name is derived from the path alone (:func:`snapshot_name`): its base name when that
is a valid snapshot name (``epoch=0-step=10.ckpt`` and ``last.ckpt`` are), otherwise a sanitised
form plus a digest of the base name. The marker also records the name, so a marker reached
through a symlink (``ModelCheckpoint(save_last="link")``) or moved elsewhere still resolves.
A marker file is untrusted input when read back: at most :data:`MAX_MARKER_BYTES` are read and
the name it holds must pass :func:`~deltackpt.store.store.validate_name`.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import uuid
from typing import Any

from deltackpt.errors import InvalidNameError
from deltackpt.store.store import validate_name

__all__ = [
    "MARKER_FORMAT",
    "is_local",
    "read_marker",
    "remove_path",
    "snapshot_name",
    "write_marker",
]

MARKER_FORMAT = "deltackpt-checkpoint-marker"
MAX_MARKER_BYTES = 64 * 1024
_BAD = re.compile(r"[^A-Za-z0-9._=+@-]")


def is_local(path: str) -> bool:
    return "://" not in path or path.startswith("file://")


def _local(path: str) -> str:
    return path[len("file://") :] if path.startswith("file://") else path


def canonical(path: Any) -> str:
    """The form of ``path`` recorded in a snapshot and compared on removal: absolute, normalised
    for local paths (Lightning passes ``os.path.realpath``-ed directories), as given otherwise."""
    p = os.fspath(path)
    return os.path.abspath(_local(p)) if is_local(p) else p.rstrip("/")


def snapshot_name(path: Any) -> str:
    """The snapshot name for the checkpoint file ``path``: deterministic, and always a valid
    snapshot name (never ``latest``, no ``..``, at most 200 characters)."""
    base = os.path.basename(os.fspath(path).rstrip("/"))
    with contextlib.suppress(InvalidNameError):
        validate_name(base)
        return base
    safe = _BAD.sub("_", base)
    while ".." in safe:
        safe = safe.replace("..", "._")
    safe = safe.lstrip("._=+@-")[:180] or "ckpt"
    return f"{safe}-{hashlib.sha256(base.encode('utf-8', 'surrogatepass')).hexdigest()[:12]}"


def write_marker(path: str, store_root: str, name: str, step: int | None) -> None:
    """Write the marker at ``path`` (atomically on a local disk: a temporary file renamed)."""
    body = json.dumps(
        {
            "format": MARKER_FORMAT,
            "version": 1,
            "store": store_root,
            "snapshot": name,
            "step": step,
        },
        sort_keys=True,
    ).encode()
    if is_local(path):
        p = _local(path)
        os.makedirs(os.path.dirname(p) or ".", exist_ok=True)
        tmp = f"{p}.{uuid.uuid4().hex[:8]}.tmp"
        with open(tmp, "wb") as f:
            f.write(body)
        os.replace(tmp, p)
        return
    import fsspec

    fs, p = fsspec.core.url_to_fs(path)
    fs.makedirs(fs._parent(p), exist_ok=True)
    fs.pipe_file(p, body)


def read_marker(path: str) -> tuple[str | None, bool]:
    """``(snapshot name or None, whether a file exists at path)``. None with True: the file is
    not a deltackpt marker (a torch checkpoint, say), or names an invalid snapshot."""
    try:
        if is_local(path):
            with open(_local(path), "rb") as f:  # follows a save_last="link" symlink
                raw = f.read(MAX_MARKER_BYTES + 1)
        else:
            import fsspec

            fs, p = fsspec.core.url_to_fs(path)
            if not fs.isfile(p):
                return None, fs.exists(p)
            with fs.open(p, "rb") as f:
                raw = f.read(MAX_MARKER_BYTES + 1)
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
        return None, os.path.lexists(_local(path)) if is_local(path) else False
    if len(raw) > MAX_MARKER_BYTES:
        return None, True
    try:
        doc = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        return None, True
    if not isinstance(doc, dict) or doc.get("format") != MARKER_FORMAT:
        return None, True
    name = doc.get("snapshot")
    try:
        validate_name(name)
    except InvalidNameError:
        return None, True
    return name, True


def remove_path(path: str) -> None:
    """Remove the file (or symlink) at ``path`` if there is one; a directory is left alone."""
    if is_local(path):
        p = _local(path)
        if os.path.islink(p) or os.path.isfile(p):
            with contextlib.suppress(FileNotFoundError):
                os.remove(p)
        return
    import fsspec

    fs, p = fsspec.core.url_to_fs(path)
    if fs.isfile(p):
        fs.rm(p)

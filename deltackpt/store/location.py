"""Where a store lives: the checks that turn ``open_store``'s ``path`` argument into a root.

A local directory (``~`` expanded) or a ``file:///abs/path`` URL is a local root (a ``Path``,
for :class:`~deltackpt.store.local.LocalStorage`); an object-store URL (``s3://bucket/prefix``,
``memory://name``: ``OBJECT_SCHEMES``) is returned as a normalized URL string, for
:class:`~deltackpt.store.objstore.FsspecStorage`. Any other scheme raises
:class:`~deltackpt.errors.UnsupportedURLError`.
"""

from __future__ import annotations

import os
import re
import urllib.parse
from pathlib import Path
from typing import Any

from deltackpt.errors import InvalidArgumentError, UnsupportedURLError
from deltackpt.store.local import LocalStorage
from deltackpt.store.storage import Storage

_URL_RE = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]+)://")
# Path("s3://bucket/run") collapses "//" into "s3:/bucket/run": such a path is a mangled URL,
# not a local folder named "s3:" (which is what a plain mkdir would silently create).
_MANGLED_URL_RE = re.compile(
    r"^(s3|s3a|s3n|gs|gcs|az|abfs|abfss|adl|wasb|wasbs|hdfs|webhdfs|http|https|ftp|sftp|"
    r"memory|hf|oss|r2|file):/",
    re.IGNORECASE,
)


OBJECT_SCHEMES = ("s3", "s3a", "gs", "gcs", "az", "abfs", "memory")  # objstore.FsspecStorage


def store_root(path: Any) -> Path | str:
    """The local directory (a Path) or the object-store URL (a str) that ``path`` names."""
    raw = path if isinstance(path, str) else None
    m = _URL_RE.match(raw) if raw is not None else None
    if raw is not None and m and m.group(1).lower() in OBJECT_SCHEMES:
        scheme, rest = m.group(1).lower(), raw[m.end() :]
        if m.group(1) != scheme:
            raise UnsupportedURLError(
                f"store={raw!r}: write the URL scheme in lower case: {scheme}://{rest}"
            )
        rest = rest.rstrip("/")
        if not rest or "\0" in rest or any(p in ("", ".", "..") for p in rest.split("/")):
            raise UnsupportedURLError(
                f"store={raw!r} is not a usable {scheme}:// URL (empty, '.' or '..' parts); "
                f"expected e.g. {scheme}://bucket/prefix"
            )
        return f"{scheme}://{rest}"
    return local_root(path)


def store_key(path: Any, root: Path | str, storage_options: dict[str, Any] | None) -> Path | str:
    """The key of the shared Store of ``root`` opened with ``storage_options``; refuses options
    for a local directory."""
    if storage_options is not None and not isinstance(root, str):
        raise InvalidArgumentError(
            f"open_store({str(path)!r}, storage_options=...): storage_options apply to object "
            "store URLs (s3://, memory://), not to local directories; drop them"
        )
    if isinstance(root, str) and storage_options:
        return f"{root}\0{sorted(storage_options.items())!r}"
    return root


def default_storage(root: Path | str, storage_options: dict[str, Any] | None) -> Storage:
    """LocalStorage of a directory, FsspecStorage of an object-store URL."""
    if isinstance(root, Path):
        return LocalStorage(root)
    from deltackpt.store.objstore import FsspecStorage  # imports fsspec: only when used

    return FsspecStorage(root, storage_options)


def local_root(path: Any) -> Path:
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
                f"store={str(path)!r} is a {scheme}:// URL{mangled}; {scheme}:// is not supported "
                "(yet): deltackpt stores are local directories (or file:///abs/path URLs) and "
                f"object stores at {', '.join(s + '://' for s in OBJECT_SCHEMES)} URLs (pip "
                "install s3fs, gcsfs or adlfs). Save to a local or mounted (e.g. gcsfuse) directory"
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


def check_location(root: Path) -> None:
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

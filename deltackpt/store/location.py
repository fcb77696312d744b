"""Where a store lives: the checks that turn ``open_store``'s ``path`` argument into a local root.

A local directory (``~`` expanded) or a ``file:///abs/path`` URL; any other scheme raises
:class:`~deltackpt.errors.UnsupportedURLError` until a backend for it exists (issue 11 plugs
object stores in here, next to :class:`~deltackpt.store.local.LocalStorage`).
"""

from __future__ import annotations

import os
import re
import urllib.parse
from pathlib import Path
from typing import Any

from deltackpt.errors import InvalidArgumentError, UnsupportedURLError

_URL_RE = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]+)://")
# Path("s3://bucket/run") collapses "//" into "s3:/bucket/run": such a path is a mangled URL,
# not a local folder named "s3:" (which is what a plain mkdir would silently create).
_MANGLED_URL_RE = re.compile(
    r"^(s3|s3a|s3n|gs|gcs|az|abfs|abfss|adl|wasb|wasbs|hdfs|webhdfs|http|https|ftp|sftp|"
    r"memory|hf|oss|r2|file):/",
    re.IGNORECASE,
)


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

"""What a snapshot is to the store: its name rules, what it holds and cost, or why it is unusable.

``validate_name`` is the one check of a snapshot name (it also keeps every name a single, safe
storage key component); ``LATEST`` is the name that resolves to the newest readable snapshot.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from deltackpt.errors import InvalidNameError
from deltackpt.format.manifest import Manifest

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


def validate_name(name: str) -> None:
    if not isinstance(name, str) or not _NAME_RE.match(name) or name == LATEST or ".." in name:
        raise InvalidNameError(
            f"snapshot name {name!r} is not allowed: use 1-200 characters from letters, digits "
            "and ._=+@- starting with a letter or digit, not 'latest' and without '..' "
            "(e.g. 'step-100')"
        )

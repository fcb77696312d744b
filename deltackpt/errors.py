"""Typed errors raised by deltackpt.

Every message names what was wrong (the key, snapshot or chunk), the expected and the actual
value, and what to do about it. Subclasses also derive from the builtin exception a Python user
would reach for (``ValueError``, ``KeyError``, ``TypeError``, ``TimeoutError``), so existing
``except`` clauses keep working.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


class DeltackptError(Exception):
    """Base class of every error deltackpt raises on purpose."""


class StoreError(DeltackptError):
    """The store directory is missing, unreadable or of an unknown format."""


class StoreFormatError(StoreError, ValueError):
    """STORE.json or a manifest does not follow the format this version reads."""


class ManifestError(StoreFormatError):
    """A snapshot's manifest is damaged or malformed: bad JSON, a wrong digest, or a field that
    fails validation (an index out of range, slices that do not add up, an unknown dtype...).
    ``snapshot`` and ``field`` name what was wrong when known."""

    def __init__(self, message: str, *, snapshot: str | None = None, field: str | None = None):
        super().__init__(message)
        self.snapshot = snapshot
        self.field = field


class UnsafePathError(StoreFormatError):
    """A path built from stored data would leave the store, or goes through a symlink the store
    did not create. deltackpt refuses it instead of following it."""


class UnsupportedURLError(StoreError, ValueError):
    """The store location is a URL whose scheme this deltackpt cannot open."""


class StoreIOError(StoreError, OSError):
    """An operating-system error (disk full, permission denied, I/O error) while using a store.

    ``errno`` is kept from the cause, and the message says what is still intact (committed
    snapshots are never touched by a failed save)."""


class StoreLockedError(StoreError, TimeoutError):
    """The store lock could not be taken in time (a gc or a save holds it)."""


class InvalidArgumentError(DeltackptError, ValueError, TypeError):
    """An argument or option has a wrong type or value. Derives from both ``ValueError`` and
    ``TypeError`` so either ``except`` clause catches it."""


class InvalidNameError(DeltackptError, ValueError):
    """A snapshot name is not allowed."""


class SnapshotNotFoundError(DeltackptError, KeyError):
    """No committed snapshot has that name."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


class SnapshotExistsError(DeltackptError, FileExistsError):
    """A committed snapshot already has that name."""


class CheckpointExistsError(SnapshotExistsError, RuntimeError):
    """``overwrite=False`` and the snapshot exists: DCP's ``FileSystemWriter`` raises a
    ``RuntimeError`` ("Checkpoint already exists ..."), deltackpt a :class:`SnapshotExistsError`;
    this is both (raised by :class:`deltackpt.dcp.StoreWriter`)."""


class UnsupportedValueError(DeltackptError, TypeError):
    """The state holds a value deltackpt does not store without pickle."""


class PickleNotAllowedError(DeltackptError, ValueError):
    """A snapshot holds pickled values and the caller did not pass allow_pickle=True."""


class KeyNotInSnapshotError(DeltackptError, KeyError):
    """A key asked of a snapshot (``open_snapshot(...).get_tensor(key)``) is not one of its
    tensors."""

    def __str__(self) -> str:  # KeyError would show the message quoted
        return str(self.args[0]) if self.args else ""


class StateMismatchError(DeltackptError, ValueError):
    """``load(into=...)`` found keys, shapes or dtypes that differ from the snapshot."""


class HeldVersionMismatchError(StateMismatchError):
    """``load(into=..., since=held)`` found that ``into`` does not hold snapshot ``held`` where
    the incremental load would rely on it (a chunk it would skip or patch hashes differently).
    Raised before anything is written: ``into`` is unchanged. ``key`` is a key path of ``into``
    whose bytes differ (one of ``keys`` when the chunk holds several small tensors)."""

    def __init__(
        self, message: str, *, key: str, keys: tuple[str, ...] = (), snapshot: str, held: str
    ) -> None:
        super().__init__(message)
        self.key = key
        self.keys = keys or (key,)
        self.snapshot = snapshot
        self.held = held


class FollowerBehindError(SnapshotNotFoundError):
    """A :class:`deltackpt.Follower` with ``fallback="raise"`` holds a snapshot that retention
    deleted (it fell behind): it cannot catch up incrementally. ``held`` is the snapshot it
    holds, ``latest`` the one it wanted. A full load (``Follower.reload()``) brings it back; a
    lease (``lease_ttl=``) keeps the held snapshot alive while the follower renews it."""

    def __init__(self, message: str, *, held: str, latest: str) -> None:
        super().__init__(message)
        self.held = held
        self.latest = latest


class CorruptChunkError(DeltackptError, ValueError):
    """A chunk's bytes do not match its digest, or its pack is missing or short.

    ``missing_pack`` is True when the cause is that the chunk's pack does not exist (a concurrent
    gc compaction may have moved the chunk: the loader re-reads the manifest once), False for
    damaged, short or unreadable bytes."""

    def __init__(self, message: str, *, missing_pack: bool = False) -> None:
        super().__init__(message)
        self.missing_pack = missing_pack


class CodecError(DeltackptError, ValueError):
    """A chunk could not be encoded or decoded (unknown codec, bad payload)."""


class SaveFailedError(DeltackptError, RuntimeError):
    """A save (often a background one) failed; the cause is chained."""


@dataclass(frozen=True)
class RankFailure:
    """Why one rank failed one step of a collective save: plain data, so it crosses ranks
    (pickled by a collective, or as JSON through the store's ``tmp/``) without the exception."""

    rank: int
    step: str  # the save step that failed: "plan", "write", "commit"
    error: str  # the exception's type name, e.g. "StoreIOError"
    message: str

    @staticmethod
    def of(rank: int, step: str, e: BaseException) -> RankFailure:
        return RankFailure(rank, step, type(e).__name__, str(e))

    def __str__(self) -> str:
        return f"rank {self.rank}: {self.error}: {self.message}"

    def to_json(self) -> dict[str, Any]:
        return {"rank": self.rank, "step": self.step, "error": self.error, "message": self.message}

    @staticmethod
    def from_json(d: dict[str, Any]) -> RankFailure:
        return RankFailure(int(d["rank"]), str(d["step"]), str(d["error"]), str(d["message"]))


class DistributedError(DeltackptError, RuntimeError):
    """A peer rank failed or timed out during a collective save, load or sync.

    A collective save raises the same error on every rank; ``failures`` lists each failing
    rank's :class:`RankFailure` (rank, step, error type, message), empty when no rank could say
    (a collective itself failed: a peer died or timed out)."""

    def __init__(self, message: str, failures: tuple[RankFailure, ...] = ()) -> None:
        super().__init__(message)
        self.failures = tuple(failures)

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (str(self), self.failures))


class ReplicaMismatchError(DistributedError, ValueError):
    """A distributed save refused plain values that the ranks hold differently (it would keep
    only rank 0's copy); the message names each key and rank, and the fixes. Nothing was
    written."""


class PartialRestoreError(DeltackptError, RuntimeError):
    """A tiered restore wrote into the live state, the load then failed (after every chunk had
    been verified: an I/O or device error), and no other tier could restore a step over it: the
    state holds part of the step tried. The message lists every attempt; restart the process
    (the tiers are unchanged)."""


class InsufficientMemoryError(DeltackptError, MemoryError):
    """A load would need more memory than this machine has; nothing was allocated."""


class StateKeyError(DeltackptError, KeyError):
    """A key path (``export_hf(key=...)``, ``import_checkpoint(src_key=...)``) names nothing in
    the state; the message lists the keys that exist."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


class ImportFormatError(DeltackptError, ValueError):
    """A file given to ``import_checkpoint`` (safetensors, index JSON, torch.save, DCP) is
    malformed or hostile: a header offset past the end of the file, an unknown dtype, a shape
    whose bytes do not match its data... Nothing was allocated for it."""


class OutputExistsError(DeltackptError, FileExistsError):
    """An export would replace files that already exist; pass ``overwrite=True`` to replace."""


class LeaseWarning(UserWarning):
    """A follower could not write or renew its lease (the store lock was busy, or a write
    failed): it keeps following and tries again at its next poll; meanwhile retention may
    delete the snapshot it holds (it then falls back to a full load)."""


class UndoSpillWarning(UserWarning):
    """A weight-sync receiver could not keep a round's old bytes in its ``undo_dir`` file (the
    directory is missing or not writable, the disk is full): it keeps them in memory instead,
    the round goes on."""


class DamagedSnapshotWarning(UserWarning):
    """Listing a store skipped committed snapshots whose manifests are damaged or unsafe."""

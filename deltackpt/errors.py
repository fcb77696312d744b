"""Typed errors raised by deltackpt.

Every message names what was wrong (the key, snapshot or chunk), the expected and the actual
value, and what to do about it. Subclasses also derive from the builtin exception a Python user
would reach for (``ValueError``, ``KeyError``, ``TypeError``, ``TimeoutError``), so existing
``except`` clauses keep working.
"""

from __future__ import annotations


class DeltackptError(Exception):
    """Base class of every error deltackpt raises on purpose."""


class StoreError(DeltackptError):
    """The store directory is missing, unreadable or of an unknown format."""


class StoreFormatError(StoreError, ValueError):
    """STORE.json or a manifest does not follow the format this version reads."""


class StoreLockedError(StoreError, TimeoutError):
    """The store lock could not be taken in time (a gc or a save holds it)."""


class InvalidNameError(DeltackptError, ValueError):
    """A snapshot name is not allowed."""


class SnapshotNotFoundError(DeltackptError, KeyError):
    """No committed snapshot has that name."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


class SnapshotExistsError(DeltackptError, FileExistsError):
    """A committed snapshot already has that name."""


class UnsupportedValueError(DeltackptError, TypeError):
    """The state holds a value deltackpt does not store without pickle."""


class PickleNotAllowedError(DeltackptError, ValueError):
    """A snapshot holds pickled values and the caller did not pass allow_pickle=True."""


class StateMismatchError(DeltackptError, ValueError):
    """``load(into=...)`` found keys, shapes or dtypes that differ from the snapshot."""


class CorruptChunkError(DeltackptError, ValueError):
    """A chunk's bytes do not match its digest, or its pack is missing or short."""


class CodecError(DeltackptError, ValueError):
    """A chunk could not be encoded or decoded (unknown codec, bad payload)."""


class SaveFailedError(DeltackptError, RuntimeError):
    """A save (often a background one) failed; the cause is chained."""


class DistributedError(DeltackptError, RuntimeError):
    """A peer rank failed or timed out during a collective save, load or sync."""


class SyncError(DeltackptError, RuntimeError):
    """A weight-sync round failed; the receiver keeps its last committed version."""

"""Errors raised by weight sync: :class:`SyncError` and its subclasses, all defined here.

All derive from :class:`SyncError` (a :class:`deltackpt.errors.DeltackptError` and a
``RuntimeError``), so one ``except SyncError`` catches every failed round. The receiver keeps its
last committed version whatever the error; the subclasses say what went wrong and therefore what
to do next:

* :class:`PeerLostError` / :class:`SyncTimeoutError` — the transport is broken (a rank died or
  stopped answering). Re-create the group (:func:`deltackpt.sync.init_group`) and call
  ``transport.reset()`` on every surviving rank; replacement ranks just construct a new transport.
* :class:`DigestMismatchError`, :class:`RoundAbortedError` — the round failed but the transport
  still works; the next ``push``/``pull`` starts cleanly (as a full round).
* :class:`PlanError` — senders disagree about the tensors (names, dtypes, shapes, coverage) or the
  options; fix the inputs.
"""

from __future__ import annotations

from deltackpt.errors import DeltackptError

__all__ = [
    "DigestMismatchError",
    "PeerLostError",
    "PlanError",
    "RoundAbortedError",
    "SyncError",
    "SyncTimeoutError",
]


class SyncError(DeltackptError, RuntimeError):
    """A weight-sync round failed; the receiver keeps its last committed version."""


class PlanError(SyncError, ValueError):
    """The senders' tensors cannot be planned: mismatched dtypes/shapes, gaps, bad options."""


class PeerLostError(SyncError):
    """A peer rank died or closed its connection during a round; the transport must be reset."""


class SyncTimeoutError(SyncError, TimeoutError):
    """A peer did not answer within the transport timeout; the transport must be reset."""


class DigestMismatchError(SyncError, ValueError):
    """A received bucket's bytes do not match the digest its sender announced."""


class RoundAbortedError(SyncError):
    """Another rank aborted the round (its own error is raised there); nothing was committed."""

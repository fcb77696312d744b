"""Errors raised by weight sync: :class:`SyncError` and its subclasses, all defined here.

All derive from :class:`SyncError` (a :class:`deltackpt.errors.DeltackptError` and a
``RuntimeError``), so one ``except SyncError`` catches every failed round. The receiver keeps its
last committed version whatever the error; the subclasses say what went wrong and therefore what
to do next:

* :class:`PeerLostError` / :class:`SyncTimeoutError` — the group is broken (a rank died or
  stopped answering). Call ``group.reconnect(new_port)`` on every surviving rank; a replacement
  rank constructs a new :class:`~deltackpt.sync.SyncGroup` with that port.
* :class:`DigestMismatchError`, :class:`RoundAbortedError` — the round failed but the group
  still works; the next ``push``/``pull`` starts cleanly (as a full round).
* :class:`PlanError` — the ranks disagree about the tensors (names, dtypes, shapes, coverage) or
  the options, or a constructor was given an argument it cannot take; fix the inputs. Also an
  :class:`~deltackpt.errors.InvalidArgumentError`.
"""

from __future__ import annotations

from deltackpt.errors import DeltackptError, InvalidArgumentError

__all__ = [
    "AdapterStageError",
    "DigestMismatchError",
    "PeerLostError",
    "PlanError",
    "RoundAbortedError",
    "SyncError",
    "SyncTimeoutError",
]


class SyncError(DeltackptError, RuntimeError):
    """A weight-sync round failed; the receiver keeps its last committed version."""


class PlanError(SyncError, InvalidArgumentError):
    """The senders' tensors cannot be planned (mismatched dtypes/shapes, gaps), or a group,
    sender or receiver was given an argument it cannot take. Also an
    :class:`~deltackpt.errors.InvalidArgumentError` (a ``ValueError`` and a ``TypeError``), like
    every bad argument of deltackpt."""


class PeerLostError(SyncError):
    """A peer rank died or closed its connection during a round; the group must be reconnected."""


class SyncTimeoutError(SyncError, TimeoutError):
    """A peer did not answer within the group timeout; the group must be reconnected."""


class DigestMismatchError(SyncError, ValueError):
    """A received bucket's bytes do not match the digest its sender announced."""


class RoundAbortedError(SyncError):
    """Another rank aborted the round (its own error is raised there); nothing was committed."""


class AdapterStageError(SyncError):
    """A LoRA adapter could not be built on every worker of an inference engine
    (``deltackpt.integrations.vllm.lora.add_lora``); no worker holds it, and the adapters added
    before are unchanged."""

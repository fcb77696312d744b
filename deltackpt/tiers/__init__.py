"""Tiered checkpoints (issue 28): a node-local tier every save, replicas on peers in another
failure domain, durable versions every N steps and on SIGTERM, and a restore that agrees on the
newest step every rank can assemble and fails closed. See docs/tiers.md.

``config.py`` (:class:`Tiers`, the local layout), ``transfer.py`` (one snapshot from a rank's
store into a peer's, over gloo, every chunk verified, committed atomically), ``restore.py``
(the agreement and the fallbacks, :class:`RestoreReport`), ``checkpointer.py``
(:class:`TieredCheckpointer`).
"""

from __future__ import annotations

from deltackpt.tiers.checkpointer import TieredCheckpointer, TierStats
from deltackpt.tiers.config import Tiers
from deltackpt.tiers.restore import RestoreReport
from deltackpt.tiers.transfer import ReplicaRefusedError

__all__ = ["ReplicaRefusedError", "RestoreReport", "TierStats", "TieredCheckpointer", "Tiers"]

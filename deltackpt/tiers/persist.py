"""Persisting a local-tier snapshot to the durable tier, off the training thread.

At a persist step the training thread stages the state once, for the local tier (as at every
save). Once that local snapshot is committed and replicated, the tiers' background thread reads
it back from the local tier (a RAM disk or NVMe: memory speed), marks its DTensor pieces as
:class:`~deltackpt.format.dtensor.Piece` again (their global offsets and shapes recorded at the
save), and saves it as a normal distributed snapshot through a synchronous
:class:`~deltackpt.Checkpointer` on the tiers' own gloo group: every rank writes only the chunks
the durable store lacks, rank 0 commits one manifest, ``durable_keep_last`` retention follows.
Memory: one transient host copy of the rank's state while it is saved.
"""

from __future__ import annotations

from typing import Any

from deltackpt.checkpointer import Checkpointer
from deltackpt.distributed.load import load
from deltackpt.errors import SaveFailedError
from deltackpt.store.store import Store
from deltackpt.tiers.config import local_name
from deltackpt.tiers.localize import Box, as_pieces


def persist_local(
    link: Any, own: Store, step: int, boxes: dict[str, Box], ok: bool, persister: Checkpointer
) -> bool:
    """Persist the local snapshot of ``step`` in ``own`` (every rank calls it, in the same order as
    the other background work on ``link``); True once committed. ``ok``: whether this rank's
    local save succeeded. When some rank's failed, every rank skips the persist: the failed
    ones return False (their own save error is raised by the caller), the others raise
    :class:`~deltackpt.errors.SaveFailedError`."""
    name = local_name(step)
    oks = link.all_gather(ok) if link is not None else [ok]
    if not ok:
        return False
    failed = [r for r, good in enumerate(oks) if not good]
    if failed:
        raise SaveFailedError(
            f"tiers: {name!r} was not persisted to the durable tier: the local save of rank(s) "
            f"{failed} failed (their errors are raised there). The previous durable version "
            "stands"
        )
    persister.save(step, as_pieces(load(own, name), boxes))
    return True

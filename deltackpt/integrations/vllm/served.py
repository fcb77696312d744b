"""The weight version an engine serves, carried across a trainer's restart (docs/sync.md,
"Versions").

A trainer that resumes from a checkpoint starts a new trainer engine; before, its versions
started again at 1 while the engine served, say, 120, and a rollout's staleness
(``step - version``) went negative (the miles#2835 / Stitch#171 class of bugs). Now:

* :func:`publish` (worker, when a trainer joins): the version it serves (None: none was
  committed since the engine started), through the group's store;
* :func:`read` (trainer, at ``trainer_init``): every worker's, checked, and the version the
  engine serves (the highest: workers of a data-parallel engine restarted apart may differ;
  the new trainer's first round is whole and brings them all to one version);
* :func:`next_version`: a ``send_weights`` without ``version=`` continues after what the engine
  serves; an explicit one that does not go past it is refused unless the caller says the run
  went back (``rewind=True``, after restoring an earlier checkpoint: the engine's later
  versions are then an abandoned line), so a version label never silently names two
  different sets of weights.
"""

from __future__ import annotations

import json
import logging
import operator

from deltackpt.sync import PlanError, SyncGroup

__all__ = ["next_version", "publish", "read"]

KEY = "vllm/served"

log = logging.getLogger("deltackpt")


def publish(group: SyncGroup, version: int | None) -> None:
    """This worker's served version in the group's store, for the trainer that joins."""
    body = json.dumps(version).encode()
    group.guard("store set", lambda: group.store.set(f"{KEY}/{group.rank}", body))


def read(group: SyncGroup, ranks: range) -> int | None:
    """The version the workers of ``ranks`` serve (the highest of theirs; None when none
    committed a round since it started), waiting within the group's timeout for each to post
    it; :class:`PlanError` for a value that is not a version (a worker of another deltackpt
    version?)."""
    keys = [f"{KEY}/{r}" for r in ranks]
    group.wait_until(lambda: bool(group.store.check(keys)), "the version each worker serves", None)
    raws = group.guard("store multi_get", lambda: group.store.multi_get(keys))
    found: dict[int, int | None] = {}
    for r, raw in zip(ranks, raws, strict=True):
        try:
            v = json.loads(bytes(raw))
        except ValueError:
            v = "?"
        if v is not None and (type(v) is not int or v < 0):
            raise PlanError(
                f"worker rank {r} says it serves version {bytes(raw)[:40]!r} ({KEY}/{r}); "
                "expected null or an integer >= 0 (a worker of another deltackpt version?)"
            )
        found[r] = v
    served = {v for v in found.values() if v is not None}
    if len(set(found.values())) > 1:
        log.warning(
            "deltackpt: the engine's workers serve different versions (%s, by rank); the first "
            "round is whole and brings them all to its version",
            found,
        )
    return max(served) if served else None


def next_version(version: int | None, sent: int | None, serving: int | None, rewind: bool) -> int:
    """The version of the next round: ``version`` if given, else one after both the last one
    this trainer sent (``sent``) and the one the engine serves (``serving``). An explicit
    ``version`` at or below ``serving`` raises :class:`PlanError` unless ``rewind``."""
    if version is None:
        return max(sent or 0, serving or 0) + 1
    try:
        given = operator.index(version)
    except TypeError:
        given = -1
    if given < 0 or isinstance(version, bool):
        raise PlanError(f"send_weights(version={version!r}): expected an integer >= 0")
    version = given
    if serving is not None and version <= serving and not rewind:
        raise PlanError(
            f"send_weights(version={version}): the engine serves version {serving}, and a "
            "version that does not go past it would name other weights with a label the "
            f"engine already served; nothing was sent. Send version {serving + 1} or later (or "
            "omit version=: the next one follows the engine's), or, when the training run was "
            "restored to an earlier step and the engine's later versions are to be replaced, "
            "pass rewind=True"
        )
    return version

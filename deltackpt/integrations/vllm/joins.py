"""What each worker tells a trainer that joins it: the weight version it serves, carried across
a trainer's restart, and the checkpoint tensors its model ignores, which the trainer then does
not send (docs/sync.md, "Versions" and "Tied embeddings").

A trainer that resumes from a checkpoint starts a new trainer engine; before, its versions
started again at 1 while the engine served, say, 120, and a rollout's staleness
(``step - version``) went negative (the miles#2835 / Stitch#171 class of bugs). Now:

* :func:`publish` (worker, when a trainer joins): the version it serves (None: none was
  committed since the engine started) and :func:`ignored_names`, through the group's store;
* :func:`read` (trainer, at ``trainer_init``): every worker's, checked: the version the engine
  serves (the highest: workers of a data-parallel engine restarted apart may differ; the new
  trainer's first round is whole and brings them all to one version) and the names every
  worker ignores;
* :func:`next_version`: a ``send_weights`` without ``version=`` continues after what the engine
  serves; an explicit one that does not go past it is refused unless the caller says the run
  went back (``rewind=True``, after restoring an earlier checkpoint: the engine's later
  versions are then an abandoned line), so a version label never silently names two
  different sets of weights.

Ignored names: a model with tied word embeddings (Qwen2.5 / Qwen3 up to 4B, Llama 3.2 1B/3B)
holds one tensor for ``model.embed_tokens.weight`` and ``lm_head.weight``, and vLLM's loader
skips ``lm_head.weight`` (its ``lm_head`` is the embedding). A trainer's state dict has both
names, so every round sent the embedding twice (27% of Qwen2.5-0.5B's bytes) for the worker
to drop one; a worker whose model ties them now says so, and the trainer leaves it out.
"""

from __future__ import annotations

import json
import logging
import operator
from dataclasses import dataclass
from typing import Any

from deltackpt.sync import PlanError, SyncGroup

__all__ = ["Joined", "ignored_names", "next_version", "publish", "read", "snapshot_step"]

KEY = "vllm/joined"


@dataclass(frozen=True)
class Joined:
    """What the workers told a trainer that joined: the version the engine serves (None: none
    since it started) and the checkpoint names every worker's model ignores."""

    serving: int | None
    ignores: frozenset[str]


def ignored_names(model: Any, hf_config: Any) -> list[str]:
    """The checkpoint tensors ``model`` (a vLLM model) ignores: ``lm_head.weight`` when its
    config ties the word embeddings and the model holds no LM head of its own (vLLM's
    ``lm_head`` is then the embedding module, whose weight it lists once)."""
    text = getattr(hf_config, "get_text_config", None)
    cfg = text() if callable(text) else hf_config
    if not getattr(cfg, "tie_word_embeddings", False):
        return []
    names = {n for n, _ in model.named_parameters()}
    return ["lm_head.weight"] if "lm_head.weight" not in names else []


def snapshot_step(metadata: Any) -> int | None:
    """A store snapshot's training step from its metadata (``"step"``: what a ``Checkpointer``
    and the integrations record, or ``deltackpt.save(..., metadata={"step": n})``): the version
    an engine serving it is said to serve; None when it has none or not a plain integer >= 0
    (a store is untrusted input)."""
    step = metadata.get("step") if isinstance(metadata, dict) else None
    return step if type(step) is int and step >= 0 else None


log = logging.getLogger("deltackpt")


def publish(group: SyncGroup, version: int | None, ignores: list[str]) -> None:
    """This worker's served version and ignored names in the group's store, for the trainer
    that joins."""
    body = json.dumps({"version": version, "ignores": list(ignores)}).encode()
    group.guard("store set", lambda: group.store.set(f"{KEY}/{group.rank}", body))


def _well_formed(got: Any) -> bool:
    v, ign = (got.get("version"), got.get("ignores")) if isinstance(got, dict) else ("?", None)
    version_ok = v is None or (type(v) is int and v >= 0)
    return version_ok and isinstance(ign, list) and all(isinstance(n, str) for n in ign)


def read(group: SyncGroup, ranks: range) -> Joined:
    """What the workers of ``ranks`` said when they joined, waiting within the group's timeout
    for each to post it; :class:`PlanError` for a record that is not one (a worker of another
    deltackpt version?)."""
    keys = [f"{KEY}/{r}" for r in ranks]
    group.wait_until(lambda: bool(group.store.check(keys)), "each worker's join record", None)
    raws = group.guard("store multi_get", lambda: group.store.multi_get(keys))
    found: dict[int, int | None] = {}
    ignores: list[set[str]] = []
    for r, raw in zip(ranks, raws, strict=True):
        try:
            got = json.loads(bytes(raw))
        except ValueError:
            got = None
        if not _well_formed(got):
            raise PlanError(
                f"worker rank {r} joined with {bytes(raw)[:80]!r} ({KEY}/{r}); expected "
                '{"version": null or an integer >= 0, "ignores": [str]} (a worker of another '
                "deltackpt version?)"
            )
        found[r] = got["version"]
        ignores.append(set(got["ignores"]))
    served = {v for v in found.values() if v is not None}
    if len(set(found.values())) > 1:
        log.warning(
            "deltackpt: the engine's workers serve different versions (%s, by rank); the first "
            "round is whole and brings them all to its version",
            found,
        )
    common = frozenset(set.intersection(*ignores)) if ignores else frozenset()
    return Joined(max(served) if served else None, common)


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

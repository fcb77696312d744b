"""Resuming a ``transformers.Trainer`` from loaded state, for both backends of
:func:`deltackpt.integrations.hf_trainer.resume_trainer` (a store and tiers).

A backend finds the checkpoint and returns a :class:`ResumePoint`: the ``TrainerState`` JSON text
of the snapshot and a ``fetch`` that loads the rest for the live model, optimizer and scheduler.
:func:`train_from` then runs ``trainer.train(resume_from_checkpoint=<a temporary folder holding
only trainer_state.json>)`` with the Trainer's own loaders (model, optimizer and scheduler,
scaler, RNG) replaced by loads of what ``fetch`` returns, so the Trainer's resume logic does the
rest (global step, epoch, skipped batches, scheduler position).

RNG: a store snapshot holds one state (``deltackpt.rng``); a tier version holds every rank's
(:data:`RNG_BY_RANK`), and each rank takes its own entry.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from deltackpt import rng as _rng
from deltackpt.checkpointer import RNG_KEY, restore_into
from deltackpt.errors import ManifestError, SnapshotNotFoundError

__all__ = [
    "RNG_BY_RANK",
    "STATE_KEY",
    "ResumePoint",
    "checked_text",
    "pop_rng_state",
    "rank_rng_state",
    "train_from",
]

STATE_KEY = "trainer_state"  # the TrainerState's JSON text, a str value of the snapshot
# Saved key holding [rng state of rank 0, rank 1, ...] (deltackpt.get_rng_state() dicts).
RNG_BY_RANK = "deltackpt.rng_by_rank"
TRAINER_STATE_NAME = "trainer_state.json"
_LOADERS = (
    "_load_from_checkpoint",
    "_load_optimizer_and_scheduler",
    "_load_scaler",
    "_load_rng_state",
)


@dataclass(frozen=True)
class ResumePoint:
    """Where a resume starts: the checked ``TrainerState`` text, ``fetch(live)`` (the loaded
    tree for the live ``{"model", "optimizer", "scheduler"}``: model, optimizer, scheduler, RNG),
    and ``model``, a loaded model state dict to put into the model ``model_init`` makes inside
    ``train`` (None: the model is loaded by ``fetch``, or was already)."""

    text: str
    fetch: Callable[[dict[str, Any]], dict[str, Any]]
    model: Any = None


def train_from(trainer: Any, point: ResumePoint, kw: dict[str, Any]) -> Any:
    """``trainer.train(resume_from_checkpoint=<a folder holding only trainer_state.json>)`` with
    the Trainer's loaders replaced by loads of ``point``."""
    with tempfile.TemporaryDirectory(prefix="deltackpt-resume-") as d:
        with open(os.path.join(d, TRAINER_STATE_NAME), "w", encoding="utf-8") as f:
            f.write(point.text)
        with _loading_from(trainer, point):
            return trainer.train(resume_from_checkpoint=d, **kw)


def checked_text(text: Any, where: str, snapshot: str) -> str:
    """``text`` if it is a ``TrainerState``'s JSON (checked before the Trainer parses it)."""
    if not isinstance(text, str):
        raise SnapshotNotFoundError(
            f"{where} has no {STATE_KEY!r} text (not saved by DeltaCheckpointCallback); pass "
            "name= of a snapshot the callback wrote"
        )
    try:
        doc = json.loads(text)
    except ValueError as e:
        doc = e
    if not isinstance(doc, dict) or type(doc.get("global_step")) is not int:
        raise ManifestError(
            f"{where}: {STATE_KEY!r} is not a TrainerState (expected a JSON object "
            f"with an int global_step, got {str(doc)[:80]!r}); resume from another snapshot "
            "(name=...)",
            snapshot=snapshot,
            field=STATE_KEY,
        )
    return text


def rank_rng_state(saved: Any, rank: int, world: int) -> Any:
    """This rank's entry of a saved :data:`RNG_BY_RANK` list (None and a warning when the saves
    had another world size: the random streams then cannot continue as they were)."""
    if not isinstance(saved, list) or not saved or len(saved) > 1 << 20:
        got = type(saved).__name__ if not isinstance(saved, list) else f"{len(saved)} entries"
        raise ManifestError(
            f"{RNG_BY_RANK!r}: expected a non-empty list of per-rank RNG states (one per rank "
            f"of the saving job), got {got}; the snapshot is damaged or not written by "
            "DeltaCheckpointCallback: resume from another one",
            field=RNG_BY_RANK,
        )
    if len(saved) != world:
        warnings.warn(
            f"resume_trainer: the checkpoint holds the RNG states of {len(saved)} rank(s) and "
            f"this job has {world}; the RNG is not restored, so random draws after this resume "
            "differ from an uninterrupted run",
            RuntimeWarning,
            stacklevel=3,
        )
        return None
    return saved[rank]


def pop_rng_state(loaded: dict[str, Any], args: Any) -> Any:
    """Pop the RNG state of this rank (``args``: the ``TrainingArguments``) from a loaded tree:
    a store snapshot's ``deltackpt.rng``, else this rank's entry of :data:`RNG_BY_RANK` (None if
    neither is there)."""
    state = loaded.pop(RNG_KEY, None)
    by_rank = loaded.pop(RNG_BY_RANK, None)
    if state is None and by_rank is not None:
        state = rank_rng_state(by_rank, args.process_index, args.world_size)
    return state


@contextlib.contextmanager
def _loading_from(trainer: Any, point: ResumePoint) -> Iterator[None]:
    """Replace, on this trainer instance only and for one ``train`` call, the Trainer's
    checkpoint loaders by loads of ``point``. Its order of calls: ``_load_from_checkpoint``
    (before the optimizer exists: only ``point.model``, if given: the tiered restore's with
    ``model_init``), ``_load_optimizer_and_scheduler`` (everything but RNG, in place),
    ``_load_scaler``, then ``_load_rng_state`` once, where the Trainer puts its own RNG state
    back."""
    apply_rng: list[Any] = []
    pending = [point.model] if point.model is not None else []

    def load_model(checkpoint: str | None, model: Any = None) -> None:
        if checkpoint is not None and pending:
            restore_into({"model": trainer.model}, {"model": pending.pop()})

    def load_all(checkpoint: str | None) -> None:
        if checkpoint is None:
            return
        live = {
            "model": trainer.model,
            "optimizer": trainer.optimizer,
            "scheduler": trainer.lr_scheduler,
        }
        loaded = point.fetch(live)
        rng_state = pop_rng_state(loaded, trainer.args)
        if rng_state is not None:
            apply_rng.append(_rng.prepare(rng_state, RNG_KEY))  # validated before changing anything
        loaded.pop(STATE_KEY, None)
        restore_into(live, loaded)

    def load_scaler(checkpoint: str | None) -> None:
        if checkpoint is not None and getattr(trainer.accelerator, "scaler", None) is not None:
            warnings.warn(
                "resume_trainer: the GradScaler state is not saved in the store; its scale starts "
                "afresh after this resume",
                RuntimeWarning,
                stacklevel=2,
            )

    def load_rng(checkpoint: str | None) -> None:
        if checkpoint is not None and apply_rng:
            apply_rng[-1]()

    saved = {k: trainer.__dict__[k] for k in _LOADERS if k in trainer.__dict__}
    trainer.__dict__.update(
        _load_from_checkpoint=load_model,
        _load_optimizer_and_scheduler=load_all,
        _load_scaler=load_scaler,
        _load_rng_state=load_rng,
    )
    try:
        yield
    finally:
        for k in _LOADERS:
            trainer.__dict__.pop(k, None)
        trainer.__dict__.update(saved)

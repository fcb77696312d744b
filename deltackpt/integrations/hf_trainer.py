"""Hugging Face ``Trainer``: save to a store with a callback, resume from it with ``resume_trainer``.

>>> from deltackpt.integrations.hf_trainer import DeltaCheckpointCallback, resume_trainer  # doctest: +SKIP
>>> args = TrainingArguments("out", save_strategy="steps", save_steps=500, ...)             # doctest: +SKIP
>>> trainer = Trainer(model, args, train_dataset=ds, callbacks=[DeltaCheckpointCallback("ckpts", keep_last=3)])  # doctest: +SKIP
>>> resume_trainer(trainer)     # trains from the latest snapshot, or from scratch on a fresh store  # doctest: +SKIP

**Saving.** The Trainer decides *when* (``save_strategy``/``save_steps``: its
``DefaultFlowCallback`` sets ``control.should_save``); the callback, on ``on_step_end`` /
``on_epoch_end``, saves the model, optimizer and scheduler state dicts, the global RNG state
(Python, numpy, torch CPU and CUDA) and the ``TrainerState`` (as its JSON text) as snapshot
``checkpoint-<global_step>`` through a :class:`~deltackpt.Checkpointer` (``keep_last``
retention deletes only its own snapshots; ``async_save=True`` blocks only while staging). It
then clears ``control.should_save`` so the Trainer does not also write its own ``checkpoint-N``
folder (``replace_trainer_saves=False`` keeps both). When that step also logs or evaluates,
the save waits for ``on_log`` / ``on_evaluate``, as the Trainer's own save comes after both
(so the saved ``TrainerState`` holds that step's log entries).

**Resuming.** The Trainer's ``train(resume_from_checkpoint=dir)`` restores the global step,
epoch, skipped batches of the current epoch (same data order), scheduler position and RNG from
files in ``dir``. :func:`resume_trainer` gives it a temporary directory holding only
``trainer_state.json`` (from the snapshot's manifest, no tensor is read for it) and, for the
duration of that ``train`` call, replaces the Trainer's loaders of model, optimizer, scheduler,
scaler and RNG with loads from the store: the weights and optimizer moments are read in place into
the live tensors once the Trainer has built its optimizer and scheduler, and the RNG state is
put back where the Trainer puts its own (after skipping the batches already trained). Nothing
large is written to disk. The Trainer's own resume logic does everything else, so the run
continues exactly as ``resume_from_checkpoint`` would.

**Tiers.** The same callback and ``resume_trainer`` take a :class:`deltackpt.tiers.Tiers` where a
store goes: every rank then saves its own state to its node's local tier, with peer replicas and
durable versions, and resumes from the newest step every rank can assemble from some tier
(:mod:`deltackpt.integrations._hf_tiers`). The hooks below (when to save, the wait for the log
and evaluation, the Trainer's loaders on resume) are the same for both; only where the state
goes and where a resume reads it from differ (``_hf_store`` / ``_hf_tiers``).

Not covered: DeepSpeed and FSDP (they checkpoint through their own engines; refused with an
error), ``save_strategy="best"`` (decided after ``on_evaluate``), the ``GradScaler`` of fp16
training (not saved: the scale re-grows after a resume, a warning says so), and the state of
``ExportableState`` callbacks other than ``TrainerControl`` (``EarlyStoppingCallback``'s
counter), which a callback cannot reach: it is saved as it was when training started.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

from transformers import Trainer, TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from deltackpt.checkpointer import Checkpointer
from deltackpt.errors import InvalidArgumentError
from deltackpt.integrations import _hf_store, _hf_tiers
from deltackpt.integrations._hf_resume import RNG_BY_RANK, STATE_KEY, train_from
from deltackpt.integrations._hf_store import StoreSaves
from deltackpt.integrations._hf_tiers import TierSaves
from deltackpt.store.store import Store
from deltackpt.tiers import TieredCheckpointer, Tiers

__all__ = [
    "DEFAULT_NAME_FORMAT",
    "RNG_BY_RANK",
    "DeltaCheckpointCallback",
    "latest_checkpoint",
    "resume_trainer",
]

DEFAULT_NAME_FORMAT = "checkpoint-{step}"


class DeltaCheckpointCallback(TrainerCallback):
    """Save the Trainer's model, optimizer, scheduler, RNG and ``TrainerState`` to ``store``
    whenever the Trainer would save a checkpoint (see the module docstring).

    ``store``: a path, URL or opened :class:`~deltackpt.Store`, or a
    :class:`deltackpt.tiers.Tiers`. ``async_save``: return once the state is staged; the save
    of step N is awaited at the next save and at the end of training (default: off for a store,
    on for tiers). ``checkpointer`` is the :class:`~deltackpt.Checkpointer` (a store; its
    ``infos`` list every committed save) or the :class:`~deltackpt.tiers.TieredCheckpointer`
    (tiers; made on first use, its ``last_restore`` says where a resume came from).

    A store only: ``keep_last`` keeps only this callback's newest N snapshots (others in the
    store are never touched); other keyword arguments are :class:`~deltackpt.SaveOptions`
    fields; world process zero saves. Tiers only: every rank saves its own state (durable
    versions every ``Tiers.persist_every`` global steps; retention and storage options are set
    in the ``Tiers``, and passing them here is an error); ``handle_sigterm=True``: on a SIGTERM
    every rank saves and persists that step, and training stops.
    """

    def __init__(
        self,
        store: str | os.PathLike[str] | Store | Tiers,
        *,
        keep_last: int | None = None,
        async_save: bool | None = None,
        name_format: str = DEFAULT_NAME_FORMAT,
        replace_trainer_saves: bool = True,
        storage_options: dict[str, Any] | None = None,
        handle_sigterm: bool = False,
        **save_options: Any,
    ) -> None:
        if not isinstance(handle_sigterm, bool):
            raise InvalidArgumentError(
                f"DeltaCheckpointCallback(handle_sigterm={handle_sigterm!r}): expected True or "
                "False"
            )
        if not isinstance(replace_trainer_saves, bool):
            raise InvalidArgumentError(
                f"DeltaCheckpointCallback(replace_trainer_saves={replace_trainer_saves!r}): "
                "expected True or False"
            )
        if async_save is not None and not isinstance(async_save, bool):
            raise InvalidArgumentError(
                f"DeltaCheckpointCallback(async_save={async_save!r}): expected True, False or "
                "None (the default: off for a store, on for tiers)"
            )
        opts: dict[str, Any] = dict(
            keep_last=keep_last,
            async_save=async_save,
            name_format=name_format,
            storage_options=storage_options,
            handle_sigterm=handle_sigterm,
            save_options=save_options,
        )
        self._saves: StoreSaves | TierSaves = (
            TierSaves.open(store, **opts)
            if isinstance(store, Tiers)
            else StoreSaves.open(store, **opts)
        )
        self._name_format = name_format
        self.replace_trainer_saves = replace_trainer_saves
        self._deferred = False

    @property
    def checkpointer(self) -> Checkpointer | TieredCheckpointer:
        return self._saves.checkpointer

    @property
    def store(self) -> Store:
        """The store (a store callback only)."""
        if isinstance(self._saves, TierSaves):
            raise InvalidArgumentError(
                "DeltaCheckpointCallback(Tiers(...)).store: a tiered callback has no single "
                "store; use .tiers, or .checkpointer (a TieredCheckpointer)"
            )
        return self._saves.store

    @property
    def tiers(self) -> Tiers | None:
        """The :class:`~deltackpt.tiers.Tiers` (None for a store callback)."""
        return self._saves.tiers if isinstance(self._saves, TierSaves) else None

    @property
    def name_format(self) -> str:
        return self._name_format

    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> TrainerControl:
        self._saves.begin()  # tiers: the checkpointer is made now on every rank (process groups)
        return control

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> TrainerControl:
        self._saves.check_stop(control)  # tiers' SIGTERM: save, persist and stop at this step
        return self._maybe_save(args, state, control, kw)

    def on_epoch_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> TrainerControl:
        return self._maybe_save(args, state, control, kw)

    def on_log(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> TrainerControl:
        if self._deferred and not control.should_evaluate:  # else: after the evaluation
            self._deferred = False
            if control.should_save:
                self._save(args, state, control, kw)
        return control

    def on_evaluate(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> TrainerControl:
        return self.on_log(args, state, control, **kw)  # the Trainer cleared should_evaluate

    def on_save(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> TrainerControl:
        if self._deferred:  # the log it waited for never came (the Trainer saved too)
            self._deferred = False
            self._save(args, state, control, kw)
        return control

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> TrainerControl:
        self._saves.wait()  # tiers: the local save, its replicas and a durable version
        return control

    def close(self) -> None:
        """Wait for pending saves; a tiered callback also shuts its checkpointer down (the next
        training run makes a new one)."""
        self._saves.close()

    def _maybe_save(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, kw: Any
    ) -> TrainerControl:
        if not control.should_save:
            return control
        if not self._saves.every_rank and not state.is_world_process_zero:
            return control  # a store: one writer; tiers: every rank saves its own state
        if control.should_log or control.should_evaluate:
            self._deferred = True  # the Trainer logs, evaluates, then saves: so do we
            return control
        self._save(args, state, control, kw)
        return control

    def _save(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, kw: Any
    ) -> None:
        model, optimizer, scheduler = kw.get("model"), kw.get("optimizer"), kw.get("lr_scheduler")
        if model is None or optimizer is None or scheduler is None:
            raise InvalidArgumentError(
                "DeltaCheckpointCallback needs the Trainer's model, optimizer and lr_scheduler "
                f"(got model={type(model).__name__}, optimizer={type(optimizer).__name__}, "
                f"lr_scheduler={type(scheduler).__name__}); add it to a transformers.Trainer "
                "through Trainer(callbacks=[...])"
            )
        live = {
            "model": model,
            "optimizer": optimizer,
            "scheduler": scheduler,
            STATE_KEY: trainer_state_json(state, control),
        }
        self._saves.save(state.global_step, live)
        if self.replace_trainer_saves:
            control.should_save = False


def trainer_state_json(state: TrainerState, control: TrainerControl) -> str:
    """``TrainerState`` as the Trainer writes ``trainer_state.json`` at a save, with the
    ``TrainerControl`` state of that moment; ``state`` itself is not changed."""
    d = dataclasses.asdict(state)
    callbacks = dict(d.get("stateful_callbacks") or {})
    callbacks["TrainerControl"] = control.state()
    d["stateful_callbacks"] = callbacks
    return json.dumps(d, indent=2, sort_keys=True) + "\n"


def latest_checkpoint(
    store: str | os.PathLike[str] | Store, name_format: str = DEFAULT_NAME_FORMAT
) -> str | None:
    """The newest snapshot a :class:`DeltaCheckpointCallback` with ``name_format`` wrote to
    ``store`` (by commit time), or None."""
    return _hf_store.latest_checkpoint(store, name_format)


def resume_trainer(
    trainer: Trainer,
    store: str | os.PathLike[str] | Store | Tiers | None = None,
    name: str | None = None,
    *,
    name_format: str | None = None,
    **train_kwargs: Any,
) -> Any:
    """Run ``trainer.train(**train_kwargs)`` resumed from snapshot ``name`` of ``store`` (default:
    the newest one a :class:`DeltaCheckpointCallback` wrote), exactly as
    ``train(resume_from_checkpoint=...)`` resumes from a ``checkpoint-N`` folder: same global
    step, epoch, data order, scheduler position and RNG. With no such snapshot (a fresh store)
    it trains from scratch, so one command serves the first run and every restart. ``store`` and
    ``name_format`` default to those of the trainer's ``DeltaCheckpointCallback``. Returns what
    ``train`` returns.

    ``store`` (or the callback's) may be a :class:`deltackpt.tiers.Tiers`: every rank then
    calls this, and the restore picks the newest step every rank can assemble from some tier
    (own local tier, a peer's replica, the durable tier; ``checkpointer.last_restore`` says
    which); ``name`` does not apply. The model is read in place before ``train``, the optimizer,
    scheduler and RNG once ``train`` has built them (see :mod:`deltackpt.integrations._hf_tiers`).
    """
    if "resume_from_checkpoint" in train_kwargs:
        raise InvalidArgumentError(
            "resume_trainer(..., resume_from_checkpoint=...): resume_trainer chooses the "
            "checkpoint itself; pass name= to pick a snapshot"
        )
    cb = next(
        (c for c in trainer.callback_handler.callbacks if isinstance(c, DeltaCheckpointCallback)),
        None,
    )
    if store is None:
        if cb is None:
            raise InvalidArgumentError(
                "resume_trainer(trainer) needs store=... when the trainer has no "
                "DeltaCheckpointCallback"
            )
        store = cb.tiers if cb.tiers is not None else cb.store
    if name_format is None:
        name_format = cb.name_format if cb is not None else DEFAULT_NAME_FORMAT
    if getattr(trainer, "is_deepspeed_enabled", False) or getattr(
        trainer, "is_fsdp_enabled", False
    ):
        raise InvalidArgumentError(
            "resume_trainer does not support DeepSpeed or FSDP trainers (their engines checkpoint "
            "model and optimizer shards themselves); use the Trainer's own checkpoints there"
        )
    if isinstance(store, Tiers):
        ours = cb._saves if cb is not None and isinstance(cb._saves, TierSaves) else None
        point = _hf_tiers.resume_point(trainer, store, ours, name, name_format)
    else:
        point = _hf_store.resume_point(store, name, name_format)
    if point is None:  # a fresh store, or no tier holds a step
        return trainer.train(**train_kwargs)
    return train_from(trainer, point, train_kwargs)

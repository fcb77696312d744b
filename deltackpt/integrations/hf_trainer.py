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

**Tiers.** Pass a :class:`deltackpt.tiers.Tiers` where a store goes (callback and
``resume_trainer``): every rank saves to its node's local tier, with peer replicas and durable
versions (:mod:`deltackpt.integrations.hf_tiers`).

Not covered: DeepSpeed and FSDP (they checkpoint through their own engines; refused with an
error), ``save_strategy="best"`` (decided after ``on_evaluate``), the ``GradScaler`` of fp16
training (not saved: the scale re-grows after a resume, a warning says so), and the state of
``ExportableState`` callbacks other than ``TrainerControl`` (``EarlyStoppingCallback``'s
counter), which a callback cannot reach: it is saved as it was when training started.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import tempfile
import warnings
from collections.abc import Callable, Iterator
from typing import Any

from transformers import Trainer, TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from deltackpt import rng as _rng
from deltackpt.checkpointer import OWNER_KEY, RNG_KEY, Checkpointer, restore_into, to_saveable
from deltackpt.errors import InvalidArgumentError, ManifestError, SnapshotNotFoundError
from deltackpt.format.manifest import Manifest
from deltackpt.format.tree import value_leaves
from deltackpt.integrations import hf_tiers as _tiers
from deltackpt.resume import restore_state
from deltackpt.store.store import Store, open_store
from deltackpt.tiers import TieredCheckpointer, Tiers

__all__ = ["DEFAULT_NAME_FORMAT", "DeltaCheckpointCallback", "latest_checkpoint", "resume_trainer"]

DEFAULT_NAME_FORMAT = "checkpoint-{step}"
STATE_KEY = _tiers.STATE_KEY  # the TrainerState's JSON text, a str value of the snapshot
TRAINER_STATE_NAME = "trainer_state.json"
_LOADERS = (
    "_load_from_checkpoint",
    "_load_optimizer_and_scheduler",
    "_load_scaler",
    "_load_rng_state",
)


class DeltaCheckpointCallback(TrainerCallback):
    """Save the Trainer's model, optimizer, scheduler, RNG and ``TrainerState`` to ``store``
    whenever the Trainer would save a checkpoint (see the module docstring).

    ``keep_last``: keep only this callback's newest N snapshots (others in the store are never
    touched). ``async_save``: return once the state is staged; the save of step N is awaited at
    the next save and at the end of training (default: off for a store, on for tiers). Other
    keyword arguments are :class:`~deltackpt.SaveOptions` fields. ``checkpointer.infos`` lists
    every committed save.

    ``store`` may be a :class:`deltackpt.tiers.Tiers`: every rank then saves its own state to
    its node's local tier (replicas to peers, durable versions every ``Tiers.persist_every``
    global steps; see :mod:`deltackpt.integrations.hf_tiers`); retention and storage options
    are set in the ``Tiers``. ``checkpointer`` is then the
    :class:`~deltackpt.tiers.TieredCheckpointer` (made on first use). ``handle_sigterm=True``
    (tiers only): on a SIGTERM every rank saves and persists that step, and training stops.
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
        _tiers.check_sigterm_option(handle_sigterm, isinstance(store, Tiers))
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
        self.tiers: _tiers.TierSaves | None = None
        self._checkpointer: Checkpointer | None = None
        if isinstance(store, Tiers):
            _tiers.refuse_store_options(keep_last, storage_options, save_options)
            async_ = True if async_save is None else async_save
            self.tiers = _tiers.TierSaves(store, async_, name_format, handle_sigterm)
        else:
            self._checkpointer = Checkpointer(
                store,
                every=1,
                keep_last=keep_last,
                async_=bool(async_save),
                name_format=name_format,
                rng=True,
                storage_options=storage_options,
                **save_options,
            )
        self._name_format = name_format
        self.replace_trainer_saves = replace_trainer_saves
        self._deferred = False

    @property
    def checkpointer(self) -> Checkpointer | TieredCheckpointer:
        if self.tiers is not None:
            return self.tiers.checkpointer
        assert self._checkpointer is not None
        return self._checkpointer

    @property
    def store(self) -> Store:
        if self._checkpointer is None:
            raise InvalidArgumentError(
                "DeltaCheckpointCallback(Tiers(...)).store: a tiered callback has no single "
                "store; use .checkpointer (a TieredCheckpointer) or its .tiers"
            )
        return self._checkpointer.store

    @property
    def name_format(self) -> str:
        return self._name_format

    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> TrainerControl:
        if self.tiers is not None:
            _ = self.tiers.checkpointer  # made now on every rank (it makes process groups)
        return control

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> TrainerControl:
        if self.tiers is not None:
            self.tiers.check_stop(control)  # SIGTERM: save, persist and stop at this step
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
        self.checkpointer.wait()  # tiers: the local save, its replicas and a durable version
        return control

    def close(self) -> None:
        """Wait for pending saves; a tiered callback also shuts its checkpointer down (the next
        training run makes a new one)."""
        if self.tiers is not None:
            self.tiers.close()
        else:
            self.checkpointer.wait()

    def _maybe_save(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, kw: Any
    ) -> TrainerControl:
        if not control.should_save:
            return control
        if self.tiers is None and not state.is_world_process_zero:
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
        if self.tiers is not None:
            self.tiers.save(state.global_step, live)
        else:
            self.checkpointer.save(state.global_step, live)
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
    st = store if isinstance(store, Store) else open_store(store, create=False)
    best = None
    for m in st.manifests():  # oldest first
        mark = m.metadata.get(OWNER_KEY) if isinstance(m.metadata, dict) else None
        if not isinstance(mark, dict) or mark.get("name_format") != name_format:
            continue
        step = mark.get("step")
        if type(step) is int and step >= 0 and m.name == name_format.format(step=step):
            best = m.name
    return best


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
    scheduler and RNG once ``train`` has built them (see :mod:`deltackpt.integrations.hf_tiers`).
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
        store = cb.tiers.tiers if cb.tiers is not None else cb.store
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
        ours = cb.tiers if cb is not None else None
        got = _tiers.restore_for_trainer(trainer, store, ours, name, name_format)
        if got is None:
            return trainer.train(**train_kwargs)
        step, tree = got
        text = _checked_text(tree.get(STATE_KEY), f"tier step {step}", f"step {step}")
        model = tree.pop("model", None)  # only with model_init: loaded once train() made it
        return _train_from(trainer, text, lambda live: tree, train_kwargs, model)
    st = store if isinstance(store, Store) else open_store(store)  # a fresh one is empty
    name = name if name is not None else latest_checkpoint(st, name_format)
    if name is None:
        return trainer.train(**train_kwargs)
    text = _state_text(st.manifest(name))
    chosen = name

    def fetch(live: dict[str, Any]) -> Any:
        return restore_state(st, chosen, live, to_saveable(live))

    return _train_from(trainer, text, fetch, train_kwargs)


def _train_from(
    trainer: Trainer,
    text: str,
    fetch: Callable[[dict[str, Any]], Any],
    kw: dict[str, Any],
    model: Any = None,
) -> Any:
    """``trainer.train(resume_from_checkpoint=<a folder holding only trainer_state.json>)`` with
    the Trainer's loaders replaced by loads of what ``fetch`` returns (and of ``model``, a
    loaded model state dict, if given)."""
    with tempfile.TemporaryDirectory(prefix="deltackpt-resume-") as d:
        with open(os.path.join(d, TRAINER_STATE_NAME), "w", encoding="utf-8") as f:
            f.write(text)
        with _loading_from(trainer, fetch, model):
            return trainer.train(resume_from_checkpoint=d, **kw)


def _state_text(m: Manifest) -> str:
    """The snapshot's TrainerState JSON, checked before the Trainer parses it."""
    text = next((node for path, node in value_leaves(m.tree) if path == STATE_KEY), None)
    return _checked_text(text, f"snapshot {m.name!r}", m.name)


def _checked_text(text: Any, where: str, snapshot: str) -> str:
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


@contextlib.contextmanager
def _loading_from(
    trainer: Trainer, fetch: Callable[[dict[str, Any]], Any], model: Any = None
) -> Iterator[None]:
    """Replace, on this trainer instance only and for one ``train`` call, the Trainer's
    checkpoint loaders by loads of ``fetch(live)`` (the loaded tree for the live state). Its
    order of calls: ``_load_from_checkpoint`` (before the optimizer exists: only ``model``, a
    loaded state dict, if given: the tiered restore's with ``model_init``),
    ``_load_optimizer_and_scheduler`` (everything but RNG, in place), ``_load_scaler``, then
    ``_load_rng_state`` once, where the Trainer puts its own RNG state back."""
    apply_rng: list[Any] = []

    pending = [model] if model is not None else []

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
        loaded = fetch(live)
        rng_state = _tiers.pop_rng_state(loaded, RNG_KEY, trainer.args)
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

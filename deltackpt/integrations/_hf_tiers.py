"""``DeltaCheckpointCallback`` over :class:`deltackpt.tiers.Tiers`: the saves and the resume
point of ``resume_trainer``.

**Saving.** At each save the Trainer decides on, *every* rank saves its own state (model,
optimizer, scheduler, ``TrainerState`` text and the RNG states of all ranks, gathered) to its
node's local tier through a :class:`~deltackpt.tiers.TieredCheckpointer` (async by default: the
call blocks while the state is staged), which replicates it to ``Tiers.replicas`` peers in the
background. The first save at or after each multiple of ``Tiers.persist_every`` (global steps)
also goes to the durable tier (a distributed snapshot named like the store path's,
``checkpoint-<global_step>``), in the background too. The checkpointer is made on the first
``on_train_begin`` (or by ``resume_trainer``), when the Trainer has set up ``torch.distributed``;
its process group is the default one.

**Resuming.** ``TieredCheckpointer.restore_latest`` picks the step and loads it in one call, and
the Trainer needs the ``trainer_state.json`` of that step before ``train`` builds its optimizer.
So the restore runs up front: the model is read in place into the Trainer's model (no copy), the
rest (optimizer moments, scheduler, RNG, ``TrainerState``) comes back as a loaded tree that the
Trainer's loaders hand to ``load_state_dict`` once the optimizer exists, as the store does with
the moments of a fresh optimizer. The cost is that tree held from before ``train`` until the
optimizer is built: one transient host copy of the optimizer state (of the whole state with
``model_init``, whose model only exists inside ``train``).

**RNG.** Each rank has its own generators. Every saved version holds all ranks' states as a list
(:data:`~deltackpt.integrations._hf_resume.RNG_BY_RANK`, one ``all_gather_object`` per save, a
few KiB per rank), so the durable tier, a distributed snapshot whose plain values come from
rank 0, restores every rank's own state too.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from deltackpt import rng as _rng
from deltackpt.errors import InvalidArgumentError
from deltackpt.integrations._hf_resume import RNG_BY_RANK, STATE_KEY, ResumePoint, checked_text
from deltackpt.tiers import TieredCheckpointer, Tiers

__all__ = ["TierSaves", "resume_point"]


def _default_group() -> Any:
    """The default process group when ``torch.distributed`` is set up, else None."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.group.WORLD
    return None


def _rank0_value(value: Any, process_group: Any) -> Any:
    """Rank 0's ``value`` on every rank: what the Trainer itself writes once, from rank 0 (its
    ``trainer_state.json``), so every rank saves the same plain value and a distributed save
    (which refuses plain values that differ between ranks) keeps it."""
    if process_group is None:
        return value
    import torch.distributed as dist

    if dist.get_world_size(process_group) == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=dist.get_global_rank(process_group, 0), group=process_group)
    return box[0]


def _gathered_rng(process_group: Any) -> list[Any]:
    """Every rank's RNG state (``deltackpt.get_rng_state()``), in rank order, on every rank."""
    mine = _rng.capture()
    if process_group is None:
        return [mine]
    import torch.distributed as dist

    world = dist.get_world_size(process_group)
    if world == 1:
        return [mine]
    out: list[Any] = [None] * world
    # as numpy arrays: all_gather_object cannot unpickle a torch tensor here (torch 2.13:
    # "UntypedStorage has no attribute dtype")
    dist.all_gather_object(out, _tree_map(mine, torch.Tensor, _Array.of), group=process_group)
    return [_tree_map(x, _Array, _Array.tensor) for x in out]


@dataclass(frozen=True)
class _Array:
    array: Any

    @staticmethod
    def of(t: torch.Tensor) -> _Array:
        return _Array(t.detach().cpu().numpy().copy())

    def tensor(self) -> torch.Tensor:
        return torch.from_numpy(self.array)


def _tree_map(tree: Any, kind: type, f: Any) -> Any:
    if isinstance(tree, kind):
        return f(tree)
    if isinstance(tree, dict):
        return {k: _tree_map(v, kind, f) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_tree_map(v, kind, f) for v in tree]
    return tree


@dataclass
class TierSaves:
    """The callback's tiered checkpointer, made on first use; its saves and its restore.

    ``persisted_at``: the global step of the newest durable version (or of the step resumed
    from); the next one goes out at the first save at or after the next multiple of
    ``Tiers.persist_every``."""

    tiers: Tiers
    async_: bool = True
    name_format: str = "checkpoint-{step}"
    handle_sigterm: bool = False
    persisted_at: int = 0
    stopping: bool = False  # a SIGTERM was agreed on: this step is saved and persisted
    _ckpt: TieredCheckpointer | None = field(default=None, repr=False)
    every_rank = True  # every rank saves its own state

    @classmethod
    def open(
        cls,
        tiers: Tiers,
        *,
        keep_last: int | None,
        async_save: bool | None,
        name_format: str,
        storage_options: dict[str, Any] | None,
        handle_sigterm: bool,
        save_options: dict[str, Any],
    ) -> TierSaves:
        """Refuses the store's options that a ``Tiers`` sets itself (or that do not apply)."""
        if keep_last is not None:
            raise InvalidArgumentError(
                f"DeltaCheckpointCallback(Tiers(...), keep_last={keep_last!r}): retention of the "
                "tiers is set in the Tiers; pass Tiers(keep_last=..., durable_keep_last=...) "
                "instead"
            )
        if storage_options is not None:
            raise InvalidArgumentError(
                "DeltaCheckpointCallback(Tiers(...), storage_options=...): the durable tier's "
                "options belong in Tiers(storage_options=...)"
            )
        if save_options:
            raise InvalidArgumentError(
                f"DeltaCheckpointCallback(Tiers(...)) does not take {sorted(save_options)}: the "
                "tiers choose their own save options; drop them (or save to a store instead)"
            )
        async_ = True if async_save is None else async_save  # default: on
        return cls(tiers, async_, name_format, handle_sigterm)

    @property
    def checkpointer(self) -> TieredCheckpointer:
        if self._ckpt is None:
            self._ckpt = TieredCheckpointer(
                self.tiers, process_group=_default_group(), async_=self.async_,
                name_format=self.name_format, handle_sigterm=self.handle_sigterm,
            )  # fmt: skip
        return self._ckpt

    def begin(self) -> None:
        _ = self.checkpointer  # made now on every rank (it makes process groups)

    def persist_due(self, step: int) -> bool:
        pe = self.tiers.persist_every
        return pe is not None and step // pe > self.persisted_at // pe

    def save(self, step: int, live: dict[str, Any]) -> None:
        """Save ``live`` (plus every rank's RNG state) as global step ``step``: to the local tier
        and its replicas, and to the durable tier when a persist is due. Every rank calls it."""
        ckpt = self.checkpointer
        live = {**live, RNG_BY_RANK: _gathered_rng(ckpt.pg)}
        if STATE_KEY in live:  # the Trainer writes its state from rank 0: so do the tiers
            live[STATE_KEY] = _rank0_value(live[STATE_KEY], ckpt.pg)
        persist = self.stopping or self.persist_due(step)
        ckpt.save(step, live, persist=persist)  # persisted from the local tier, in the background
        if persist:
            self.persisted_at = step
        if self.stopping:
            ckpt.wait()  # the SIGTERM path: committed before the Trainer stops

    def check_stop(self, control: Any) -> None:
        """With ``handle_sigterm``: every rank agrees (one tiny all-reduce per step) whether any
        got SIGTERM; if so, this step is saved and persisted and training stops after it."""
        if not self.handle_sigterm or self.stopping:
            return
        if self.checkpointer.stop_requested():
            self.stopping = True
            control.should_save = True
            control.should_training_stop = True

    def restore(self, model: Any) -> tuple[int, dict[str, Any]] | None:
        """Restore the newest step some tier holds: ``model`` (None: it is made later, by
        ``model_init``) in place, the rest as a loaded tree. Returns the step and the tree (with
        ``"model"`` only when ``model`` is None), or None when no tier holds a step."""
        ckpt = self.checkpointer
        state: dict[str, Any] = {} if model is None else {"model": model}
        ckpt.restore_latest(state)
        report = ckpt.last_restore
        if report is None or report.step is None:
            return None
        if model is not None:
            state.pop("model")
        self.persisted_at = report.step
        return report.step, state

    def wait(self) -> None:
        """The local save, its replicas and a durable version (nothing when none was made)."""
        if self._ckpt is not None:
            self._ckpt.wait()

    def close(self) -> None:
        """Shut the checkpointer down (the next training run makes a new one)."""
        if self._ckpt is not None:
            self._ckpt.close()
            self._ckpt = None


def resume_point(
    trainer: Any, tiers: Tiers, ours: TierSaves | None, name: str | None, name_format: str
) -> ResumePoint | None:
    """``resume_trainer``'s tiered restore (see :meth:`TierSaves.restore`), through the
    callback's own checkpointer ``ours`` when it serves these ``tiers``, else through one made
    for this restore only; None when no tier holds a step."""
    if name is not None:
        raise InvalidArgumentError(
            f"resume_trainer(trainer, Tiers(...), name={name!r}): a tiered restore picks the "
            "newest step every rank can assemble itself; drop name="
        )
    mine = ours is None or ours.tiers != tiers
    saves = ours if ours is not None and not mine else TierSaves(tiers, name_format=name_format)
    try:
        got = saves.restore(trainer.model if trainer.model_init is None else None)
    finally:
        if mine:
            saves.close()
    if got is None:
        return None
    step, tree = got
    text = checked_text(tree.get(STATE_KEY), f"tier step {step}", f"step {step}")
    model = tree.pop("model", None)  # only with model_init: loaded once train() made it
    return ResumePoint(text, lambda live: tree, model)

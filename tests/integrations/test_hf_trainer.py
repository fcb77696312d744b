"""``DeltaCheckpointCallback`` and ``resume_trainer`` under a real ``transformers.Trainer`` (CPU)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

from transformers import TrainerCallback

import deltackpt
from deltackpt import rng
from deltackpt.errors import InvalidArgumentError, SnapshotNotFoundError
from deltackpt.integrations.hf_trainer import (
    DeltaCheckpointCallback,
    latest_checkpoint,
    resume_trainer,
)
from tests.integrations._fork import run_and_kill
from tests.integrations._hf_run import (
    MAX_STEPS,
    CallAt,
    Interrupt,
    StopAtStep,
    make_trainer,
    weights,
)
from tests.integrations.conftest import same_bits

pytestmark = pytest.mark.slow


_same = same_bits


def _names(store: Path) -> list[str]:
    return [s.name for s in deltackpt.snapshots(store)]


def _reference(tmp_path: Path, **overrides: Any) -> dict[str, torch.Tensor]:
    """An uninterrupted run, started through resume_trainer on a fresh store (trains from 0)."""
    t = make_trainer(
        tmp_path / "ref", [DeltaCheckpointCallback(tmp_path / "ref-store")], **overrides
    )
    out = resume_trainer(t)
    assert out.global_step == MAX_STEPS
    return weights(t)


def test_sigkill_then_resume_matches_an_uninterrupted_run(tmp_path: Path) -> None:
    ref = _reference(tmp_path)
    store, out = tmp_path / "store", tmp_path / "run"
    deltackpt.save({"w": torch.ones(2)}, store, "by-hand", metadata={"step": 4})

    def crashing(at_kill_point):  # type: ignore[no-untyped-def]
        cb = DeltaCheckpointCallback(store, keep_last=2)
        make_trainer(out, [cb, CallAt(6, at_kill_point)]).train()  # saves at 4, killed in 7

    run_and_kill(crashing)
    assert _names(store) == ["by-hand", "checkpoint-4"]
    trainer = make_trainer(out, [DeltaCheckpointCallback(store, keep_last=2)], init_seed=9)
    result = resume_trainer(trainer)
    assert result.global_step == trainer.state.global_step == MAX_STEPS
    assert trainer.lr_scheduler.last_epoch == MAX_STEPS
    assert _same(weights(trainer), ref)
    assert _names(store) == ["by-hand", "checkpoint-8", "checkpoint-12"]  # keep_last=2, own only
    # the callback replaced the Trainer's own checkpoint folders
    assert not list(out.glob("checkpoint-*"))


def test_resume_without_the_rng_state_differs(tmp_path: Path, monkeypatch: Any) -> None:
    """The control: the RNG restore is what makes dropout after the resume match."""
    ref = _reference(tmp_path)
    store = tmp_path / "store"
    with pytest.raises(Interrupt):
        make_trainer(tmp_path / "run", [DeltaCheckpointCallback(store), StopAtStep(6)]).train()
    monkeypatch.setattr(rng, "prepare", lambda state, where: lambda: None)
    trainer = make_trainer(tmp_path / "run", [DeltaCheckpointCallback(store)], init_seed=9)
    resume_trainer(trainer)
    assert trainer.state.global_step == MAX_STEPS
    assert not _same(weights(trainer), ref)


def test_async_saves_and_saves_after_evaluation(tmp_path: Path) -> None:
    ref = _reference(tmp_path, evaluate=True)
    store = tmp_path / "store"
    order: list[tuple[str, int]] = []

    class Spy(TrainerCallback):
        def on_evaluate(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            order.append(("eval", state.global_step))

    callbacks: list[DeltaCheckpointCallback] = []

    def run(*extra: TrainerCallback, seed: int = 0) -> Any:
        cb = DeltaCheckpointCallback(store, keep_last=3, async_save=True)
        callbacks.append(cb)
        return make_trainer(tmp_path / "run", [Spy(), cb, *extra], init_seed=seed, evaluate=True)

    with pytest.raises(Interrupt):
        run(StopAtStep(9)).train()
    callbacks[0].checkpointer.wait()  # step 8's async save may still be committing
    # 8 steps per epoch: this resume starts at an epoch boundary (the other test: mid-epoch)
    assert latest_checkpoint(store) == "checkpoint-8"
    order.clear()
    trainer = run(seed=3)
    resume_trainer(trainer)
    assert order == [("eval", 12)]
    assert _names(store) == ["checkpoint-4", "checkpoint-8", "checkpoint-12"]
    assert _same(weights(trainer), ref)
    # saved after the evaluation of its step, as the Trainer's own save is: its log holds it
    state = json.loads(deltackpt.load(store, "checkpoint-8")["trainer_state"])
    assert any("eval_loss" in e and e["step"] == 8 for e in state["log_history"])


def test_tiny_llama_with_tied_embeddings_resumes_bit_exactly(tmp_path: Path) -> None:
    ref = _reference(tmp_path, llama=True, logging_strategy="no")
    store = tmp_path / "store"

    def run(*callbacks: TrainerCallback, seed: int = 0) -> Any:
        return make_trainer(
            tmp_path / "run", callbacks, init_seed=seed, llama=True, logging_strategy="no"
        )

    with pytest.raises(Interrupt):
        run(DeltaCheckpointCallback(store), StopAtStep(6)).train()
    trainer = run(DeltaCheckpointCallback(store), seed=4)
    resume_trainer(trainer)
    model = trainer.model
    assert model.lm_head.weight is model.model.embed_tokens.weight  # still tied after the load
    assert _same(weights(trainer), ref)
    assert not list((tmp_path / "run").glob("checkpoint-*"))


def test_resume_errors(tmp_path: Path) -> None:
    store = tmp_path / "store"
    deltackpt.save({"w": torch.ones(2)}, store, "other")
    t = make_trainer(tmp_path / "run")
    with pytest.raises(InvalidArgumentError, match="needs store="):
        resume_trainer(t)
    with pytest.raises(SnapshotNotFoundError, match="trainer_state"):
        resume_trainer(t, store, "other")
    with pytest.raises(InvalidArgumentError, match="chooses the checkpoint"):
        resume_trainer(t, store, resume_from_checkpoint=True)
    assert latest_checkpoint(store) is None

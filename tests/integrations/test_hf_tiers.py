"""``DeltaCheckpointCallback`` and ``resume_trainer`` given a ``Tiers`` instead of a store, under
a real ``transformers.Trainer`` (CPU): local tier after a SIGKILL, durable tier with the local
tier wiped, what each tier holds, and a 2-rank gloo DDP run resumed from a peer's replica."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")


import deltackpt
from deltackpt.errors import InvalidArgumentError, ManifestError
from deltackpt.integrations._hf_resume import rank_rng_state
from deltackpt.integrations.hf_trainer import RNG_BY_RANK, DeltaCheckpointCallback, resume_trainer
from deltackpt.tiers import Tiers
from tests.integrations._fork import run_and_kill
from tests.integrations._hf_run import (
    MAX_STEPS,
    CallAt,
    Interrupt,
    StopAtStep,
    TinyNet,
    make_trainer,
    weights,
)
from tests.integrations.conftest import same_bits

pytestmark = pytest.mark.slow


PERSIST_EVERY = 8  # saves every 4 steps (_hf_run.SAVE_STEPS): 4, 8, 12; durable: 8 only


REF_LOSSES: dict[int, float] = {}


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    """An uninterrupted run's final weights (no checkpointing: saves draw no random numbers);
    its losses per step go to REF_LOSSES."""
    torch.set_num_threads(1)
    t = make_trainer(tmp_path_factory.mktemp("ref"))
    assert t.train().global_step == MAX_STEPS
    REF_LOSSES.update(_losses(t))
    return weights(t)


def _losses(trainer: Any) -> dict[int, float]:
    return {e["step"]: e["loss"] for e in trainer.state.log_history if "loss" in e}


def _tiers(root: Path, **kw: Any) -> Tiers:
    args: dict[str, Any] = dict(
        local=root / "local", durable=root / "durable", replicas=0, persist_every=PERSIST_EVERY
    )
    args.update(kw)
    return Tiers(**args)


def _names(store: Path) -> list[str]:
    return [s.name for s in deltackpt.snapshots(store)]


def test_sigkill_then_resume_from_the_local_tier(tmp_path: Path, reference: Any) -> None:
    tiers, out = _tiers(tmp_path), tmp_path / "run"

    def crashing(at_kill_point):  # type: ignore[no-untyped-def]
        cb = DeltaCheckpointCallback(tiers)

        def kill() -> None:
            cb.checkpointer.wait()  # step 4's async save committed (else the tier holds nothing)
            at_kill_point()

        make_trainer(out, [cb, CallAt(6, kill)]).train()

    run_and_kill(crashing)  # saved step 4 to the local tier, killed in step 7
    assert _names(tmp_path / "local" / "rank-00000") == ["step-00000004"]
    assert not (tmp_path / "durable").exists() or _names(tmp_path / "durable") == []
    cb = DeltaCheckpointCallback(tiers)
    trainer = make_trainer(out, [cb], init_seed=9)
    result = resume_trainer(trainer)
    report = cb.checkpointer.last_restore
    assert report is not None and (report.step, report.sources) == (4, ("local",))
    assert result.global_step == trainer.state.global_step == MAX_STEPS
    assert trainer.lr_scheduler.last_epoch == MAX_STEPS
    assert same_bits(weights(trainer), reference)
    assert _losses(trainer) == REF_LOSSES and len(REF_LOSSES) == MAX_STEPS  # 1-4 from the save
    # on_train_end waited: keep_last=2 locally; the durable tier holds only the persist step
    assert _names(tmp_path / "local" / "rank-00000") == ["step-00000008", "step-00000012"]
    assert _names(tmp_path / "durable") == ["checkpoint-8"]
    assert cb.checkpointer.stats.persisted == 1
    assert not list(out.glob("checkpoint-*"))  # the callback replaced the Trainer's own saves


def _interrupted(tmp_path: Path, tiers: Tiers, at: int, **kw: Any) -> None:
    """Train with the tiered callback until ``at`` steps are done, then wait for its saves."""
    cb = DeltaCheckpointCallback(tiers)
    with pytest.raises(Interrupt):
        make_trainer(tmp_path / "run", [cb, StopAtStep(at)], **kw).train()
    cb.checkpointer.wait()  # an exception skips on_train_end: the async saves may be pending


def test_resume_from_the_durable_tier_with_the_local_tier_wiped(
    tmp_path: Path, reference: Any
) -> None:
    tiers = _tiers(tmp_path)
    _interrupted(tmp_path, tiers, 10)  # local 4 and 8, durable 8
    assert _names(tmp_path / "durable") == ["checkpoint-8"]
    shutil.rmtree(tmp_path / "local")  # the node's RAM disk is gone
    cb = DeltaCheckpointCallback(tiers)
    trainer = make_trainer(tmp_path / "run", [cb], init_seed=5)
    resume_trainer(trainer)
    report = cb.checkpointer.last_restore
    assert report is not None and (report.step, report.sources) == (8, ("durable",))
    assert same_bits(weights(trainer), reference)
    assert _names(tmp_path / "durable") == ["checkpoint-8"]  # 12: not a persist step
    assert _names(tmp_path / "local" / "rank-00000") == ["step-00000012"]


def test_sigterm_saves_and_persists_that_step_then_stops(tmp_path: Path, reference: Any) -> None:
    tiers = _tiers(tmp_path)
    cb = DeltaCheckpointCallback(tiers, handle_sigterm=True)
    trainer = make_trainer(tmp_path / "run", [cb, CallAt(6, lambda: os.kill(os.getpid(), 15))])
    try:
        assert trainer.train().global_step == 7  # the signal came in step 7: it stopped after it
    finally:
        cb.close()  # puts the previous SIGTERM handler back
    assert _names(tmp_path / "durable") == ["checkpoint-7"]  # not a persist step: the signal
    shutil.rmtree(tmp_path / "local")
    cb = DeltaCheckpointCallback(tiers)
    trainer = make_trainer(tmp_path / "run", [cb], init_seed=4)
    resume_trainer(trainer)
    report = cb.checkpointer.last_restore
    assert report is not None and (report.step, report.sources) == (7, ("durable",))
    assert same_bits(weights(trainer), reference)
    with pytest.raises(InvalidArgumentError, match="needs tiers"):
        DeltaCheckpointCallback(tmp_path / "store", handle_sigterm=True)


def test_a_newer_local_step_wins_and_a_plain_store_resume_reads_the_durable_tier(
    tmp_path: Path, reference: Any
) -> None:
    tiers = _tiers(tmp_path, persist_every=4, durable_keep_last=1)
    _interrupted(tmp_path, tiers, 11)  # local 4, 8; durable 8 (kept 1)
    assert _names(tmp_path / "durable") == ["checkpoint-8"]
    # a durable version is an ordinary store snapshot: the store path resumes from it too,
    # with the RNG of its rank (from the per-rank list)
    plain = make_trainer(tmp_path / "plain", [], init_seed=3)
    resume_trainer(plain, tmp_path / "durable")
    assert same_bits(weights(plain), reference)
    loaded = deltackpt.load(tmp_path / "durable", "checkpoint-8")
    assert isinstance(loaded[RNG_BY_RANK], list) and len(loaded[RNG_BY_RANK]) == 1
    # the tiered resume prefers the local tier when it holds the newest step
    cb = DeltaCheckpointCallback(tiers)
    trainer = make_trainer(tmp_path / "run", [cb], init_seed=7)
    resume_trainer(trainer, tiers)  # the callback's Tiers, passed explicitly
    report = cb.checkpointer.last_restore
    assert report is not None and (report.step, report.sources) == (8, ("local",))
    assert same_bits(weights(trainer), reference)
    assert _names(tmp_path / "durable") == ["checkpoint-12"]


def test_model_init_gets_its_weights_once_train_made_the_model(
    tmp_path: Path, reference: Any
) -> None:
    """With ``model_init`` the model exists only inside ``train``: the restore loads the whole
    state up front and the model once ``train`` made it."""
    tiers = _tiers(tmp_path, durable=None, persist_every=None)
    _interrupted(tmp_path, tiers, 6)  # local 4
    trainer = make_trainer(tmp_path / "run", [DeltaCheckpointCallback(tiers)], init_seed=2)
    made: list[torch.nn.Module] = []

    def model_init() -> torch.nn.Module:
        made.append(TinyNet())
        return made[-1]

    trainer.model_init = model_init
    resume_trainer(trainer)
    assert len(made) == 1 and trainer.model is made[0]
    assert same_bits(weights(trainer), reference)


def test_a_fresh_tier_trains_from_scratch(tmp_path: Path, reference: Any) -> None:
    cb = DeltaCheckpointCallback(_tiers(tmp_path, durable=None, persist_every=None))
    trainer = make_trainer(tmp_path / "run", [cb])
    assert resume_trainer(trainer).global_step == MAX_STEPS
    assert same_bits(weights(trainer), reference)
    assert cb.checkpointer.last_restore is not None
    assert cb.checkpointer.last_restore.step is None
    assert _names(tmp_path / "local" / "rank-00000") == ["step-00000008", "step-00000012"]
    cb.close()


def test_errors(tmp_path: Path) -> None:
    tiers = _tiers(tmp_path)
    with pytest.raises(InvalidArgumentError, match="keep_last"):
        DeltaCheckpointCallback(tiers, keep_last=3)
    with pytest.raises(InvalidArgumentError, match="storage_options"):
        DeltaCheckpointCallback(tiers, storage_options={"anon": True})
    with pytest.raises(InvalidArgumentError, match="min_chunk"):
        DeltaCheckpointCallback(tiers, min_chunk=4)
    with pytest.raises(InvalidArgumentError, match="async_save"):
        DeltaCheckpointCallback(tiers, async_save="yes")  # type: ignore[arg-type]
    cb = DeltaCheckpointCallback(tiers)
    with pytest.raises(InvalidArgumentError, match="no single store"):
        _ = cb.store
    assert cb.tiers is tiers
    t = make_trainer(tmp_path / "run", [cb])
    with pytest.raises(InvalidArgumentError, match="drop name="):
        resume_trainer(t, tiers, "checkpoint-4")
    # replicas need peers: a single process has none
    with pytest.raises(InvalidArgumentError, match="process_group"):
        resume_trainer(make_trainer(tmp_path / "r2"), _tiers(tmp_path, replicas=1))
    with pytest.raises(ManifestError, match="per-rank RNG"):
        rank_rng_state({"torch": 1}, 0, 1)
    with pytest.warns(RuntimeWarning, match="2 rank"):
        assert rank_rng_state([{}, {}], 0, 1) is None


def test_ddp_two_nodes_one_wiped_resumes_from_the_peer_replica(tmp_path: Path) -> None:
    """2 gloo ranks, each its own node: rank 1's node loses its local tier (its own state and
    rank 0's replica); the resume takes rank 1's state from the replica rank 0 holds."""
    from tests._dist import free_port, spawn
    from tests.integrations._hf_tiers_ddp import run_rank

    def both(phase: str) -> list[dict[str, Any]]:
        port = free_port()
        targets = [(run_rank, (r, 2, port, str(tmp_path), phase)) for r in range(2)]
        return [o.unwrap() for o in spawn(targets, timeout=90, fast_exit=True)]

    crashed = both("crash")
    assert all(c["stats"].replicas_committed == 2 for c in crashed)  # steps 4 and 8, each way
    assert _names(tmp_path / "durable") == ["checkpoint-8"]
    assert _names(tmp_path / "node0" / "replica-00001-on-00000") == [
        "step-00000004",
        "step-00000008",
    ]
    shutil.rmtree(tmp_path / "node1")
    resumed = both("resume")
    for r in range(2):
        report = resumed[r]["report"]
        assert (report.step, report.sources) == (8, ("local", "peer 0"))
        assert resumed[r]["global_step"] == MAX_STEPS
        got, ref = (
            {k: torch.from_numpy(v) for k, v in d.items()}
            for d in (resumed[r]["weights"], crashed[r]["reference"])
        )
        assert same_bits(got, ref)
    # rank 1's node holds its state again: the fetched step 8, then its own save of step 12
    assert _names(tmp_path / "node1" / "rank-00001") == ["step-00000008", "step-00000012"]

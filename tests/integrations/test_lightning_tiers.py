"""``DeltaCheckpointIO(Tiers(...))`` under a real ``lightning.pytorch.Trainer`` (CPU, tiny model).

The run of ``_lightning_fit``: 8 steps per epoch, 4 epochs; ``ModelCheckpoint`` (top 2 by loss,
``save_last=True``) saves ``epoch=..`` and ``last.ckpt`` at global steps 8, 16 and 32 (epoch 2's
loss is not in the top 2, and ``last.ckpt`` is only written alongside a top-k file);
``persist_every=16`` sends steps 16 and 32 to the durable tier.
"""

from __future__ import annotations

import json
import pickle
import shutil
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("lightning")

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback

import deltackpt
from deltackpt.errors import InvalidArgumentError, SnapshotNotFoundError, UnsupportedValueError
from deltackpt.integrations.lightning import OWNER_KEY, DeltaCheckpointIO
from deltackpt.tiers import Tiers
from tests._dist import free_port, run_ranks
from tests.integrations._fork import run_and_kill
from tests.integrations._lightning_fit import EPOCHS, StopAt, fit, weights
from tests.integrations._lightning_tiers_ranks import load_on_rank
from tests.integrations.conftest import same_bits

pytestmark = pytest.mark.slow


class _Interrupted(Exception):
    pass


class _SaveLastAt(Callback):
    """``trainer.save_checkpoint(<dirpath>/last.ckpt)`` at the start of global step ``step``."""

    def __init__(self, step: int, root: Path) -> None:
        self.step, self.path = step, root / "checkpoints" / "last.ckpt"

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step == self.step:
            trainer.save_checkpoint(self.path)


def _raise() -> None:
    raise _Interrupted


def _tiers(tmp: Path, **kw: Any) -> Tiers:
    args: dict[str, Any] = dict(
        local=tmp / "shm", durable=tmp / "durable", replicas=0, persist_every=16
    )
    args.update(kw)
    return Tiers(**args)


def _local(tmp: Path) -> set[str]:
    return {s.name for s in deltackpt.snapshots(tmp / "shm" / "rank-00000")}


def _durable(tmp: Path) -> set[str]:
    return {s.name for s in deltackpt.snapshots(tmp / "durable")}


def _files(root: Path) -> set[str]:
    return {p.name for p in (root / "checkpoints").iterdir()}


def _marker(root: Path, name: str) -> dict[str, Any]:
    return json.loads((root / "checkpoints" / name).read_text())  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    """An uninterrupted run through the tiers: what every resume must reproduce, bit for bit."""
    tmp = tmp_path_factory.mktemp("ref")
    io = DeltaCheckpointIO(_tiers(tmp))
    assert isinstance(io.tiers, Tiers) and io.async_save  # tiers: async by default
    _, module, mc = fit(tmp / "run", [io])
    kept = {Path(p).name for p in mc.best_k_models} | {"last.ckpt"}
    assert _files(tmp / "run") == kept  # removed paths lose their marker
    assert _marker(tmp / "run", "last.ckpt")["snapshot"] == "step-00000032"
    assert _local(tmp) == {"step-00000016", "step-00000032"}  # Tiers.keep_last=2
    assert _durable(tmp) == {"step-00000016", "step-00000032"}  # only persist steps
    return weights(module)


def test_sigkill_then_resume_last_from_the_local_tier(
    tmp_path: Path, reference: dict[str, torch.Tensor]
) -> None:
    root = tmp_path / "run"

    def crashing(at_kill_point):  # type: ignore[no-untyped-def]
        io = DeltaCheckpointIO(_tiers(tmp_path))

        def drained_then_killed() -> None:
            io.wait()  # the step-16 save and its markers are committed: a deterministic kill
            at_kill_point()

        fit(root, [io], extra=[StopAt(19, drained_then_killed)])

    run_and_kill(crashing)
    assert _marker(root, "last.ckpt")["step"] == 16
    assert _local(tmp_path) == {"step-00000008", "step-00000016"}
    assert _durable(tmp_path) == {"step-00000016"}

    io = DeltaCheckpointIO(_tiers(tmp_path))
    trainer, resumed, mc = fit(root, [io], ckpt_path="last", seed=123)  # another seed
    assert io.last_restore is not None
    assert (io.last_restore.step, io.last_restore.sources) == (16, ("local",))
    assert trainer.global_step == EPOCHS * 8
    assert same_bits(weights(resumed), reference)
    assert _files(root) == {Path(p).name for p in mc.best_k_models} | {"last.ckpt"}
    assert _durable(tmp_path) == {"step-00000016", "step-00000032"}


def test_sigkill_with_saves_in_flight_resumes_from_what_committed(
    tmp_path: Path, reference: dict[str, torch.Tensor]
) -> None:
    """Killed right after the step-16 saves returned (local commit, markers and the durable
    version still in flight): a marker never names an uncommitted step, and the resume takes
    the newest step some tier committed (8 or 16), bit-exactly either way."""
    root = tmp_path / "run"

    def crashing(at_kill_point):  # type: ignore[no-untyped-def]
        class Killed(DeltaCheckpointIO):
            def save_checkpoint(self, checkpoint, path, storage_options=None):  # type: ignore[no-untyped-def]
                super().save_checkpoint(checkpoint, path, storage_options)
                if checkpoint["global_step"] == 16 and Path(path).name == "last.ckpt":
                    at_kill_point()

        fit(root, [Killed(_tiers(tmp_path))])

    run_and_kill(crashing)
    marked = _marker(root, "last.ckpt")["step"]
    assert marked in (8, 16) and f"step-{marked:08d}" in _local(tmp_path)
    io = DeltaCheckpointIO(_tiers(tmp_path))
    trainer, resumed, _ = fit(root, [io], ckpt_path="last", seed=9)
    assert io.last_restore is not None and io.last_restore.step in (8, 16)
    assert io.last_restore.step >= marked
    assert trainer.global_step == EPOCHS * 8
    assert same_bits(weights(resumed), reference)


def test_local_tier_wiped_resumes_from_the_durable_tier(
    tmp_path: Path, reference: dict[str, torch.Tensor]
) -> None:
    root = tmp_path / "run"
    io = DeltaCheckpointIO(_tiers(tmp_path))
    # saved 8, 16 and (by hand, mid-epoch) 20; persisted 16 only (20 // 16 == 16 // 16)
    with pytest.raises(_Interrupted):
        fit(root, [io], extra=[_SaveLastAt(20, root), StopAt(22, _raise)])
    io.teardown()  # Lightning tears down on an exception too; idempotent
    assert _marker(root, "last.ckpt")["step"] == 20
    assert _local(tmp_path) == {"step-00000016", "step-00000020"}
    assert _durable(tmp_path) == {"step-00000016"}
    shutil.rmtree(tmp_path / "shm")  # the node rebooted: its RAM disk is empty

    probe = DeltaCheckpointIO(_tiers(tmp_path))  # fit() silences warnings: look here
    with pytest.warns(RuntimeWarning, match="names step 20.*newest step.*is 16"):
        assert probe.load_checkpoint(root / "checkpoints" / "last.ckpt")["global_step"] == 16
    probe.teardown()

    io = DeltaCheckpointIO(_tiers(tmp_path))
    trainer, resumed, _ = fit(root, [io], ckpt_path="last", seed=5)
    assert io.last_restore is not None
    assert (io.last_restore.step, io.last_restore.tier) == (16, "durable")
    assert trainer.global_step == EPOCHS * 8
    assert same_bits(weights(resumed), reference)
    assert _durable(tmp_path) == {"step-00000016", "step-00000032"}


def test_load_a_given_path_restores_its_step_or_names_what_is_held(tmp_path: Path) -> None:
    io = DeltaCheckpointIO(_tiers(tmp_path, keep_last=1, persist_every=2), async_save=False)
    d = tmp_path / "ckpts"
    for step in (1, 2, 3):
        sd = {"w": torch.full((4,), float(step))}
        io.save_checkpoint({"global_step": step, "state_dict": sd}, d / f"step={step}.ckpt")
    io.teardown()
    # step 3 from the local tier, step 2 from the durable tier (local keeps 1), step 1: gone
    fresh = DeltaCheckpointIO(_tiers(tmp_path, keep_last=1, persist_every=2))
    assert fresh.load_checkpoint(d / "step=3.ckpt")["state_dict"]["w"][0] == 3
    assert fresh.load_checkpoint(d / "step=2.ckpt")["state_dict"]["w"][0] == 2
    with pytest.raises(SnapshotNotFoundError, match=r"step=1\.ckpt.*step 1.*\[3\].*\[2\]"):
        fresh.load_checkpoint(d / "step=1.ckpt")
    with pytest.raises(SnapshotNotFoundError, match="no marker"):
        fresh.load_checkpoint(d / "nothing.ckpt")
    torch.save({"a": 1}, d / "torch.ckpt")
    with pytest.raises(InvalidArgumentError, match="not a marker"):
        fresh.load_checkpoint(d / "torch.ckpt")
    # remove_checkpoint drops the marker only; the tiers keep what their retention keeps
    fresh.remove_checkpoint(d / "step=3.ckpt")
    assert not (d / "step=3.ckpt").exists() and _local(tmp_path) == {"step-00000003"}
    fresh.teardown()


def test_values_and_attribute_dicts_round_trip(tmp_path: Path) -> None:
    from lightning.fabric.utilities.data import AttributeDict

    io = DeltaCheckpointIO(_tiers(tmp_path, durable=None, persist_every=None))
    ckpt = {"global_step": 5, "hyper_parameters": AttributeDict(lr=0.1), "x": torch.arange(3)}
    io.save_checkpoint(ckpt, tmp_path / "c" / "last.ckpt")
    back = io.load_checkpoint(tmp_path / "c" / "last.ckpt")  # waits for the async save
    assert type(back["hyper_parameters"]) is AttributeDict and back["hyper_parameters"].lr == 0.1
    assert torch.equal(back["x"], torch.arange(3)) and OWNER_KEY not in back
    t = threading.Thread(target=io.save_checkpoint, args=({"global_step": 9}, tmp_path / "b"))
    with pytest.warns(RuntimeWarning, match="background thread"):
        t.start()
        t.join(60)
    with pytest.raises(UnsupportedValueError, match="never pickle"):
        io.save_checkpoint({"global_step": 6, "o": object()}, tmp_path / "c" / "o.ckpt")
    io.teardown()


def test_bad_combinations_are_typed_errors(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgumentError, match=r"replicas=1.*rank 0 only.*replicas=0"):
        DeltaCheckpointIO(Tiers(local=tmp_path / "shm"))  # Tiers' default: one replica
    for kw in ({"allow_pickle": True}, {"gc_on_remove": False}, {"threads": 2}):
        with pytest.raises(InvalidArgumentError, match="only async_save= and rng="):
            DeltaCheckpointIO(_tiers(tmp_path), **kw)
    with pytest.raises(InvalidArgumentError, match="expected True or False"):
        DeltaCheckpointIO(_tiers(tmp_path), async_save="yes")
    io = DeltaCheckpointIO(_tiers(tmp_path))
    with pytest.raises(InvalidArgumentError, match="no single store"):
        _ = io.store
    with pytest.raises(InvalidArgumentError, match="global_step"):
        io.save_checkpoint({"state_dict": {}}, tmp_path / "a.ckpt")
    with pytest.raises(InvalidArgumentError, match="reserves"):
        io.save_checkpoint({"global_step": 1, OWNER_KEY: 1}, tmp_path / "a.ckpt")
    with pytest.raises(InvalidArgumentError, match="storage options"):
        io.save_checkpoint({"global_step": 1}, tmp_path / "a.ckpt", storage_options={"a": 1})
    io.teardown()


def test_every_rank_loads_what_rank_0_restored(tmp_path: Path) -> None:
    """Lightning calls load_checkpoint on every rank (DDP): rank 0 restores from the tiers and
    broadcasts; the others get the same dict and RNG state, or a DistributedError."""
    tiers = _tiers(tmp_path)
    path = tmp_path / "c" / "last.ckpt"
    io = DeltaCheckpointIO(tiers, async_save=False)
    torch.manual_seed(3)
    io = pickle.loads(pickle.dumps(io))  # ddp_spawn pickles the plug-in
    io.save_checkpoint({"global_step": 7, "state_dict": {"w": torch.arange(4.0)}}, path)
    expected = torch.rand(1).item()  # the first draw after the saved RNG state
    io.teardown()
    got = run_ranks(load_on_rank, 2, free_port(), tiers, str(path), timeout=120)
    for out in got:
        assert out["step"] == 7 and out["w"] == [0.0, 1.0, 2.0, 3.0]
        assert out["draw"] == expected
    assert [o["error"] for o in got] == ["SnapshotNotFoundError", "DistributedError"]

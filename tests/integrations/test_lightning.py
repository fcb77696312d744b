"""``DeltaCheckpointIO`` under a real ``lightning.pytorch.Trainer`` (CPU, tiny model)."""

from __future__ import annotations

import argparse
import contextlib
import json
import pickle
import threading
from pathlib import Path

import pytest
import torch

pytest.importorskip("lightning")

from lightning.pytorch.plugins.io import AsyncCheckpointIO

import deltackpt
from deltackpt.errors import (
    InvalidArgumentError,
    SnapshotExistsError,
    UnsupportedValueError,
)
from deltackpt.integrations import _lightning_store
from deltackpt.integrations.lightning import OWNER_KEY, DeltaCheckpointIO
from deltackpt.integrations.markers import snapshot_name
from deltackpt.store.store import validate_name
from tests.integrations._fork import run_and_kill
from tests.integrations._lightning_fit import EPOCHS, StopAt, fit, weights
from tests.integrations.conftest import same_bits

pytestmark = pytest.mark.slow


_same = same_bits


def _names(store: Path) -> set[str]:
    return {s.name for s in deltackpt.snapshots(store)}


def _files(root: Path) -> set[str]:
    return {p.name for p in (root / "checkpoints").iterdir()}


class _Interrupted(Exception):
    pass


def _raise() -> None:
    raise _Interrupted


class _Spy(DeltaCheckpointIO):
    """Records what Lightning asked to remove."""

    removed: list[str]

    def remove_checkpoint(self, path):  # type: ignore[no-untyped-def]
        self.removed.append(Path(path).name)
        super().remove_checkpoint(path)


def test_sigkill_then_resume_last_matches_an_uninterrupted_run(tmp_path: Path) -> None:
    _, ref, _ = fit(tmp_path / "ref", [DeltaCheckpointIO(tmp_path / "ref-store")])
    store, root = tmp_path / "store", tmp_path / "run"

    def crashing(at_kill_point):  # type: ignore[no-untyped-def]
        # mid epoch 2 (8 steps per epoch): epochs 0 and 1 are saved, last.ckpt is epoch 1
        fit(root, [DeltaCheckpointIO(store)], extra=[StopAt(19, at_kill_point)])

    run_and_kill(crashing)
    assert "last.ckpt" in _names(store) and "last.ckpt" in _files(root)
    marker = json.loads((root / "checkpoints" / "last.ckpt").read_text())
    assert marker["snapshot"] == "last.ckpt" and marker["step"] == 16

    # another seed: everything that matters must come from the checkpoint
    trainer, resumed, mc = fit(root, [DeltaCheckpointIO(store)], ckpt_path="last", seed=123)
    assert trainer.global_step == EPOCHS * 8
    assert _same(weights(resumed), weights(ref))
    kept = {Path(p).name for p in mc.best_k_models} | {"last.ckpt"}
    assert _names(store) == kept == _files(root)


def test_sigkill_between_commit_and_marker(tmp_path: Path) -> None:
    """Killed after a snapshot's commit, before its marker: the marker files still name only
    committed snapshots, the resume starts from the previous last.ckpt, re-saves over the
    orphan, and ends bit-identical to an uninterrupted run."""
    _, ref, _ = fit(tmp_path / "ref", [DeltaCheckpointIO(tmp_path / "ref-store")])
    store, root = tmp_path / "store", tmp_path / "run"

    def crashing(at_kill_point):  # type: ignore[no-untyped-def]
        real = _lightning_store.write_marker

        def write_marker(path, store_root, name, step):  # type: ignore[no-untyped-def]
            if name == "epoch=1-step=16.ckpt":
                at_kill_point()
            real(path, store_root, name, step)

        _lightning_store.write_marker = write_marker  # in the forked child only
        fit(root, [DeltaCheckpointIO(store)])

    run_and_kill(crashing)
    assert _names(store) == {"epoch=0-step=8.ckpt", "epoch=1-step=16.ckpt", "last.ckpt"}
    assert _files(root) == {"epoch=0-step=8.ckpt", "last.ckpt"}
    assert deltackpt.load(store, "last.ckpt")["global_step"] == 8
    _, resumed, mc = fit(root, [DeltaCheckpointIO(store)], ckpt_path="last", seed=11)
    assert _same(weights(resumed), weights(ref))
    kept = {Path(p).name for p in mc.best_k_models} | {"last.ckpt"}
    assert _names(store) == kept == _files(root)


def test_resume_without_rng_state_differs(tmp_path: Path) -> None:
    """The control for the test above: without the RNG state, shuffles and dropout differ."""
    _, ref, _ = fit(tmp_path / "ref", [DeltaCheckpointIO(tmp_path / "ref-store", rng=False)])
    store, root = tmp_path / "store", tmp_path / "run"
    with pytest.raises(_Interrupted):
        fit(root, [DeltaCheckpointIO(store, rng=False)], extra=[StopAt(19, _raise)])
    _, resumed, _ = fit(root, [DeltaCheckpointIO(store, rng=False)], ckpt_path="last", seed=123)
    assert not _same(weights(resumed), weights(ref))


def test_top_k_removes_only_what_model_checkpoint_asked(tmp_path: Path) -> None:
    store = tmp_path / "store"
    deltackpt.save({"w": torch.ones(3)}, store, "by-hand", metadata={"step": 8})
    # a snapshot named like one ModelCheckpoint writes, but for another directory: never removed
    # (and never overwritten: ModelCheckpoint's first file is epoch=0-step=8.ckpt)
    other = DeltaCheckpointIO(store)
    other.save_checkpoint(
        {"global_step": 1, "x": torch.zeros(2)}, tmp_path / "elsewhere" / "e.ckpt"
    )
    io = _Spy(store)
    io.removed = []
    _, _, mc = fit(tmp_path / "run", [io])
    kept = {Path(p).name for p in mc.best_k_models} | {"last.ckpt"}
    assert len(kept) == 3 and io.removed  # top 2 + last; 4 epochs: some were removed
    assert _names(store) == kept | {"by-hand", "e.ckpt"}
    assert _files(tmp_path / "run") == kept
    assert not set(io.removed) & kept
    for name in kept:
        meta = deltackpt.open_store(store).manifest(name).metadata
        assert meta[OWNER_KEY]["path"] == str(tmp_path / "run" / "checkpoints" / name)
    # removing a path whose snapshot was written for another path leaves that snapshot alone
    io.remove_checkpoint(tmp_path / "run" / "checkpoints" / "e.ckpt")
    assert "e.ckpt" in _names(store)
    assert deltackpt.verify(store).ok

    # fit(ckpt_path=<a top-k file>) restores exactly that checkpoint (here: nothing left to train)
    newest = max(mc.best_k_models, key=lambda p: int(Path(p).stem.split("step=")[1]))
    saved = deltackpt.load(store, Path(newest).name)
    trainer, module, _ = fit(tmp_path / "run", [DeltaCheckpointIO(store)], ckpt_path=newest, seed=7)
    assert trainer.global_step == saved["global_step"] == EPOCHS * 8
    assert _same(weights(module), saved["state_dict"])


def test_async_save_resumes_bit_exactly_and_keeps_only_top_k(tmp_path: Path) -> None:
    _, ref, _ = fit(tmp_path / "ref", [DeltaCheckpointIO(tmp_path / "ref-store")])
    store, root = tmp_path / "store", tmp_path / "run"
    io = DeltaCheckpointIO(store, async_save=True)
    with pytest.raises(_Interrupted):
        fit(root, [io], extra=[StopAt(19, _raise)])
    io.teardown()  # Lightning tears down on an exception too; idempotent
    trainer, resumed, mc = fit(
        root, [DeltaCheckpointIO(store, async_save=True)], ckpt_path="last", seed=5
    )
    assert _same(weights(resumed), weights(ref))
    kept = {Path(p).name for p in mc.best_k_models} | {"last.ckpt"}
    assert _names(store) == kept == _files(root)
    last = deltackpt.open_store(store).manifest("last.ckpt").metadata
    assert last["step"] == trainer.global_step == EPOCHS * 8


def test_lightning_async_checkpoint_io_wrapper(tmp_path: Path) -> None:
    """AsyncCheckpointIO(DeltaCheckpointIO(...)): saves in its thread, top-k exact, resume works
    (RNG is captured late on its thread, hence rng=False and no bit-exactness claim here)."""
    store, root = tmp_path / "store", tmp_path / "run"
    with pytest.raises(_Interrupted):
        fit(
            root,
            [AsyncCheckpointIO(DeltaCheckpointIO(store, rng=False))],
            extra=[StopAt(19, _raise)],
        )
    trainer, _, mc = fit(
        root, [AsyncCheckpointIO(DeltaCheckpointIO(store, rng=False))], ckpt_path="last", seed=5
    )
    assert trainer.global_step == EPOCHS * 8
    kept = {Path(p).name for p in mc.best_k_models} | {"last.ckpt"}
    assert _names(store) == kept == _files(root)
    io = DeltaCheckpointIO(tmp_path / "s2")  # rng=True: say that the RNG state comes late
    t = threading.Thread(target=io.save_checkpoint, args=({"global_step": 1}, tmp_path / "a.ckpt"))
    with pytest.warns(RuntimeWarning, match="background thread"):
        t.start()
        t.join(60)


def test_values_that_need_pickle_name_the_key_and_need_the_opt_in(tmp_path: Path) -> None:
    ns = argparse.Namespace(lr=0.1)  # an argparse result passed as a hyper-parameter
    ckpt = {"global_step": 3, "state_dict": {"w": torch.ones(2)}, "hyper_parameters": {"o": ns}}
    path = tmp_path / "c" / "x.ckpt"
    with pytest.raises(UnsupportedValueError, match=r"hyper_parameters/o.*allow_pickle=True"):
        DeltaCheckpointIO(tmp_path / "s").save_checkpoint(ckpt, path)
    assert not path.exists()  # no marker without a committed snapshot
    DeltaCheckpointIO(tmp_path / "s", allow_pickle=True).save_checkpoint(ckpt, path)
    back = DeltaCheckpointIO(tmp_path / "s", allow_pickle=True).load_checkpoint(path)
    assert back["hyper_parameters"]["o"] == ns
    with pytest.raises(deltackpt.errors.PickleNotAllowedError):
        DeltaCheckpointIO(tmp_path / "s").load_checkpoint(path)
    with pytest.raises(deltackpt.errors.PickleNotAllowedError):  # weights_only never unpickles
        DeltaCheckpointIO(tmp_path / "s", allow_pickle=True).load_checkpoint(
            path, weights_only=True
        )


def test_names_markers_and_foreign_snapshots(tmp_path: Path) -> None:
    assert snapshot_name("/a/b/epoch=0-step=10.ckpt") == "epoch=0-step=10.ckpt"
    odd = snapshot_name("/a/b/my run: ..best.ckpt")
    assert odd != snapshot_name("/a/b/my run: ..best2.ckpt")
    for n in (odd, snapshot_name("/x/latest"), snapshot_name("/x/.hidden"), snapshot_name("/x/")):
        validate_name(n)
    store = tmp_path / "s"
    deltackpt.save({"w": torch.ones(1)}, store, "last.ckpt")  # not ours
    io = DeltaCheckpointIO(store)
    assert io.tiers is None and io.checkpointer is None and not io.async_save
    io = pickle.loads(pickle.dumps(io))  # ddp_spawn pickles the plug-in: its configuration
    assert io.store.root == deltackpt.open_store(store).root
    with pytest.raises(SnapshotExistsError, match="did not write"):
        io.save_checkpoint({"global_step": 1}, tmp_path / "d" / "last.ckpt")
    io.remove_checkpoint(tmp_path / "d" / "last.ckpt")  # Lightning asks: not ours, kept
    assert "last.ckpt" in _names(store)
    torch_file = tmp_path / "d" / "t.ckpt"
    torch_file.parent.mkdir(exist_ok=True)
    torch.save({"a": 1}, torch_file)
    with pytest.raises(InvalidArgumentError, match="not a deltackpt marker"):
        io.load_checkpoint(torch_file)
    # a marker reached through a symlink (save_last="link") loads the snapshot it names
    io.save_checkpoint({"global_step": 2, "w": torch.arange(3)}, tmp_path / "d" / "e.ckpt")
    (tmp_path / "d" / "link.ckpt").symlink_to("e.ckpt")
    assert torch.equal(io.load_checkpoint(tmp_path / "d" / "link.ckpt")["w"], torch.arange(3))
    io.remove_checkpoint(tmp_path / "d" / "link.ckpt")  # removes the link, not e.ckpt
    assert "e.ckpt" in _names(store) and (tmp_path / "d" / "e.ckpt").exists()
    with contextlib.suppress(FileNotFoundError):
        assert not (tmp_path / "d" / "link.ckpt").is_symlink()
    with pytest.raises(InvalidArgumentError, match="storage options"):
        io.save_checkpoint({"global_step": 3}, tmp_path / "d" / "f.ckpt", storage_options={"a": 1})

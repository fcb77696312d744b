"""Checkpointer(fold_max_chain=K) (issue 39): after each committed save the snapshot is folded on
one background thread, so a fresh reader of it walks at most K delta links; folds coalesce to
the newest snapshot, only rank 0 folds, a failed fold warns and training goes on, and retention
deleting a snapshot while it is folded is fine. Chain depth is measured as in
tests/store/test_fold.py (``deepest_chain`` of the manifest)."""

from __future__ import annotations

import threading
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import deltackpt
import deltackpt.checkpointer as checkpointer_mod
from deltackpt.errors import InvalidArgumentError, SnapshotNotFoundError
from deltackpt.store.fold import deepest_chain
from deltackpt.store.store import Store
from tests.store.test_fold import CHUNK, _step, _u8
from tests.store.test_fold import _state as fold_state

POSITIONS = 4
STEPS = 8


def _state() -> dict[str, torch.Tensor]:
    return fold_state(positions=POSITIONS)


def _store(tmp_path: Path) -> Store:
    return deltackpt.open_store(tmp_path / "s", chunk_bytes=CHUNK, small_bytes=CHUNK)


def _ckpt(st: Store, **kw: Any) -> deltackpt.Checkpointer:
    return deltackpt.Checkpointer(st, every=1, rng=False, encoding="smallest", **kw)


def _train(
    ckpt: deltackpt.Checkpointer, steps: int = STEPS, *, wait: bool = False
) -> dict[str, dict[str, torch.Tensor]]:
    """Save ``steps`` RL-like versions; return the state each snapshot must hold."""
    sd, g = _state(), torch.Generator().manual_seed(1)
    saved = {}
    for step in range(steps):
        ckpt.save(step, sd)
        if wait:
            ckpt.wait()  # the save committed and its fold finished
        saved[ckpt.name(step)] = {k: t.clone() for k, t in sd.items()}
        _step(sd, g)
    ckpt.close()
    return saved


def _assert_loads(st: Store, saved: dict[str, dict[str, torch.Tensor]]) -> None:
    names = st.names()
    assert names, "no snapshot left"
    for name in names:
        got = deltackpt.load(st, name)
        want = saved[name]
        assert got.keys() == want.keys()
        for k in want:
            assert np.array_equal(_u8(got[k]), _u8(want[k])), (name, k)


@pytest.mark.parametrize("async_", [True, False], ids=["async", "sync"])
def test_every_snapshot_keeps_at_most_max_chain_links(tmp_path, async_):
    st = _store(tmp_path)
    ckpt = _ckpt(st, async_=async_, fold_max_chain=2)
    saved = _train(ckpt, wait=True)
    assert len(st.names()) == STEPS
    assert max(deepest_chain(st.manifest(n)) for n in st.names()) <= 2
    assert any(r.chunks_folded for r in ckpt.folds)  # the bound came from folds, not from saves
    assert all(r.deepest_after <= 2 for r in ckpt.folds)
    _assert_loads(st, saved)


def test_without_the_option_chains_grow(tmp_path):
    st = _store(tmp_path)
    ckpt = _ckpt(st)
    saved = _train(ckpt)
    assert deepest_chain(st.manifest(st.names()[-1])) == STEPS - 1
    assert ckpt.folds == []
    _assert_loads(st, saved)


def test_the_newest_snapshot_is_folded_without_waiting_between_saves(tmp_path):
    st = _store(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fold failed
        saved = _train(_ckpt(st, fold_max_chain=1))
    assert deepest_chain(st.manifest(st.names()[-1])) <= 1
    _assert_loads(st, saved)


def test_folds_coalesce_to_the_newest_snapshot(tmp_path, monkeypatch):
    """A fold still running when saves commit is followed by one fold: of the newest."""
    real = checkpointer_mod.fold
    entered, release = threading.Event(), threading.Event()
    calls: list[tuple[str, str]] = []

    def slow_fold(store: Any, name: str, **kw: Any) -> Any:
        calls.append((name, threading.current_thread().name))
        if len(calls) == 1:
            entered.set()
            assert release.wait(30)
        return real(store, name, **kw)

    monkeypatch.setattr(checkpointer_mod, "fold", slow_fold)
    st = _store(tmp_path)
    ckpt = _ckpt(st, async_=False, fold_max_chain=2)
    sd, g = _state(), torch.Generator().manual_seed(1)
    ckpt.save(0, sd)
    assert entered.wait(30)
    for step in range(1, 5):  # these commit while the fold of step 0 runs
        _step(sd, g)
        ckpt.save(step, sd)
    release.set()
    ckpt.close()
    assert [n for n, _ in calls] == [ckpt.name(0), ckpt.name(4)]
    assert all(t != threading.main_thread().name for _, t in calls)  # never the training thread
    assert deepest_chain(st.manifest(ckpt.name(4))) <= 2


def test_a_failing_fold_warns_once_and_training_goes_on(tmp_path, monkeypatch):
    def broken(store: Any, name: str, **kw: Any) -> Any:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(checkpointer_mod, "fold", broken)
    st = _store(tmp_path)
    ckpt = _ckpt(st, fold_max_chain=2)
    with pytest.warns(RuntimeWarning, match="background fold of snapshot") as rec:
        saved = _train(ckpt, steps=3, wait=True)
    fold_warnings = [w for w in rec if "background fold" in str(w.message)]
    assert len(fold_warnings) == 3  # one per failed fold, each reported once
    assert all("No space left" in str(w.message) for w in fold_warnings)
    assert len(st.names()) == 3 and ckpt.folds == []
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ckpt.close()  # already reported: not again
    _assert_loads(st, saved)


def test_a_snapshot_deleted_while_folding_is_skipped_quietly(tmp_path, monkeypatch):
    """Retention (or anyone) deleting the snapshot a fold works on: SnapshotNotFoundError from
    fold is no failure, and the snapshot is not brought back."""
    real = checkpointer_mod.fold
    raised: list[str] = []

    def deleted_meanwhile(store: Any, name: str, **kw: Any) -> Any:
        deltackpt.delete(store, name)
        try:
            return real(store, name, **kw)
        except SnapshotNotFoundError:
            raised.append(name)
            raise

    monkeypatch.setattr(checkpointer_mod, "fold", deleted_meanwhile)
    st = _store(tmp_path)
    ckpt = _ckpt(st, fold_max_chain=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _train(ckpt, steps=3, wait=True)
    assert raised == [ckpt.name(s) for s in range(3)]
    assert st.names() == [] and ckpt.folds == []


def test_retention_beside_background_folds(tmp_path):
    """keep_last deletes (and gc compacts) while the folds of newer snapshots run."""
    st = _store(tmp_path)
    ckpt = _ckpt(st, keep_last=2, fold_max_chain=1, chain_budget=8.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        saved = _train(ckpt)
    assert st.names() == [ckpt.name(STEPS - 2), ckpt.name(STEPS - 1)]
    assert deepest_chain(st.manifest(ckpt.name(STEPS - 1))) <= 1
    assert ckpt.folds[-1].snapshot == ckpt.name(STEPS - 1)  # the newest is always folded
    assert ckpt.folds[-1].chunks_folded > 0
    _assert_loads(st, saved)
    assert deltackpt.verify(st).ok


def test_only_rank_0_folds(tmp_path, monkeypatch):
    import torch.distributed as dist

    st = _store(tmp_path)
    for rank, folds in ((0, True), (1, False)):
        monkeypatch.setattr(dist, "get_rank", lambda group=None, r=rank: r)
        ckpt = deltackpt.Checkpointer(st, rng=False, process_group=object(), fold_max_chain=2)
        assert (ckpt._folder is not None) is folds


@pytest.mark.parametrize("bad", [0, -1, 65, True, 2.0, "2"], ids=repr)
def test_fold_max_chain_is_checked(tmp_path, bad):
    with pytest.raises(InvalidArgumentError, match=r"fold_max_chain=.*fold_max_chain=4"):
        deltackpt.Checkpointer(tmp_path / "s", fold_max_chain=bad)
    assert not (tmp_path / "s").exists()


def test_fold_needs_a_lock_or_sole_writer_on_an_object_store(tmp_path):
    url = f"memory://fold-{tmp_path.name}"
    with pytest.raises(InvalidArgumentError, match="sole_writer=True"):
        deltackpt.Checkpointer(url, fold_max_chain=2)
    st = deltackpt.open_store(url, chunk_bytes=CHUNK, small_bytes=CHUNK)
    with pytest.raises(InvalidArgumentError, match="sole_writer=True"):
        deltackpt.Checkpointer(st, fold_max_chain=2)
    ckpt = deltackpt.Checkpointer(
        url, sole_writer=True, fold_max_chain=2, rng=False, encoding="smallest"
    )
    saved = _train(ckpt, steps=5, wait=True)
    st = ckpt.store
    assert len(st.names()) == 5
    assert max(deepest_chain(st.manifest(n)) for n in st.names()) <= 2
    assert any(r.chunks_folded for r in ckpt.folds)
    _assert_loads(st, saved)

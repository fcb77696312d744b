"""``deltackpt.Checkpointer(Tiers(...))`` in one process: a tiered checkpointer with the
Checkpointer's calls (a RAM-disk-like local tier every save, durable versions every
``persist_every`` steps). The multi-rank behaviour is in tests/distributed/test_tiers*.py."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

import deltackpt
from deltackpt.errors import InvalidArgumentError
from deltackpt.store.store import open_store
from deltackpt.tiers import TieredCheckpointer, Tiers


def _state(seed: int, device: str = "cpu") -> dict[str, Any]:
    torch.manual_seed(seed)
    model = torch.nn.Linear(64, 32).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return {"model": model, "opt": opt, "step": 0}


def _train(state: dict[str, Any], step: int) -> None:
    model, opt = state["model"], state["opt"]
    x = torch.full((4, 64), float(step), device=model.weight.device)
    loss = model(x).square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    state["step"] = step


def _tiers(root: Path) -> Tiers:
    return Tiers(local=root / "shm", durable=root / "durable", replicas=0, persist_every=2)


def test_checkpointer_of_tiers_saves_locally_persists_and_resumes(tmp_path: Path) -> None:
    ckpt = deltackpt.Checkpointer(_tiers(tmp_path), every=1)
    assert isinstance(ckpt, TieredCheckpointer)
    live = _state(0)
    snapshots: dict[int, dict[str, torch.Tensor]] = {}
    for step in range(5):
        _train(live, step)
        ckpt.maybe_save(step, live)
        snapshots[step] = {k: v.clone() for k, v in live["model"].state_dict().items()}
    ckpt.close()
    own = open_store(tmp_path / "shm" / "rank-00000", create=False)
    assert own.names() == ["step-00000003", "step-00000004"]  # Tiers(keep_last=2)
    assert open_store(tmp_path / "durable", create=False).names() == [
        "step-00000001",
        "step-00000003",
    ]

    fresh = _state(1)
    with deltackpt.Checkpointer(_tiers(tmp_path), every=1) as again:
        assert again.restore_latest(fresh) == 5
        assert again.last_restore.sources == ("local",)
    for k, v in fresh["model"].state_dict().items():
        assert torch.equal(v, snapshots[4][k]), k
    assert fresh["step"] == 4 and fresh["opt"].state_dict()["state"][0]["step"] == 5

    shutil.rmtree(tmp_path / "shm")  # the node rebooted: its RAM tier is gone
    fresh = _state(2)
    with deltackpt.Checkpointer(_tiers(tmp_path), every=1) as again:
        assert again.restore_latest(fresh) == 4
        assert again.last_restore.sources == ("durable",)
    for k, v in fresh["model"].state_dict().items():
        assert torch.equal(v, snapshots[3][k]), k


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"keep_last": 3}, "Tiers\\(keep_last="),
        ({"rng": True}, "does not save RNG"),
        ({"keep_every": 10}, "does not take \\['keep_every'\\]"),
        ({"storage_options": {}}, "does not take \\['storage_options'\\]"),
    ],
)
def test_checkpointer_arguments_that_do_not_apply_to_tiers_are_refused(
    tmp_path: Path, kwargs: dict[str, Any], match: str
) -> None:
    with pytest.raises(InvalidArgumentError, match=match):
        deltackpt.Checkpointer(_tiers(tmp_path), **kwargs)


def test_replicas_need_a_process_group(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgumentError, match="needs a process_group"):
        deltackpt.Checkpointer(Tiers(local=tmp_path / "shm", replicas=1))
    plain = deltackpt.Checkpointer(tmp_path / "plain", every=1)
    assert type(plain) is deltackpt.Checkpointer  # a store path is still a plain Checkpointer


def _corrupt_new_chunk(tiers: Tiers) -> str:
    """Flip a byte of a chunk the newest local snapshot has and the one before has not."""
    import numpy as np

    st = open_store(tiers.own_dir(0), create=False)
    names = [i.name for i in deltackpt.snapshots(st)]
    new = st.manifest(names[-1]).chunks
    d = sorted(set(new) - set(st.manifest(names[-2]).chunks))[0]
    data = np.fromfile(st.pack_path(new[d].pack), dtype=np.uint8)
    data[new[d].offset + new[d].length // 2] ^= 0xFF
    data.tofile(st.pack_path(new[d].pack))
    return d


def _two_steps(tiers: Tiers) -> list[dict[str, torch.Tensor]]:
    ckpt = TieredCheckpointer(tiers, every=1, async_=False)
    state = _state(0)
    saved = []
    for step in range(2):
        _train(state, step + 1)
        ckpt.maybe_save(step, state)
        saved.append({k: v.clone() for k, v in state["model"].state_dict().items()})
    ckpt.close()
    return saved


def test_a_damaged_own_snapshot_is_refused_before_anything_is_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A rank's own local snapshot is verified whole before any rank loads it: a damaged one is
    refused with the live state untouched (no copy of the state is kept to put it back), and
    the step before is restored, bit-exactly."""
    import deltackpt.tiers.checkpointer as tc

    tiers = Tiers(local=tmp_path / "shm", durable=None, replicas=0)
    saved = _two_steps(tiers)
    d = _corrupt_new_chunk(tiers)
    loads: list[str] = []
    real = tc.restore_state
    monkeypatch.setattr(
        tc, "restore_state", lambda st, name, *a: loads.append(name) or real(st, name, *a)
    )
    fresh = _state(1)
    again = TieredCheckpointer(tiers, every=1)
    assert again.restore_latest(fresh) == 1
    again.close()
    rep = again.last_restore
    assert rep is not None and rep.step == 0 and len(loads) == 1  # step 1 was never loaded
    assert len(rep.refused) == 1 and "step 1, rank 0, local" in rep.refused[0]
    assert "damaged" in rep.refused[0] and d in rep.refused[0]
    for k, v in fresh["model"].state_dict().items():
        assert torch.equal(v, saved[0][k]), k


def test_a_load_that_fails_after_verification_with_nothing_else_is_a_partial_restore_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A load that wrote into the state and then failed (an I/O or device error after every
    chunk was verified) is refused, the step before is loaded over it; when nothing else can
    be, PartialRestoreError says the state holds part of a step."""
    import deltackpt.tiers.checkpointer as tc
    from deltackpt.errors import PartialRestoreError

    tiers = Tiers(local=tmp_path / "shm", durable=None, replicas=0)
    saved = _two_steps(tiers)
    real = tc.restore_state
    fail = {"step-00000001"}

    def half_read(st: Any, name: str, state: Any, *a: Any) -> Any:
        if name in fail:
            with torch.no_grad():
                state["model"].weight.fill_(7.0)
            raise OSError("read failed halfway")
        return real(st, name, state, *a)

    monkeypatch.setattr(tc, "restore_state", half_read)
    fresh = _state(1)
    again = TieredCheckpointer(tiers, every=1)
    assert again.restore_latest(fresh) == 1  # step 0 loaded over the half-written step 1
    again.close()
    assert again.last_restore is not None and "read failed halfway" in again.last_restore.refused[0]
    for k, v in fresh["model"].state_dict().items():
        assert torch.equal(v, saved[0][k]), k

    fail.add("step-00000000")
    again = TieredCheckpointer(tiers, every=1)
    with pytest.raises(PartialRestoreError, match=r"step-00000000.*read failed halfway"):
        again.restore_latest(_state(2))
    again.close()


@pytest.mark.gpu
def test_a_tiered_restore_of_cuda_state_keeps_no_copy_of_it_on_the_device(tmp_path: Path) -> None:
    """CUDA model and optimizer state restored from the local tier, bit-exactly, in place: the
    device holds no second copy of the state while it runs (damage is refused before any
    write, so nothing is kept to put it back)."""
    tiers = Tiers(local=tmp_path / "shm", durable=None, replicas=0)
    state = _state(0, "cuda")
    _train(state, 1)
    ckpt = TieredCheckpointer(tiers, every=1, async_=False)
    ckpt.maybe_save(0, state)
    ckpt.close()
    want = {k: v.clone() for k, v in state["model"].state_dict().items()}
    fresh = _state(1, "cuda")
    _train(fresh, 2)  # its moments exist: read in place
    nbytes = sum(t.numel() * t.element_size() for t in fresh["model"].state_dict().values()) * 3
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    again = TieredCheckpointer(tiers, every=1)
    assert again.restore_latest(fresh) == 1
    again.close()
    torch.cuda.synchronize()
    assert torch.cuda.max_memory_allocated() - base < nbytes // 4
    for k, v in fresh["model"].state_dict().items():
        assert v.is_cuda and torch.equal(v, want[k]), k

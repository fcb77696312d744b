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


@pytest.mark.parametrize(
    ("device", "parked"),
    [
        ("cpu", False),
        ("cpu", True),
        pytest.param("cuda", True, marks=pytest.mark.gpu),
    ],
    ids=["copy-beside", "parked-on-host", "cuda-parked-on-host"],
)
def test_a_restore_that_fails_midway_puts_the_state_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, device: str, parked: bool
) -> None:
    """A load attempt that wrote into the live tensors and then failed, with nothing else to
    try: the state is put back bit-exactly, in the same tensor objects. ``parked``: the copy
    taken before the attempt is kept on the host, as for GPU state with no room beside it on
    the device (on "cpu" forced: the CPU stands in for the device)."""
    import deltackpt.tiers.checkpointer as tc

    ckpt = TieredCheckpointer(_tiers(tmp_path), every=1, async_=False)
    state = _state(0)
    for step in range(2):
        _train(state, step)
        ckpt.maybe_save(step, state)
    ckpt.close()

    fresh = _state(1, device)
    _train(fresh, 1)  # the optimizer holds moments: they must come back too
    weight = fresh["model"].weight
    moment = fresh["opt"].state[weight]["exp_avg"]
    want = {k: v.clone() for k, v in fresh["model"].state_dict().items()}
    want_moment = moment.clone()
    if parked:
        if device == "cpu":
            monkeypatch.setattr(tc, "is_device", lambda t: True)
        monkeypatch.setattr(tc, "device_room", lambda d, n: False)
    backups: list[Any] = []
    real_backup = tc._backup
    monkeypatch.setattr(
        tc, "_backup", lambda tree: backups.append(real_backup(tree)) or backups[-1]
    )

    def half_read(*args: Any, **kwargs: Any) -> Any:
        with torch.no_grad():
            weight.fill_(7.0)
            moment.fill_(7.0)
        raise OSError("read failed halfway")

    monkeypatch.setattr(tc, "restore_state", half_read)
    again = TieredCheckpointer(Tiers(local=tmp_path / "shm", durable=None, replicas=0), every=1)
    assert again.restore_latest(fresh) == 0
    again.close()
    assert again.last_restore is not None and again.last_restore.step is None
    assert any("read failed halfway" in r for r in again.last_restore.refused)
    kinds = {type(v).__name__ for v in backups[0]["model"].values()}
    assert kinds == ({"_Parked"} if parked else {"Tensor"}), kinds
    assert fresh["model"].weight is weight  # the module's own tensors, in place
    for k, v in fresh["model"].state_dict().items():
        assert torch.equal(v, want[k]), k
    assert torch.equal(fresh["opt"].state[weight]["exp_avg"], want_moment)
    assert want_moment.abs().sum() > 0


def test_a_damaged_own_snapshot_fails_its_load_and_the_one_before_is_restored(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The load of a rank's own local snapshot checks every chunk it reads, so no verify pass
    runs before it; a damaged chunk fails that attempt (after it wrote into the state) and the
    step before is loaded over it, bit-exactly."""
    import numpy as np

    import deltackpt.tiers.restore as tr

    tiers = Tiers(local=tmp_path / "shm", durable=None, replicas=0)
    ckpt = TieredCheckpointer(tiers, every=1, async_=False)
    state = _state(0)
    saved = []
    for step in range(2):
        _train(state, step + 1)
        ckpt.maybe_save(step, state)
        saved.append({k: v.clone() for k, v in state["model"].state_dict().items()})
    ckpt.close()
    st = open_store(tiers.own_dir(0), create=False)
    names = [i.name for i in deltackpt.snapshots(st)]
    new = st.manifest(names[1]).chunks
    d = sorted(set(new) - set(st.manifest(names[0]).chunks))[0]
    data = np.fromfile(st.pack_path(new[d].pack), dtype=np.uint8)
    data[new[d].offset + new[d].length // 2] ^= 0xFF
    data.tofile(st.pack_path(new[d].pack))

    passes: list[Any] = []
    real = tr.verify
    monkeypatch.setattr(tr, "verify", lambda *a, **k: passes.append(a) or real(*a, **k))
    fresh = _state(1)
    again = TieredCheckpointer(tiers, every=1)
    assert again.restore_latest(fresh) == 1
    again.close()
    assert passes == []  # no hashing pass before the loads
    rep = again.last_restore
    assert rep is not None and rep.step == 0
    assert len(rep.refused) == 1 and "step 1, rank 0, local" in rep.refused[0]
    assert "corrupt" in rep.refused[0] and d in rep.refused[0]
    for k, v in fresh["model"].state_dict().items():
        assert torch.equal(v, saved[0][k]), k

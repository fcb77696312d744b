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


def _state(seed: int) -> dict[str, Any]:
    torch.manual_seed(seed)
    model = torch.nn.Linear(64, 32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return {"model": model, "opt": opt, "step": 0}


def _train(state: dict[str, Any], step: int) -> None:
    model, opt = state["model"], state["opt"]
    loss = model(torch.full((4, 64), float(step))).square().mean()
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

"""``deltackpt.load`` of a snapshot written through ``dcp.save`` returns the nesting that was saved
(rebuilt from DCP's ``planner_data``, deltackpt/format/dcp_nesting.py), and DCP's own reader
still loads it."""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp

import deltackpt
from deltackpt.dcp import StoreReader, StoreWriter
from deltackpt.format.dcp_nesting import nested_manifest
from tests._dist import free_port, run_ranks

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
warnings.filterwarnings("ignore", message="torch.distributed is (disabled|unavailable)")


def _state(seed: int) -> tuple[dict, torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(2):
        model(torch.randn(4, 8)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    state = {
        "model": model.state_dict(),
        "optim": opt.state_dict(),
        "extra": {"steps": [1, 2, 3], "pair": [torch.arange(3), torch.ones(2)], "n": 5},
        "step": 7,
    }
    return state, model, opt


def _same(a, b, path="") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), path
    elif isinstance(a, dict):
        assert list(a) == list(b), (path, list(a), list(b))  # same keys (and key types), order
        for k in a:
            _same(a[k], b[k], f"{path}/{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _same(x, y, f"{path}/{i}")
    else:
        assert a == b, (path, a, b)


def test_single_process_dcp_save_loads_nested(tmp_path):
    store = tmp_path / "s"
    state, _model, _ = _state(0)
    dcp.save(state, storage_writer=StoreWriter(store, "n0"))

    got = deltackpt.load(store, "n0")
    _same(state, got)  # int optimizer state ids included
    # the optimizer accepts the loaded state as it is
    _, _, opt2 = _state(1)
    opt2.load_state_dict(got["optim"])
    assert torch.equal(
        opt2.state_dict()["state"][0]["exp_avg"], state["optim"]["state"][0]["exp_avg"]
    )

    # DCP's reader still sees the flat items (the manifest tree is what DCP wrote)
    m = deltackpt.open_store(store).manifest("n0")
    assert [k for k, _ in m.tree["dict"]][:2] == ["model.0.weight", "model.0.bias"]
    target, _, _ = _state(2)
    dcp.load(target, storage_reader=StoreReader(store, "n0"))
    _same(state, target)

    # load(into=) of the nested state assigns values where they were, not at dotted keys
    into, _, _ = _state(3)
    deltackpt.load(store, "n0", into=into)
    assert "extra.n" not in into and into["extra"]["n"] == 5
    _same(state["model"], into["model"])


def test_untrusted_planner_data_keeps_the_flat_tree(tmp_path):
    store = tmp_path / "s"
    dcp.save({"a": {"b": torch.ones(2)}, "c": 1}, storage_writer=StoreWriter(store, "x"))
    m = deltackpt.open_store(store).manifest("x")
    assert nested_manifest(m).tree == {"dict": [["a", {"dict": [["b", {"tensor": 0}]]}], ["c", 1]]}
    bad = [
        {"a.b": ["z", "b"], "c": ["c"]},  # disagrees with its fqn
        {"a.b": ["a", 0], "c": ["c"]},  # an int segment that is not the fqn's
        {"a.b": ["a", "b"], "c": ["a", "b"]},  # two items at one place (and the wrong fqn)
        {"a.b": ["a"] * 40, "c": ["c"]},  # too deep
        {"a.b": "a.b", "c": ["c"]},  # not a path
    ]
    for pd in bad:
        dcp_info = {**m.metadata["dcp"], "planner_data": pd}
        hostile = dataclasses.replace(m, metadata={**m.metadata, "dcp": dcp_info})
        assert nested_manifest(hostile).tree == m.tree, pd
    # a list with a hole (DCP drops empty containers) stays flat too
    holed = {"dict": [["l.1", 3]]}
    hostile = dataclasses.replace(
        m, tree=holed, metadata={**m.metadata, "dcp": {"planner_data": {"l.1": ["l", 1]}}}
    )
    assert nested_manifest(hostile).tree == holed
    # a manifest without DCP facts (deltackpt.save) is untouched
    deltackpt.save({"a": {"b": torch.ones(2)}}, store, "plain")
    plain = deltackpt.open_store(store).manifest("plain")
    assert nested_manifest(plain) is plain


def _two_ranks(rank: int, world: int, port: int, store: str) -> dict:
    import datetime

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
        timeout=datetime.timedelta(seconds=30),
    )  # fmt: skip
    mesh = init_device_mesh("cpu", (world,))
    full = torch.arange(32, dtype=torch.float32).reshape(8, 4)
    state = {
        "model": {"w": distribute_tensor(full, mesh, [Shard(0)]), "b": torch.ones(3)},
        "optim": {"state": {0: {"step": torch.tensor(2.0)}}, "param_groups": [{"params": [0]}]},
        "sched": {"milestones": [1, 2], "last": 4},
    }
    dcp.save(state, storage_writer=StoreWriter(store, "d"))
    target = {
        "model": {"w": distribute_tensor(torch.zeros(8, 4), mesh, [Shard(0)]), "b": torch.zeros(3)},
        "optim": {"state": {0: {"step": torch.tensor(0.0)}}, "param_groups": [{"params": [0]}]},
        "sched": {"milestones": [], "last": 0},
    }
    dcp.load(target, storage_reader=StoreReader(store, "d"))
    ok = torch.equal(target["model"]["w"].full_tensor(), full) and target["sched"]["last"] == 4
    dist.destroy_process_group()
    return {"dcp_load_ok": ok}


@pytest.mark.multiproc
def test_two_rank_dcp_save_loads_nested(tmp_path):
    store = str(tmp_path / "s")
    out = run_ranks(_two_ranks, 2, free_port(), store, timeout=90)
    assert all(o["dcp_load_ok"] for o in out)
    got = deltackpt.load(store, "d")  # one process: full tensors, nested
    assert list(got) == ["model", "optim", "sched"]
    assert torch.equal(got["model"]["w"], torch.arange(32, dtype=torch.float32).reshape(8, 4))
    assert torch.equal(got["model"]["b"], torch.ones(3))
    assert torch.equal(got["optim"]["state"][0]["step"], torch.tensor(2.0))
    assert got["optim"]["param_groups"] == [{"params": [0]}]
    assert got["sched"] == {"milestones": [1, 2], "last": 4}

"""``Checkpointer(..., process_group=pg)`` resumes FSDP2 (issue 25, item 1).

Real ``fully_shard`` models with AdamW on 2 gloo ranks: an async Checkpointer saves, a fresh
model and a fresh optimizer (no moments yet) resume through ``restore_latest`` bit-exactly, each
rank reading about half of the snapshot (its own boxes), and training on gives the same weights
as the uninterrupted run. The same snapshot resumes a plain model on 1 process (2 -> 1), and a
snapshot of 1 process resumes the 2-rank FSDP2 model (1 -> 2).
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import pytest
import torch

import deltackpt
from tests._dist import free_port, init_gloo, run_ranks
from tests.distributed._models import MLP

pytestmark = pytest.mark.multiproc


def _batch(step: int, rank: int) -> torch.Tensor:
    return torch.randn(4, 16, generator=torch.Generator().manual_seed(1000 * rank + step))


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int, rank: int) -> None:
    model(_batch(step, rank)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()


def _full(t: torch.Tensor) -> np.ndarray:
    from deltackpt.format.dtensor import is_dtensor

    t = t.full_tensor() if is_dtensor(t) else t
    return t.detach().clone().numpy()  # numpy, not tensors: see tests/_dist.py


def _values(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, np.ndarray]:
    """Every weight and every optimizer moment, gathered whole (a collective on FSDP2)."""
    out = {f"model/{k}": _full(v) for k, v in model.named_parameters()}
    for i, p in enumerate(model.parameters()):
        for k, v in sorted(opt.state[p].items()):
            out[f"optim/{i}/{k}"] = _full(v)
    return out


def _fsdp(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = MLP()
    # a CPU mesh: without one FSDP2 shards onto CUDA wherever it is visible (gloo, CPU batches)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    fully_shard(model.l1, mesh=mesh)
    fully_shard(model.l2, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _init(rank: int, world: int, port: int, timeout: float = 60.0) -> Any:
    return init_gloo(rank, world, port, timeout)


def _ckpt(store: str, pg: Any, **kw: Any) -> deltackpt.Checkpointer:
    return deltackpt.Checkpointer(store, every=3, keep_last=2, rng=False, process_group=pg, **kw)


def _train_and_save(rank: int, world: int, port: int, store: str) -> dict:
    import torch.distributed as dist

    pg = _init(rank, world, port)
    model, opt = _fsdp(0)
    ckpt = _ckpt(store, pg, async_=True)
    out: dict[str, Any] = {}
    for step in range(6):
        _train(model, opt, step, rank)
        state = {"model": model, "optim": opt, "data": {"seen": step + 1}}
        ckpt.maybe_save(step, state)  # async: steps 2 and 5
        if step == 5:
            out["saved"] = _values(model, opt)
    ckpt.close()
    for step in (6, 7):
        _train(model, opt, step, rank)
    out["final"] = _values(model, opt)
    out["snapshots"] = [s.name for s in deltackpt.snapshots(store)]
    dist.destroy_process_group()
    return out


def _resume(rank: int, world: int, port: int, store: str, single: str) -> dict:
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from deltackpt.loading import plan

    read: list[int] = []
    run_jobs = plan.run_jobs

    def counting(packs: Any, chunks: Any, jobs: list, *a: Any) -> None:
        read.append(sum(n for job in jobs for _, n, _ in job.targets))
        run_jobs(packs, chunks, jobs, *a)

    plan.run_jobs = counting
    pg = _init(rank, world, port)
    out: dict[str, Any] = {}
    # 2 -> 2: a fresh model and a fresh optimizer, resumed; then the same steps as the first run
    model, opt = _fsdp(seed=1)  # other initial weights: the restore must replace them all
    state = {"model": model, "optim": opt, "data": {"seen": 0}}
    out["start"] = _ckpt(store, pg).restore_latest(state)
    out["read"] = sum(read)
    out["seen"] = state["data"]["seen"]
    out["moments_are_dtensors"] = all(
        isinstance(v, DTensor) for s in opt.state.values() for k, v in s.items() if k != "step"
    )
    out["restored"] = _values(model, opt)
    for step in (6, 7):
        _train(model, opt, step, rank)
    out["final"] = _values(model, opt)
    # 1 -> 2: the snapshot of a single process without FSDP, into the 2-rank FSDP2 model
    model, opt = _fsdp(seed=2)
    out["single_start"] = _ckpt(single, pg).restore_latest({"model": model, "optim": opt})
    out["single_restored"] = _values(model, opt)
    _train(model, opt, 9, rank)  # the optimizer's moments are usable DTensors
    dist.destroy_process_group()
    return out


def _same(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> None:
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and np.array_equal(a[k], b[k]), k


def test_checkpointer_with_a_process_group_resumes_fsdp2_bit_exactly(tmp_path):
    store, single = str(tmp_path / "fsdp"), str(tmp_path / "single")
    trained = run_ranks(_train_and_save, 2, free_port(), store, timeout=240)
    assert trained[0]["snapshots"] == ["step-00000002", "step-00000005"]

    # 2 -> 1: the 2-rank snapshot resumes a plain model and a fresh optimizer in this process
    torch.manual_seed(3)
    model = MLP()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        start = deltackpt.Checkpointer(store, every=3, rng=False).restore_latest(
            {"model": model, "optim": opt}
        )
    assert start == 6
    _same(_values(model, opt), trained[0]["saved"])

    # a snapshot of one process for the 1 -> 2 resume
    torch.manual_seed(4)
    model = MLP()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(3):
        _train(model, opt, step, 0)
    ck = deltackpt.Checkpointer(single, every=3, rng=False, async_=False)
    ck.maybe_save(2, {"model": model, "optim": opt})
    single_saved = _values(model, opt)

    resumed = run_ranks(_resume, 2, free_port(), store, single, timeout=240)
    total = sum(e.nbytes for e in deltackpt.open_store(store).manifest("step-00000005").tensors)
    for r in resumed:
        assert r["start"] == 6 and r["seen"] == 6
        assert r["moments_are_dtensors"]
        _same(r["restored"], trained[0]["saved"])
        _same(r["final"], trained[0]["final"])  # training on == never interrupted
        assert 0 < r["read"] < 0.6 * total, (r["read"], total)  # its own boxes, not everything
        assert r["single_start"] == 3
        _same(r["single_restored"], single_saved)

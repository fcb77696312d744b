"""An NCCL process group (what GPU training passes as ``process_group``): its backend carries no
host tensors, so a broadcast load sends its buckets through the rank's GPU
(``Group.wire_device``). The selection runs here with stand-ins; a one-rank NCCL group runs
on a GPU machine (``gpu``): a save, broadcast loads, and FSDP2 on the GPU resumed by a
``Checkpointer`` with that group."""

from __future__ import annotations

import datetime

import pytest
import torch

import deltackpt
from deltackpt.distributed.collectives import wire_device
from tests._dist import free_port, run_ranks


class _Group:
    def __init__(self, *types: str) -> None:
        self._device_types = [torch.device(t) for t in types]


def test_groups_with_a_host_backend_send_host_tensors():
    assert wire_device(_Group("cuda", "cpu")).type == "cpu"  # gloo (also on a GPU machine)
    assert wire_device(_Group("cpu")).type == "cpu"


def test_an_nccl_only_group_sends_from_the_current_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert wire_device(_Group("cuda")) == torch.device("cuda", 1)
    assert wire_device(_Group("cuda", "cpu")).type == "cpu"


def _nccl_rank(rank: int, world: int, port: int, store: str) -> bool:
    import torch.distributed as dist

    torch.cuda.set_device(0)
    dist.init_process_group(
        "nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
        timeout=datetime.timedelta(seconds=60),
    )  # fmt: skip
    pg = dist.group.WORLD
    try:
        g = torch.Generator(device="cuda").manual_seed(5)
        state = {
            "w": torch.randn(300, 70, device="cuda", generator=g),
            "b": torch.randn(1000, device="cuda", generator=g).to(torch.bfloat16),
            "n": torch.arange(7),
            "step": 3,
        }
        deltackpt.save(state, store, "s0", process_group=pg)
        into = {
            k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else 0 for k, v in state.items()
        }
        deltackpt.load(
            store, "s0", into=into, process_group=pg, mode="broadcast", bucket_bytes=8192
        )
        assert all(torch.equal(into[k], state[k]) for k in ("w", "b", "n")) and into["step"] == 3
        got = deltackpt.load(store, "s0", process_group=pg, mode="broadcast", bucket_bytes=8192)
        assert torch.equal(got["w"], state["w"].cpu()) and torch.equal(got["b"], state["b"].cpu())
        _fsdp_resume(store + "-fsdp", pg)
        return True
    finally:
        dist.destroy_process_group()


def _fsdp_model(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    mesh = init_device_mesh("cuda", (1,))
    for layer in (model[0], model[2], model):
        fully_shard(layer, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _fsdp_step(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
    x = torch.randn(8, 16, device="cuda", generator=torch.Generator("cuda").manual_seed(step))
    model(x).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()


def _fsdp_resume(store: str, pg: object) -> None:
    """FSDP2 on the GPU with AdamW: an async Checkpointer saves, a fresh model and optimizer
    resume bit-exactly and train on as the uninterrupted run does."""
    model, opt = _fsdp_model(0)
    ckpt = deltackpt.Checkpointer(
        store, every=2, keep_last=2, process_group=pg, async_=True, rng=False
    )
    for step in range(4):
        _fsdp_step(model, opt, step)
        ckpt.maybe_save(step, {"model": model, "optim": opt})  # saves after steps 1 and 3
    ckpt.close()
    _fsdp_step(model, opt, 4)
    want = [p.full_tensor().cpu() for p in model.parameters()]
    model2, opt2 = _fsdp_model(1)
    ckpt2 = deltackpt.Checkpointer(store, every=2, process_group=pg, rng=False)
    assert ckpt2.restore_latest({"model": model2, "optim": opt2}) == 4
    ckpt2.close()
    assert all(p.device.type == "cuda" for p in model2.parameters())
    _fsdp_step(model2, opt2, 4)
    got = [p.full_tensor().cpu() for p in model2.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


@pytest.mark.gpu
def test_a_one_rank_nccl_group_saves_and_broadcast_loads(tmp_path):
    assert run_ranks(_nccl_rank, 1, free_port(), str(tmp_path / "s"), timeout=180) == [True]

"""export_hf of a snapshot saved by 2 gloo ranks (every weight a DTensor shard): the export
reassembles each tensor from its saved pieces and loads with ``from_pretrained``."""

from __future__ import annotations

import datetime

import pytest
import torch

import deltackpt
from tests._dist import free_port, run_ranks
from tests.interop._hf import logits, tiny, train

pytestmark = [pytest.mark.multiproc, pytest.mark.slow]


def _save_sharded(
    rank: int, world: int, port: int, store: str, full: dict[str, torch.Tensor]
) -> int:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
        timeout=datetime.timedelta(seconds=60),
    )  # fmt: skip
    mesh = init_device_mesh("cpu", (world,))
    sd = {
        k: distribute_tensor(
            v.detach(), mesh, [Shard(v.dim() - 1 if k.endswith("proj.weight") else 0)]
        )
        for k, v in full.items()
    }
    deltackpt.save({"model": sd}, store, "dist", process_group=dist.group.WORLD)
    dist.destroy_process_group()
    return rank


def test_export_of_a_two_rank_save_reassembles_every_tensor(tmp_path):
    pytest.importorskip("transformers")  # here: the ranks import this module, and need none
    store = str(tmp_path / "s")
    model = tiny("llama")
    train(model)
    full = {k: v.detach().clone() for k, v in model.state_dict().items()}
    assert run_ranks(_save_sharded, 2, free_port(), store, full, timeout=150) == [0, 1]
    m = deltackpt.open_store(store).manifest("dist")
    assert m.dist["world_size"] == 2
    assert all(e.shards is not None and len(e.shards) == 2 for e in m.tensors)
    deltackpt.export_hf(store, "dist", tmp_path / "hf", config=model.config, max_shard_size="50KB")
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    for k, t in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], t), k
    assert torch.equal(logits(loaded), logits(model))

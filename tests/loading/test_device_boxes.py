"""DTensor shards and restores through the device pipeline (loading/to_device.py): a DTensor's
local box of whole leading rows (FSDP2's ``Shard(0)``, ``Replicate``) takes its saved bytes as
they are, and ``Checkpointer.restore_latest`` (``load_reusing``) fills device targets through
the pinned buckets as ``load(into=)`` does. Run here on CPU targets with the device paths
forced (``DELTACKPT_DEVICE_SCAN=always``); the ``gpu`` case restores CUDA tensors."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import deltackpt
from deltackpt.format.manifest import Shard, TensorEntry
from deltackpt.loading import assemble
from deltackpt.loading.reshard import sub_slices
from deltackpt.loading.to_device import box_entry
from deltackpt.options import overrides
from tests._dist import free_port, init_gloo, run_ranks


def _entry(shape: tuple[int, ...], shards: list[tuple[tuple[int, ...], tuple[int, ...]]] | None):
    """A float32 entry saved whole (``shards`` None) or as the given (offsets, shape) pieces,
    each piece's bytes one slice of a chunk named after it."""
    if shards is None:
        n = 4 * int(torch.tensor(shape).prod())
        return TensorEntry("t", "float32", shape, data=(("whole", 0, n),))
    pieces = []
    for k, (off, sh) in enumerate(shards):
        n = 4 * int(torch.tensor(sh).prod())
        pieces.append(Shard(off, sh, ((f"piece{k}", 0, n),)))
    return TensorEntry("t", "float32", shape, shards=tuple(pieces))


def test_a_box_of_leading_rows_is_a_byte_range_of_the_saved_tensor():
    e = _entry((10, 6), None)
    sub = box_entry(e, ((3, 0), (4, 6)))
    assert sub is not None and sub.shape == (4, 6) and sub.shards is None
    assert sub.data == sub_slices(e.data, 3 * 24, 7 * 24) == (("whole", 72, 96),)
    assert box_entry(e, ((0, 0), (10, 6))).data == e.data  # Replicate: the whole tensor


def test_a_box_over_several_saved_row_blocks_takes_each_one_s_part():
    e = _entry((10, 6), [((0, 0), (5, 6)), ((5, 0), (5, 6))])  # saved by two Shard(0) ranks
    sub = box_entry(e, ((3, 0), (4, 6)))  # rows 3..6: two of the first block, two of the next
    assert sub is not None and sub.data == (("piece0", 72, 48), ("piece1", 0, 48))


@pytest.mark.parametrize(
    "shards, box",
    [
        (None, ((0, 2), (10, 3))),  # some columns (Shard(1))
        ([((0, 0), (10, 3)), ((0, 3), (10, 3))], ((0, 0), (5, 6))),  # saved by columns
        ([((0, 0), (4, 6)), ((5, 0), (5, 6))], ((3, 0), (4, 6))),  # row 4 saved nowhere
        ([((0, 0), (6, 6)), ((4, 0), (6, 6))], ((3, 0), (4, 6))),  # saved blocks overlap
    ],
)
def test_other_boxes_go_the_general_way(shards: Any, box: Any):
    assert box_entry(_entry((10, 6), shards), box) is None


@pytest.fixture
def taken(monkeypatch: pytest.MonkeyPatch) -> list[list[str]]:
    """The keys each load sent through the device pipeline."""
    seen: list[list[str]] = []
    real = assemble.read_to_device

    def spy(packs: Any, m: Any, items: Any, *a: Any, **kw: Any) -> int:
        seen.append(sorted(e.path for e, _ in items))
        return real(packs, m, items, *a, **kw)

    monkeypatch.setattr(assemble, "read_to_device", spy)
    return seen


def _model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Linear(128, 8))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(4, 64)).square().mean().backward()
    opt.step()
    return model, opt


def test_restore_latest_fills_device_targets_through_the_buckets(tmp_path: Path, taken):
    torch.manual_seed(0)
    model, opt = _model()
    ckpt = deltackpt.Checkpointer(tmp_path / "s", every=1, rng=False)
    ckpt.save(0, {"model": model, "optim": opt})
    ckpt.close()
    want = {k: v.clone() for k, v in model.state_dict().items()}
    torch.manual_seed(1)
    model2, opt2 = _model()  # other weights, moments already held
    with overrides(DELTACKPT_DEVICE_SCAN="always"):
        ckpt2 = deltackpt.Checkpointer(tmp_path / "s", every=1, rng=False)
        assert ckpt2.restore_latest({"model": model2, "optim": opt2}) == 1
        ckpt2.close()
    assert all(torch.equal(model2.state_dict()[k], v) for k, v in want.items())
    for p, p2 in zip(model.parameters(), model2.parameters(), strict=True):
        assert torch.equal(opt.state[p]["exp_avg"], opt2.state[p2]["exp_avg"])
    assert any("model/0.weight" in keys for keys in taken)
    assert any(any(k.endswith("exp_avg_sq") for k in keys) for keys in taken)


def _dtensor_rank(rank: int, world: int, port: int, store: str) -> list[str]:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from deltackpt.loading import assemble as asm

    pg = init_gloo(rank, world, port)
    mesh = init_device_mesh("cpu", (world,))
    g = torch.Generator().manual_seed(3)
    full = {
        "a": torch.randn(37, 24, generator=g),  # uneven over 2 ranks
        "r": torch.randn(50, 8, generator=g).to(torch.bfloat16),
        "c": torch.randn(12, 40, generator=g),
    }
    places = {"a": [Shard(0)], "r": [Replicate()], "c": [Shard(1)]}
    state = {k: distribute_tensor(v, mesh, places[k]) for k, v in full.items()}
    if rank == 0:
        deltackpt.save(full, store, "whole")  # one process, whole tensors
    deltackpt.save(state, store, "sharded", process_group=pg)  # row blocks of 2 ranks
    seen: list[str] = []
    real = asm.read_to_device

    def spy(packs: Any, m: Any, items: Any, *a: Any, **kw: Any) -> int:
        seen.extend(e.path for e, _ in items)
        return real(packs, m, items, *a, **kw)

    asm.read_to_device = spy
    try:
        for name in ("whole", "sharded"):
            into = {
                k: distribute_tensor(torch.zeros_like(v), mesh, places[k]) for k, v in full.items()
            }
            with overrides(DELTACKPT_DEVICE_SCAN="always"):
                deltackpt.load(store, name, into=into, process_group=pg)
            for k, v in full.items():
                assert torch.equal(into[k].full_tensor(), v), (name, k)
    finally:
        asm.read_to_device = real
        dist.destroy_process_group()
    return sorted(set(seen))


@pytest.mark.multiproc
def test_row_shards_load_through_the_buckets_on_two_ranks(tmp_path: Path):
    store = str(tmp_path / "s")
    deltackpt.open_store(store, chunk_bytes=4096, small_bytes=256)
    got = run_ranks(_dtensor_rank, 2, free_port(), store, timeout=120)
    assert got == [["a", "r"], ["a", "r"]]  # Shard(1) columns go the general way


@pytest.mark.gpu
def test_restore_latest_of_cuda_state_goes_through_the_buckets(tmp_path: Path, taken):
    torch.manual_seed(0)
    model = torch.nn.Linear(256, 512).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(4, 256, device="cuda")).square().mean().backward()
    opt.step()
    ckpt = deltackpt.Checkpointer(tmp_path / "s", every=1, rng=False)
    ckpt.save(0, {"model": model, "optim": opt})
    ckpt.close()
    want = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    ckpt2 = deltackpt.Checkpointer(tmp_path / "s", every=1, rng=False)
    assert ckpt2.restore_latest({"model": model, "optim": opt}) == 1
    ckpt2.close()
    torch.cuda.synchronize()
    assert all(torch.equal(model.state_dict()[k], v) for k, v in want.items())
    assert any("model/weight" in keys for keys in taken)

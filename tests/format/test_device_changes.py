"""Changed elements found by torch operations where the buffers live
(format/device_changes.py) are the host encoder's list, and pack to the same bytes; on a GPU,
CUDA finds the same list as the CPU."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import zstandard

from deltackpt.format import changes
from deltackpt.format.device_changes import (
    changed_elements_on,
    changed_many_on_device,
    changed_on_device,
    to_host,
)


def _rl_step(n: int, dtype: torch.dtype, share: float, seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(n, generator=g).to(dtype)
    new = base.clone()
    mask = torch.rand(n, generator=g) < share
    new[mask] += (torch.randn(n, generator=g) * 0.01).to(dtype)[mask]
    return new.view(torch.uint8), base.view(torch.uint8)


def _host(new: torch.Tensor, base: torch.Tensor, itemsize: int, cap: int):
    return changes.changed_elements(new.numpy(), base.numpy(), itemsize, cap)


@pytest.mark.parametrize(
    ("dtype", "n", "share"),
    [
        (torch.bfloat16, 100_003, 0.02),  # an RL step; an odd count leaves a tail after the words
        (torch.float32, 4_097, 0.3),
        (torch.float64, 1_000, 0.01),
        (torch.int8, 999, 0.5),
    ],
)
def test_the_device_list_is_the_host_list(dtype, n, share):
    new, base = _rl_step(n, dtype, share, 1) if dtype.is_floating_point else _ints(n, share)
    itemsize = torch.empty(0, dtype=dtype).element_size()
    host = _host(new, base, itemsize, n)
    dev = changed_elements_on(new, base, itemsize, n)
    assert host is not None and dev is not None
    assert np.array_equal(host[0], dev[0]) and host[0].dtype == dev[0].dtype == np.uint32
    assert np.array_equal(host[1], dev[1]) and host[1].dtype == dev[1].dtype
    cctx = zstandard.ZstdCompressor(level=1, write_content_size=True)
    packed = changes.pack_changes(*dev, itemsize, cctx)
    assert packed == changes.pack_changes(*host, itemsize, cctx)


def _ints(n: int, share: float) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(2)
    base = torch.randint(-100, 100, (n,), dtype=torch.int8, generator=g)
    new = torch.where(torch.rand(n, generator=g) < share, base + 1, base)
    return new.view(torch.uint8), base.view(torch.uint8)


def test_bit_patterns_not_values_are_compared():
    base = torch.tensor([0.0, float("nan"), 1.0, -0.0], dtype=torch.float32)
    new = torch.tensor([-0.0, float("nan"), 1.0, -0.0], dtype=torch.float32)
    idx, vals = changed_elements_on(new.view(torch.uint8), base.view(torch.uint8), 4, 4)
    assert idx.tolist() == [0]  # -0.0 != 0.0 in bits; the same NaN equals itself
    assert vals.view(np.float32).tolist() == [-0.0]


def test_over_the_cap_is_none_and_unaligned_views_work():
    new, base = _rl_step(10_000, torch.bfloat16, 0.1, 3)
    k = _host(new, base, 2, 10_000)[0].size
    assert changed_elements_on(new, base, 2, k - 1) is None
    assert changed_elements_on(new, base, 2, k) is not None
    got = changed_elements_on(new[2:-2], base[2:-2], 2, 10_000)  # storage offset 2 bytes
    want = _host(new[2:-2].clone(), base[2:-2].clone(), 2, 10_000)
    assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1])
    with pytest.raises(ValueError, match="whole elements"):
        changed_elements_on(new[:3], base[:3], 2, 10)


def _pairs() -> list[tuple[torch.Tensor, torch.Tensor, int, int]]:
    a = _rl_step(50_001, torch.bfloat16, 0.02, 5)
    b = _rl_step(4_096, torch.float32, 0.3, 6)
    same = torch.arange(300, dtype=torch.int16).view(torch.uint8)
    over = _rl_step(1_000, torch.bfloat16, 0.5, 7)
    return [(*a, 2, 50_001), (*b, 4, 4_096), (same, same.clone(), 2, 10), (*over, 2, 100)]


def test_many_pairs_give_each_pairs_list():
    """One call over tensors of several sizes and widths (one unchanged, one over its cap) is
    the list of one call per pair, element for element and in the same dtypes."""
    pairs = _pairs()
    many = changed_many_on_device(pairs)
    assert many[3] is None  # half of the elements changed, the cap is 10%
    assert many[2] is not None and many[2][0].numel() == 0 and many[2][0].dtype == torch.int32
    for (new, base, size, cap), got in zip(pairs, many, strict=True):
        one = changed_on_device(new, base, size, cap)
        assert (one is None) == (got is None)
        if got is not None:
            assert got[0].dtype == one[0].dtype == torch.int32 and got[1].dtype == one[1].dtype
            host = _host(new, base, size, cap)
            assert np.array_equal(to_host(got)[0], host[0])
            assert np.array_equal(to_host(got)[1], host[1])
    assert changed_many_on_device([]) == []
    with pytest.raises(ValueError, match="whole elements"):
        changed_many_on_device([*pairs, (pairs[0][0][:3], pairs[0][1][:3], 2, 10)])


@pytest.mark.gpu
def test_cuda_lists_many_tensors_with_one_wait():
    """On CUDA the lists of many tensors cost one wait for the device (the counts), not two
    per tensor: ``torch.cuda.set_sync_debug_mode`` counts the synchronising calls."""
    pairs = [(n.cuda(), b.cuda(), s, c) for n, b, s, c in _pairs()]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with pytest.warns(UserWarning, match="synchroniz") as seen:
            many = changed_many_on_device(pairs)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert len(seen) == 1, [str(w.message) for w in seen]
    for (new, base, size, cap), got in zip(_pairs(), many, strict=True):
        host = _host(new, base, size, cap)
        assert (host is None) == (got is None)
        if got is not None:
            assert np.array_equal(to_host(got)[0], host[0])
            assert np.array_equal(to_host(got)[1], host[1])


@pytest.mark.gpu
def test_cuda_finds_the_cpu_list():
    new, base = _rl_step(1 << 20, torch.bfloat16, 0.03, 4)
    cpu = changed_elements_on(new, base, 2, 1 << 20)
    gpu = changed_elements_on(new.cuda(), base.cuda(), 2, 1 << 20)
    assert np.array_equal(cpu[0], gpu[0]) and np.array_equal(cpu[1], gpu[1])

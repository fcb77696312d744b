"""Bit-exact round trips over dtypes, shapes, nesting, shared storage and inline values."""

from __future__ import annotations

import math
import warnings
from collections import OrderedDict

import pytest
import torch

import deltackpt
from deltackpt.errors import PickleNotAllowedError, UnsupportedValueError

warnings.filterwarnings("ignore", message="ComplexHalf support is experimental")

ALL_DTYPES = [
    torch.float64, torch.float32, torch.float16, torch.bfloat16,
    torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz,
    torch.int8, torch.int16, torch.int32, torch.int64,
    torch.uint8, torch.uint16, torch.uint32, torch.uint64,
    torch.bool, torch.complex32, torch.complex64, torch.complex128,
]  # fmt: skip


def random_tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    """Random bit patterns (NaNs and all) so every byte matters."""
    g = torch.Generator().manual_seed(seed)
    n = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
    raw = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)
    if dtype == torch.bool:
        raw = raw % 2
    return raw.view(dtype).reshape(shape) if n else torch.empty(shape, dtype=dtype)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.numel() == 0:
        return True
    return torch.equal(
        a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8)
    )


def assert_same(a, b, path="") -> None:
    assert type(a) is type(b), f"{path}: {type(a)} != {type(b)}"
    if isinstance(a, torch.Tensor):
        assert same_bits(a, b), f"{path}: tensor bytes differ"
    elif isinstance(a, dict):
        assert list(a.keys()) == list(b.keys()), f"{path}: keys differ"
        for k in a:
            assert_same(a[k], b[k], f"{path}/{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{path}/{i}")
    elif isinstance(a, float) and math.isnan(a):
        assert math.isnan(b)
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_every_dtype_roundtrips_bit_exact(store_dir, dtype):
    state = {
        "vec": random_tensor(dtype, (1000,), 1),
        "mat": random_tensor(dtype, (37, 29), 2),
        "scalar": random_tensor(dtype, (), 3),
        "empty": random_tensor(dtype, (0, 5), 4),
    }
    deltackpt.save(state, store_dir, "s")
    out = deltackpt.load(store_dir, "s")
    assert_same(state, out)


@pytest.mark.parametrize("shape", [(), (0,), (1,), (3, 0, 2), (7, 1, 3), (1 << 20,), (300, 5000)])
def test_shapes_including_multi_chunk(tmp_path, shape):
    store = deltackpt.open_store(tmp_path / "s", chunk_bytes=64 << 10, small_bytes=16 << 10)
    t = random_tensor(torch.float32, shape, 5)
    deltackpt.save({"t": t}, store, "a")
    assert same_bits(deltackpt.load(store, "a")["t"], t)


def test_non_contiguous_views_keep_their_values(store_dir):
    base = torch.randn(64, 48)
    state = {
        "t": base.t(),
        "step": base[::3, 5:40:2],
        "exp": torch.randn(4, 1).expand(4, 10),
        "conj": torch.randn(5, dtype=torch.complex64).conj(),
    }
    expected = {k: v.clone() for k, v in state.items()}
    deltackpt.save(state, store_dir, "a")
    out = deltackpt.load(store_dir, "a")
    for k in state:
        assert torch.equal(out[k], expected[k]), k


def test_tied_weights_come_back_tied(store_dir):
    emb = torch.nn.Embedding(50, 16)
    head = torch.nn.Linear(16, 50, bias=False)
    head.weight = emb.weight  # tied, as in GPT-2 / Qwen2
    state = {"emb": emb.weight, "head": head.weight, "other": torch.randn(3)}
    deltackpt.save(state, store_dir, "a")
    out = deltackpt.load(store_dir, "a")
    assert torch.equal(out["emb"], emb.weight)
    assert out["emb"].data_ptr() == out["head"].data_ptr()
    assert isinstance(out["emb"], torch.nn.Parameter) and out["emb"].requires_grad
    out["emb"].data[0, 0] = 123.0
    assert out["head"][0, 0].item() == 123.0


def test_different_views_of_one_storage_share_storage(store_dir):
    flat = torch.arange(100, dtype=torch.float32)
    state = {"a": flat[10:50].view(8, 5), "b": flat[40:90], "as_int": flat[0:4].view(torch.int32)}
    deltackpt.save(state, store_dir, "a")
    out = deltackpt.load(store_dir, "a")
    for k in state:
        assert same_bits(out[k], state[k]), k
    out["a"][-1, -1] = -1.0  # element 49 of the shared storage
    assert out["b"][9].item() == -1.0


def test_nesting_and_inline_values(store_dir):
    od = OrderedDict([("w", torch.randn(3)), ("b", torch.randn(2))])
    od._metadata = OrderedDict([("", {"version": 2})])
    state = {
        "model": od,
        "optim": {"state": {0: {"step": torch.tensor(7.0), "exp_avg": torch.randn(3)}, 1: {}},
                  "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "params": [0, 1], "amsgrad": False}]},
        "step": 12345678901234567890,
        "floats": [0.1, -0.0, float("inf"), float("-inf"), float("nan"), 1e-310],
        "misc": (None, True, "ünïcode ✓", b"\x00\xffbytes", torch.Size([2, 3]), torch.float16, torch.device("cpu")),
        "empty": {"d": {}, "l": [], "t": ()},
    }  # fmt: skip
    deltackpt.save(state, store_dir, "a")
    out = deltackpt.load(store_dir, "a")
    assert_same(state, out)
    assert out["model"]._metadata == od._metadata
    assert out["floats"][1] == -0.0 and math.copysign(1, out["floats"][1]) == -1


def test_optimizer_state_restores_into_a_fresh_optimizer(store_dir):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(3):
        model(torch.randn(5, 8)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    deltackpt.save({"model": model.state_dict(), "optim": opt.state_dict()}, store_dir, "a")
    out = deltackpt.load(store_dir, "a")
    model2 = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    opt2 = torch.optim.AdamW(model2.parameters(), lr=1e-2)
    model2.load_state_dict(out["model"])
    opt2.load_state_dict(out["optim"])
    x = torch.randn(5, 8)
    for m, o in ((model, opt), (model2, opt2)):
        m(x).pow(2).mean().backward()
        o.step()
    for p, q in zip(model.parameters(), model2.parameters(), strict=True):
        assert torch.equal(p, q)


def test_unsupported_values_are_refused_with_the_key_named(store_dir):
    class Custom:
        pass

    with pytest.raises(UnsupportedValueError, match=r"'extra/obj'.*allow_pickle=True"):
        deltackpt.save({"extra": {"obj": Custom()}}, store_dir, "a")
    assert deltackpt.snapshots(store_dir) == []


def test_pickle_is_opt_in_on_save_and_on_load(store_dir):
    state = {"w": torch.ones(2), "obj": {1, 2, 3}}
    deltackpt.save(state, store_dir, "a", allow_pickle=True)
    with pytest.raises(PickleNotAllowedError, match="'obj'"):
        deltackpt.load(store_dir, "a")
    out = deltackpt.load(store_dir, "a", allow_pickle=True)
    assert out["obj"] == {1, 2, 3}


def test_load_into_copies_in_place_and_sets_values(store_dir):
    model = torch.nn.Linear(4, 3)
    state = {"model": model.state_dict(), "step": 5, "sched": {"last_epoch": 3}}
    deltackpt.save(state, store_dir, "a")
    fresh = torch.nn.Linear(4, 3)
    ptr = fresh.weight.data_ptr()
    target = {"model": fresh.state_dict(), "step": 0, "sched": {"last_epoch": 0}}
    returned = deltackpt.load(store_dir, "a", into=target)
    assert returned is target
    assert torch.equal(fresh.weight, model.weight) and torch.equal(fresh.bias, model.bias)
    assert fresh.weight.data_ptr() == ptr
    assert target["step"] == 5 and target["sched"]["last_epoch"] == 3


def test_load_into_strict_reports_mismatches(store_dir):
    deltackpt.save({"a": torch.zeros(3), "b": torch.zeros(2)}, store_dir, "s")
    with pytest.raises(
        deltackpt.errors.StateMismatchError, match=r"'a'.*float32\[3\].*float32\[4\]"
    ):
        deltackpt.load(store_dir, "s", into={"a": torch.zeros(4), "b": torch.zeros(2)})
    with pytest.raises(deltackpt.errors.StateMismatchError, match=r"not in the target: \['b'\]"):
        deltackpt.load(store_dir, "s", into={"a": torch.zeros(3)})
    target = {"a": torch.ones(3)}
    deltackpt.load(store_dir, "s", into=target, strict=False)
    assert torch.equal(target["a"], torch.zeros(3))


def test_load_into_non_contiguous_and_other_dtype_targets(store_dir):
    src = torch.randn(6, 4)
    deltackpt.save({"w": src}, store_dir, "s")
    target = torch.zeros(4, 6).t()  # non-contiguous, same shape
    deltackpt.load(store_dir, "s", into={"w": target})
    assert torch.equal(target, src)


def test_latest_is_the_last_committed(store_dir):
    for i in range(3):
        deltackpt.save({"i": torch.tensor(i)}, store_dir, f"s{i}")
    assert deltackpt.load(store_dir)["i"].item() == 2
    assert [s.name for s in deltackpt.snapshots(store_dir)] == ["s0", "s1", "s2"]


def test_errors_for_names_and_missing_snapshots(store_dir):
    deltackpt.save({"x": torch.ones(1)}, store_dir, "a")
    with pytest.raises(deltackpt.errors.SnapshotExistsError, match="overwrite=True"):
        deltackpt.save({"x": torch.ones(1)}, store_dir, "a")
    deltackpt.save({"x": torch.zeros(1)}, store_dir, "a", overwrite=True)
    assert deltackpt.load(store_dir, "a")["x"].item() == 0
    for bad in ["", "latest", "a/b", "../x", ".hidden"]:
        with pytest.raises(deltackpt.errors.InvalidNameError):
            deltackpt.save({}, store_dir, bad)
    with pytest.raises(deltackpt.errors.SnapshotNotFoundError, match=r"'nope'.*\['a'\]"):
        deltackpt.load(store_dir, "nope")
    with pytest.raises(deltackpt.errors.SnapshotNotFoundError, match="no committed snapshot"):
        deltackpt.load(deltackpt.open_store(store_dir.parent / "empty"))
    with pytest.raises(deltackpt.errors.StoreError, match=r"STORE\.json missing"):
        deltackpt.load(store_dir.parent / "not-a-store")


def test_small_tensors_around_large_ones_share_a_group_chunk(tmp_path):
    # small, large, small: the second small tensor joins the first one's group chunk
    store = deltackpt.open_store(tmp_path / "s", chunk_bytes=64 << 10, small_bytes=16 << 10)
    state = {"s1": torch.arange(10), "big": torch.randn(100_000), "s2": torch.arange(20) * 3}
    deltackpt.save(state, store, "a")
    out = deltackpt.load(store, "a")
    for k, v in state.items():
        assert torch.equal(out[k], v), k
    m = store.manifest("a")
    assert m.tensors[0].data[0][0] == m.tensors[2].data[0][0]  # one group chunk

"""Async saves whose sources have no staging buffer yet: held on the device (a clone on CPU) at
the call, their buffers allocated and filled by the deferred step behind the caller
(``saving/stage.py``; forced on CPU state with ``DELTACKPT_STAGE_DEFER=always``)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator

import pytest
import torch

import deltackpt
import deltackpt.saving.engine as engine
import deltackpt.saving.stage as stage_mod
from deltackpt.errors import DeltackptError, InvalidArgumentError, SaveFailedError
from deltackpt.options import overrides
from deltackpt.saving.engine import saver_for
from deltackpt.saving.plan import plan_state
from deltackpt.saving.stage import Arena, Staged, stage


def _state(seed: int = 0, n: int = 4, numel: int = 200_000) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"w{i}": torch.randn(numel, generator=g) for i in range(n)}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu().contiguous().view(torch.uint8)


def _same_bits(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(_bits(a[k]), _bits(b[k])) for k in a)


@pytest.fixture
def staged(monkeypatch: pytest.MonkeyPatch) -> list[Staged]:
    """Every :class:`Staged` the save engine gets from ``stage``, in order."""
    seen: list[Staged] = []
    real = engine.stage

    def spy(*args, **kwargs) -> Staged:
        out = real(*args, **kwargs)
        seen.append(out)
        return out

    monkeypatch.setattr(engine, "stage", spy)
    return seen


@pytest.fixture
def defer_always() -> Iterator[None]:
    with overrides(DELTACKPT_STAGE_DEFER="always"):
        yield


def _patch_alloc(
    monkeypatch: pytest.MonkeyPatch, before: Callable[[], None], callers: list[str] | None = None
) -> list[int]:
    """Run ``before`` ahead of every staging buffer allocation; returns the sizes allocated (and
    the allocating threads' names in ``callers``)."""
    sizes: list[int] = []
    real = stage_mod.host_buffer

    def alloc(nbytes: int, for_device: bool) -> torch.Tensor:
        sizes.append(nbytes)
        if callers is not None:
            callers.append(threading.current_thread().name)
        before()
        return real(nbytes, for_device)

    monkeypatch.setattr(stage_mod, "host_buffer", alloc)
    return sizes


@pytest.mark.usefixtures("defer_always")
def test_the_snapshot_holds_the_bytes_at_the_call(store_dir, staged, monkeypatch):
    state = _state()
    state["w0"][:3] = torch.tensor([float("nan"), -0.0, float("inf")])
    expected = {k: v.clone() for k, v in state.items()}
    gate = threading.Event()
    callers: list[str] = []
    sizes = _patch_alloc(monkeypatch, lambda: gate.wait(timeout=30), callers)
    h = deltackpt.async_save(state, store_dir, "a")
    h.staged.result(timeout=30)  # held: the caller may change its tensors
    assert staged[-1].deferred == len(state)
    for v in state.values():
        v.add_(1.0)  # before the deferred step copies anything to its buffers
    gate.set()
    info = h.result(timeout=60)
    assert info.name == "a" and len(sizes) == len(state)
    me = threading.current_thread().name
    assert me not in callers  # the buffers were allocated behind the caller
    assert _same_bits(deltackpt.load(store_dir, "a"), expected)


@pytest.mark.usefixtures("defer_always")
def test_a_second_save_reuses_the_buffers_without_a_deferred_step(store_dir, staged, monkeypatch):
    state = _state(1)
    deltackpt.async_save(state, store_dir, "a").result(timeout=60)
    arena = saver_for(deltackpt.open_store(store_dir)).arenas[0]
    ptrs = {k: b.data_ptr() for k, b in arena.buffers.items()}
    assert staged[-1].deferred == len(state) and len(ptrs) == len(state)
    sizes = _patch_alloc(monkeypatch, lambda: None)
    for v in state.values():
        v.mul_(2.0)
    expected = {k: v.clone() for k, v in state.items()}
    h = deltackpt.async_save(state, store_dir, "b")
    assert staged[-1].deferred == 0 and sizes == []
    for v in state.values():
        v.zero_()  # the bytes were copied into the arena in the call
    h.result(timeout=60)
    assert {k: b.data_ptr() for k, b in arena.buffers.items()} == ptrs
    assert _same_bits(deltackpt.load(store_dir, "b"), expected)
    # a new tensor (the structure changed): only its bytes are deferred
    state["extra"] = torch.arange(50_000, dtype=torch.float32)
    expected = {k: v.clone() for k, v in state.items()}
    deltackpt.async_save(state, store_dir, "c").result(timeout=60)
    assert staged[-1].deferred == 1 and sizes == [state["extra"].nbytes]
    assert _same_bits(deltackpt.load(store_dir, "c"), expected)


def test_arrays_cannot_be_read_before_the_deferred_step():
    state = _state(2, n=3)
    plan = plan_state(state, 1 << 20, 4096)
    st = stage(plan, Arena(), "always")
    assert st.deferred == len(plan.sources) and len(st.arrays) == len(plan.sources)
    with pytest.raises(DeltackptError, match=r"internal error.*before its deferred staging"):
        st.arrays[0]
    st.wait()
    st.wait()  # once only: a second wait returns at once
    for src, arr in zip(plan.sources, st.arrays, strict=True):
        assert torch.equal(torch.from_numpy(arr), src.data)


def test_defer_off_stages_in_the_call():
    state = _state(3, n=2)
    plan = plan_state(state, 1 << 20, 4096)
    arena = Arena()
    st = stage(plan, arena, "off")
    assert st.deferred == 0 and len(arena.buffers) == 2
    for src, arr in zip(plan.sources, st.arrays, strict=True):
        assert torch.equal(torch.from_numpy(arr), src.data)


@pytest.mark.usefixtures("defer_always")
def test_a_failed_deferred_step_fails_the_save_and_the_next_one_works(
    store_dir, staged, monkeypatch
):
    state = _state(4)

    def refuse() -> None:
        raise RuntimeError("cannot pin that much (injected)")

    _patch_alloc(monkeypatch, refuse)
    h = deltackpt.async_save(state, store_dir, "a")
    h.staged.result(timeout=30)  # held; the failure comes later, in the background
    with pytest.raises(SaveFailedError, match=r"staging .* failed: cannot pin") as ei:
        h.result(timeout=60)
    assert isinstance(ei.value.__cause__, RuntimeError)
    assert deltackpt.snapshots(store_dir) == []
    with pytest.raises(DeltackptError):  # the held bytes are gone, never half-read
        staged[-1].arrays[0]
    monkeypatch.undo()
    expected = {k: v.clone() for k, v in state.items()}
    deltackpt.async_save(state, store_dir, "a").result(timeout=60)
    assert [s.name for s in deltackpt.snapshots(store_dir)] == ["a"]
    assert _same_bits(deltackpt.load(store_dir, "a"), expected)


@pytest.mark.usefixtures("defer_always")
def test_without_room_on_the_device_the_buffers_are_allocated_in_the_call(
    store_dir, staged, monkeypatch
):
    monkeypatch.setattr(stage_mod, "device_room", lambda device, nbytes: False)
    state = _state(5)
    expected = {k: v.clone() for k, v in state.items()}
    h = deltackpt.async_save(state, store_dir, "a")
    assert staged[-1].deferred == 0
    for v in state.values():
        v.zero_()
    h.result(timeout=60)
    assert _same_bits(deltackpt.load(store_dir, "a"), expected)


def test_a_bad_knob_is_refused(store_dir):
    with overrides(DELTACKPT_STAGE_DEFER="later"), pytest.raises(InvalidArgumentError):
        deltackpt.async_save(_state(n=1), store_dir, "a")


@pytest.mark.gpu
def test_first_async_save_of_cuda_state_holds_on_the_device(store_dir, staged):
    # 256 MB over 4 tensors: pinning that in the call would take ~0.1 s; the deferred path
    # copies it on the device instead and pins behind the caller.
    g = torch.Generator(device="cuda").manual_seed(7)
    state = {f"w{i}": torch.randn(16 << 20, device="cuda", generator=g) for i in range(4)}
    expected = {k: v.cpu() for k, v in state.items()}
    h = deltackpt.async_save(state, store_dir, "g")
    assert staged[-1].deferred == len(state)
    for v in state.values():
        v.add_(1.0)  # queued on the current stream, which waits for the held copies
    h.staged.result(timeout=60)
    h.result(timeout=120)
    assert _same_bits(deltackpt.load(store_dir, "g"), expected)
    arena = saver_for(deltackpt.open_store(store_dir)).arenas[0]
    assert len(arena.buffers) == len(state)
    assert all(b.is_pinned() for b in arena.buffers.values())
    # the next save copies straight into those pinned buffers
    expected = {k: v.cpu() for k, v in state.items()}
    h = deltackpt.async_save(state, store_dir, "g2")
    assert staged[-1].deferred == 0
    h.staged.result(timeout=60)
    h.result(timeout=120)
    assert _same_bits(deltackpt.load(store_dir, "g2"), expected)

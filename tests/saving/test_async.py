"""Async saves: staging isolates the saved bytes; errors surface once; back-pressure; deltas."""

from __future__ import annotations

import gc as pygc
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch

import deltackpt
from deltackpt.errors import SaveFailedError
from deltackpt.format.codecs import RAW, XOR, ZSTD, EncodePolicy
from deltackpt.saving.engine import saver_for
from deltackpt.saving.hooks import hooks
from deltackpt.store.store import Store
from tests._faults import close_store, faulty_store


def _model_state(seed: int = 0, n: int = 6, numel: int = 300_000) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"w{i}": torch.randn(numel, generator=g) for i in range(n)}


def _gated_store(path, gate: threading.Event) -> Store:
    """The store at ``path`` whose pack writes wait for ``gate`` (through the storage seam)."""
    return faulty_store(path, on_write=lambda key, n: gate.wait(timeout=30))


def test_mutating_state_after_staging_does_not_change_the_snapshot(store_dir):
    state = _model_state()
    expected = {k: v.clone() for k, v in state.items()}
    gate = threading.Event()
    st = _gated_store(store_dir, gate)
    h = deltackpt.async_save(state, st, "a")
    assert h.staged.done() and not h.done()
    for v in state.values():  # training goes on: overwrite and free the live weights
        v.mul_(-3.0).add_(1.0)
    state.clear()
    gate.set()
    info = h.result(timeout=60)
    close_store(st)
    assert info.name == "a" and info.blocked_seconds <= info.seconds
    out = deltackpt.load(store_dir, "a")
    for k, v in expected.items():
        assert torch.equal(out[k], v)


def test_staging_buffers_are_reused_across_saves(store_dir):
    state = _model_state()
    deltackpt.async_save(state, store_dir, "a", encoding=EncodePolicy(codecs=(RAW, ZSTD))).result()
    st = deltackpt.open_store(store_dir)
    arena = saver_for(st).arenas[0]
    ptrs = {k: b.data_ptr() for k, b in arena.buffers.items()}
    state["w0"].add_(1)
    deltackpt.async_save(state, store_dir, "b", encoding=EncodePolicy(codecs=(RAW, ZSTD))).result()
    assert {k: b.data_ptr() for k, b in arena.buffers.items()} == ptrs


def test_background_failure_is_raised_once_from_result(store_dir):
    state = _model_state(n=2)
    deltackpt.save(state, store_dir, "ok")

    def boom(name: str) -> None:
        raise OSError(28, "No space left on device")

    with hooks.override(before_commit=boom):
        h = deltackpt.async_save(state, store_dir, "bad")
        with pytest.raises(OSError, match="No space left"):
            h.result(timeout=60)
    deltackpt.async_save(state, store_dir, "next").result(timeout=60)  # not raised again
    assert [s.name for s in deltackpt.snapshots(store_dir)] == ["ok", "next"]


def test_unobserved_background_failure_is_raised_by_the_next_save(store_dir):
    state = _model_state(n=2)

    def boom(name: str) -> None:
        raise OSError(5, "I/O error")

    with hooks.override(before_commit=boom):
        h = deltackpt.async_save(state, store_dir, "bad")
        while not h.done():
            time.sleep(0.01)
    with pytest.raises(SaveFailedError, match="I/O error"):
        deltackpt.async_save(state, store_dir, "next")
    deltackpt.save(state, store_dir, "next")  # raised once only
    assert [s.name for s in deltackpt.snapshots(store_dir)] == ["next"]


def test_a_new_save_waits_for_the_previous_one(store_dir):
    state = _model_state(n=2)
    gate = threading.Event()
    st = _gated_store(store_dir, gate)
    h1 = deltackpt.async_save(state, st, "a")
    threading.Timer(0.3, gate.set).start()
    h2 = deltackpt.async_save(state, st, "b")
    assert h1.done()
    info = h2.result(timeout=60)
    close_store(st)
    assert info.waited_seconds >= 0.2
    assert [s.name for s in deltackpt.snapshots(store_dir)] == ["a", "b"]


def test_dropped_unfinished_handle_warns(store_dir):
    gate = threading.Event()
    st = _gated_store(store_dir, gate)
    h = deltackpt.async_save(_model_state(n=1), st, "a")
    with pytest.warns(ResourceWarning, match="dropped before it finished"):
        del h
        pygc.collect()
    gate.set()
    saver_for(st).flush()
    close_store(st)
    assert [s.name for s in deltackpt.snapshots(store_dir)] == ["a"]


def test_closing_the_store_saver_frees_its_state_and_the_next_save_starts_afresh(store_dir):
    state = _model_state(n=2)
    st = deltackpt.open_store(store_dir)
    h = deltackpt.async_save(state, st, "a", encoding="smallest")
    saver = saver_for(st)
    saver.close()  # waits for "a" first
    assert h.done() and h.result().name == "a"
    assert saver.arenas[0].nbytes() == saver.arenas[1].nbytes() == 0
    assert not saver.delta_bases
    assert saver_for(st) is not saver
    deltackpt.save(state, st, "b")
    assert [s.name for s in deltackpt.snapshots(st)] == ["a", "b"]


def test_over_budget_state_is_saved_inline_without_staging(store_dir):
    state = _model_state(n=2)
    h = deltackpt.async_save(state, store_dir, "a", memory_budget=1 << 20)
    assert h.done()  # blocked until committed: no copy was allowed
    assert saver_for(deltackpt.open_store(store_dir)).arenas[0].nbytes() == 0
    out = deltackpt.load(store_dir, "a")
    assert torch.equal(out["w1"], state["w1"])


def test_interpreter_exit_flushes_pending_saves(tmp_path):
    store = tmp_path / "s"
    code = textwrap.dedent(f"""
        import torch, deltackpt
        h = deltackpt.async_save({{"w": torch.arange(2_000_000, dtype=torch.float32)}}, {str(store)!r}, "last")
        h.detach()
    """)
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
    out = deltackpt.load(store, "last")
    assert torch.equal(out["w"], torch.arange(2_000_000, dtype=torch.float32))


def _chain_depths(store_dir, name: str) -> dict[str, int]:
    m = deltackpt.open_store(store_dir).manifest(name)

    def depth(d: str) -> int:
        base = m.chunks[d].base
        return 0 if base is None else 1 + depth(base)

    return {d: depth(d) for d in m.chunks}


def _adam_like_step(state: dict[str, torch.Tensor], seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for v in state.values():
        v.sub_(4e-3 * torch.randn(v.shape, generator=g).sign() * v.abs())


def test_xor_deltas_shrink_saves_and_stay_bit_exact(store_dir):
    state = {k: v.to(torch.bfloat16) for k, v in _model_state(n=4, numel=1 << 20).items()}
    full = deltackpt.save(state, store_dir, "s0", encoding="smallest")
    snapshots = {"s0": {k: v.clone() for k, v in state.items()}}
    for i in range(1, 4):
        _adam_like_step(state, i)
        info = deltackpt.save(state, store_dir, f"s{i}", encoding="smallest")
        snapshots[f"s{i}"] = {k: v.clone() for k, v in state.items()}
        assert info.bytes_written < 0.5 * full.bytes_written, (
            i,
            info.bytes_written,
            full.bytes_written,
        )
    codecs_used = {c.codec for c in deltackpt.open_store(store_dir).manifest("s3").chunks.values()}
    assert XOR in codecs_used
    for name, expected in snapshots.items():
        out = deltackpt.load(store_dir, name)
        for k, v in expected.items():
            assert torch.equal(out[k], v), (name, k)
    assert deltackpt.verify(store_dir).ok


def test_delta_chains_are_bounded_by_keyframes(store_dir):
    state = {k: v.to(torch.bfloat16) for k, v in _model_state(n=2, numel=1 << 20).items()}
    for i in range(7):
        _adam_like_step(state, i)
        deltackpt.save(state, store_dir, f"s{i}", keyframe_every=3, encoding="smallest")
        assert max(_chain_depths(store_dir, f"s{i}").values()) <= 2
    assert max(_chain_depths(store_dir, "s4").values()) >= 1


def test_gc_keeps_the_bases_of_delta_chunks_alive(store_dir):
    state = {k: v.to(torch.bfloat16) for k, v in _model_state(n=2, numel=1 << 20).items()}
    for i in range(3):
        _adam_like_step(state, i)
        deltackpt.save(state, store_dir, f"s{i}")
    deltackpt.gc(store_dir, keep_last=1)
    assert [s.name for s in deltackpt.snapshots(store_dir)] == ["s2"]
    out = deltackpt.load(store_dir, "s2")
    for k, v in state.items():
        assert torch.equal(out[k], v)
    assert deltackpt.verify(store_dir).ok


def test_encoding_can_be_forced_or_turned_off(store_dir):
    state = _model_state(n=1)
    a = deltackpt.save(state, store_dir, "raw", encoding=EncodePolicy(codecs=(RAW,)))
    assert {c.codec for c in deltackpt.open_store(store_dir).manifest("raw").chunks.values()} == {
        RAW
    }
    state["w0"].add_(1)
    deltackpt.save(state, store_dir, "zstd", encoding=EncodePolicy(force=ZSTD))
    assert {c.codec for c in deltackpt.open_store(store_dir).manifest("zstd").chunks.values()} == {
        ZSTD
    }
    assert a.bytes_written >= a.logical_bytes


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(32, 64)
        self.b = torch.nn.Linear(64, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


def _train(ckpt: deltackpt.Checkpointer, state: dict, start: int, stop: int) -> None:
    model, opt = state["model"], state["optim"]
    for step in range(start, stop):
        g = torch.Generator().manual_seed(step)
        x = torch.randn(16, 32, generator=g)
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        state["step"] = step
        ckpt.maybe_save(step, state)


def test_checkpointer_resumes_identically_and_keeps_last(store_dir):
    torch.manual_seed(0)
    model = Net()
    state = {"model": model, "optim": torch.optim.AdamW(model.parameters(), lr=1e-2), "step": 0}
    with deltackpt.Checkpointer(store_dir, every=3, keep_last=2) as ckpt:
        assert ckpt.restore_latest(state) == 0
        _train(ckpt, state, 0, 10)  # saves after steps 2, 5, 8
    assert [s.name for s in deltackpt.snapshots(store_dir)] == ["step-00000005", "step-00000008"]
    reference = Net()
    reference.load_state_dict(model.state_dict())

    # A "restart": fresh objects, resume from step 9, train to 12 in both worlds.
    torch.manual_seed(1)
    model2 = Net()
    state2 = {"model": model2, "optim": torch.optim.AdamW(model2.parameters(), lr=1e-2), "step": -1}
    ckpt2 = deltackpt.Checkpointer(store_dir, every=3, keep_last=2)
    start = ckpt2.restore_latest(state2)
    assert start == 9 and state2["step"] == 8
    # replay the live run from its step-8 snapshot too, so both continue from the same point
    state_live = {"model": Net(), "optim": None, "step": None}
    state_live["optim"] = torch.optim.AdamW(state_live["model"].parameters(), lr=1e-2)
    deltackpt.Checkpointer(store_dir, every=1000).restore_latest(state_live)
    for st in (state2, state_live):
        _train(
            ckpt2 if st is state2 else deltackpt.Checkpointer(store_dir / "scratch", every=1000),
            st,
            9,
            12,
        )
    ckpt2.close()
    for p, q in zip(state2["model"].parameters(), state_live["model"].parameters(), strict=True):
        assert torch.equal(p, q)
    names = [s.name for s in deltackpt.snapshots(store_dir)]
    assert names == ["step-00000008", "step-00000011"]


def test_checkpointer_retention_spares_foreign_snapshots(store_dir):
    deltackpt.save({"x": torch.ones(2)}, store_dir, "manual")
    state = {"w": torch.zeros(4)}
    with deltackpt.Checkpointer(store_dir, every=1, keep_last=1, async_=False) as ckpt:
        for step in range(3):
            state["w"].add_(1)
            ckpt.maybe_save(step, state)
    assert [s.name for s in deltackpt.snapshots(store_dir)] == ["manual", "step-00000002"]
    assert torch.equal(deltackpt.load(store_dir)["w"], torch.full((4,), 3.0))


@pytest.mark.gpu
def test_cuda_state_is_staged_into_pinned_buffers(store_dir):
    state = {"w": torch.randn(1 << 20, device="cuda")}
    h = deltackpt.async_save(state, store_dir, "g")
    h.staged.result(timeout=60)
    expected = state["w"].cpu()
    state["w"].zero_()
    h.result(timeout=60)
    assert torch.equal(deltackpt.load(store_dir, "g")["w"], expected)
    arenas = saver_for(deltackpt.open_store(store_dir)).arenas
    buf = next(iter(arenas[1].buffers.values()), None) or next(iter(arenas[0].buffers.values()))
    assert buf.is_pinned()


@pytest.mark.gpu
def test_cuda_state_changed_right_after_a_warm_async_save_is_saved_as_it_was(store_dir):
    # A warm save copies into pinned buffers on a side stream and returns before they land;
    # the step queued next (on the current stream) must not change the bytes under them
    # (Checkpointer and the Lightning plug-in return to training without waiting for staged).
    g = torch.Generator(device="cuda").manual_seed(3)
    state = {f"w{i}": torch.randn(16 << 20, device="cuda", generator=g) for i in range(4)}
    deltackpt.async_save(state, store_dir, "warm").result(timeout=120)  # buffers pinned
    for step in range(3):
        for v in state.values():
            v.mul_(1.5)  # every element changes: every chunk is copied
        expected = {k: v.cpu() for k, v in state.items()}
        h = deltackpt.async_save(state, store_dir, f"s{step}")
        for v in state.values():  # no wait for h.staged: queued behind the copies
            v.add_(1.0)
        h.result(timeout=120)
        got = deltackpt.load(store_dir, f"s{step}")
        assert all(torch.equal(got[k], expected[k]) for k in expected), step


def test_unchanged_chunks_are_hashed_in_place_not_copied(store_dir):
    calls: list[int] = []
    copied: list[int] = []

    def save(name: str) -> None:
        before = len(calls)
        with hooks.override(on_stage_copy=calls.append):
            deltackpt.async_save(state, store, name).result()
        copied.append(len(calls) - before)

    store = deltackpt.open_store(store_dir, chunk_bytes=256 << 10)
    state = {k: v.to(torch.bfloat16) for k, v in _model_state(n=4, numel=1 << 19).items()}
    n_chunks = 4 * ((1 << 20) // (256 << 10))
    save("a")
    assert copied[-1] == n_chunks  # first save: every chunk is new
    save("b")
    assert copied[-1] == 0  # nothing changed: nothing copied, only hashed
    state["w2"][:10] += 1  # one chunk of one tensor
    save("c")
    assert copied[-1] == 1
    out = deltackpt.load(store, "c")
    assert all(torch.equal(out[k], v) for k, v in state.items())


def test_delta_bases_stay_right_when_chunks_change_irregularly(store_dir):
    # Each chunk's base lives in one of two arenas; a chunk that changes, rests, changes again
    # must be staged into the arena that does not hold its current base.
    store = deltackpt.open_store(store_dir, chunk_bytes=64 << 10)
    g = torch.Generator().manual_seed(3)
    state = {"w": torch.randn(8 * (64 << 10) // 2, generator=g).to(torch.bfloat16)}  # 8 chunks
    expected = {}
    n = state["w"].numel() // 8
    for i in range(9):
        for c in range(8):
            if torch.rand((), generator=g) < 0.5:
                part = state["w"][c * n : (c + 1) * n]
                part.sub_(4e-2 * torch.randn(n, generator=g).sign() * part.abs())
        save = deltackpt.async_save if i % 2 else deltackpt.save
        result = save(state, store, f"s{i}", keyframe_every=3, encoding="smallest")
        if i % 2:
            result.result()
        expected[f"s{i}"] = state["w"].clone()
    assert any(r.codec == "xor" for r in store.manifest("s8").chunks.values())
    for name, w in expected.items():
        assert torch.equal(deltackpt.load(store, name)["w"], w), name
    assert deltackpt.verify(store).ok

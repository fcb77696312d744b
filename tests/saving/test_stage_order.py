"""Async saves of a world of one without delta bases: hash-first and copy-first staging commit
the bytes of the call, write every changed chunk and no unchanged one; auto picks per save."""

from __future__ import annotations

import threading

import pytest
import torch

import deltackpt
from deltackpt.errors import InvalidArgumentError
from deltackpt.format.codecs import RAW, XOR, EncodePolicy
from deltackpt.options import overrides
from deltackpt.saving.engine import saver_for
from deltackpt.saving.hooks import hooks
from deltackpt.saving.order import COPY_FIRST_AT, StageOrder
from deltackpt.store.store import Store
from tests._faults import close_store, faulty_store

CHUNK = 64 << 10
FAST = {"encoding": "fast-restore", "overwrite": True}


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    state = {f"w{i}": torch.randn(4 * CHUNK // 4, generator=g) for i in range(4)}
    state["bias"] = torch.randn(10, generator=g)  # a group chunk
    state["step"] = torch.tensor(3)
    return state


def _gated(path, gate: threading.Event, mode: str) -> Store:
    """The store at ``path`` whose pack writes wait for ``gate``, its saves in ``mode``."""
    st = faulty_store(path, on_write=lambda key, n: gate.wait(timeout=30))
    saver_for(st).order.mode = mode
    return st


def _change(state: dict[str, torch.Tensor], kind: str) -> None:
    if kind == "dense":
        for t in state.values():
            t.add_(1)
    elif kind == "sparse":  # one chunk of one tensor, and the small group
        state["w2"][CHUNK // 4 + 5] += 1.0
        state["bias"][0] += 1.0


@pytest.mark.parametrize("mode", ["hash-first", "copy-first", "auto"])
def test_the_snapshot_holds_the_bytes_of_the_call_whatever_the_order(store_dir, mode):
    store = deltackpt.open_store(store_dir, chunk_bytes=CHUNK, small_bytes=1024)
    del store  # the layout is set; the gated store below opens it again
    state = _state()
    gate = threading.Event()
    st = _gated(store_dir, gate, mode)
    try:
        for i, kind in enumerate(["first", "dense", "sparse", "same", "dense", "dense"]):
            _change(state, kind)
            expected = {k: v.clone() for k, v in state.items()}
            gate.clear()
            h = deltackpt.async_save(state, st, f"s{i}", **FAST)
            assert h.staged.done() and not h.done()  # the writes wait for the gate
            for v in state.values():  # the caller goes on: its tensors change under the save
                v.mul_(-3).add_(11)
            gate.set()
            info = h.result(timeout=60)
            out = deltackpt.load(st, f"s{i}")
            assert set(out) == set(expected)
            for k, v in expected.items():
                assert torch.equal(out[k], v), (mode, kind, k)
            if kind == "same":
                assert info.chunks_new == 0  # nothing written again
            if kind == "sparse":
                assert info.chunks_new == 2  # the changed chunk of w2 and the group
            for k, v in expected.items():  # back to the saved state for the next step
                state[k].copy_(v)
    finally:
        close_store(st)


def test_copy_first_writes_only_the_changed_chunks(store_dir):
    st = deltackpt.open_store(store_dir, chunk_bytes=CHUNK, small_bytes=1024)
    saver_for(st).order.mode = "copy-first"
    state = {f"w{i}": torch.arange(4 * CHUNK // 4, dtype=torch.float32) + i for i in range(3)}
    copied: list[int] = []
    with hooks.override(on_stage_copy=copied.append):
        first = deltackpt.async_save(state, st, "a", **FAST).result()
        assert first.chunks_new == 12
        same = deltackpt.async_save(state, st, "b", **FAST).result()
        assert same.chunks_new == 0 and same.chunks_reused == 12
        state["w1"][3 * CHUNK // 4] = -1.0  # the first element of w1's last chunk
        one = deltackpt.async_save(state, st, "c", **FAST).result()
    assert one.chunks_new == 1 and one.chunks_reused == 11
    assert copied == []  # copy-first copies whole sources, not chunks after a hash
    out = deltackpt.load(st, "c")
    assert all(torch.equal(out[k], v) for k, v in state.items())
    assert torch.equal(deltackpt.load(st, "a")["w1"], torch.arange(4 * CHUNK // 4) + 1.0)


def test_auto_copies_first_after_a_dense_save_and_hashes_first_after_a_sparse_one(store_dir):
    st = deltackpt.open_store(store_dir, chunk_bytes=CHUNK, small_bytes=1024)
    order = saver_for(st).order
    assert order.mode == "auto" and not order.copy_first()  # no evidence: hash-first
    state = _state()
    deltackpt.async_save(state, st, "a", **FAST).result()
    assert order.changed == 1.0 and order.copy_first()  # everything was new
    _change(state, "sparse")
    deltackpt.async_save(state, st, "b", **FAST).result()  # copy-first, learns: 2 of 18 chunks
    assert order.changed is not None and order.changed < COPY_FIRST_AT
    assert not order.copy_first()
    _change(state, "dense")
    deltackpt.async_save(state, st, "c", **FAST).result()
    assert order.copy_first()
    out = deltackpt.load(st, "c")
    assert all(torch.equal(out[k], v) for k, v in state.items())


def test_saves_with_delta_bases_keep_hashing_first(store_dir):
    st = deltackpt.open_store(store_dir, chunk_bytes=CHUNK, small_bytes=1024)
    saver = saver_for(st)
    saver.order.mode = "copy-first"
    state = _state()
    xor = EncodePolicy(codecs=(RAW, XOR))  # delta bases kept
    deltackpt.async_save(state, st, "a", encoding=xor).result()
    _change(state, "sparse")
    copied: list[int] = []
    with hooks.override(on_stage_copy=copied.append):
        deltackpt.async_save(state, st, "b", encoding=xor).result()
    assert len(copied) == 1  # the hash pass copied the changed chunk: the order was not used
    assert saver.delta_bases


def test_a_bad_stage_order_is_refused_with_its_name(store_dir):
    with overrides(DELTACKPT_STAGE_ORDER="fast"), pytest.raises(InvalidArgumentError) as e:
        StageOrder()
    msg = str(e.value)
    assert "DELTACKPT_STAGE_ORDER" in msg and "'fast'" in msg and "copy-first" in msg
    with overrides(DELTACKPT_STAGE_ORDER="copy-first"):
        assert StageOrder().copy_first()
    order = StageOrder(mode="sideways")
    with pytest.raises(InvalidArgumentError, match="sideways"):
        order.copy_first()

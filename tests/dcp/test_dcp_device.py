"""The DCP plug-in with state in device memory: ``StoreWriter`` finds the changed chunks where
the tensors live and copies only those to the host (as ``deltackpt.save`` does), and
``StoreReader`` copies into device targets from pinned spans with one wait per batch. Here the
CPU stand-in runs the same code (``DELTACKPT_DEVICE_SCAN=always``); the ``gpu`` case runs it
on CUDA tensors."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp

import deltackpt
from deltackpt.dcp import StoreReader, StoreWriter
from deltackpt.saving.hooks import hooks

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
warnings.filterwarnings("ignore", message="torch.distributed is (disabled|unavailable)")

CHUNK = 64 << 10


def _state(device: str) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "a": torch.randn(4 * CHUNK // 4, generator=g).to(device),  # 4 chunks
        "b": torch.randn(64, 1024, generator=g).to(torch.bfloat16).to(device),  # 2 chunks
        "small": torch.arange(10, dtype=torch.int32).to(device),  # grouped
    }


def _save(state: dict, store, name: str) -> int:
    copied: list[int] = []
    with hooks.override(on_stage_copy=copied.append):
        dcp.save(state, storage_writer=StoreWriter(store, name))
    return len(copied)


def _same(a: dict, b: dict) -> bool:
    return all(torch.equal(a[k].cpu(), b[k].cpu()) for k in a)


@pytest.fixture
def forced(monkeypatch):
    monkeypatch.setenv("DELTACKPT_DEVICE_SCAN", "always")


def test_only_changed_chunks_of_a_dcp_save_are_copied(tmp_path, forced):
    store = deltackpt.open_store(tmp_path / "s", chunk_bytes=CHUNK, small_bytes=1024)
    state = _state("cpu")
    first = _save(state, store, "s0")
    assert first == 7  # 4 + 2 chunks, and the group chunk
    assert _save(state, store, "s1") == 1  # nothing changed: only the group chunk
    before = {k: v.clone() for k, v in state.items()}
    state["a"][5] += 1.0  # one chunk of "a"
    assert _save(state, store, "s2") == 2
    for name in ("s0", "s1"):
        got = {k: torch.zeros_like(v) for k, v in state.items()}
        dcp.load(got, storage_reader=StoreReader(store, name))
        assert _same(got, before) and not _same(got, state)
    got = {k: torch.zeros_like(v) for k, v in state.items()}
    dcp.load(got, storage_reader=StoreReader(store, "s2"))
    assert _same(got, state)
    assert deltackpt.verify(store).ok


def test_a_chunk_gc_removed_is_copied_again(tmp_path, forced):
    # an unchanged chunk is trusted only while its digest is still in the store
    store = deltackpt.open_store(tmp_path / "s", chunk_bytes=CHUNK, small_bytes=1024)
    state = _state("cpu")
    _save(state, store, "s0")
    store.remove_snapshot("s0")
    deltackpt.gc(store)
    assert _save(state, store, "s1") == 7
    got = {k: torch.zeros_like(v) for k, v in state.items()}
    dcp.load(got, storage_reader=StoreReader(store, "s1"))
    assert _same(got, state)


@pytest.mark.parametrize("bucket", [200 << 10, 1 << 20])
def test_dcp_load_into_device_targets_goes_through_pinned_buffers(tmp_path, forced, bucket):
    from deltackpt.dcp import reader as reader_mod
    from deltackpt.loading import to_device

    store = deltackpt.open_store(tmp_path / "s", chunk_bytes=CHUNK, small_bytes=1024)
    state = _state("cpu")
    dcp.save(state, storage_writer=StoreWriter(store, "s0"))
    queued: list[int] = []
    run = reader_mod._ToDevice.run

    def spy(self, planner):  # type: ignore[no-untyped-def]
        queued.append(len(self.items))
        return run(self, planner)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(to_device, "BUCKET", bucket)  # 200 KiB: "a" (256 KiB) goes in blocks of rows
        mp.setattr(reader_mod._ToDevice, "run", spy)
        got = {k: torch.zeros_like(v) for k, v in state.items()}
        dcp.load(got, storage_reader=StoreReader(store, "s0"))
    assert _same(got, state)
    assert sum(queued) == 3  # every tensor item queued with its batch, committed after


@pytest.mark.gpu
def test_dcp_save_and_load_of_cuda_state(tmp_path):
    store = deltackpt.open_store(tmp_path / "s", chunk_bytes=CHUNK, small_bytes=1024)
    state = _state("cuda")
    assert _save(state, store, "s0") == 7
    assert _save(state, store, "s1") == 1
    state["a"][5] += 1.0
    assert _save(state, store, "s2") == 2
    got = {k: torch.zeros_like(v) for k, v in state.items()}
    dcp.load(got, storage_reader=StoreReader(store, "s2"))
    assert all(v.device.type == "cuda" for v in got.values()) and _same(got, state)
    assert deltackpt.verify(store).ok

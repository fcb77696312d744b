"""``load(into=, since=)`` into tensors in GPU memory: chunks ``held`` has at the same bytes are
not read, the others are read whole (their bytes are not on the host to patch) and copied in at
the commit. Here plain CPU tensors stand in for device ones (``DELTACKPT_DEVICE_SCAN=always``);
the ``gpu`` case catches up CUDA tensors."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import deltackpt
from deltackpt.errors import CorruptChunkError
from deltackpt.loading.stats import LoadStats
from deltackpt.options import overrides
from tests.loading.test_keys import _corrupt_entry

CHUNK = 16 << 10


def _versions(tmp_path: Path) -> tuple[Path, list[dict[str, torch.Tensor]]]:
    store = tmp_path / "s"
    deltackpt.open_store(store, chunk_bytes=CHUNK, small_bytes=1024)
    g = torch.Generator().manual_seed(0)
    v0 = {
        "w": torch.randn(64, 1024, generator=g),  # 16 chunks
        "b": torch.randn(8192, generator=g).to(torch.bfloat16),  # 1 chunk
        "n": torch.randn(100, generator=g),  # grouped with the other small tensors
    }
    v1 = {k: v.clone() for k, v in v0.items()}
    v1["w"][3, 7] += 1.0  # chunk 0 of w
    v1["w"][40] += 1.0  # a whole row inside chunk 10
    deltackpt.save(v0, store, "v0")
    deltackpt.save(v1, store, "v1")
    return store, [v0, v1]


def test_a_device_target_reads_only_the_chunks_that_changed(tmp_path: Path):
    store, (v0, v1) = _versions(tmp_path)
    into = {k: v.clone() for k, v in v0.items()}
    stats = LoadStats()
    with overrides(DELTACKPT_DEVICE_SCAN="always"):
        deltackpt.load(store, "v1", into=into, since="v0", stats=stats)
    assert all(torch.equal(into[k], v1[k]) for k in v1)
    assert stats.chunks_unchanged == 14 + 1 + 1  # w's other chunks, b, the small tensors' chunk
    assert stats.chunks_read == 2  # w's two changed chunks, and nothing else
    assert stats.bytes_read == 2 * CHUNK


def test_verify_full_reads_a_device_target_whole(tmp_path: Path):
    store, (v0, v1) = _versions(tmp_path)
    into = {k: v.clone() for k, v in v0.items()}
    into["w"][60, 0] = 9.0  # into is not quite v0 where no chunk changed: full replaces it
    stats = LoadStats()
    with overrides(DELTACKPT_DEVICE_SCAN="always"):
        deltackpt.load(store, "v1", into=into, since="v0", stats=stats, verify="full")
    assert all(torch.equal(into[k], v1[k]) for k in v1)
    assert stats.chunks_unchanged == 0


def test_a_corrupt_changed_chunk_leaves_the_target_as_it_was(tmp_path: Path):
    store, (v0, _) = _versions(tmp_path)
    _corrupt_entry(store, "v1", "w")
    into = {k: v.clone() for k, v in v0.items()}
    with overrides(DELTACKPT_DEVICE_SCAN="always"), pytest.raises(CorruptChunkError):
        deltackpt.load(store, "v1", into=into, since="v0")
    assert all(torch.equal(into[k], v0[k]) for k in v0)  # staged, never copied in


@pytest.mark.gpu
def test_cuda_targets_catch_up_reading_only_what_changed(tmp_path: Path):
    store, (v0, v1) = _versions(tmp_path)
    into = {k: v.cuda() for k, v in v0.items()}
    stats = LoadStats()
    deltackpt.load(store, "v1", into=into, since="v0", stats=stats)
    assert all(torch.equal(into[k].cpu(), v1[k]) for k in v1)
    assert stats.chunks_unchanged == 16 and stats.chunks_read == 2

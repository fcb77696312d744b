"""Loads into device tensors through reused host buckets (loading/to_device.py).

The CPU suite runs the pipeline on CPU targets (``DELTACKPT_DEVICE_SCAN=always``): the same
bucket planning, reads and copies a GPU runs, with ordinary buffers and synchronous copies. The
``gpu`` tests load into CUDA tensors.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import deltackpt
from deltackpt.errors import CorruptChunkError
from deltackpt.loading import assemble, to_device
from deltackpt.loading.stats import LoadStats
from deltackpt.options import overrides
from tests.loading.test_keys import _corrupt_entry

CHUNK = 16 << 10


def _state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(40_000, generator=g)  # 160 kB: 10 chunks
    return {
        "w": w,
        "tied": w,  # the same tensor twice: one shared storage
        "h": torch.randn(300, 70, generator=g).half(),
        "b": torch.randn(9_000, generator=g).bfloat16(),
        "i": torch.arange(12_345, dtype=torch.int64),
        "t": torch.randn(64, 48, generator=g).t(),  # saved as a non-contiguous view
        "empty": torch.empty(0, 3),
        "step": 7,
    }


def _zeros_like(sd: dict[str, Any], device: str = "cpu") -> dict[str, Any]:
    return {
        k: torch.zeros_like(v, device=device) if isinstance(v, torch.Tensor) else 0
        for k, v in sd.items()
    }


@pytest.fixture
def spans(monkeypatch: pytest.MonkeyPatch) -> list[list[str]]:
    """The keys each device-pipeline load took that way."""
    seen: list[list[str]] = []
    real = assemble.read_to_device

    def spy(packs: Any, m: Any, items: Any, *a: Any, **kw: Any) -> int:
        seen.append([e.path for e, _ in items])
        return real(packs, m, items, *a, **kw)

    monkeypatch.setattr(assemble, "read_to_device", spy)
    return seen


@pytest.mark.parametrize("bucket", [1 << 20, 3 * CHUNK, 1])
def test_bit_exact_through_buckets(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, spans: list[list[str]], bucket: int
) -> None:
    """One bucket for all, several (a tensor spanning three), and one chunk a bucket."""
    monkeypatch.setattr(to_device, "BUCKET", bucket)
    deltackpt.open_store(tmp_path / "s", chunk_bytes=CHUNK, small_bytes=1024)
    sd = _state()
    deltackpt.save(sd, tmp_path / "s", "x")
    into = _zeros_like(sd)
    stats = LoadStats()
    with overrides(DELTACKPT_DEVICE_SCAN="always"):
        deltackpt.load(tmp_path / "s", "x", into=into, stats=stats)
    for k, v in sd.items():
        if isinstance(v, torch.Tensor):
            assert torch.equal(into[k], v), k
    assert into["step"] == 7
    # whole, contiguous targets went through the buckets; the tied pair is a shared storage,
    # "t"'s target is strided like the saved view and the empty tensor has no bytes: the
    # general way
    assert sorted(spans[0]) == ["b", "h", "i"]
    plain = LoadStats()
    deltackpt.load(tmp_path / "s", "x", into=_zeros_like(sd), stats=plain)
    assert stats.chunks_read == plain.chunks_read  # no chunk is read twice


def test_off_by_default_on_cpu(tmp_path: Path, spans: list[list[str]]) -> None:
    sd = _state()
    deltackpt.save(sd, tmp_path / "s", "x")
    deltackpt.load(tmp_path / "s", "x", into=_zeros_like(sd))
    assert spans == []  # CPU targets are read into in place


def test_a_strided_target_goes_the_general_way(tmp_path: Path, spans: list[list[str]]) -> None:
    sd = {"a": torch.randn(5000), "m": torch.randn(60, 80)}
    deltackpt.save(sd, tmp_path / "s", "x")
    into = {"a": torch.zeros(5000), "m": torch.zeros(80, 60).t()}
    with overrides(DELTACKPT_DEVICE_SCAN="always"):
        deltackpt.load(tmp_path / "s", "x", into=into)
    assert torch.equal(into["a"], sd["a"]) and torch.equal(into["m"], sd["m"])
    assert spans == [["a"]]


def test_a_corrupt_chunk_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(to_device, "BUCKET", 2 * CHUNK)
    deltackpt.open_store(tmp_path / "s", chunk_bytes=CHUNK, small_bytes=1024)
    sd = {"a": torch.randn(20_000), "b": torch.randn(20_000), "c": torch.randn(20_000)}
    deltackpt.save(sd, tmp_path / "s", "x")
    _corrupt_entry(tmp_path / "s", "x", "b")
    with (
        overrides(DELTACKPT_DEVICE_SCAN="always"),
        pytest.raises(CorruptChunkError, match="'b'"),
    ):
        deltackpt.load(tmp_path / "s", "x", into={k: torch.zeros(20_000) for k in sd})
    # the other keys still load (damage is reported where it is)
    into = {"a": torch.zeros(20_000)}
    with overrides(DELTACKPT_DEVICE_SCAN="always"):
        deltackpt.load(tmp_path / "s", "x", into=into, keys=["a"], strict=False)
    assert torch.equal(into["a"], sd["a"])


def test_buckets_hold_whole_chunks() -> None:
    from deltackpt.format.manifest import TensorEntry

    e = TensorEntry("w", "float32", (10,), data=(("d0", 0, 16), ("d1", 0, 16), ("d2", 0, 8)))
    f = TensorEntry("v", "float32", (4,), data=(("d3", 0, 16),))
    out = to_device._buckets([(e, torch.zeros(10)), (f, torch.zeros(4))], 32)
    assert [b.nbytes for b in out] == [32, 24]
    assert [[(s.path, s.start, s.offset, s.n) for s in b.spans] for b in out] == [
        [("w", 0, 0, 32)],
        [("w", 32, 0, 8), ("v", 0, 8, 16)],
    ]


# ---------------------------------------------------------------------------- CUDA


@pytest.mark.gpu
def test_load_into_cuda_tensors(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, spans: Any
) -> None:
    monkeypatch.setattr(to_device, "BUCKET", 4 << 20)  # several buckets, both buffers reused
    sd = {f"w{i}": torch.randn(1 << 20, device="cuda") for i in range(6)}
    sd["half"] = torch.randn(3000, 7, device="cuda").half()
    sd["cpu"] = torch.randn(1000)
    deltackpt.save(sd, tmp_path / "s", "x")
    into = {k: torch.zeros_like(v) for k, v in sd.items()}
    deltackpt.load(tmp_path / "s", "x", into=into)
    torch.cuda.synchronize()
    for k, v in sd.items():
        assert into[k].device == v.device and torch.equal(into[k], v), k
    assert sorted(spans[0]) == sorted(k for k in sd if k != "cpu")


# ---------------------------------------------------------------------------- load(device=)


def test_load_with_device_makes_new_tensors_there_ties_kept(
    tmp_path: Path, spans: list[list[str]]
) -> None:
    """``device=`` (map_location): whole tensors through the device pipeline (the CPU stand-in
    here), shared storages moved once (tied stays tied), parameters stay parameters."""
    sd = _state()
    sd["p"] = torch.nn.Parameter(torch.randn(50))
    deltackpt.open_store(tmp_path / "s", chunk_bytes=CHUNK, small_bytes=1024)
    deltackpt.save(sd, tmp_path / "s", "x")
    with overrides(DELTACKPT_DEVICE_SCAN="always"):
        got = deltackpt.load(tmp_path / "s", "x", device="cpu")
    for k, v in sd.items():
        if isinstance(v, torch.Tensor):
            assert torch.equal(got[k], v), k
            assert got[k].dtype == v.dtype and got[k].shape == v.shape, k
    assert got["step"] == 7
    assert got["w"].data_ptr() == got["tied"].data_ptr()  # one storage, as saved
    assert isinstance(got["p"], torch.nn.Parameter)
    assert sorted(spans[0]) == ["b", "h", "i", "p", "t"]  # whole tensors: straight there


def test_load_with_device_and_into_is_refused(tmp_path: Path) -> None:
    from deltackpt.errors import InvalidArgumentError

    sd = {"a": torch.randn(10)}
    deltackpt.save(sd, tmp_path / "s", "x")
    with pytest.raises(InvalidArgumentError, match="with into="):
        deltackpt.load(tmp_path / "s", "x", into={"a": torch.zeros(10)}, device="cpu")
    with pytest.raises(InvalidArgumentError, match="device"):
        deltackpt.load(tmp_path / "s", "x", device="no-such-device")


@pytest.mark.gpu
def test_load_with_device_cuda() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA (no GPU on this machine)")
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        sd = _state()
        deltackpt.open_store(Path(d) / "s", chunk_bytes=CHUNK, small_bytes=1024)
        deltackpt.save(sd, Path(d) / "s", "x")
        got = deltackpt.load(Path(d) / "s", "x", device="cuda")
    for k, v in sd.items():
        if isinstance(v, torch.Tensor):
            assert got[k].is_cuda and torch.equal(got[k].cpu(), v), k
    assert got["w"].data_ptr() == got["tied"].data_ptr()


def test_copy_through_cuts_and_packs_runs_through_the_ring() -> None:
    """``copy_through`` (a catch-up's changed runs of device tensors, at its commit): runs longer
    than a bucket cut, short ones packed several to a bucket, every byte where it belongs."""
    g = torch.Generator().manual_seed(3)
    dst = torch.zeros(1000, dtype=torch.uint8)
    spans = [(0, 250), (300, 10), (310, 7), (500, 1), (600, 400)]  # two over the 100-byte cap
    runs = [
        (dst[a : a + n], torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g))
        for a, n in spans
    ]
    to_device.copy_through(runs, cap=100)
    want = torch.zeros(1000, dtype=torch.uint8)
    for (a, n), (_, src) in zip(spans, runs, strict=True):
        want[a : a + n] = src
    assert torch.equal(dst, want)
    to_device.copy_through([])  # nothing to copy: no buffers

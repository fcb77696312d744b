"""Incremental load: ``load(name, into=state_of_held, since=held)`` reads only what differs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import deltackpt
from deltackpt import LoadStats
from deltackpt.errors import (
    CorruptChunkError,
    HeldVersionMismatchError,
    InvalidArgumentError,
    SnapshotNotFoundError,
    StateMismatchError,
)
from deltackpt.format.codecs import XOR
from deltackpt.store.packs import pack_name

CHUNK = 64 << 10  # small chunks: several per tensor, so "one chunk changed" is a real case
N_SAVES = 6


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _copy(state: dict[str, Any]) -> dict[str, Any]:
    return {
        "model": {k: t.clone() for k, t in state["model"].items()},
        "step": state["step"],
    }


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return a["model"].keys() == b["model"].keys() and all(
        torch.equal(_bits(a["model"][k]), _bits(b["model"][k])) for k in a["model"]
    )


def _history(path: Path, encoding: str | None) -> tuple[deltackpt.Store, list[dict[str, Any]]]:
    """Snapshots s0..s5 of a small bf16 model: each step nudges a few rows of ``w0`` (an RL-like
    step: most of the state is unchanged) and a small tensor; returns the states saved."""
    st = deltackpt.open_store(path, chunk_bytes=CHUNK, small_bytes=16 << 10)
    g = torch.Generator().manual_seed(0)
    model = {f"w{i}": torch.randn(256, 256, generator=g).to(torch.bfloat16) for i in range(6)}
    model["bias"] = torch.randn(10, generator=g)
    model["norm"] = torch.ones(20)
    model["scale"] = torch.full((30,), 2.0)
    state: dict[str, Any] = {"model": model, "step": 0}
    saved = []
    kw = {"encoding": encoding} if encoding else {}
    for k in range(N_SAVES):
        deltackpt.save(state, st, f"s{k}", keyframe_every=4, **kw)
        saved.append(_copy(state))
        model["w0"][: 3 + k] += 0.01
        model["bias"][0] += 1.0
        state["step"] += 1
    return st, saved


def _w0_codec(st: deltackpt.Store, name: str) -> str:
    d = st.manifest(name).tensors[0].data[0][0]  # model/w0's first chunk: the one that changes
    return st.manifest(name).chunks[d].codec


@pytest.mark.parametrize("encoding", ["smallest", None])
@pytest.mark.parametrize("held,name", [(0, 1), (0, 3), (1, 2), (1, 4), (2, 5)])
def test_catch_up_is_bit_exact(tmp_path: Path, encoding: str | None, held: int, name: int) -> None:
    st, saved = _history(tmp_path / "s", encoding)
    into = _copy(saved[held])
    into["step"] = -1
    stats = LoadStats()
    out = deltackpt.load(st, f"s{name}", into=into, since=f"s{held}", stats=stats)
    assert out is into
    assert _same(into, saved[name]) and into["step"] == name
    assert stats.chunks_unchanged >= 10  # five tensors of two chunks each never changed
    if encoding == "smallest":
        assert _w0_codec(st, "s0") != XOR and _w0_codec(st, "s1") == XOR  # keyframe, mid-chain
        if (held, name) in [(0, 1), (0, 3), (1, 2)]:  # w0's chain reaches the held chunk
            assert stats.chunks_patched >= 1
    else:
        assert stats.chunks_patched == 0  # the default writes no xor chunks on a local disk


def test_unchanged_chunks_are_not_read(tmp_path: Path) -> None:
    st, saved = _history(tmp_path / "s", None)
    full = LoadStats()
    deltackpt.load(st, "s1", stats=full)
    inc = LoadStats()
    into = _copy(saved[0])
    deltackpt.load(st, "s1", into=into, since="s0", stats=inc)
    assert _same(into, saved[1])
    # w0's first chunk and the chunk of small tensors changed; twelve 64 KiB chunks did not
    assert inc.chunks_unchanged >= 11
    assert 0 < inc.bytes_read <= 3 * CHUNK
    assert inc.bytes_read < full.bytes_read / 4
    assert full.chunks_read == inc.chunks_read + inc.chunks_unchanged + inc.chunks_patched


def test_same_snapshot_reads_nothing(tmp_path: Path) -> None:
    st, saved = _history(tmp_path / "s", "smallest")
    into, stats = _copy(saved[3]), LoadStats()
    deltackpt.load(st, "s3", into=into, since="s3", stats=stats)
    assert stats.bytes_read == 0 and _same(into, saved[3])


@pytest.mark.parametrize("verify", [True, "full", False])
@pytest.mark.parametrize("key", ["w0", "w3", "norm"])
def test_into_not_holding_held_raises_and_writes_nothing(
    tmp_path: Path, key: str, verify: bool | str
) -> None:
    st, saved = _history(tmp_path / "s", "smallest")
    into = _copy(saved[0])
    into["model"][key].view(-1)[5] += 1  # w0: patched; w3: unchanged; norm: read whole
    before = _copy(into)
    if key == "norm":  # its chunk of small tensors changed (bias did): nothing relies on it
        deltackpt.load(st, "s2", into=into, since="s0", verify=verify)
        assert _same(into, saved[2])
        return
    if verify != "full" and key == "w3":  # unchanged chunks are hashed only by verify="full"
        deltackpt.load(st, "s2", into=into, since="s0", verify=verify)
        assert not _same(into, saved[2])
        return
    with pytest.raises(HeldVersionMismatchError) as err:
        deltackpt.load(st, "s2", into=into, since="s0", verify=verify)
    assert err.value.key == f"model/{key}" or f"model/{key}" in err.value.keys
    assert "s0" in str(err.value) and f"model/{key}" in str(err.value)
    assert isinstance(err.value, StateMismatchError)
    assert _same(into, before) and into["step"] == before["step"]


def test_mismatch_in_a_chunk_of_small_tensors_names_its_keys(tmp_path: Path) -> None:
    st, saved = _history(tmp_path / "s", "smallest")
    m2 = st.manifest("s2")
    chunk = {e.path: e.data[0][0] for e in m2.tensors if e.path in ("model/norm", "model/scale")}
    assert chunk["model/norm"] == chunk["model/scale"]  # the cold group, split from bias
    into = _copy(saved[2])
    into["model"]["norm"][3] += 1
    before = _copy(into)
    deltackpt.load(st, "s4", into=_copy(into), since="s2")  # unchanged: trusted by default
    with pytest.raises(HeldVersionMismatchError, match="model/scale") as err:
        deltackpt.load(st, "s4", into=into, since="s2", verify="full")
    assert set(err.value.keys) == {"model/norm", "model/scale"}
    assert _same(into, before)


def test_into_holding_another_snapshot_raises(tmp_path: Path) -> None:
    st, saved = _history(tmp_path / "s", "smallest")
    into = _copy(saved[2])  # holds s2, claims s0
    before = _copy(into)
    with pytest.raises(HeldVersionMismatchError, match="model/"):
        deltackpt.load(st, "s3", into=into, since="s0")
    assert _same(into, before)


def test_corrupt_patch_payload_raises_and_writes_nothing(tmp_path: Path) -> None:
    st, saved = _history(tmp_path / "s", "smallest")
    d = st.manifest("s1").tensors[0].data[0][0]
    rec = st.manifest("s1").chunks[d]
    assert rec.codec == XOR
    with open(tmp_path / "s" / "packs" / pack_name(rec.pack), "r+b") as f:
        f.seek(rec.offset + rec.length // 2)
        b = f.read(1)
        f.seek(rec.offset + rec.length // 2)
        f.write(bytes([b[0] ^ 0xFF]))
    into = _copy(saved[0])
    before = _copy(into)
    with pytest.raises(CorruptChunkError, match="model/w0"):
        deltackpt.load(st, "s1", into=into, since="s0")
    assert _same(into, before)


def test_missing_since_snapshot(tmp_path: Path) -> None:
    st, saved = _history(tmp_path / "s", None)
    into = _copy(saved[0])
    with pytest.raises(SnapshotNotFoundError, match="nope"):
        deltackpt.load(st, "s1", into=into, since="nope")
    assert _same(into, saved[0])


def test_bad_since_arguments(tmp_path: Path) -> None:
    st, saved = _history(tmp_path / "s", None)
    with pytest.raises(InvalidArgumentError, match="needs into="):
        deltackpt.load(st, "s1", since="s0")
    with pytest.raises(InvalidArgumentError, match="mode='all_ranks'"):
        deltackpt.load(st, "s1", into=_copy(saved[0]), since="s0", mode="broadcast")


def test_since_with_keys_and_shape_checks(tmp_path: Path) -> None:
    st, saved = _history(tmp_path / "s", "smallest")
    into = _copy(saved[0])
    deltackpt.load(st, "s3", into=into, since="s0", keys=["model/w0"], strict=False)
    assert torch.equal(_bits(into["model"]["w0"]), _bits(saved[3]["model"]["w0"]))
    assert torch.equal(_bits(into["model"]["bias"]), _bits(saved[0]["model"]["bias"]))
    bad = _copy(saved[0])
    bad["model"]["w1"] = torch.zeros(3)
    with pytest.raises(StateMismatchError, match="model/w1"):
        deltackpt.load(st, "s1", into=bad, since="s0")


def test_targets_read_whole_when_not_contiguous(tmp_path: Path) -> None:
    """A target the bytes cannot be patched in (here a transposed view) is read whole."""
    st, saved = _history(tmp_path / "s", "smallest")
    into = _copy(saved[0])
    into["model"]["w0"] = into["model"]["w0"].t().contiguous().t()
    deltackpt.load(st, "s3", into=into, since="s0")
    assert _same(into, saved[3])


def test_object_store(tmp_path: Path) -> None:
    pytest.importorskip("fsspec")
    _, saved = _history(tmp_path / "unused", "smallest")
    url = f"memory://since-{tmp_path.name}"
    mem = deltackpt.open_store(url, chunk_bytes=CHUNK, small_bytes=16 << 10)
    state = _copy(saved[0])
    for k in range(3):
        deltackpt.save(saved[k], mem, f"s{k}", encoding="smallest", keyframe_every=4)
    stats = LoadStats()
    deltackpt.load(mem, "s2", into=state, since="s0", stats=stats)
    assert _same(state, saved[2]) and stats.chunks_unchanged >= 10


def _flip(st: deltackpt.Store, root: Path, name: str, d: str) -> None:
    rec = st.manifest(name).chunks[d]
    with open(root / "packs" / pack_name(rec.pack), "r+b") as f:
        f.seek(rec.offset + rec.length // 2)
        b = f.read(1)
        f.seek(rec.offset + rec.length // 2)
        f.write(bytes([b[0] ^ 0xFF]))


def _mapped(a: Any) -> bool:
    import mmap

    while isinstance(a, (np.ndarray, memoryview)):
        a = a.obj if isinstance(a, memoryview) else a.base
    return isinstance(a, mmap.mmap)


def test_raw_chunks_are_verified_and_copied_from_the_mapped_pack(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A changed raw chunk of a local store is not staged: it is hashed where it lies in the
    mapped pack and copied from there at the commit (a copy of the changed bytes fewer, and no
    staging memory); a damaged one still fails the load with into unchanged."""
    from deltackpt.loading import since

    st, saved = _history(tmp_path / "s", None)
    staged: list[since.CatchUp] = []
    real = since.prepare
    monkeypatch.setattr(
        since, "prepare", lambda *a, **k: staged.append(real(*a, **k)) or staged[-1]
    )
    into = _copy(saved[0])
    deltackpt.load(st, "s1", into=into, since="s0")
    assert _same(into, saved[1])
    m = st.manifest("s1")
    raw = [a for d, a in staged[0].chunks.items() if m.chunks[d].codec == "raw"]
    assert raw and all(_mapped(a) for a in raw)  # views of the pack's mapping, nothing staged

    d = st.manifest("s2").tensors[0].data[0][0]  # w0's changed first chunk, raw
    assert st.manifest("s2").chunks[d].codec == "raw"
    _flip(st, tmp_path / "s", "s2", d)
    into = _copy(saved[1])
    before = _copy(into)
    with pytest.raises(CorruptChunkError, match=r"model/w0.*hash to"):
        deltackpt.load(st, "s2", into=into, since="s1")
    assert _same(into, before)
    deltackpt.load(st, "s2", into=into, since="s1", verify=False)  # not hashed: as a plain load
    assert not torch.equal(into["model"]["w0"], saved[2]["model"]["w0"])


def test_a_raw_chunk_past_the_end_of_its_pack_is_read_and_reported(tmp_path: Path) -> None:
    """Hostile input on the mapped path: a pack cut short before a changed raw chunk's end
    gives no view of it (nothing past the mapped size is touched); the read that takes over
    reports the truncation naming a chunk the cut took (this one, or a later one of its pack:
    the reads run on threads), and into is unchanged."""
    st, saved = _history(tmp_path / "s", None)
    m = st.manifest("s2")
    d = m.tensors[0].data[0][0]
    rec = m.chunks[d]
    assert rec.codec == "raw"
    cut = rec.offset + rec.length // 2
    with open(tmp_path / "s" / "packs" / pack_name(rec.pack), "r+b") as f:
        f.truncate(cut)
    lost = {x for x, r in m.chunks.items() if r.pack == rec.pack and r.offset + r.length > cut}
    into = _copy(saved[1])
    before = _copy(into)
    with pytest.raises(CorruptChunkError, match="truncated") as ei:
        deltackpt.load(st, "s2", into=into, since="s1")
    assert any(x in str(ei.value) for x in lost) and _same(into, before)
    assert d in {p.chunk for p in deltackpt.verify(st).problems}

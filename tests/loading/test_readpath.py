"""The read engine: scatter reads into destinations, coalesced preads, in-place hashing.

Grouped chunks (many small tensors in one chunk) and runs of chunks lying back to back in a pack
are read by one preadv straight into the destination tensors; these tests pin that the result is
still bit-exact, that new tensors never share memory, and that damage is still reported per chunk
with the key that uses it.
"""

from __future__ import annotations

import itertools
import os
from pathlib import Path

import numpy as np
import pytest
import torch

import deltackpt
from deltackpt.errors import CorruptChunkError
from deltackpt.format.codecs import RAW, EncodePolicy
from deltackpt.format.hashing import digest
from deltackpt.format.manifest import ChunkRecord
from deltackpt.store.chunks import ChunkReader, ChunkTargets, _layout, plan_runs, run_jobs
from deltackpt.store.packs import PackReaders

RAW_ONLY = EncodePolicy(codecs=(RAW,))


def _small_state(n: int = 40, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"w{i}": torch.randn(3 + i % 7, generator=g) for i in range(n)}


def _bits(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def test_grouped_chunk_loads_bit_exact_into_independent_tensors(store_dir: Path) -> None:
    state = _small_state()
    deltackpt.save(state, store_dir, "s1", encoding=RAW_ONLY)
    m = deltackpt.open_store(store_dir).manifest("s1")
    assert len(m.chunks) < len(state)  # the small tensors really share chunks
    for threads in (1, 3):
        out = deltackpt.load(store_dir, threads=threads)
        for k, t in state.items():
            assert _bits(out[k]) == _bits(t)
        ptrs = {out[k].untyped_storage().data_ptr() for k in out}
        assert len(ptrs) == len(out)  # each tensor owns its memory, as with torch.load
        out["w0"].add_(1)
        for k in list(state)[1:]:
            assert _bits(out[k]) == _bits(state[k])


def test_grouped_chunk_into_existing_tensors(store_dir: Path) -> None:
    state = _small_state()
    deltackpt.save(state, store_dir, "s1", encoding=RAW_ONLY)
    target = {k: torch.zeros_like(v) for k, v in state.items()}
    deltackpt.load(store_dir, into=target)
    for k, t in state.items():
        assert _bits(target[k]) == _bits(t)


def test_adjacent_chunks_are_coalesced_and_exact(tmp_path: Path) -> None:
    store = deltackpt.open_store(tmp_path / "s", chunk_bytes=4096, small_bytes=0)
    g = torch.Generator().manual_seed(1)
    state = {f"t{i}": torch.randn(3000 + 17 * i, generator=g) for i in range(12)}
    deltackpt.save(state, store, "s1", encoding=RAW_ONLY, threads=1)
    m = store.manifest("s1")
    jobs = [ChunkTargets(d) for d in m.chunks]
    runs = plan_runs(jobs, m.chunks, threads=1)
    assert max(len(r) for r in runs) > 1  # several chunks per preadv
    for r in runs:
        recs = [m.chunks[j.digest] for j in r]
        assert len({x.pack for x in recs}) == 1
        assert all(a.offset < b.offset for a, b in itertools.pairwise(recs))
    for threads in (1, 4):
        out = deltackpt.load(store, threads=threads)
        for k, t in state.items():
            assert _bits(out[k]) == _bits(t)
        target = {k: torch.empty_like(v) for k, v in state.items()}
        deltackpt.load(store, into=target, threads=threads)
        for k, t in state.items():
            assert _bits(target[k]) == _bits(t)


def _pack_of(store: deltackpt.Store, name: str, key: str) -> tuple[str, ChunkRecord]:
    m = store.manifest(name)
    e = next(e for e in m.tensors if e.path == key)
    d = e.all_slices()[-1][0]
    return d, m.chunks[d]


@pytest.mark.parametrize("key", ["t0", "t5", "t11"])
def test_corrupt_chunk_inside_a_coalesced_read_names_its_key(tmp_path: Path, key: str) -> None:
    store = deltackpt.open_store(tmp_path / "s", chunk_bytes=4096, small_bytes=0)
    state = {f"t{i}": torch.arange(3000, dtype=torch.float32) + i for i in range(12)}
    deltackpt.save(state, store, "s1", encoding=RAW_ONLY, threads=1)
    d, rec = _pack_of(store, "s1", key)
    with open(store.pack_path(rec.pack), "r+b") as f:
        f.seek(rec.offset + rec.length // 2)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0x40]))
    deltackpt.store.store._STORES.clear()
    for threads in (1, 4):
        with pytest.raises(CorruptChunkError) as ei:
            deltackpt.load(tmp_path / "s", threads=threads)
        assert d in str(ei.value) and repr(key) in str(ei.value)
        with pytest.raises(CorruptChunkError, match=d):
            deltackpt.load(tmp_path / "s", into={k: torch.empty_like(v) for k, v in state.items()})
    # verify=False skips the hash: the damaged bytes arrive, every other tensor is intact
    out = deltackpt.load(tmp_path / "s", verify=False)
    for k, t in state.items():
        assert torch.equal(out[k], t) == (k != key)


def test_truncated_pack_blames_the_first_chunk_cut(tmp_path: Path) -> None:
    store = deltackpt.open_store(tmp_path / "s", chunk_bytes=4096, small_bytes=0)
    state = {f"t{i}": torch.arange(3000, dtype=torch.float32) * i for i in range(6)}
    deltackpt.save(state, store, "s1", encoding=RAW_ONLY, threads=1)
    _d, rec = _pack_of(store, "s1", "t3")
    m = store.manifest("s1")
    pack_recs = sorted((r.offset, dd) for dd, r in m.chunks.items() if r.pack == rec.pack)
    cut = rec.offset + rec.length // 2
    os.truncate(store.pack_path(rec.pack), cut)
    first_cut = next(dd for off, dd in pack_recs if off + m.chunks[dd].size > cut)
    deltackpt.store.store._STORES.clear()
    with pytest.raises(CorruptChunkError, match="truncated") as ei:
        deltackpt.load(tmp_path / "s", threads=1)
    assert first_cut in str(ei.value)


def test_duplicate_tensors_share_a_chunk_and_stay_separate(store_dir: Path) -> None:
    a = torch.zeros(1 << 20)
    state = {"a": a, "b": torch.zeros(1 << 20), "c": torch.ones(5)}
    deltackpt.save(state, store_dir, "s1", encoding=RAW_ONLY)
    out = deltackpt.load(store_dir)
    assert out["a"].data_ptr() != out["b"].data_ptr()
    assert torch.equal(out["a"], a) and torch.equal(out["b"], a)
    target = {k: torch.full_like(v, 7) for k, v in state.items()}
    deltackpt.load(store_dir, into=target)
    assert all(torch.equal(target[k], state[k]) for k in state)


def test_tied_storage_into_is_read_in_place_and_stays_tied(store_dir: Path) -> None:
    emb = torch.randn(300, 64)
    state = {"embed": emb, "head": emb, "other": torch.randn(10)}
    deltackpt.save(state, store_dir, "s1", encoding=RAW_ONLY)
    t = torch.zeros(300, 64)
    tied = {"embed": t, "head": t, "other": torch.zeros(10)}
    deltackpt.load(store_dir, into=tied)
    assert tied["embed"] is t and tied["head"] is t and torch.equal(t, emb)
    untied = {"embed": torch.zeros(300, 64), "head": torch.zeros(300, 64), "other": torch.zeros(10)}
    deltackpt.load(store_dir, into=untied)
    assert torch.equal(untied["embed"], emb) and torch.equal(untied["head"], emb)
    assert untied["embed"].data_ptr() != untied["head"].data_ptr()
    # targets overlapping each other unlike the snapshot's tie: no in-place read (it would
    # change the bytes copied later); each is copied from a fresh buffer, in key order
    base = torch.zeros(301 * 64)
    odd = {"embed": base[: 300 * 64].view(300, 64), "head": base[64:].view(300, 64)}
    odd["other"] = torch.zeros(10)
    deltackpt.load(store_dir, into=odd)
    assert torch.equal(odd["head"], emb) and torch.equal(odd["embed"][:1], emb[:1])
    new = deltackpt.load(store_dir)
    assert new["embed"].untyped_storage().data_ptr() == new["head"].untyped_storage().data_ptr()


def test_layout_pieces_gaps_and_copies() -> None:
    rec = ChunkRecord("p" * 20, 4096, 100, 100)
    a, b, c = np.empty(10, np.uint8), np.empty(30, np.uint8), np.empty(5, np.uint8)
    lay = _layout(ChunkTargets("d", [(50, 30, b), (5, 10, a), (52, 5, c)]), rec)
    assert lay is not None
    assert [p if isinstance(p, int) else p.size for p in lay.pieces] == [5, 10, 35, 30, 20]
    assert lay.gap_bytes == 60 and len(lay.copies) == 1
    # straddling two targets cannot be served by one copy: the scratch path takes it
    x = np.empty(20, np.uint8)
    assert _layout(ChunkTargets("d", [(0, 10, a), (10, 30, b), (5, 20, x)]), rec) is None


def test_scatter_read_over_many_iovecs_and_partial_targets(tmp_path: Path) -> None:
    """A chunk whose targets need more than IOV_MAX iovecs, and targets leaving gaps (bytes no
    one wants, which are still hashed)."""
    packs_dir = tmp_path / "packs"
    packs_dir.mkdir()
    data = np.random.default_rng(0).integers(0, 256, 9000, dtype=np.uint8)
    pid = "a" * 20
    with open(packs_dir / f"{pid}.pack", "wb") as f:
        f.write(bytes(4096) + data.tobytes())
    d = digest(data)
    rec = ChunkRecord(pid, 4096, data.size, data.size)
    # 3000 targets of 2 bytes every 3 bytes: 6000 iovecs with the gaps
    dsts = [np.zeros(2, np.uint8) for _ in range(3000)]
    job = ChunkTargets(d, [(3 * i, 2, dst) for i, dst in enumerate(dsts)], where="key 'k'")
    with PackReaders(packs_dir) as packs:
        assert ChunkReader(packs, {d: rec}).read(job) == data.size
        for i, dst in enumerate(dsts):
            assert dst.tobytes() == data[3 * i : 3 * i + 2].tobytes()
        bad = ChunkTargets("f" * 32, job.targets, where="key 'k'")
        with pytest.raises(CorruptChunkError, match="'k'"):
            run_jobs(packs, {"f" * 32: rec}, [bad], verify=True, threads=2)

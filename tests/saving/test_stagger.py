"""Staggered keyframes (issue 39): each chunk position keyframes at its own slot, so no version
pays every keyframe, for about the same keyframes in all; chains keep the link cap, every version
loads bit-exact; and a writer whose newest snapshot was folded builds on the short chain."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace
from typing import Any

import numpy as np
import pytest
import torch

import deltackpt
from deltackpt.saving import chains
from deltackpt.saving.chains import slot_offset
from deltackpt.store.fold import chain_links, deepest_chain, used_chunks

CHUNK = 64 << 10
POSITIONS = 32  # one 2 MiB bf16 tensor cut into 64 KiB chunks
K = 8
VERSIONS = 40


def _state(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(POSITIONS * CHUNK // 2, generator=g).to(torch.bfloat16)}


def _step(sd: dict[str, torch.Tensor], g: torch.Generator) -> None:
    """An RL-like step: a few elements of every chunk change (a small patch delta each)."""
    w = sd["w"].view(POSITIONS, -1)
    idx = torch.randint(0, w.shape[1], (POSITIONS, 8), generator=g)
    w.scatter_add_(1, idx, torch.full(idx.shape, 0.5, dtype=w.dtype))


def _keyframes_per_version(tmp_path: Any, tag: str) -> tuple[list[int], list[dict[str, Any]]]:
    """Save VERSIONS versions; per version, how many chunks were written as keyframes."""
    st = deltackpt.open_store(tmp_path / tag, chunk_bytes=CHUNK, small_bytes=CHUNK)
    sd, g = _state(), torch.Generator().manual_seed(1)
    saved, counts, prev = [], [], set()
    for v in range(VERSIONS):
        deltackpt.save(sd, st, f"v{v}", encoding="smallest", keyframe_every=K)
        m = st.manifest(f"v{v}")
        used = used_chunks(m)
        assert len(used) == POSITIONS
        counts.append(sum(1 for d in used if m.chunks[d].base is None and d not in prev))
        assert deepest_chain(m) <= K - 1  # the cap holds
        prev = set(m.chunks)
        saved.append({k: t.clone() for k, t in sd.items()})
        _step(sd, g)
    for v in (1, K, VERSIONS // 2, VERSIONS - 1):
        got = deltackpt.load(st, f"v{v}")
        assert np.array_equal(got["w"].view(torch.int16).numpy(), saved[v]["w"].view(torch.int16))
    return counts, saved


def test_offsets_spread_over_half_the_cap():
    offs = Counter(slot_offset(f"w#{i}", 32) for i in range(1000))
    assert set(offs) <= set(range(17)) and len(offs) == 17  # [0, k/2], all of them used
    assert slot_offset("w#3", 32) == slot_offset("w#3", 32)  # stable across calls


def test_keyframes_are_staggered_across_versions(tmp_path, monkeypatch):
    counts, _ = _keyframes_per_version(tmp_path, "staggered")
    assert counts[0] == POSITIONS  # the first version is all keyframes
    later = counts[1:]
    # without staggering every position keyframes on the same versions (below): all 32 at once
    assert max(later) <= POSITIONS // 2, later
    assert sum(1 for c in later if c) >= 2 * (VERSIONS // K), later  # spread over many versions

    monkeypatch.setattr(chains, "slot_offset", lambda key, k: 0)
    synced, _ = _keyframes_per_version(tmp_path, "synced")
    assert [v for v, c in enumerate(synced) if c] == list(range(0, VERSIONS, K)), synced
    assert all(c == POSITIONS for c in synced if c)
    # the price: at most one shortened chain per position (the first, up to its slot)
    assert sum(later) <= sum(synced[1:]) + POSITIONS, (sum(later), sum(synced[1:]))


@pytest.mark.parametrize("keep_links", [0, 1])
def test_writer_builds_on_a_folded_chain(tmp_path, keep_links):
    """After fold repointed the newest snapshot at keyframes, the next saves' deltas build on
    them: their chains restart short, and they still write only deltas."""
    st = deltackpt.open_store(tmp_path / "s", chunk_bytes=CHUNK, small_bytes=CHUNK)
    sd, g = _state(), torch.Generator().manual_seed(2)
    for v in range(6):  # the default cap (32): no slot before save 16
        deltackpt.save(sd, st, f"v{v}", encoding="smallest")
        _step(sd, g)
    assert deepest_chain(st.manifest("v5")) == 5
    deltackpt.fold(st, "v5", max_chain=2, keep_links=keep_links)
    assert deepest_chain(st.manifest("v5")) == keep_links
    for v in range(6, 12):
        info = deltackpt.save(sd, st, f"v{v}", encoding="smallest")
        m = st.manifest(f"v{v}")
        assert sorted({chain_links(d, m.chunks) for d in used_chunks(m)}) == [keep_links + v - 5]
        assert info.bytes_written < POSITIONS * CHUNK // 4, (v, info.bytes_written)
        last = sd["w"].clone()
        _step(sd, g)
    assert np.array_equal(deltackpt.load(st, "v11")["w"].view(torch.int16), last.view(torch.int16))


def test_bases_follow_a_fold():
    """A delta base whose chain the index now ends sooner (a fold) counts the index's links and
    bytes, so the cap and the byte budget apply to the chain readers walk; a longer chain in the
    index never raises the count, and slots are marked per position."""
    from deltackpt.format.manifest import ChunkRecord
    from deltackpt.saving.stage import DeltaRef

    def rec(base: str | None, length: int = 100) -> ChunkRecord:
        codec = "raw" if base is None else "patch"
        return ChunkRecord("p", 4096, length, 1000, codec, 2, base)

    data = np.zeros(1000, np.uint8)
    index = {"a": rec(None, 1000), "b": rec("a"), "c": rec("b", 50)}
    refs = {"x": DeltaRef("c", data, 9, 0, 900, 50), "y": DeltaRef("a", data, 0, 0, 0, 0)}
    out = chains.stagger(refs, index, 1, 32)
    assert (out["x"].depth, out["x"].chain_bytes, out["x"].last_delta) == (2, 150, 50)
    assert out["y"].depth == 0
    deep = {"x": DeltaRef("c", data, 1, 0, 50, 50)}
    assert chains.stagger(deep, index, 1, 32)["x"].depth == 1  # never raised
    n = next(n for n in range(1, 64) if (n + slot_offset("x", 8)) % 8 == 0)
    assert chains.stagger(refs, index, n, 8)["x"].slot
    assert not chains.stagger(refs, index, n + 1, 8)["x"].slot
    assert chains.stagger(refs, index, n, 8)["x"].due(1000, 8, 64.0)  # a delta at its slot
    y = replace(refs["y"], slot=True)
    assert not y.due(1000, 8, 64.0)  # a keyframe is never cut again at its slot

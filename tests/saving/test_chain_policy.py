"""xor chains cut by their bytes (issue 27): an RL-like step writes about the size of its change,
a pretraining-like step writes keyframes, chains stay within their byte budget and link cap
(also across processes), every version loads and catches up bit-exact, and keep_last keeps its
disk bound."""

from __future__ import annotations

from itertools import pairwise
from typing import Any

import numpy as np
import pytest
import torch

import deltackpt
from deltackpt.errors import InvalidArgumentError
from deltackpt.format.codecs import XOR, EncodePolicy, encode
from deltackpt.options import DEFAULT_CHAIN_BUDGET, DEFAULT_KEYFRAME_EVERY, SaveOptions
from deltackpt.saving import chains
from deltackpt.saving.chains import bounded_chains, retained_bound
from deltackpt.saving.engine import saver_for

CHUNK = 1 << 20  # two chunks per 1M-element bf16 tensor
PAD = 4096  # pack payloads start at multiples of this (store/packs.py PACK_ALIGN)
XOR1 = EncodePolicy(force=XOR, level=1)


class Trainer:
    """bf16 weights cast from an fp32 master that AdamW updates with random gradients."""

    def __init__(self, n: int = 4, numel: int = 256 << 10, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.master = [torch.randn(numel, generator=g).mul_(0.02) for _ in range(n)]
        for p in self.master:
            p.requires_grad_(True)
        self.opt = torch.optim.AdamW(self.master, lr=1e-6, weight_decay=0.0)
        self.g = g
        self.state = {f"w{i}": p.detach().to(torch.bfloat16) for i, p in enumerate(self.master)}

    def step(self, lr: float) -> None:
        for group in self.opt.param_groups:
            group["lr"] = lr
        for p in self.master:
            p.grad = torch.randn(p.shape, generator=self.g).mul_(1e-3)
        self.opt.step()
        with torch.no_grad():
            for i, p in enumerate(self.master):
                self.state[f"w{i}"].copy_(p)

    def copy(self) -> dict[str, torch.Tensor]:
        return {k: v.clone() for k, v in self.state.items()}


def _u8(t: torch.Tensor) -> np.ndarray:
    return t.reshape(-1).view(torch.uint8).numpy()


def _change_bytes(prev: dict[str, torch.Tensor], cur: dict[str, torch.Tensor]) -> int:
    """xor + zstd-1 of the change, chunk by chunk as the store cuts it."""
    total = 0
    for k in cur:
        a, b = _u8(prev[k]), _u8(cur[k])
        for i in range(0, a.size, CHUNK):
            if not np.array_equal(a[i : i + CHUNK], b[i : i + CHUNK]):
                total += len(
                    encode(b[i : i + CHUNK], 2, base=a[i : i + CHUNK], policy=XOR1).payload
                )
    return total


def _chains(st: deltackpt.Store, name: str) -> dict[str, tuple[int, int, int]]:
    """Per chunk of ``name``: (xor links, their payload bytes, raw size)."""
    m = st.manifest(name)
    out = {}
    for d, rec in m.chunks.items():
        links = nbytes = 0
        cur = rec
        while cur.base is not None:
            links, nbytes = links + 1, nbytes + cur.length
            cur = m.chunks[cur.base]
        out[d] = (links, nbytes, rec.size)
    return out


def _store(tmp_path: Any) -> deltackpt.Store:
    return deltackpt.open_store(tmp_path / "s", chunk_bytes=CHUNK)


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(np.array_equal(_u8(a[k]), _u8(b[k])) for k in a)


def test_rl_steps_write_about_the_size_of_their_change(tmp_path):
    """bf16 from an fp32 master, AdamW at lr 1e-6: each save writes its xor delta, not keyframes
    rolled in every few saves (the depth-only policy wrote ~5x the change here)."""
    st, tr = _store(tmp_path), Trainer(numel=1 << 20)
    deltackpt.save(tr.state, st, "s0", encoding="smallest")
    written = change = 0
    for i in range(1, 11):
        prev = tr.copy()
        tr.step(1e-6)
        c = _change_bytes(prev, tr.state)
        info = deltackpt.save(tr.state, st, f"s{i}", encoding="smallest")
        extra = info.chunks_new * PAD + (8 << 10)  # payload alignment, the manifest
        assert info.bytes_written <= 1.3 * c + extra, (i, info.bytes_written, c)
        written, change = written + info.bytes_written - extra, change + c
    assert 0 < change < 0.1 * 10 * sum(v.numel() * 2 for v in tr.state.values())
    assert written <= 1.3 * change  # a `patch` delta may be up to 1.25x the xor size
    links = [n for n, _, _ in _chains(st, "s10").values()]
    assert max(links) == 10  # one chain grew through all ten saves


def test_depth_only_policy_still_rolls_keyframes_every_k_saves(tmp_path):
    """Every chain is cut within k saves; each position at its own staggered slot (issue 39:
    tests/saving/test_stagger.py), so chains reach the cap but not all on the same saves."""
    st, tr = _store(tmp_path), Trainer()
    deepest = []
    for i in range(8):
        deltackpt.save(tr.state, st, f"s{i}", encoding="smallest", keyframe_every=4)
        deepest.append(max(n for n, _, _ in _chains(st, f"s{i}").values()))
        tr.step(1e-6)
    assert deepest[:2] == [0, 1] and max(deepest) <= 3, deepest  # slots start at save k/2


def test_pretraining_step_writes_keyframes_not_growing_chains(tmp_path):
    """Nearly every element changes (its xor delta is ~40% of the chunk): a delta that large
    overflows a small budget at once, and the default one after two links, so chunks are
    written whole instead of growing chains."""
    st, tr = _store(tmp_path), Trainer()
    logical = sum(v.numel() * 2 for v in tr.state.values())
    deltackpt.save(tr.state, st, "s0", encoding="smallest")
    for i in range(1, 6):
        tr.step(1e-3)
        info = deltackpt.save(tr.state, st, f"s{i}", encoding="smallest", chain_budget=0.25)
        chains = _chains(st, f"s{i}")
        assert all(n == 0 for n, _, _ in chains.values()), i  # keyframes only
        assert info.bytes_written >= 0.5 * logical  # zstd keyframes: ~70% of the raw bytes
    depths = []
    for i in range(6, 14):  # the default budget allows at most two such links
        tr.step(1e-3)
        deltackpt.save(tr.state, st, f"s{i}", encoding="smallest")
        depths.append(max(n for n, _, _ in _chains(st, f"s{i}").values()))
    assert max(depths) <= 2 and 0 in depths, depths


@pytest.mark.parametrize(("budget", "every"), [(0.2, 64), (DEFAULT_CHAIN_BUDGET, 5), (0.0, 16)])
def test_chains_stay_within_their_bytes_and_links(tmp_path, budget, every):
    st, tr = _store(tmp_path), Trainer(n=2)
    saved, deepest = [], []
    for i in range(14):
        deltackpt.save(
            tr.state, st, f"s{i}", encoding="smallest", chain_budget=budget, keyframe_every=every
        )
        saved.append(tr.copy())
        for links, nbytes, size in _chains(st, f"s{i}").values():
            assert links < every and nbytes <= budget * size, (i, links, nbytes, size)
        deepest.append(max(n for n, _, _ in _chains(st, f"s{i}").values()))
        tr.step(1e-5)
    if budget:  # chains grew, and were cut (by bytes, or at the link cap) before growing on
        assert max(deepest) > 0 and any(b < a for a, b in pairwise(deepest)), deepest
    else:
        assert max(deepest) == 0
    for i, state in enumerate(saved):
        assert _same(deltackpt.load(st, f"s{i}"), state), i


def test_every_version_loads_and_catches_up_bit_exact(tmp_path):
    st, tr = _store(tmp_path), Trainer(n=3)
    saved = []
    for i in range(12):
        deltackpt.save(tr.state, st, f"s{i}", encoding="smallest", chain_budget=0.3)
        saved.append(tr.copy())
        tr.step(1e-6 if i < 6 else 1e-5 if i < 10 else 1e-3)
    for i, state in enumerate(saved):
        assert _same(deltackpt.load(st, f"s{i}"), state), i
        for back in (1, 3, i):
            if 0 < back <= i:
                held = {k: v.clone() for k, v in saved[i - back].items()}
                deltackpt.load(st, f"s{i}", into=held, since=f"s{i - back}")
                assert _same(held, state), (i, back)


def test_first_save_of_a_process_continues_the_stored_chains(tmp_path, monkeypatch):
    """Chain links and bytes are read back from the store's records: a new process (here: a
    closed saver) does not start counting from zero on chunks that sit deep in a chain."""
    monkeypatch.setattr(chains, "slot_offset", lambda key, k: 0)  # slots on the cap's saves
    st, tr = _store(tmp_path), Trainer(n=2)
    for i in range(4):  # s0 keyframes, s1..s3 one link each: depth 3
        deltackpt.save(tr.state, st, f"s{i}", encoding="smallest", keyframe_every=4)
        tr.step(1e-6)
    saver_for(st).close()
    last = {k: v for k, v in deltackpt.load(st, "s3").items()}
    deltackpt.save(last, st, "s4", encoding="smallest", keyframe_every=4)  # unchanged: reused
    assert max(n for n, _, _ in _chains(st, "s4").values()) == 3
    deltackpt.save(tr.state, st, "s5", encoding="smallest", keyframe_every=4)
    assert max(n for n, _, _ in _chains(st, "s5").values()) == 0  # a 4th link would be over


def test_chain_budget_is_validated():
    for bad in (-0.1, float("nan"), float("inf"), "1", True, None):
        with pytest.raises(InvalidArgumentError, match="chain_budget"):
            SaveOptions(chain_budget=bad)
    for bad in (0, 65, 2.0):
        with pytest.raises(InvalidArgumentError, match="keyframe_every"):
            SaveOptions(keyframe_every=bad)
    assert SaveOptions().chain_budget == DEFAULT_CHAIN_BUDGET
    assert SaveOptions().keyframe_every == DEFAULT_KEYFRAME_EVERY


def test_bounded_chains_lowers_the_budget_for_keep_last():
    assert bounded_chains({}, None) == {}
    assert bounded_chains({}, 1)["chain_budget"] == 0.0
    assert bounded_chains({}, 3)["chain_budget"] == 0.5
    assert "chain_budget" not in bounded_chains({}, 9)  # the default fits
    assert bounded_chains({"chain_budget": 2.0}, 2) == {"chain_budget": 2.0}  # the caller's
    assert retained_bound(3, 0.5) == 3.5


def _disk(root: Any) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file() and p.suffix == ".pack")


@pytest.mark.parametrize("keep", [2, 3])
def test_keep_last_stays_within_its_bound(tmp_path, keep):
    """Many RL-like steps, then big ones after a full chain (the worst case of the proof in
    saving/chains.py): the packs never hold more than (keep + chain_budget) states."""
    tr = Trainer(n=3, numel=1 << 20)
    logical = sum(v.numel() * 2 for v in tr.state.values())
    ckpt = deltackpt.Checkpointer(
        _store(tmp_path), every=1, keep_last=keep, async_=False, rng=False, encoding="smallest"
    )
    budget = ckpt.save_options["chain_budget"]
    assert budget == (keep - 1) * 0.25
    lrs = [1e-6] * 20 + [1e-3] * 3 + [1e-5] * 8 + [1e-3] * 2
    deltas = 0
    for step, lr in enumerate(lrs):
        ckpt.maybe_save(step, tr.state)
        assert _disk(tmp_path / "s") <= retained_bound(keep, budget) * logical, (step, lr)
        deltas += ckpt.infos[-1].bytes_written < 0.3 * logical
        last = tr.copy()
        tr.step(lr)
    ckpt.close()
    assert deltas >= 15  # deltas were still written where they pay
    assert _same(deltackpt.load(tmp_path / "s", ckpt.infos[-1].name), last)
    assert deltackpt.verify(tmp_path / "s").ok

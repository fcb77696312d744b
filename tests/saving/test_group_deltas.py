"""Small tensors packed into group chunks are deltas too (issue 39): a group whose members
(keys, sizes, offsets) are unchanged xors or patches against its last version, so a LoRA-like
run's versions cost about their change, not a keyframe of every adapter each time."""

from __future__ import annotations

import numpy as np
import torch

import deltackpt
from deltackpt.format import codecs
from deltackpt.format.codecs import DELTAS
from deltackpt.saving.plan import layout_chunks


def _lora(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        f"layer{i}.lora_{ab}": torch.randn(16, 256, generator=g).to(torch.bfloat16)
        for i in range(40)
        for ab in "AB"
    }  # 80 tensors of 8 KiB: one group chunk


def _step(state: dict[str, torch.Tensor], g: torch.Generator, share: float = 0.03) -> None:
    for t in state.values():
        m = torch.rand(t.shape, generator=g) < share
        t[m] += (torch.randn(t.shape, generator=g) * 0.01).to(t.dtype)[m]


def test_a_lora_runs_versions_cost_about_their_change(store_dir):
    state, g = _lora(), torch.Generator().manual_seed(1)
    infos = []
    for v in range(6):
        _step(state, g)
        infos.append(deltackpt.save(state, store_dir, f"v{v}", encoding="smallest"))
        got = deltackpt.load(store_dir, f"v{v}")
        assert all(torch.equal(got[k], state[k]) for k in state), v
    full = infos[0].bytes_written
    assert all(i.bytes_written < full / 5 for i in infos[1:]), [i.bytes_written for i in infos]
    m = deltackpt.open_store(store_dir).manifest("v5")
    assert sum(r.codec in DELTAS for r in m.chunks.values()) >= 5  # a chain of group deltas
    # a follower catches up from v2 to v5 in place, reading only deltas
    held = deltackpt.load(store_dir, "v2")
    deltackpt.load(store_dir, "v5", into=held, since="v2")
    assert all(torch.equal(held[k], state[k]) for k in state)


def test_a_group_whose_members_change_starts_a_new_chain(store_dir):
    state, g = _lora(2), torch.Generator().manual_seed(3)
    deltackpt.save(state, store_dir, "a", encoding="smallest")
    _step(state, g)
    state["layer0.lora_A"] = torch.zeros(16, 128, dtype=torch.bfloat16)  # a member resized
    info = deltackpt.save(state, store_dir, "b", encoding="smallest")
    m = deltackpt.open_store(store_dir).manifest("b")
    assert not any(r.codec in DELTAS for r in m.chunks.values()), info
    got = deltackpt.load(store_dir, "b")
    assert all(torch.equal(got[k], state[k]) for k in state)


def test_a_group_of_one_element_size_is_byte_grouped_by_it(store_dir):
    # bf16 adapters: the group chunk is grouped by 2 (exponent bytes together), which makes its
    # keyframe and its deltas smaller than ungrouped bytes; mixed element sizes are not grouped
    state = _lora(4)
    deltackpt.save(state, store_dir, "bf16", encoding="smallest")
    st = deltackpt.open_store(store_dir)
    (grouped,) = st.manifest("bf16").chunks.values()
    assert grouped.itemsize == 2
    raw = np.concatenate([t.reshape(-1).view(torch.uint8).numpy() for t in state.values()])
    flat = codecs.encode(raw, 1, policy=codecs.ENCODINGS["smallest"])
    assert grouped.length < len(flat.payload), (grouped.length, len(flat.payload))
    got = deltackpt.load(store_dir, "bf16")
    assert all(torch.equal(got[k], state[k]) for k in state)
    chunks, _ = layout_chunks([64, 128, 64], [2, 4, 2], ["a", "b", "c"], 1 << 20, 4096)
    assert [c.itemsize for c in chunks] == [1]  # bf16 and fp32 members: not grouped
    chunks, _ = layout_chunks([64, 128], [4, 4], ["a", "b"], 1 << 20, 4096)
    assert [c.itemsize for c in chunks] == [4]

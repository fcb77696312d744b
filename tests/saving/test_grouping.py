"""Group chunks follow what changes together (deltackpt/saving/grouping.py): a LoRA run's saves
write the adapter's bytes, not the small frozen tensors grouped beside them; a full fine-tune
keeps the tree-order layout."""

from __future__ import annotations

import pytest
import torch

import deltackpt
from deltackpt.format.hashing import digest
from deltackpt.saving.grouping import RECHECK_EVERY, ChangeHistory, likely_hot
from deltackpt.saving.plan import chunk_view, plan_state

CHUNK, SMALL = 4 << 20, 1 << 20


def _tiny_lora() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=64, vocab_size=128,
    )  # fmt: skip
    model = peft.get_peft_model(
        transformers.LlamaForCausalLM(cfg),
        peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]),
    )
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    return model, opt


def _train_step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    x = torch.randint(0, 128, (2, 8))
    model(input_ids=x, labels=x).loss.backward()
    opt.step()
    opt.zero_grad()


def _pack_bytes(store: deltackpt.Store, name: str) -> int:
    return store.manifest(name).stats.pack_bytes


@pytest.mark.parametrize("with_optim", [False, True], ids=["model", "model+optim"])
def test_lora_saves_write_only_the_adapter(tmp_path, with_optim):
    model, opt = _tiny_lora()
    store = deltackpt.open_store(tmp_path / "s")
    sd = model.state_dict()
    adapter = sum(v.numel() * v.element_size() for k, v in sd.items() if "lora_" in k)
    total = sum(v.numel() * v.element_size() for v in sd.values())
    assert total > 20 * adapter  # everything is small here: all of it is grouped
    written, states = [], []
    for step in range(5):
        _train_step(model, opt)
        state = {"model": model.state_dict()}
        if with_optim:
            state["optim"] = opt.state_dict()
        deltackpt.save(state, store, f"s{step}")
        written.append(_pack_bytes(store, f"s{step}"))
        states.append({k: v.clone() for k, v in state["model"].items()})
    changed = adapter * (3 if with_optim else 1)  # + AdamW's two moments per adapter tensor
    assert written[0] >= total
    for n in written[1:]:  # from the second save on: the adapter's groups only
        assert n <= 2 * changed + 8192, (written, changed)  # + pack header and alignment
    for step in (0, 4):  # every snapshot is still the whole, exact state
        got = deltackpt.load(store, f"s{step}")["model"]
        assert got.keys() == states[step].keys()
        assert all(torch.equal(got[k], v) for k, v in states[step].items())


def test_history_separates_unnamed_changing_tensors(tmp_path):
    """No names or requires_grad to go by: from the third save on, only what changed is written
    (the second save finds out, the third regroups once)."""
    torch.manual_seed(0)
    frozen = {f"f{i}": torch.randn(1000) for i in range(60)}  # 4 kB each
    hot = {f"h{i}": torch.randn(1000) for i in range(0, 60, 6)}  # interleaved in tree order
    state = {
        k: frozen.get(k, hot.get(k)) for k in sorted({*frozen, *hot}, key=lambda k: int(k[1:]))
    }
    store = deltackpt.open_store(tmp_path / "s", chunk_bytes=64 * 1024, small_bytes=16 * 1024)
    written = []
    for step in range(6):
        for t in hot.values():
            t.add_(1.0)
        deltackpt.save(state, store, f"s{step}")
        written.append(_pack_bytes(store, f"s{step}"))
    hot_bytes = 4000 * len(hot)
    assert written[1] > 3 * hot_bytes  # before it knows: every group has a changing member
    for n in written[3:]:
        assert n <= 2 * hot_bytes + 8192, written
    got = deltackpt.load(store, "s5")
    assert all(torch.equal(got[k], v) for k, v in state.items())


def _learn(h: ChangeHistory, state: dict) -> list:
    plan = plan_state(state, CHUNK, SMALL, False, h.is_hot)
    arrays = [s.data.numpy() for s in plan.sources]
    bufs: dict = {}
    digests = [
        digest(chunk_view(c, arrays.__getitem__, bufs, ci)) for ci, c in enumerate(plan.chunks)
    ]
    h.learn(plan, digests, bufs)
    return [[plan.sources[si].key for si, _, _ in c.parts] for c in plan.chunks]


def test_full_fine_tune_keeps_the_tree_order_layout():
    state = {f"w{i}": torch.randn(3000) for i in range(400)}  # 4.8 MB, all small, all change
    plain = plan_state(state, CHUNK, SMALL)
    want = [[plain.sources[si].key for si, _, _ in c.parts] for c in plain.chunks]
    h = ChangeHistory()
    for _ in range(RECHECK_EVERY + 2):
        assert _learn(h, state) == want
        for t in state.values():
            t.add_(1.0)
    assert len(h.hot) == len(state)


def test_members_turn_hot_at_once_and_cold_at_a_recheck():
    state = {f"w{i}": torch.zeros(100) for i in range(10)}
    w3 = ("w3", 400)
    h = ChangeHistory()
    _learn(h, state)  # first look: no evidence
    state["w3"].add_(1.0)
    _learn(h, state)
    assert h.hot == {w3}
    state["w3"].add_(1.0)
    layout = _learn(h, state)  # w3 now has a group of its own
    assert ["w3"] in layout and h.hot == {w3}
    for _ in range(RECHECK_EVERY):
        state["w3"].add_(1.0)
        _learn(h, state)
    assert h.hot == {w3}
    for _ in range(2 * RECHECK_EVERY):  # unchanged since the last look: cold again
        _learn(h, state)
    assert not h.hot
    assert ["w3"] not in _learn(h, state)  # back with the others


def test_prior():
    assert likely_hot("model/base_model.model.layers.0.q_proj.lora_A.default.weight", False)
    assert likely_hot("m/x.modules_to_save.default.weight", False)
    assert likely_hot("optim/state/3/exp_avg", False)
    assert likely_hot("w", True)
    assert not likely_hot("model/model.layers.0.input_layernorm.weight", False)
    assert not likely_hot("optim/param_groups/0/lr", False)

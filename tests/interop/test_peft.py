"""``deltackpt.export_peft``: a LoRA run's snapshot -> the adapter directory peft writes (loaded
by ``PeftModel.from_pretrained`` with identical logits), or the merged model."""

from __future__ import annotations

import json

import pytest
import torch

import deltackpt
from deltackpt.errors import InvalidArgumentError, OutputExistsError, StateKeyError
from deltackpt.interop.peft import peft_config_dict

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
safetensors_torch = pytest.importorskip("safetensors.torch")

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")

CFG = dict(
    hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    intermediate_size=64, vocab_size=128,
)  # fmt: skip


def _base() -> torch.nn.Module:
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**CFG)).eval()


def _trained(modules_to_save: list[str] | None = None):
    lora = peft.LoraConfig(
        r=4, lora_alpha=16, target_modules=["q_proj", "v_proj"], modules_to_save=modules_to_save
    )
    model = peft.get_peft_model(_base(), lora)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    torch.manual_seed(1)
    for _ in range(3):
        x = torch.randint(0, 128, (2, 8))
        model(input_ids=x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad()
    return model.eval(), lora, opt


X = torch.arange(16).reshape(2, 8) % 128


def _logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=X).logits


@pytest.mark.parametrize("modules_to_save", [None, ["lm_head"]], ids=["lora", "modules_to_save"])
def test_adapter_export_loads_in_peft_with_identical_logits(tmp_path, modules_to_save):
    model, lora, opt = _trained(modules_to_save)
    store = tmp_path / "s"
    deltackpt.save({"model": model.state_dict(), "optim": opt.state_dict()}, store, "step-3")
    files = deltackpt.export_peft(store, "step-3", tmp_path / "out", config=lora)
    assert sorted(f.name for f in files) == ["adapter_config.json", "adapter_model.safetensors"]

    # the same keys and bytes as peft's own save_pretrained
    model.save_pretrained(tmp_path / "ref")
    ours = safetensors_torch.load_file(tmp_path / "out/adapter_model.safetensors")
    ref = safetensors_torch.load_file(tmp_path / "ref/adapter_model.safetensors")
    assert sorted(ours) == sorted(ref) and ours
    assert all(torch.equal(ours[k], ref[k]) for k in ref)
    assert any(k.endswith("q_proj.lora_A.weight") for k in ours)
    cfg = json.loads((tmp_path / "out/adapter_config.json").read_text())
    assert cfg["r"] == 4 and cfg["lora_alpha"] == 16 and cfg["inference_mode"] is True
    ref_cfg = json.loads((tmp_path / "ref/adapter_config.json").read_text())
    same = ("r", "lora_alpha", "peft_type", "inference_mode", "modules_to_save", "use_dora")
    assert {k: cfg[k] for k in same} == {k: ref_cfg[k] for k in same}

    loaded = peft.PeftModel.from_pretrained(_base(), tmp_path / "out").eval()
    assert torch.equal(_logits(loaded), _logits(model))


def test_merged_export_loads_as_a_plain_model(tmp_path):
    model, lora, _ = _trained()
    store = tmp_path / "s"
    deltackpt.save({"model": model.state_dict()}, store, "s")
    base = _base()
    deltackpt.export_peft(
        store, "s", tmp_path / "merged", config=lora, merged=True, base_model=base
    )
    plain = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    want = _logits(model.merge_and_unload())
    # the same arithmetic as peft's merge (w + (B @ A) * scaling, float32): bit-identical
    assert torch.equal(_logits(plain), want)
    names = set(safetensors_torch.load_file(tmp_path / "merged/model.safetensors"))
    assert not any("lora_" in n or "base_layer" in n for n in names)
    assert "model.layers.0.self_attn.q_proj.weight" in names


def test_config_from_metadata_and_errors(tmp_path):
    model, lora, _ = _trained()
    store = tmp_path / "s"
    sd = model.state_dict()
    deltackpt.save({"model": sd}, store, "bare")
    deltackpt.save({"model": sd}, store, "meta", metadata={"peft_config": peft_config_dict(lora)})
    with pytest.raises(InvalidArgumentError, match="config="):
        deltackpt.export_peft(store, "bare", tmp_path / "a")
    deltackpt.export_peft(store, "meta", tmp_path / "b")  # the config the snapshot holds
    loaded = peft.PeftModel.from_pretrained(_base(), tmp_path / "b").eval()
    assert torch.equal(_logits(loaded), _logits(model))
    with pytest.raises(OutputExistsError):
        deltackpt.export_peft(store, "meta", tmp_path / "b")
    deltackpt.export_peft(store, "meta", tmp_path / "b", overwrite=True)
    with pytest.raises(StateKeyError, match="adapter 'other'"):
        deltackpt.export_peft(store, "meta", tmp_path / "c", adapter_name="other")
    with pytest.raises(StateKeyError, match="key 'nope'"):
        deltackpt.export_peft(store, "meta", tmp_path / "c", key="nope")
    with pytest.raises(InvalidArgumentError, match="base_model="):
        deltackpt.export_peft(store, "meta", tmp_path / "c", merged=True)


def test_checkpointer_saves_record_the_lora_config_of_a_peft_model(tmp_path):
    """A Checkpointer (and so the HF Trainer plug-in) handed the live PEFT model records its
    LoRA config: the adapter exports (and add_lora reads) with no config=."""
    model, _, opt = _trained()
    ckpt = deltackpt.Checkpointer(tmp_path / "s", every=1, async_=False)
    ckpt.save(3, {"model": model, "optim": opt})
    name = ckpt.name(3)
    meta = deltackpt.open_store(tmp_path / "s").manifest(name).metadata
    assert meta["peft_config"]["r"] == 4 and sorted(meta["peft_config"]["target_modules"]) == [
        "q_proj",
        "v_proj",
    ]
    deltackpt.export_peft(tmp_path / "s", name, tmp_path / "out")
    loaded = peft.PeftModel.from_pretrained(_base(), tmp_path / "out").eval()
    assert torch.equal(_logits(loaded), _logits(model))

    # two adapters: which config belongs to the snapshot is not for us to guess
    model.add_adapter("second", peft.LoraConfig(r=2, target_modules=["q_proj"]))
    ckpt.save(4, {"model": model})
    assert "peft_config" not in deltackpt.open_store(tmp_path / "s").manifest(ckpt.name(4)).metadata
    ckpt.close()

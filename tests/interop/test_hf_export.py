"""export_hf: tiny Llama and Qwen2 models saved during training, exported, and loaded back with
``AutoModelForCausalLM.from_pretrained`` give identical tensors and logits."""

from __future__ import annotations

import itertools
import json
import struct

import pytest
import torch

import deltackpt
from deltackpt.errors import InvalidArgumentError, OutputExistsError, StateKeyError
from tests.interop._hf import logits, tiny, train

pytest.importorskip("transformers")
safetensors = pytest.importorskip("safetensors")


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def trained(request, tmp_path_factory):
    """(model, store, out_dir): a model trained 3 steps, saved with its optimizer, exported."""
    model = tiny(request.param)
    opt = train(model)
    store = tmp_path_factory.mktemp("store")
    deltackpt.save({"model": model.state_dict(), "optim": opt.state_dict(), "step": 3}, store, "s3")
    out = tmp_path_factory.mktemp("hf") / "out"
    report = deltackpt.export_hf(store, "s3", out, config=model.config)
    return model, store, out, report


def _from_pretrained(path, **kw):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, **kw)


def test_from_pretrained_gives_identical_tensors_and_logits(trained):
    model, _, out, report = trained
    loaded = _from_pretrained(out)
    want, got = model.state_dict(), loaded.state_dict()
    assert set(got) == set(want)
    for k, t in want.items():
        assert got[k].dtype == t.dtype and torch.equal(got[k], t), k
    assert torch.equal(logits(loaded), logits(model))
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    assert report.files == ["model.safetensors", "config.json"]


def test_tied_embedding_is_written_once_as_save_pretrained_does(trained, tmp_path):
    model, _, out, report = trained
    from safetensors import safe_open

    with safe_open(out / "model.safetensors", "pt") as f:
        mine = set(f.keys())
        assert f.metadata() == {"format": "pt"}
    model.save_pretrained(tmp_path / "ref")
    with safe_open(tmp_path / "ref" / "model.safetensors", "pt") as f:
        theirs = set(f.keys())
    assert mine == theirs
    tied = model.config.tie_word_embeddings
    assert report.tied == ({"lm_head.weight": "model.embed_tokens.weight"} if tied else {})
    assert ("lm_head.weight" in mine) == (not tied)


def test_header_is_padded_and_offsets_are_contiguous(trained):
    _, _, out, _ = trained
    raw = (out / "model.safetensors").read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    assert n % 8 == 0
    header = json.loads(raw[8 : 8 + n])
    spans = sorted(tuple(v["data_offsets"]) for k, v in header.items() if k != "__metadata__")
    assert spans[0][0] == 0 and spans[-1][1] == len(raw) - 8 - n
    assert all(a[1] == b[0] for a, b in itertools.pairwise(spans))


def test_sharded_bf16_export_loads_and_matches_the_cast_model(trained, tmp_path):
    model, store, _, _ = trained
    done: list[int] = []
    r = deltackpt.export_hf(
        store,
        "s3",
        tmp_path,
        dtype="bf16",
        max_shard_size="20KB",
        config=model.config,
        progress=done.append,
    )
    assert sum(done) == r.total_bytes and len(done) == r.tensors
    shards = [f for f in r.files if f.startswith("model-")]
    assert len(shards) > 1 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == r.total_bytes
    assert set(index["weight_map"].values()) == set(shards)
    assert json.loads((tmp_path / "config.json").read_text())["dtype"] == "bfloat16"
    loaded = _from_pretrained(tmp_path)
    assert loaded.dtype == torch.bfloat16
    for k, t in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], t.to(torch.bfloat16)), k


def test_existing_files_are_refused_unless_overwrite(trained, tmp_path):
    _, store, _, _ = trained
    deltackpt.export_hf(store, "s3", tmp_path, max_shard_size="20KB")
    before = sorted(p.name for p in tmp_path.iterdir())
    with pytest.raises(OutputExistsError, match="overwrite=True"):
        deltackpt.export_hf(store, "s3", tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    deltackpt.export_hf(store, "s3", tmp_path, overwrite=True)  # one file: stale shards go
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors"]


def test_unknown_key_names_it_and_lists_what_exists(trained, tmp_path):
    _, store, _, _ = trained
    with pytest.raises(StateKeyError) as e:
        deltackpt.export_hf(store, "s3", tmp_path, key="modle")
    assert "'modle'" in str(e.value) and "'model'" in str(e.value) and "'optim'" in str(e.value)
    assert list(tmp_path.iterdir()) == []


def test_rename_and_whole_state_key(tmp_path):
    sd = {"a.weight": torch.randn(3, 4), "b": torch.arange(6), "drop": torch.ones(2)}
    deltackpt.save(sd, tmp_path / "s", "x")
    rename = lambda k: None if k == "drop" else "m." + k  # noqa: E731
    deltackpt.export_hf(tmp_path / "s", "x", tmp_path / "o", key=None, rename=rename)
    from safetensors.torch import load_file

    got = load_file(tmp_path / "o" / "model.safetensors")
    assert set(got) == {"m.a.weight", "m.b"}
    assert torch.equal(got["m.a.weight"], sd["a.weight"]) and torch.equal(got["m.b"], sd["b"])
    with pytest.raises(InvalidArgumentError, match="both"):
        deltackpt.export_hf(tmp_path / "s", "x", tmp_path / "o2", key=None, rename=lambda k: "z")
    with pytest.raises(InvalidArgumentError, match="max_shard_size"):
        deltackpt.export_hf(tmp_path / "s", "x", tmp_path / "o3", key=None, max_shard_size="5XB")


def test_non_contiguous_and_partial_views_of_a_shared_storage(tmp_path):
    base = torch.randn(6, 4)
    sd = {"t": base.t(), "top": base[:3], "all": base, "same": base}
    deltackpt.save({"model": sd}, tmp_path / "s", "x")
    r = deltackpt.export_hf(tmp_path / "s", "x", tmp_path / "o")
    assert r.tied == {"same": "all"}
    from safetensors.torch import load_file

    got = load_file(tmp_path / "o" / "model.safetensors")
    assert set(got) == {"t", "top", "all"}
    for k in got:
        assert torch.equal(got[k], sd[k]), k


def test_snapshot_written_through_the_dcp_plugin(tmp_path):
    import warnings

    import torch.distributed.checkpoint as dcp

    from deltackpt.dcp import StoreWriter

    model = {"model.embed.weight": torch.randn(8, 4), "lm_head.weight": torch.randn(8, 4)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP: "assuming the intent is to save in a single process"
        dcp.save(
            {"model": model, "optim": {"lr": 0.1, "t": [torch.ones(2)]}},
            storage_writer=StoreWriter(tmp_path / "s", "x"),
        )
    deltackpt.export_hf(tmp_path / "s", "x", tmp_path / "o")
    from safetensors.torch import load_file

    got = load_file(tmp_path / "o" / "model.safetensors")
    assert set(got) == set(model)
    assert all(torch.equal(got[k], model[k]) for k in model)


def test_damaged_chunk_fails_the_export_and_leaves_no_file(tmp_path):
    from deltackpt.errors import CorruptChunkError

    sd = {"a": torch.randn(64, 64), "b": torch.randn(64, 64)}
    deltackpt.save({"model": sd}, tmp_path / "s", "x")
    (pack,) = (tmp_path / "s" / "packs").rglob("*.pack")
    raw = bytearray(pack.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    pack.write_bytes(bytes(raw))
    with pytest.raises(CorruptChunkError):
        deltackpt.export_hf(tmp_path / "s", "x", tmp_path / "o", max_shard_size="20KB")
    assert list((tmp_path / "o").iterdir()) == []  # temporaries removed, nothing renamed in


def test_fp8_export_writes_block_fp8_weights_with_their_scales(trained, tmp_path):
    """fp8=True: the decoder layers' projections as float8_e4m3fn in 128 x 128 blocks, each
    followed by its weight_scale_inv, byte for byte what the refit's quantizer makes of the
    cast weight; everything else as without it; the config names the quantization. Sharded
    into small files, a weight and its scales may land in two of them."""
    from safetensors.torch import load_file

    from deltackpt.sync.fp8 import quantize_blocks

    model, store, _, _ = trained
    sd = model.state_dict()
    for shard in ("5GB", "2KB"):
        out = tmp_path / shard
        r = deltackpt.export_hf(store, "s3", out, dtype="bf16", config=model.config, fp8=True,
                                max_shard_size=shard)  # fmt: skip
        got: dict[str, torch.Tensor] = {}
        for f in r.files:
            if f.endswith(".safetensors"):
                got.update(load_file(str(out / f)))
        if shard == "2KB":
            assert len([f for f in r.files if f.endswith(".safetensors")]) > 2
            index = json.loads((out / "model.safetensors.index.json").read_text())
            assert set(index["weight_map"]) == set(got)
        picked = [n for n in sd if ".layers." in n and n.endswith("_proj.weight")]
        assert picked and all(got[n].dtype == torch.float8_e4m3fn for n in picked)
        for n in picked:
            q, s = quantize_blocks(sd[n].detach().to(torch.bfloat16))
            assert torch.equal(got[n].view(torch.uint8), q.view(torch.uint8)), n
            assert torch.equal(got[n + "_scale_inv"], s), n
        rest = [n for n in got if n not in picked and not n.endswith("_scale_inv")]
        assert rest and all(got[n].dtype == torch.bfloat16 for n in rest)
        assert "model.embed_tokens.weight" in rest and "model.norm.weight" in rest
        cfg = json.loads((out / "config.json").read_text())
        assert cfg["quantization_config"]["quant_method"] == "fp8"
        assert cfg["quantization_config"]["weight_block_size"] == [128, 128]
        # the 2-D weights left as they were are named, so a loader expects no FP8 there
        ignored = cfg["quantization_config"]["ignored_layers"]
        assert ignored == cfg["quantization_config"]["modules_to_not_convert"]
        assert ignored == sorted(n.removesuffix(".weight") for n in rest if got[n].dim() == 2)
        assert "model.embed_tokens" in ignored
    with pytest.raises(InvalidArgumentError, match=r"fp8='yes' is invalid"):
        deltackpt.export_hf(store, "s3", tmp_path / "bad", fp8="yes")


def test_fp8_export_writes_fused_experts_per_expert(tmp_path):
    """A store saved from transformers 5 holds each MoE layer's experts fused
    (``experts.gate_up_proj`` [E, 2I, H], gate rows then up rows; ``experts.down_proj``): the
    FP8 export writes them as vLLM's FP8 MoE loader takes them, per expert, each quantized with
    its scales (left fused they stayed bf16 where the config promises FP8 experts). Each fused
    entry is read once per batch; a bf16 export keeps them fused."""
    from safetensors.torch import load_file

    from deltackpt.sync.fp8 import quantize_blocks

    g = torch.Generator().manual_seed(3)
    p = "model.layers.0.mlp.experts"
    sd = {
        f"{p}.gate_up_proj": torch.randn(3, 256, 128, generator=g).to(torch.bfloat16),
        f"{p}.down_proj": torch.randn(3, 128, 128, generator=g).to(torch.bfloat16),
        "model.layers.0.mlp.gate.weight": torch.randn(3, 128, generator=g).to(torch.bfloat16),
    }
    deltackpt.save({"model": sd}, tmp_path / "s", "v0")
    for shard in ("5GB", "40KB"):
        out = tmp_path / f"fp8-{shard}"
        r = deltackpt.export_hf(tmp_path / "s", "v0", out, fp8=True, max_shard_size=shard)
        got: dict[str, torch.Tensor] = {}
        for f in r.files:
            if f.endswith(".safetensors"):
                got.update(load_file(str(out / f)))
        for e in range(3):
            for name, w in [
                (f"{p}.{e}.gate_proj.weight", sd[f"{p}.gate_up_proj"][e, :128]),
                (f"{p}.{e}.up_proj.weight", sd[f"{p}.gate_up_proj"][e, 128:]),
                (f"{p}.{e}.down_proj.weight", sd[f"{p}.down_proj"][e]),
            ]:
                q, s = quantize_blocks(w)
                assert torch.equal(got[name].view(torch.uint8), q.view(torch.uint8)), name
                assert torch.equal(got[name + "_scale_inv"], s), name
        assert f"{p}.gate_up_proj" not in got and len(got) == 3 * 3 * 2 + 1
        assert got["model.layers.0.mlp.gate.weight"].dtype == torch.bfloat16  # the router
    plain = deltackpt.export_hf(tmp_path / "s", "v0", tmp_path / "bf16")
    kept = load_file(str(tmp_path / "bf16" / plain.files[0]))
    assert torch.equal(kept[f"{p}.gate_up_proj"], sd[f"{p}.gate_up_proj"])

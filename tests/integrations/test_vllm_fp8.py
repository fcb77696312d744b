"""Refit into a vLLM engine that serves block-FP8 weights (``fp8_layout.py``): the engine's
layout read from its modules, what the trainer quantizes for it, and what the workers refuse
(modules shaped like vLLM's, no vLLM needed); then a real CPU engine started from a block-FP8
checkpoint of a tiny Qwen3-MoE (FP8 linears and FP8 experts; ``_vllm_fp8.py`` in
``.venv-vllm``): bf16 weights refused before anything is
loaded, FP8 rounds committed bit for bit, and the engine's parameters and logprobs equal to
vLLM's own load of the same FP8 weights. vLLM's CPU build has FP8 kernels for AMX processors
only; elsewhere ``_vllm_amx`` emulates their matrix products (the loading is vLLM's own)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from deltackpt.integrations.vllm import fp8_layout
from deltackpt.sync import PlanError
from deltackpt.sync.fp8 import Fp8Blocks
from tests.integrations._vllm_env import real, run_script

E4M3 = torch.float8_e4m3fn


class Fp8LinearMethod:  # the names vLLM's classes have: the layout reads type names
    pass


class UnquantizedLinearMethod:
    pass


class Fp8MoEMethod:
    pass


def linear(out: int, inp: int, fp8: bool, block: bool = True) -> torch.nn.Module:
    m = torch.nn.Module()
    m.weight = torch.nn.Parameter(torch.zeros(out, inp, dtype=E4M3 if fp8 else torch.bfloat16),
                                  requires_grad=False)  # fmt: skip
    m.quant_method = Fp8LinearMethod() if fp8 else UnquantizedLinearMethod()
    if fp8 and block:
        m.weight_block_size = [128, 128]
        m.weight_scale_inv = torch.nn.Parameter(torch.ones(-(-out // 128), -(-inp // 128)))
    elif fp8:
        m.weight_scale = torch.nn.Parameter(torch.ones(1))
    return m


def model(
    *,
    lm_head_fp8: bool = False,
    moe: bool = False,
    per_tensor: bool = False,
    block_moe: bool = False,
) -> Any:
    """Two layers as vLLM builds them: fused qkv_proj and gate_up_proj in block FP8, norms and
    embeddings unquantized, an attention module with an FP8 KV cache method (not a weight)."""
    root = torch.nn.Module()
    root.packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"],
                                   "gate_up_proj": ["gate_proj", "up_proj"]}  # fmt: skip
    root.model = torch.nn.Module()
    root.model.embed_tokens = torch.nn.Embedding(16, 128)
    root.model.layers = torch.nn.ModuleList()
    for _ in range(2):
        layer = torch.nn.Module()
        layer.self_attn = torch.nn.Module()
        layer.self_attn.qkv_proj = linear(384, 128, True)
        layer.self_attn.o_proj = linear(128, 128, True, block=not per_tensor)
        attn = layer.self_attn.attn = torch.nn.Module()
        attn.quant_method = type("Fp8KVCacheMethod", (), {})()
        layer.mlp = torch.nn.Module()
        if moe or block_moe:  # vLLM 0.32: experts.routed_experts holds the fused weights
            layer.mlp.experts = torch.nn.Module()
            ex = layer.mlp.experts.routed_experts = torch.nn.Module()
            ex.quant_method = Fp8MoEMethod()
            ex.w13_weight = torch.nn.Parameter(
                torch.zeros(4, 512, 128, dtype=E4M3), requires_grad=False
            )
            if block_moe:
                ex.weight_block_size = [128, 128]
                ex.w13_weight_scale_inv = torch.nn.Parameter(torch.ones(4, 4, 1))
        else:
            layer.mlp.gate_up_proj = linear(512, 128, True)
            layer.mlp.down_proj = linear(128, 256, True)
        layer.input_layernorm = torch.nn.LayerNorm(128)
        root.model.layers.append(layer)
    root.lm_head = linear(16, 128, lm_head_fp8)
    return root


def state() -> dict[str, torch.Tensor]:
    sd: dict[str, torch.Tensor] = {"model.embed_tokens.weight": torch.zeros(16, 128)}
    for i in range(2):
        p = f"model.layers.{i}."
        for n, shape in [("self_attn.q_proj", (128, 128)), ("self_attn.k_proj", (128, 128)),
                         ("self_attn.v_proj", (128, 128)), ("self_attn.o_proj", (128, 128)),
                         ("mlp.gate_proj", (256, 128)), ("mlp.up_proj", (256, 128)),
                         ("mlp.down_proj", (128, 256))]:  # fmt: skip
            sd[p + n + ".weight"] = torch.randn(shape).to(torch.bfloat16)
        sd[p + "input_layernorm.weight"] = torch.ones(128, dtype=torch.bfloat16)
    sd["lm_head.weight"] = torch.zeros(16, 128, dtype=torch.bfloat16)
    return sd


def test_the_layout_names_the_block_fp8_modules_and_what_it_cannot_quantize() -> None:
    lay = fp8_layout.engine_layout(model())
    assert lay is not None and lay["block"] == [128, 128] and lay["dtype"] == "float8_e4m3fn"
    assert lay["modules"] == [f"model.layers.{i}.{m}" for i in range(2) for m in
                              ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj",
                               "mlp.down_proj")]  # fmt: skip
    assert lay["other"] == [] and lay["packed"]["qkv_proj"] == ["q_proj", "k_proj", "v_proj"]
    assert json.loads(json.dumps(lay)) == lay  # it travels through the group's store
    assert fp8_layout.engine_layout(torch.nn.Linear(4, 4)) is None
    moe = fp8_layout.engine_layout(model(moe=True))
    assert moe is not None and moe["other"] == ["model.layers.0.mlp.experts.routed_experts",
                                                "model.layers.1.mlp.experts.routed_experts"]  # fmt: skip
    with pytest.raises(PlanError, match=r"holds 2 modules as FP8 in a form deltackpt does not"):
        fp8_layout.blocks_for(moe)
    per_tensor = fp8_layout.engine_layout(model(per_tensor=True))
    assert per_tensor is not None and "model.layers.0.self_attn.o_proj" in per_tensor["other"]


def test_the_trainer_quantizes_exactly_the_weights_of_the_engines_fp8_modules() -> None:
    spec = fp8_layout.blocks_for(fp8_layout.engine_layout(model()))
    assert isinstance(spec, Fp8Blocks) and spec.block == (128, 128) and spec.dtype == E4M3
    sd = state()
    out = spec.apply(sd)
    fp8 = sorted(n for n, t in out.items() if t.dtype == E4M3)
    assert fp8 == sorted(n for n in sd if ("_proj" in n))  # q/k/v, o, gate/up, down: fused too
    assert all(out[n + "_scale_inv"].dtype == torch.float32 for n in fp8)
    assert out["lm_head.weight"] is sd["lm_head.weight"]  # unquantized in the engine
    assert out["model.layers.0.input_layernorm.weight"].dtype == torch.bfloat16
    assert fp8_layout.blocks_for(None) is None


def test_the_workers_refuse_what_would_be_written_unscaled_or_unquantized() -> None:
    m = model()
    lay = fp8_layout.engine_layout(m)
    sd = state()
    why = fp8_layout.refusal(m, lay, [("model.layers.1.mlp.up_proj.weight",
                                       sd["model.layers.1.mlp.up_proj.weight"])])  # fmt: skip
    assert why is not None
    assert why.startswith("tensor 'model.layers.1.mlp.up_proj.weight' is bfloat16 but the engine "
                          "holds model.layers.1.mlp.gate_up_proj as block FP8 (float8_e4m3fn, "
                          "blocks [128, 128])")  # fmt: skip
    assert "quantize='auto'" in why
    wrong = [("lm_head.weight", torch.zeros(16, 128, dtype=E4M3))]
    why = fp8_layout.refusal(m, lay, wrong)
    assert why is not None and "holds lm_head unquantized (bfloat16): send it unquantized" in why
    # an engine without FP8 weights (no layout) refuses FP8 bytes too
    assert "unquantized" in (fp8_layout.refusal(model(), None, wrong) or "")
    # a model whose loader renames checkpoint names (vLLM's hf_to_vllm_mapper.map_name)
    renamed = model()
    renamed.hf_to_vllm_mapper = type(
        "Mapper", (), {"map_name": staticmethod(lambda k: k.replace("language_model.", ""))}
    )()
    bf16 = [("language_model.model.layers.0.mlp.down_proj.weight", torch.zeros(128, 256))]
    why = fp8_layout.refusal(renamed, fp8_layout.engine_layout(renamed), bf16)
    assert why is not None and "holds model.layers.0.mlp.down_proj as block FP8" in why
    good = Fp8Blocks(include=lambda n: "_proj" in n).apply(sd)
    assert fp8_layout.refusal(m, lay, good.items()) is None
    assert fp8_layout.refusal(m, None, [("x.weight", torch.zeros(2))]) is None


# ---- the real engine ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def fp8_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    env = dict(os.environ)
    amx = str(Path(__file__).with_name("_vllm_amx"))  # the CPU FP8 kernel's AMX tiles
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [amx, env.get("PYTHONPATH")]))
    return run_script(tmp_path_factory, "_vllm_fp8.py", env=env)


@real
def test_bf16_weights_into_fp8_parameters_are_refused_before_anything_is_loaded(fp8_run):
    r = fp8_run
    assert r["refused"].startswith("RoundAbortedError: the commit of version 1 failed")
    assert "is bfloat16 fused experts" in r["refused_fused"], r["refused_fused"]
    assert r["refused_fused_params_unchanged"]
    assert ("tensor 'model.layers.0.self_attn.q_proj.weight' is bfloat16 but the engine holds "
            "model.layers.0.self_attn.qkv_proj as block FP8") in r["refused"]  # fmt: skip
    assert "serves the weights it started with" in r["refused"]
    assert r["refused_params_unchanged"]
    assert r["refused_engine_version"] != "1"


@real
def test_an_engine_starts_from_deltackpts_fp8_export_as_from_the_reference(fp8_run):
    """export_hf(fp8=True) of a saved model: every parameter vLLM loads from it equals what it
    loads from the reference FP8 checkpoint (names chosen by hand, the same quantizer)."""
    assert fp8_run["export_equals_reference"]


@real
def test_an_fp8_engine_starts_from_the_bf16_store_itself_as_from_the_reference(fp8_run):
    """load_format="deltackpt" from the saved bf16 snapshot (experts fused), with the export's
    config: the loader splits the experts and quantizes each FP8 module's weights in the
    engine's blocks; every parameter equals vLLM's own load of the reference FP8 checkpoint."""
    assert fp8_run["store_start_equals_reference"]


@real
def test_the_engine_publishes_its_fp8_layout_and_the_trainer_quantizes_by_it(fp8_run):
    """A Qwen3-MoE engine: block-FP8 linears (fused q/k/v, o, the dense layer's gate/up and
    down) and block-FP8 experts; the trainer quantizes exactly their checkpoint weights, not
    the router, the embeddings or the LM head."""
    r = fp8_run
    lay = r["layout"]
    assert lay["block"] == [128, 128] and lay["dtype"] == "float8_e4m3fn" and not lay["other"]
    assert len(lay["modules"]) == 6  # qkv and o per layer, gate_up and down of the dense one
    assert lay["experts"] == ["model.layers.1.mlp.experts"]
    weights = [n for n in r["picked"] if n.endswith(".weight")]
    assert len(weights) == 7 + 4 + 4 * 3 and all(n + "_scale_inv" in r["picked"] for n in weights)
    d = r["dtypes"]
    for n in ("model.layers.0.mlp.down_proj.weight", "model.layers.1.mlp.experts.3.up_proj.weight",
              "model.layers.1.self_attn.k_proj.weight"):  # fmt: skip
        assert d[n] == "torch.float8_e4m3fn" and d[n + "_scale_inv"] == "torch.float32", n
    assert d["model.layers.1.mlp.gate.weight"] == "torch.bfloat16"  # the router
    assert d["lm_head.weight"] == "torch.bfloat16"


@real
def test_fp8_rounds_commit_the_quantized_weights_bit_for_bit(fp8_run):
    full, *deltas = fp8_run["rounds"]
    assert full["full"] and full["sent"] == fp8_run["fp8_bytes"] < fp8_run["bf16_bytes"]
    for r in fp8_run["rounds"]:
        assert r["identical"] and r["worker_version"] == r["version"], r["version"]
        assert r["engine_version"] == str(r["version"]) and r["last"]["commit"]["ok"]
        assert r["last"]["path"] == "reload"  # quantized modules: never written in place
    assert not any(d["full"] for d in deltas)
    assert all(d["sent"] < full["sent"] / 5 for d in deltas)  # the changed FP8 elements


@real
def test_the_engine_equals_vllms_own_load_of_the_same_fp8_weights(fp8_run):
    r = fp8_run
    assert r["params_equal_vllm_load"]  # every parameter, FP8 ones as vLLM packed them
    assert len(r["fp8_params"]) == 8  # 6 linears, the experts' w13 and w2
    assert r["tokens"] == r["fresh_tokens"] and r["logprobs"] == r["fresh_logprobs"]


@real
def test_the_store_route_quantizes_bf16_snapshots_for_the_fp8_engine(fp8_run):
    """``deltackpt_follow`` from a store of the trainer's bf16 saves (two plain follows, then a
    staged one and its commit): the worker quantizes its FP8 modules' weights; the engine then
    equals vLLM's own load of the same weights."""
    r = fp8_run
    first, second, staged = r["follow"]
    assert first["mode"] == "full" and second["mode"] != "full", r["follow"]
    assert staged["version"] == "v7" and staged["path"] == "reload", staged  # quantized: reload
    assert r["follow_params_equal_vllm_load"]
    assert r["follow_logprobs"] == r["follow_fresh_logprobs"]


@pytest.mark.parametrize(
    "layout",
    [
        {"modules": "model.layers.0"},
        {"modules": ["a"], "block": [128]},
        {"modules": ["a"], "block": [128, "128"]},
        {"modules": ["a"], "packed": {"qkv_proj": "q_proj"}},
        {"modules": ["a"], "other": [1]},
        [1, 2],
    ],
)
def test_a_malformed_layout_from_a_worker_is_refused_by_the_trainer(layout: Any) -> None:
    """The layout comes from a peer through the group's store: checked before it is used."""

    class Store:  # the group's store, holding what the worker posted
        def check(self, keys: list[str]) -> bool:
            return True

        def get(self, key: str) -> bytes:
            return json.dumps(layout).encode()

    class Group:
        store = Store()

        def wait_until(self, *a: Any) -> None:
            pass

        def guard(self, what: str, fn: Any) -> Any:
            return fn()

    with pytest.raises(PlanError, match=r"the engine's FP8 layout \(vllm/fp8/1\) is malformed"):
        fp8_layout.read(Group(), 1)  # type: ignore[arg-type]


def test_block_fp8_experts_are_quantized_by_their_checkpoint_names() -> None:
    """Fused experts held as block FP8 (vLLM's Fp8MoEMethod: w13_weight and its scales): the
    trainer quantizes the checkpoint's per-expert weights (``experts.<e>.gate_proj.weight``),
    and a worker refuses one that is not FP8."""
    m = model(block_moe=True)
    lay = fp8_layout.engine_layout(m)
    assert lay is not None and not lay["other"]
    assert lay["experts"] == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
    spec = fp8_layout.blocks_for(lay)
    assert spec is not None
    expert = "model.layers.1.mlp.experts.3.down_proj.weight"
    w = torch.randn(128, 256).to(torch.bfloat16)
    assert spec.picks(expert, w) and spec.picks("model.layers.0.self_attn.k_proj.weight", w)
    assert not spec.picks("model.layers.1.mlp.gate.weight", w)  # the router
    assert not spec.picks("model.layers.1.mlp.experts.x.down_proj.weight", w)
    why = fp8_layout.refusal(m, lay, [(expert, w)])
    assert why is not None and "holds the experts of model.layers.1.mlp.experts as block FP8" in why
    assert fp8_layout.refusal(m, lay, spec.apply({expert: w}).items()) is None


def test_fused_experts_are_split_per_expert_and_refused_when_sent_unquantized() -> None:
    """transformers 5 holds experts fused (``experts.gate_up_proj`` [E, 2I, H], gate rows then up
    rows; ``experts.down_proj`` [E, H, I]): for an engine with block-FP8 experts they are split
    into the per-expert weights it loads (views), quantized one by one; sent fused in bf16 a
    worker refuses them (vLLM's loader wrote them unscaled: a probe saw scales of 1e32)."""
    from deltackpt.sync import LocalShard

    m = model(block_moe=True)
    lay = fp8_layout.engine_layout(m)
    p = "model.layers.1.mlp.experts"
    gate_up = torch.randn(4, 512, 128).to(torch.bfloat16)
    down = torch.randn(4, 128, 256).to(torch.bfloat16)
    norm = torch.ones(128, dtype=torch.bfloat16)
    fused = {f"{p}.gate_up_proj": gate_up, f"{p}.down_proj": down, "x.norm.weight": norm}
    split = fp8_layout.unfused(fused, lay)
    assert list(split)[:3] == [f"{p}.0.gate_proj.weight", f"{p}.0.up_proj.weight",
                               f"{p}.1.gate_proj.weight"]  # fmt: skip
    assert len(split) == 4 * 3 + 1 and split["x.norm.weight"] is norm
    assert torch.equal(split[f"{p}.2.up_proj.weight"], gate_up[2, 256:])
    assert torch.equal(split[f"{p}.3.down_proj.weight"], down[3])
    assert split[f"{p}.1.gate_proj.weight"].data_ptr() == gate_up[1].data_ptr()  # a view
    # what the trainer sends: each expert's weights quantized, with its scales; accepted
    spec = fp8_layout.blocks_for(lay)
    assert spec is not None
    sent = spec.apply(split)
    assert sent[f"{p}.0.gate_proj.weight"].dtype == E4M3
    assert tuple(sent[f"{p}.0.gate_proj.weight_scale_inv"].shape) == (2, 1)
    assert fp8_layout.refusal(m, lay, sent.items()) is None
    # sent fused and unquantized (quantize="none"): refused, naming it
    why = fp8_layout.refusal(m, lay, [(f"{p}.gate_up_proj", gate_up)])
    assert why is not None and why.startswith(
        f"tensor '{p}.gate_up_proj' is bfloat16 fused experts"
    )
    # expert parallelism: a rank's shard of whole experts keeps their global numbers
    mine = fp8_layout.unfused(
        {f"{p}.down_proj": LocalShard(down[2:], (2, 0, 0), (4, 128, 256))}, lay
    )
    assert sorted(mine) == [f"{p}.2.down_proj.weight", f"{p}.3.down_proj.weight"]
    assert torch.equal(mine[f"{p}.3.down_proj.weight"], down[3])
    with pytest.raises(PlanError, match="cuts its experts"):
        fp8_layout.unfused(
            {f"{p}.down_proj": LocalShard(down[:, :64], (0, 0, 0), (4, 128, 256))}, lay
        )
    # an engine without FP8 experts gets them fused, as vLLM loads them (untouched)
    assert fp8_layout.unfused(fused, fp8_layout.engine_layout(model())) is fused

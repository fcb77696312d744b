"""Run by tests/integrations/test_vllm_fp8.py in the ``.venv-vllm`` interpreter: a CPU vLLM
engine started from a block-FP8 checkpoint (a tiny Qwen3-MoE whose linear and expert weights are
``float8_e4m3fn`` in 128 x 128 blocks with ``weight_scale_inv``, as DeepSeek-V3 and
Qwen3-*-FP8 ship them; its config from deltackpt's own ``export_hf(fp8=True)``, its weights
from the saved bf16 snapshot itself, ``load_format="deltackpt"``, both checked against vLLM's
load of a reference FP8 checkpoint first) with ``backend="deltackpt"``, its engine core in this
process, and bf16 trainers in this process:

1. a trainer with ``quantize="none"`` sends its bf16 weights as they are: the workers refuse
   the round before loading anything (the engine's parameters stay as they were);
2. a trainer with the default ``quantize="auto"``: a full round, two sparse deltas after RL-like
   steps (sent as transformers 5 holds the experts, fused: the trainer splits them) and a
   staged round; each worker's committed copies against the trainer's weights
   quantized independently here, the bytes each round sent; then the engine's parameters and
   logprobs against vLLM's own load of the same FP8 weights from disk (``reload_weights``);
3. the store route (the worker extension's ``deltackpt_follow``): the trainer saves bf16
   snapshots (``model.state_dict()``: experts fused), the worker reads them, splits the experts and quantizes its FP8 modules' weights in the engine's
   blocks; the engine's parameters against vLLM's own load again.

vLLM's CPU FP8 kernel uses AMX tiles where the processor has them: the test puts
``_vllm_amx/`` on PYTHONPATH. Writes what it saw as JSON to ``argv[1]``.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from typing import Any

import torch
from _vllm_commit import logprobs
from _vllm_run import _committed, _pack, _unpack, free_port, greedy, rl_step, same

BLOCK = [128, 128]
LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def tiny_moe(seed: int) -> torch.nn.Module:
    """A two-layer Qwen3-MoE: layer 0 a dense MLP, layer 1 four experts (top 2) and a router;
    head_dim 64 (the CPU attention kernels), k/v of 128 rows (whole 128-row blocks: vLLM
    narrows a fused qkv's scales by block), no linear biases (vLLM's CPU FP8 kernel takes no
    bf16 bias)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(
        vocab_size=512, hidden_size=256, intermediate_size=512, moe_intermediate_size=256,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
        num_experts=4, num_experts_per_tok=2, mlp_only_layers=[0], decoder_sparse_step=1,
        max_position_embeddings=256, tie_word_embeddings=False, initializer_range=0.1,
    )  # fmt: skip
    cfg.architectures = ["Qwen3MoeForCausalLM"]
    torch.manual_seed(seed)
    return Qwen3MoeForCausalLM(cfg).to(torch.bfloat16)


def state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``model``'s weights under the checkpoint's names: transformers 5 holds each layer's
    experts fused (``experts.gate_up_proj`` [E, 2I, H], ``experts.down_proj`` [E, H, I]);
    checkpoints, vLLM's loader and a trainer's per-expert modules name them
    ``experts.<e>.gate_proj.weight``..."""
    out: dict[str, torch.Tensor] = {}
    for k, v in model.state_dict().items():
        v = v.detach()
        if k.endswith("experts.gate_up_proj"):
            p, inter = k.removesuffix("gate_up_proj"), v.shape[1] // 2
            for e in range(v.shape[0]):
                out[f"{p}{e}.gate_proj.weight"] = v[e, :inter].contiguous()
                out[f"{p}{e}.up_proj.weight"] = v[e, inter:].contiguous()
        elif k.endswith("experts.down_proj"):
            p = k.removesuffix("down_proj")
            for e in range(v.shape[0]):
                out[f"{p}{e}.down_proj.weight"] = v[e].contiguous()
        else:
            out[k] = v
    return out


def fused(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``model.state_dict()`` as transformers 5 holds it: experts fused (see :func:`state`)."""
    return {k: v.detach() for k, v in model.state_dict().items()}


def quantized(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``model``'s weights as the engine holds them: its linear and expert weights in FP8
    blocks with their scales, chosen by name here (not by the engine's layout the trainer
    reads)."""
    from deltackpt.sync.fp8 import Fp8Blocks

    sd = state(model)
    names = {n for n in sd if n.split(".")[-2] in LINEAR}
    return Fp8Blocks(include=names, block=tuple(BLOCK)).apply(sd)


def fp8_checkpoint(model: torch.nn.Module, path: str) -> None:
    """A Hugging Face checkpoint of ``model`` quantized to block FP8 (config and safetensors;
    the routers named unquantized, as FP8 checkpoints name them)."""
    from safetensors.torch import save_file

    q = quantized(model)
    os.makedirs(path, exist_ok=True)
    model.config.to_json_file(f"{path}/config.json")
    save_file({k: v.contiguous() for k, v in q.items()},
              f"{path}/model.safetensors", metadata={"format": "pt"})  # fmt: skip
    with open(f"{path}/config.json") as f:
        cfg = json.load(f)
    cfg["quantization_config"] = {
        "quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": BLOCK,
        "ignored_layers": sorted(n.removesuffix(".weight") for n, t in q.items()
                                 if t.dim() == 2 and t.dtype == torch.bfloat16),
    }  # fmt: skip
    with open(f"{path}/config.json", "w") as f:
        json.dump(cfg, f)


def _params(worker: Any) -> bytes:
    """Every parameter of the engine's model (FP8 weights as vLLM packed them for its kernel)."""
    model = worker.model_runner.get_model()
    return _pack({n: p.detach().clone() for n, p in model.named_parameters()})


def _dtypes(worker: Any) -> dict[str, str]:
    return {n: str(t.dtype) for n, t in worker.weight_transfer_engine.committed().items()}


def _last(worker: Any) -> dict[str, Any]:
    eng = worker.weight_transfer_engine
    return {"path": eng.last_path, "commit": eng.last_commit, "fp8": eng.fp8}


def params_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)


def main(out_path: str) -> None:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # collective_rpc(fn)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core here: one start less
    from vllm import LLM
    from vllm.config import WeightTransferConfig
    from vllm.distributed.weight_transfer import WeightTransferTrainerFactory

    import deltackpt
    from deltackpt.integrations.vllm.extension import EXTENSION
    from deltackpt.integrations.vllm.trainer import DeltackptTrainerInitInfo, LocalLLMClient

    tmp = tempfile.mkdtemp(prefix="vllm-fp8-", dir=os.path.dirname(os.path.abspath(out_path)))
    # deltackpt's own FP8 export of a saved model (export_hf(fp8=True)) gives the engine its
    # config; the engine starts from the saved bf16 snapshot itself (load_format="deltackpt":
    # quantized in the engine's blocks as it loads)
    start = tiny_moe(0)
    deltackpt.save({"model": fused(start)}, f"{tmp}/start-store", "v0")  # experts fused
    deltackpt.export_hf(f"{tmp}/start-store", "v0", f"{tmp}/start", config=start.config, fp8=True)
    llm = LLM(
        model=f"{tmp}/start", skip_tokenizer_init=True, enforce_eager=True, dtype="bfloat16",
        max_model_len=256, max_num_seqs=4, enable_prefix_caching=True,
        weight_transfer_config=WeightTransferConfig(backend="deltackpt"),
        worker_extension_cls=EXTENSION, load_format="deltackpt",
        model_loader_extra_config={"store": f"{tmp}/start-store"},
    )  # fmt: skip
    res: dict[str, Any] = {}

    def init(quantize: str) -> Any:
        info = DeltackptTrainerInitInfo(
            rank=0, master_port=free_port(), dtype="bfloat16", num_workers=1, links="gloo",
            quantize=quantize,
        )  # fmt: skip
        return WeightTransferTrainerFactory.trainer_init(info, client=LocalLLMClient(llm))

    def params() -> dict[str, torch.Tensor]:
        return _unpack(llm.collective_rpc(_params)[0])  # type: ignore[no-any-return]

    # 0. the start from the store and the export (vLLM's loader reading its files) are each
    # what vLLM's own load of the reference FP8 checkpoint gives
    from_store = params()
    llm.collective_rpc("reload_weights", kwargs={"weights_path": f"{tmp}/start"})
    exported = params()
    fp8_checkpoint(start, f"{tmp}/start-ref")
    llm.collective_rpc("reload_weights", kwargs={"weights_path": f"{tmp}/start-ref"})
    llm.reset_prefix_cache()
    reference = params()
    res["export_equals_reference"] = params_equal(exported, reference)
    res["store_start_equals_reference"] = params_equal(from_store, reference)

    # 1. bf16 weights into FP8 parameters: refused before anything is loaded
    trainer = tiny_moe(1)
    before = params()
    eng = init("none")
    try:
        eng.send_weights(state(trainer), version=1)
        res["refused"] = None
    except Exception as e:
        res["refused"] = f"{type(e).__name__}: {e}"
    res["refused_params_unchanged"] = params_equal(params(), before)
    res["refused_engine_version"] = llm.get_weight_version()
    # the same as transformers 5 holds them (fused experts): refused too (before, vLLM's loader
    # wrote the bf16 experts into the FP8 ones unscaled), from a trainer engine of their own
    eng.shutdown()
    eng = init("none")
    try:
        experts = {k: v for k, v in fused(trainer).items() if ".experts." in k}
        eng.send_weights(experts, version=1)
        res["refused_fused"] = None
    except Exception as e:
        res["refused_fused"] = f"{type(e).__name__}: {e}"
    res["refused_fused_params_unchanged"] = params_equal(params(), before)
    res["layout"] = llm.collective_rpc(_last)[0]["fp8"]
    eng.shutdown()

    # 2. quantize="auto": the trainer quantizes what the engine holds as FP8
    eng = init("auto")
    res["picked"] = sorted(eng.fp8.names(state(trainer))) if eng.fp8 else []
    gen = torch.Generator().manual_seed(2)
    res["rounds"] = []
    for version in (1, 2, 3, 4):
        if version > 1:
            rl_step(trainer, 0.02, gen)
        # rounds 2 and 3 as transformers 5 holds the experts (fused): split by the trainer
        sd = fused(trainer) if version in (2, 3) else state(trainer)
        stats = eng.send_weights(sd, version=version, stage=version == 4)
        if version == 4:
            eng.commit()
        want = quantized(trainer)
        ver, got = _unpack(llm.collective_rpc(_committed)[0])
        res["rounds"].append(
            {
                "version": version,
                "full": stats.full,
                "sent": stats.payload_bytes,
                "worker_version": ver,
                "engine_version": llm.get_weight_version(),
                "identical": got.keys() == want.keys() and all(same(got[k], want[k]) for k in want),
                "last": llm.collective_rpc(_last)[0],
            }
        )
    res["dtypes"] = llm.collective_rpc(_dtypes)[0]
    res["bf16_bytes"] = sum(t.numel() * t.element_size() for t in state(trainer).values())
    res["fp8_bytes"] = sum(t.numel() * t.element_size() for t in quantized(trainer).values())
    res["tokens"], res["logprobs"], mine = greedy(llm), logprobs(llm), params()
    eng.shutdown()
    # vLLM's own load of the same FP8 weights from disk, in this engine
    fp8_checkpoint(trainer, f"{tmp}/final")
    llm.collective_rpc("reload_weights", kwargs={"weights_path": f"{tmp}/final"})
    llm.reset_prefix_cache()
    res["fresh_tokens"], res["fresh_logprobs"] = greedy(llm), logprobs(llm)
    theirs = params()
    res["params_equal_vllm_load"] = params_equal(mine, theirs)
    res["fp8_params"] = sorted(n for n, t in theirs.items() if t.dtype == torch.float8_e4m3fn)

    # 3. the store route: bf16 snapshots, quantized by the worker for its FP8 modules
    store = f"{tmp}/store"
    reports = []
    for name in ("v5", "v6", "v7"):  # v7 staged: quantized while serving, then committed
        rl_step(trainer, 0.02, gen)
        deltackpt.save({"model": fused(trainer)}, store, name)  # model.state_dict()
        staged = name == "v7"
        got = llm.collective_rpc("deltackpt_follow", args=(store,), kwargs={"stage": staged})[0]
        if staged:
            got = llm.collective_rpc("deltackpt_follow_commit")[0]
        reports.append(got)
    llm.reset_prefix_cache()  # its KV blocks were computed with the old weights
    mine = params()
    res["follow_logprobs"] = logprobs(llm)
    fp8_checkpoint(trainer, f"{tmp}/final-store")
    llm.collective_rpc("reload_weights", kwargs={"weights_path": f"{tmp}/final-store"})
    llm.reset_prefix_cache()
    res["follow"] = reports
    res["follow_fresh_logprobs"] = logprobs(llm)
    res["follow_params_equal_vllm_load"] = params_equal(mine, params())
    with open(out_path, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])

"""An RL step's weights into a CPU vLLM engine that serves block-FP8 weights, side by side in one
run: deltackpt's rounds (``quantize="auto"``) vs writing an FP8 checkpoint and
``reload_weights`` (vLLM's ``disk`` route, what miles and VIME do for FP8 today).

One engine started from a block-FP8 checkpoint (128 x 128 blocks, ``float8_e4m3fn``, as
DeepSeek-V3 and Qwen3-*-FP8 ship them) of a random-initialised Llama of ``--size`` (the shapes
of ``bench_vllm.py``'s sizes; Llama because vLLM's CPU FP8 kernel takes no bf16 bias), its
engine core in this process. The trainer holds bf16 copies of fp32 masters before and after
one AdamW step at lr 1e-6 after 2 warm-up steps (``_harness/rl_step.py``). Per repeat:

* ``deltackpt full`` then ``deltackpt delta``: ``send_weights`` (the trainer quantizes the
  weights of the engine's FP8 modules and sends them with their scales), timed as the trainer
  sees it, pause included; then a ``staged delta`` of the same step (``stage=True`` while
  serving, then ``commit()``), with its pause inside the worker;
* ``FP8 checkpoint + reload_weights``: quantize the same weights and ``save_file`` (while the
  engine serves), then ``reload_weights`` (its pause); bytes = the file.

Greedy tokens of both paths are compared (they must be equal: the same FP8 bytes). This
machine's memcpy is measured in the same run.

    PYTHONPATH=tests/integrations/_vllm_amx .venv-vllm/bin/python benchmarks/bench_vllm_fp8.py
    ... --size 100m --repeats 1   # quick
    ... --moe                     # a ~250M Qwen3-MoE: block-FP8 experts

vLLM's CPU FP8 kernel uses AMX tiles where the processor has them: the process must ask Linux
for AMX state first (``tests/integrations/_vllm_amx`` on PYTHONPATH, as above). On a processor
without AMX that folder emulates the FP8 kernels for the tests (vLLM has none there), so the
benchmark refuses to run: its times would be the emulation's.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's deltackpt

import torch
from _harness.limits import median, timed
from _harness.report import fmt_bytes, md_table
from bench_vllm import SIZES, free_port, greedy, versions

BLOCK = [128, 128]


#: ``--moe``: a Qwen3-MoE of about 250M parameters (12 layers of 8 experts, top 2)
MOE = dict(vocab_size=32000, hidden_size=1024, intermediate_size=2048, moe_intermediate_size=512,
           num_hidden_layers=12, num_attention_heads=16, num_key_value_heads=4, head_dim=64,
           num_experts=8, num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[])  # fmt: skip


def per_expert(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers 5's fused experts under the checkpoint's per-expert names."""
    from deltackpt.sync.fp8 import expert_parts

    out: dict[str, torch.Tensor] = {}
    for k, v in sd.items():
        parts = expert_parts(k, tuple(v.shape))
        if parts is None:
            out[k] = v
        for name, _, (e, r0, r1) in parts or []:
            out[name] = v[e, r0:r1].contiguous()
    return out


def write_fp8_model(size: str, path: str, moe: bool = False) -> dict[str, torch.Tensor]:
    """A block-FP8 checkpoint of a random Llama of ``size`` (``moe``: the Qwen3-MoE of
    :data:`MOE`) at ``path``; its bf16 state under the checkpoint's names."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    kw = dict(max_position_embeddings=256, tie_word_embeddings=False)
    cfg = Qwen3MoeConfig(**kw, **MOE) if moe else LlamaConfig(**kw, **SIZES[size])
    cfg.architectures = ["Qwen3MoeForCausalLM" if moe else "LlamaForCausalLM"]
    torch.manual_seed(0)
    model = (Qwen3MoeForCausalLM if moe else LlamaForCausalLM)(cfg).to(torch.bfloat16)
    sd = per_expert({k: v.detach() for k, v in model.state_dict().items()})
    os.makedirs(path, exist_ok=True)
    cfg.to_json_file(f"{path}/config.json")
    save_fp8(sd, path)
    with open(f"{path}/config.json") as f:
        c = json.load(f)
    kept = sorted(
        n.removesuffix(".weight")
        for n, t in sd.items()
        if t.dim() == 2 and n not in linear_names(sd)
    )  # (the routers)
    c["quantization_config"] = {
        "quant_method": "fp8",
        "activation_scheme": "dynamic",
        "weight_block_size": BLOCK,
        "ignored_layers": kept,
    }
    c["dtype"] = "bfloat16"
    with open(f"{path}/config.json", "w") as f:
        json.dump(c, f)
    return sd  # fmt: skip


def linear_names(sd: dict[str, torch.Tensor]) -> set[str]:
    return {n for n in sd if n.endswith("_proj.weight")}


def save_fp8(sd: dict[str, torch.Tensor], path: str) -> int:
    """``sd`` quantized (its linear weights) and written as safetensors; the file's bytes."""
    from safetensors.torch import save_file

    from deltackpt.sync.fp8 import Fp8Blocks

    q = Fp8Blocks(include=linear_names(sd), block=tuple(BLOCK)).apply(sd)
    save_file({k: v.contiguous() for k, v in q.items()}, f"{path}/model.safetensors")
    return os.path.getsize(f"{path}/model.safetensors")


def _commit_inside(worker: Any) -> float:
    c = worker.weight_transfer_engine.last_commit or {}
    return float(c.get("seconds", float("nan")))


def spread(xs: list[float]) -> str:
    return f"{median(xs):.3f} [{min(xs):.3f}-{max(xs):.3f}]"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # (not "tiny": its one kv head has 64 rows, and vLLM narrows a fused qkv's scales by block)
    ap.add_argument("--size", default="500m", choices=sorted(set(SIZES) - {"tiny"}))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--moe", action="store_true", help="a ~250M Qwen3-MoE (8 experts) instead")
    ap.add_argument("--tmp", default=None, help="where the checkpoints go (default: a temp dir)")
    args = ap.parse_args()
    if "_PatchOnImport" in {type(f).__name__ for f in sys.meta_path}:
        sys.exit("bench_vllm_fp8: this processor has no AMX tiles, so vLLM's CPU build has no "
                 "FP8 kernel here and tests/integrations/_vllm_amx emulates them: run it on an "
                 "AMX processor (Sapphire Rapids or newer)")  # fmt: skip
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM
    from vllm.config import WeightTransferConfig
    from vllm.distributed.weight_transfer import WeightTransferTrainerFactory

    from deltackpt.integrations.vllm.trainer import DeltackptTrainerInitInfo, LocalLLMClient

    tmp = tempfile.mkdtemp(prefix="bench-vllm-fp8-", dir=args.tmp)
    src = torch.ones(512 << 20, dtype=torch.uint8)
    dst = torch.zeros_like(src)
    memcpy = (
        (512 << 20) / median([timed(lambda d=dst, s=src: d.copy_(s))[0] for _ in range(3)]) / 1e9
    )
    del src, dst
    sd = write_fp8_model(args.size, f"{tmp}/start", moe=args.moe)
    shapes = {k: tuple(v.shape) for k, v in sd.items()}
    nparams = sum(v.numel() for v in sd.values())
    llm = LLM(
        model=f"{tmp}/start", skip_tokenizer_init=True, enforce_eager=True, dtype="bfloat16",
        max_model_len=256, max_num_seqs=4,
        weight_transfer_config=WeightTransferConfig(backend="deltackpt"),
    )  # fmt: skip
    info = DeltackptTrainerInitInfo(rank=0, master_port=free_port(), dtype="bfloat16")
    eng = WeightTransferTrainerFactory.trainer_init(info, client=LocalLLMClient(llm))
    rows: dict[str, list[float]] = {}
    sent: dict[str, float] = {}
    same: list[bool] = []
    changed = []
    version = 0
    for rep in range(args.repeats):
        before, after, frac = versions(shapes, lr=1e-6, warmup=2)
        changed.append(frac)
        for tag, state, stage in (("full", before, False), ("delta", after, False),
                                  ("staged delta", after, True)):  # fmt: skip
            if tag == "staged delta":  # back to "before", then the same step staged
                version += 1
                eng.send_weights(before, version=version)
            version += 1
            t0 = time.perf_counter()
            st = eng.send_weights(state, version=version, stage=stage, full=tag == "full")
            t1 = time.perf_counter()
            if stage:
                eng.commit()
                rows.setdefault("staged delta: commit() pause", []).append(time.perf_counter() - t1)
                rows.setdefault("staged delta: pause inside the worker", []).append(
                    llm.collective_rpc(_commit_inside)[0]
                )
                rows.setdefault("staged delta: prepared while serving", []).append(t1 - t0)
            else:
                rows.setdefault(f"deltackpt {tag} (one call, pause included)", []).append(t1 - t0)
            sent[tag] = st.payload_bytes
        ours = greedy(llm)
        d = tempfile.mkdtemp(dir=tmp)
        t0 = time.perf_counter()
        size = save_fp8(after, d)
        t1 = time.perf_counter()
        llm.collective_rpc("reload_weights", kwargs={"weights_path": d})
        t2 = time.perf_counter()
        rows.setdefault("FP8 checkpoint + reload_weights", []).append(t2 - t0)
        rows.setdefault("  its checkpoint write (while serving)", []).append(t1 - t0)
        rows.setdefault("  its reload_weights (the pause)", []).append(t2 - t1)
        sent["file"] = size
        shutil.rmtree(d)
        llm.reset_prefix_cache()
        same.append(greedy(llm) == ours)
        print(f"repeat {rep + 1}: { ({k: round(v[-1], 3) for k, v in rows.items()}) }", flush=True)
    eng.shutdown()
    base = median(rows["FP8 checkpoint + reload_weights"])
    bytes_of = {"deltackpt full (one call, pause included)": sent["full"],
                "deltackpt delta (one call, pause included)": sent["delta"],
                "staged delta: prepared while serving": sent["staged delta"],
                "FP8 checkpoint + reload_weights": sent["file"]}  # fmt: skip
    table = md_table(
        ["path", "seconds (median [range])", "vs checkpoint + reload", "bytes"],
        [[k, spread(v), f"{median(v) / base:.2f}x", fmt_bytes(bytes_of.get(k))]
         for k, v in rows.items()],
    )  # fmt: skip
    print(
        f"\nbench_vllm_fp8: {'Qwen3-MoE, 8 experts' if args.moe else 'size ' + args.size} "
        f"({nparams / 1e6:.3g}M params, "
        f"{fmt_bytes(2 * nparams)} bf16), {args.repeats} repeats, changed bf16 elements "
        f"{median(changed):.2%}, memcpy {memcpy:.2f} GB/s, torch threads "
        f"{torch.get_num_threads()}; the same tokens on both paths: {all(same)}\n\n{table}"
    )
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()

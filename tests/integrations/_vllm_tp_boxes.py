"""Run by tests/integrations/test_vllm_tp_boxes.py in the ``.venv-vllm`` interpreter: the
TP=2 engine of ``_vllm_tp.py`` with ``DeltackptTrainerInitInfo(tp_boxes=True,
staging="ring")``: each worker receives and holds only its tensor-parallel boxes, through two
message slots. A full round and two sparse deltas, each
worker's held boxes against the same boxes of the trainer's tensors, the bytes each receiver
holds, the staged round and the failed commits of ``_vllm_commit.py`` (their checks read the
boxes), greedy tokens and every readable parameter against vLLM's own load of the trainer's
weights from disk (``reload_weights`` in the same engine). Writes what it saw as JSON to
``argv[1]``.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from typing import Any

import _vllm_commit
import torch
from _vllm_run import _pack, _unpack, free_port, greedy, rl_step, same, tiny_qwen2, vllm_reload
from _vllm_tp import tp_engine

BUCKET = 64 << 10


def _boxes(worker: Any) -> bytes:
    """Per trainer name, ``(offset, box copy)``: the box this worker holds (whole: offset 0)."""
    eng = worker.weight_transfer_engine
    where = eng.held_boxes()
    out = {}
    for n, t in eng.committed().items():
        b = where[n]
        out[n] = ([0] * t.dim() if b is None else list(b[0]), t)
    return _pack((eng.version, out))


def _memory(worker: Any) -> dict[str, Any]:
    """The receiver's byte counts and this process's resident set (VmRSS, VmHWM, bytes)."""
    mem = dict(worker.weight_transfer_engine.memory())
    with open("/proc/self/status") as f:
        for line in f:
            key, _, val = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                mem[key] = int(val.split()[0]) * 1024
    return mem


def _held_boxes(worker: Any) -> Any:
    return worker.weight_transfer_engine.held_boxes()


def _readable(worker: Any) -> bytes:
    model = worker.model_runner.get_model()
    return _pack({n: p.detach().clone() for n, p in model.named_parameters() if p.numel()})


def same_box(a: Any, b: torch.Tensor) -> bool:
    """``a``: ``(offset, box)`` from :func:`_boxes`, equal to that box of ``b``."""
    if not isinstance(a, tuple):
        return same(a, b)
    off, t = a
    sl = tuple(slice(o, o + s) for o, s in zip(off, t.shape, strict=True))
    return t.dim() == b.dim() and same(t, b[sl].contiguous())


def main(out_path: str) -> None:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # collective_rpc(fn)
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    from vllm.distributed.weight_transfer import WeightTransferTrainerFactory

    from deltackpt.integrations.vllm.trainer import DeltackptTrainerInitInfo, LocalLLMClient

    # the commit scenarios compare what each worker holds: its boxes
    _vllm_commit._committed = _boxes  # type: ignore[attr-defined]
    _vllm_commit.same = same_box  # type: ignore[attr-defined]

    tmp = tempfile.mkdtemp(prefix="vllm-tpb-", dir=os.path.dirname(os.path.abspath(out_path)))
    tiny_qwen2(0).save_pretrained(f"{tmp}/start")
    trainer = tiny_qwen2(1)
    llm = tp_engine(f"{tmp}/start", transfer=True)
    res: dict[str, Any] = {"rounds": []}
    # the memory-bound configuration: boxes, two message slots (staging="ring"), small buckets
    # so that this tiny model's round takes many of them
    info = DeltackptTrainerInitInfo(
        rank=0, master_port=free_port(), dtype="bfloat16", num_workers=2, tp_boxes=True,
        staging="ring", bucket_bytes=BUCKET, links="gloo",
    )  # fmt: skip
    res["bucket_bytes"] = BUCKET
    eng = WeightTransferTrainerFactory.trainer_init(info, client=LocalLLMClient(llm))
    gen = torch.Generator().manual_seed(2)
    for version in (1, 2, 3):
        if version > 1:
            rl_step(trainer, 0.02, gen)
        stats = eng.send_weights(trainer.state_dict(), version=version)
        sd = {k: v.detach() for k, v in trainer.state_dict().items()}
        per_worker = [_unpack(raw) for raw in llm.collective_rpc(_boxes)]
        res["rounds"].append(
            {
                "version": version,
                "full": stats.full,
                "sent": stats.payload_bytes,
                "per_link": {str(k): v for k, v in stats.per_link.items()},
                "links": len(stats.per_link),
                "engine_version": llm.get_weight_version(),
                "worker_versions": [v for v, _ in per_worker],
                "identical": [
                    got.keys() == sd.keys() and all(same_box(got[k], sd[k]) for k in sd)
                    for _, got in per_worker
                ],
                "memory": llm.collective_rpc(_memory),
            }
        )
    res["model_bytes"] = sum(t.numel() * t.element_size() for t in trainer.state_dict().values())
    res["boxes"] = [
        {n: None if b is None else [list(b[0]), list(b[1])] for n, b in w.items()}
        for w in llm.collective_rpc(_held_boxes)
    ]
    res["paths"] = llm.collective_rpc(
        lambda w: w.weight_transfer_engine.param_paths()  # type: ignore[no-any-return]
    )
    res["commit"] = _vllm_commit.commit_scenarios(llm, eng, trainer, gen, 2, 3)
    res["memory_end"] = llm.collective_rpc(_memory)
    res["tokens"], res["fresh_tokens"], readable, fresh_readable = against_vllm_load(
        llm, eng, trainer, f"{tmp}/final"
    )
    res["readable"] = [
        {
            "names": sorted(rd),
            "equal": sorted(k for k in rd if k in fr and same(rd[k], fr[k])),
        }
        for rd, fr in zip(readable, fresh_readable, strict=True)
    ]
    res["whole"] = whole_tensors(llm, trainer, gen, tmp)
    with open(out_path, "w") as f:
        json.dump(res, f, indent=1)


def against_vllm_load(
    llm: Any, eng: Any, trainer: Any, path: str
) -> tuple[list[list[int]], list[list[int]], list[Any], list[Any]]:
    """Greedy tokens and every worker's readable parameters as ``eng``'s commits left them,
    then the same after vLLM's own load of the trainer's weights in this engine
    (``reload_weights``: its loader and post-processing on both workers) instead of a fresh
    TP=2 engine (~30 s on 2 cores; test_vllm.py compares with a fresh engine at TP=1).
    ``eng`` is shut down in between."""
    tokens = greedy(llm)
    mine = [_unpack(r) for r in llm.collective_rpc(_readable)]
    eng.shutdown()
    vllm_reload(llm, trainer, path)
    return tokens, greedy(llm), mine, [_unpack(r) for r in llm.collective_rpc(_readable)]


def whole_tensors(llm: Any, trainer: Any, gen: Any, tmp: str) -> dict[str, Any]:
    """The same engine fed whole tensors (a new trainer, no tp_boxes): each worker's commits
    write its rows or columns of the whole tensors into its shards; then tokens and every
    readable parameter against vLLM's own load of the same weights."""
    from vllm.distributed.weight_transfer import WeightTransferTrainerFactory

    from deltackpt.integrations.vllm.trainer import DeltackptTrainerInitInfo, LocalLLMClient

    info = DeltackptTrainerInitInfo(
        rank=0,
        master_port=free_port(),
        dtype="bfloat16",
        num_workers=2,
        staging="round",
        links="gloo",
    )
    eng = WeightTransferTrainerFactory.trainer_init(info, client=LocalLLMClient(llm))
    out: dict[str, Any] = {"paths": []}
    eng.send_weights(trainer.state_dict(), version=30)  # full: reloaded, slots learned
    for v in (31, 32):
        rl_step(trainer, 0.02, gen)
        eng.send_weights(trainer.state_dict(), version=v, stage=True)
        eng.commit()
        out["paths"].append(llm.collective_rpc(_vllm_commit._last_path))
    out["tokens"], out["fresh_tokens"], mine, theirs = against_vllm_load(
        llm, eng, trainer, f"{tmp}/final-whole"
    )
    out["readable_equal"] = [
        bool(a) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
        for a, b in zip(mine, theirs, strict=True)
    ]
    return out


if __name__ == "__main__":
    main(sys.argv[1])

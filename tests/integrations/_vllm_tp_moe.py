"""Run by tests/integrations/test_vllm_tp_moe.py in the ``.venv-vllm`` interpreter: a tiny
Qwen3-MoE (a dense layer, then a layer of 4 routed experts) on a CPU vLLM engine with
``tensor_parallel_size=2``, started from a store (``load_format="deltackpt"``), its engine core
in this process, following stores in tensor-parallel boxes (``deltackpt_follow(tp_boxes=True)``):

1. ``tp_boxes``' rules on each worker for an expert's projections, one by one and fused (as
   transformers 5 holds them: ``experts.gate_up_proj`` ``[E, 2I, H]``, ``experts.down_proj``
   ``[E, H, I]``);
2. a store of the model's own state dict (experts fused): a full follow, an RL-like step, a
   step that changes one expert's down projection; each worker's copy and what it reports;
   then every readable parameter and the greedy tokens against vLLM's own load of the same
   weights (``reload_weights`` of a ``save_pretrained`` directory);
3. a store of the same weights with one tensor per expert projection (the names vLLM's
   checkpoints and RL trainers' exports use): a full follow, an RL-like step, the same
   comparison;
4. the trainer's route (``backend="deltackpt"``, ``tp_boxes=True``; experts sent fused as the
   model holds them, or, expert-parallel, one tensor per expert projection, so that a worker
   does not even receive the other worker's): a full round and an RL-like delta, each worker's
   committed boxes against the trainer's weights, the bytes each worker received; the same
   comparison.

With ``argv[2] == "ep"`` the engine runs its experts expert-parallel
(``enable_expert_parallel=True``: each worker holds two whole experts): the rules then hold a
worker's own experts whole, drop the other worker's (``skip``), and box fused experts by rows of
its own. vLLM 0.32's CPU build cannot run a forward pass with expert parallelism (a worker dies
in it, with vLLM's own loader too), so that run compares parameters only, no tokens. Writes what
it saw as JSON to ``argv[1]``.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from typing import Any

import torch
from _vllm_fp8 import state as per_expert
from _vllm_fp8 import tiny_moe
from _vllm_run import _unpack, free_port, greedy, rl_step, same
from _vllm_tp import _boxes, _readable, rounds, same_box

EXPERTS = "model.layers.1.mlp.experts"
NAMES = {  # a checkpoint name of each kind, and its shape in the tiny model
    f"{EXPERTS}.0.gate_proj.weight": (256, 256),
    f"{EXPERTS}.3.up_proj.weight": (256, 256),
    f"{EXPERTS}.1.down_proj.weight": (256, 256),
    f"{EXPERTS}.gate_up_proj": (4, 512, 256),
    f"{EXPERTS}.down_proj": (4, 256, 256),
}


def _rules(worker: Any) -> dict[str, Any]:
    from deltackpt.integrations.vllm import tp_boxes

    rule = tp_boxes.box_rules(worker.model_runner.get_model())
    out = {}
    for name, shape in NAMES.items():
        r = rule(name, shape)
        box = None if r.box is None else [list(r.box.offset), list(r.box.size)]
        out[name] = {"module": r.module, "box": box, "why": r.why, "skip": r.skip}
    return out


def _copy(worker: Any) -> dict[str, Any]:
    f = worker._deltackpt_follower
    return {
        "bytes": sum(t.nbytes for t in f.state.values()),
        "boxed": sorted(k for k, b in f.held_boxes.items() if b),
        "skipped": sorted(k for k, b in f.held_boxes.items() if b is False),
    }


def _tokens(llm: Any) -> list[list[int]] | None:
    """Greedy tokens, or None under expert parallelism (no forward pass on vLLM's CPU build)."""
    return None if EP else greedy(llm)


EP = False  # main() sets it


def follow_and_compare(
    llm: Any, model: Any, store: str, steps: list[Any], path: str
) -> dict[str, Any]:
    """Each step changes ``model`` and saves it to ``store`` (a callable of the snapshot name),
    then every worker follows in boxes; then the engine against vLLM's own load."""
    out: dict[str, Any] = {"steps": []}
    for i, step in enumerate(steps):
        step(f"s{i}")
        got = llm.collective_rpc("deltackpt_follow", args=(store,), kwargs={"tp_boxes": True})
        out["steps"].append({"follow": got, "copy": llm.collective_rpc(_copy)})
    out.update(against_vllm(llm, model, path))
    return out


def against_vllm(llm: Any, model: Any, path: str, before: Any = None) -> dict[str, Any]:
    """The engine's greedy tokens and every worker's readable parameters, then the same after
    vLLM's own load of ``model``'s weights (``reload_weights`` of a ``save_pretrained``
    directory); ``before()`` runs in between (a trainer's shutdown)."""
    tokens, mine = _tokens(llm), [_unpack(r) for r in llm.collective_rpc(_readable)]
    if before is not None:
        before()
    model.save_pretrained(path)
    llm.collective_rpc("reload_weights", kwargs={"weights_path": path})
    llm.reset_prefix_cache()
    theirs = [_unpack(r) for r in llm.collective_rpc(_readable)]
    return {
        "same_tokens": None if EP else tokens == _tokens(llm),
        "same_readable": [
            bool(a) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
            for a, b in zip(mine, theirs, strict=True)
        ],
    }


def split_rounds(llm: Any, eng: Any, model: Any, gen: Any) -> list[dict[str, Any]]:
    """``_vllm_tp.rounds`` with the experts sent one tensor per projection; per worker also the
    trainer tensors it does not hold."""
    out = []
    for i, version in enumerate((1, 2)):
        if i:
            rl_step(model, 0.02, gen)
        stats = eng.send_weights(per_expert(model), version=version)
        want = per_expert(model)
        per_worker = [_unpack(raw) for raw in llm.collective_rpc(_boxes)]
        out.append({
            "version": version, "full": stats.full, "sent": stats.payload_bytes,
            "per_link": {str(k): v for k, v in stats.per_link.items()},
            "worker_versions": [w for w, _ in per_worker],
            "identical": [
                set(got) <= set(want) and all(same_box(got[k], want[k]) for k in got)
                for _, got in per_worker
            ],
            "missing": [sorted(set(want) - set(got)) for _, got in per_worker],
        })  # fmt: skip
    return out


def trainer_rounds(llm: Any, model: Any, gen: Any, path: str) -> dict[str, Any]:
    """A trainer's rounds in boxes: a full one and an RL-like delta (``_vllm_tp.rounds``), then
    the engine against vLLM's own load."""
    import _vllm_commit
    from vllm.distributed.weight_transfer import WeightTransferTrainerFactory

    from deltackpt.integrations.vllm.trainer import DeltackptTrainerInitInfo, LocalLLMClient

    _vllm_commit._committed = _boxes  # type: ignore[attr-defined]
    info = DeltackptTrainerInitInfo(
        rank=0, master_port=free_port(), dtype="bfloat16", num_workers=2, tp_boxes=True,
        links="gloo",
    )  # fmt: skip
    eng = WeightTransferTrainerFactory.trainer_init(info, client=LocalLLMClient(llm))
    if EP:  # one tensor per expert projection: each worker wants only its own experts
        out: dict[str, Any] = {"rounds": split_rounds(llm, eng, model, gen)}
    else:
        out = {"rounds": rounds(llm, eng, model, gen, (1, 2), _boxes, same_box)}
    out["held_boxes"] = llm.collective_rpc(
        lambda w: sorted(  # type: ignore[no-any-return]
            n for n, b in w.weight_transfer_engine.held_boxes().items() if b is not None
        )
    )
    out.update(against_vllm(llm, model, path, before=eng.shutdown))
    return out


def main(out_path: str, ep: bool) -> None:
    global EP
    EP = ep
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # collective_rpc(fn)
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM
    from vllm.config import WeightTransferConfig

    import deltackpt
    from deltackpt.integrations.vllm.extension import EXTENSION

    tmp = tempfile.mkdtemp(prefix="vllm-moe-", dir=os.path.dirname(os.path.abspath(out_path)))
    model, gen = tiny_moe(0), torch.Generator().manual_seed(3)
    model.config.save_pretrained(f"{tmp}/config")
    fused, split = f"{tmp}/fused", f"{tmp}/split"

    def state() -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in model.state_dict().items()}

    def save_fused(name: str) -> None:
        deltackpt.save({"model": state()}, fused, name, encoding="smallest")

    def save_split(name: str) -> None:
        deltackpt.save({"model": per_expert(model)}, split, name, encoding="smallest")

    save_fused("start")
    llm = LLM(
        model=f"{tmp}/config", skip_tokenizer_init=True, enforce_eager=True, dtype="bfloat16",
        max_model_len=256, max_num_seqs=4, tensor_parallel_size=2, enable_prefix_caching=True,
        worker_extension_cls=EXTENSION, load_format="deltackpt",
        weight_transfer_config=WeightTransferConfig(backend="deltackpt"),
        enable_expert_parallel=ep,
        model_loader_extra_config={"store": fused},
    )  # fmt: skip
    res: dict[str, Any] = {"rules": llm.collective_rpc(_rules)}
    res["model_bytes"] = sum(t.nbytes for t in model.state_dict().values())

    def rl(name: str, save: Any) -> None:
        rl_step(model, 0.05, gen)
        save(name)

    def one_expert(name: str) -> None:
        with torch.no_grad():
            model.model.layers[1].mlp.experts.down_proj[2].add_(0.5)
        save_fused(name)

    res["fused"] = follow_and_compare(
        llm, model, fused, [save_fused, lambda n: rl(n, save_fused), one_expert], f"{tmp}/ref1"
    )
    res["split"] = follow_and_compare(
        llm, model, split, [save_split, lambda n: rl(n, save_split)], f"{tmp}/ref2"
    )
    res["rounds"] = trainer_rounds(llm, model, gen, f"{tmp}/ref3")
    with open(out_path, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:] == ["ep"])

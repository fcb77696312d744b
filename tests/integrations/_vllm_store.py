"""Refit through the store, against a real CPU vLLM engine (``store_scenarios``): a trainer
(this process) publishes versions with ``deltackpt.save``; the engine's workers, started with
the deltackpt worker extension, pull each one with
``collective_rpc("deltackpt_follow", args=(store,))``.

Run at the end of ``_vllm_run.py --short`` (its engine also has the ``deltackpt``
weight-transfer backend: the store link and the backend live on one engine), whose report
keeps the result under ``"store"``; checked by tests/integrations/test_vllm.py. This saves
the engine start of a run of its own. On its own, on an engine with the extension only:
``.venv-vllm/bin/python tests/integrations/_vllm_store.py OUT.json``.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from typing import Any

import torch
from _vllm_run import (
    _readable,
    _unpack,
    engine,
    expected_readable,
    greedy,
    readable_same,
    rl_step,
    same,
    tiny_qwen2,
)


def _tamper_follower(worker: Any) -> None:
    """Change the follower's held copy behind its back (as a stray write would)."""
    worker._deltackpt_loaded["model.layers.0.mlp.down_proj.weight"].view(-1)[:8] += 1


def store_scenarios(llm: Any, tmp: str) -> dict[str, Any]:
    """Publish v0..v6 to a fresh store under ``tmp`` from a trainer of its own and pull them
    into ``llm`` (started with ``worker_extension_cls=EXTENSION``): full, incremental, nothing
    new, a tampered held copy, a staged follow and its commit; then what the model holds
    against the trainer's weights. The engine's weights before do not matter (the first pull
    is full); after, it holds v6."""
    import deltackpt
    from deltackpt.integrations.vllm.extension import state_digests

    store = f"{tmp}/store"
    # one store object (it keeps the delta bases across saves); chunks small enough that this
    # tiny model's tensors are chunked on their own (below small_bytes they share group chunks)
    st = deltackpt.open_store(store, chunk_bytes=1 << 16, small_bytes=1 << 12)
    trainer = tiny_qwen2(1)
    gen = torch.Generator().manual_seed(2)

    def publish(name: str) -> dict[str, str]:
        sd = {k: v.detach().clone() for k, v in trainer.state_dict().items()}
        deltackpt.save({"model": sd}, st, name, encoding="smallest")
        return state_digests(sd)

    res: dict[str, Any] = {"pulls": []}

    def pull(tag: str, want: dict[str, str] | None) -> None:
        got = llm.collective_rpc("deltackpt_follow", args=(store,))[0]
        dig = llm.collective_rpc("deltackpt_follow_digests")[0]
        got.update(tag=tag, identical=want is not None and dig["digests"] == want)
        res["pulls"].append(got)

    pull("v0", publish("v0"))
    for k in (1, 2, 3):
        rl_step(trainer, 0.02, gen)
        pull(f"v{k}", publish(f"v{k}"))
    pull("nothing new", None)
    llm.collective_rpc(_tamper_follower)
    rl_step(trainer, 0.02, gen)
    pull("tampered", publish("v4"))
    rl_step(trainer, 0.02, gen)
    pull("v5", publish("v5"))
    # staged: prepared while the engine serves v5, loaded at the commit. The follow does not
    # reset the prefix cache (an engine with prefix caching may hold blocks of older weights)
    llm.reset_prefix_cache()
    before = greedy(llm)
    params = _unpack(llm.collective_rpc(_readable)[0])
    rl_step(trainer, 0.02, gen)
    want = publish("v6")
    staged = llm.collective_rpc("deltackpt_follow", args=(store,), kwargs={"stage": True})[0]
    served = greedy(llm)  # the staged poll may still run: the model is v5 until the commit
    while_staged = _unpack(llm.collective_rpc(_readable)[0])
    got = llm.collective_rpc("deltackpt_follow_commit")[0]
    dig = llm.collective_rpc("deltackpt_follow_digests")[0]
    after = _unpack(llm.collective_rpc(_readable)[0])
    got.update(tag="v6 staged", identical=dig["digests"] == want, staged=staged["staged"])
    got["served_v5_while_staged"] = served == before and all(
        same(params[k], while_staged[k]) for k in params
    )
    got["moved"] = not all(same(params[k], after[k]) for k in params)
    res["pulls"].append(got)
    llm.reset_prefix_cache()
    stats = deltackpt.LoadStats()
    deltackpt.load(store, "v6", stats=stats)
    res["full_bytes"] = stats.bytes_read
    # what the model holds against the trainer's weights: every parameter vLLM keeps readable
    # (all of them where it keeps linear weights; embeddings, norms, biases and lm_head where it
    # repacks them into kernels). Greedy tokens against vLLM loading the same weights are
    # test_vllm.py's check of the same reload path.
    sd = {k: v.detach() for k, v in trainer.state_dict().items()}
    readable = _unpack(llm.collective_rpc(_readable)[0])
    want = expected_readable(sd, list(readable))
    res["readable_identical"] = bool(readable) and all(
        readable_same(readable[k], want[k]) for k in readable
    )
    return res


def _store(path: str) -> Any:
    """A store whose chunks are small enough that this tiny model's tensors are chunked on their
    own (below ``small_bytes`` they share group chunks)."""
    import deltackpt

    return deltackpt.open_store(path, chunk_bytes=1 << 16, small_bytes=1 << 12)


def _nudge(model: torch.nn.Module, name: str) -> None:
    """Change one tensor of ``model`` a little (64 elements)."""
    with torch.no_grad():
        model.get_parameter(name).view(-1)[:64] += 0.25


def _holds(llm: Any, model: torch.nn.Module) -> bool:
    """Every parameter ``llm`` keeps readable is ``model``'s weights, bit for bit."""
    sd = {k: v.detach() for k, v in model.state_dict().items()}
    readable = _unpack(llm.collective_rpc(_readable)[0])
    want = expected_readable(sd, list(readable))
    return bool(readable) and all(readable_same(readable[k], want[k]) for k in readable)


def _publish(st: Any, model: torch.nn.Module, name: str) -> None:
    import deltackpt

    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    deltackpt.save({"model": sd}, st, name, encoding="smallest")


#: the model the full run's engine starts with, from a store (``load_format="deltackpt"``)
START_SEED = 0


def publish_start(tmp: str) -> dict[str, Any]:
    """The full run's start: ``tmp/start`` holds the config only (no weight file), the store
    ``tmp/start-store`` the weights as ``s0`` and a newer ``s1`` (one tensor changed); the
    engine's ``model_loader_extra_config``: the newest, kept for the follower."""
    first = tiny_qwen2(START_SEED)
    first.config.save_pretrained(f"{tmp}/start")
    st = _store(f"{tmp}/start-store")
    _publish(st, first, "s0")
    _nudge(first, "model.layers.0.mlp.down_proj.weight")
    _publish(st, first, "s1")
    return {"store": f"{tmp}/start-store", "snapshot": "latest", "follow": True}


def started(llm: Any, tmp: str) -> dict[str, Any]:
    """An engine started by :func:`publish_start`'s config: what it says it started from,
    whether it holds ``s1``, then the first follow of that store after a newer ``s2``."""
    first = tiny_qwen2(START_SEED)
    _nudge(first, "model.layers.0.mlp.down_proj.weight")
    out: dict[str, Any] = {"report": llm.collective_rpc("deltackpt_started")[0]}
    out["holds_s1"] = _holds(llm, first)
    from deltackpt.integrations.vllm import store_link

    st = _store(f"{tmp}/start-store")
    _nudge(first, "model.layers.1.self_attn.o_proj.weight")
    _publish(st, first, "s2")
    # from the driver (store_link): the workers' follow, then the prefix cache and the label;
    # the store's path spelt otherwise than at the start: the same store, still incremental
    out["follow"] = store_link.follow(llm, f"{tmp}/./start-store")
    out["holds_s2"] = _holds(llm, first)
    out["label_s2"] = llm.get_weight_version()
    _nudge(first, "model.norm.weight")
    _publish(st, first, "s3")
    store_link.stage(llm, f"{tmp}/start-store")
    out["label_while_staged"] = llm.get_weight_version()
    out["commit"] = store_link.commit(llm)
    out["holds_s3"], out["label_s3"] = _holds(llm, first), llm.get_weight_version()
    return out


def _scribble(worker: Any) -> None:
    """Change the model's final norm in place, outside both routes (as another loader would)."""
    with torch.no_grad():
        worker.model_runner.get_model().model.norm.weight.add_(1)


def two_routes(llm: Any, eng: Any, trainer: torch.nn.Module, tmp: str) -> dict[str, Any]:
    """One engine fed by both routes in turn: ``eng`` (a trainer engine joined to ``llm``,
    its rounds continuing) and a store under ``tmp`` that ``llm``'s workers follow. Each
    update changes one tensor of one layer only, so a route that handed over its change alone
    would leave the other layers on the other route's weights. Per step: the update's report
    and whether every readable parameter equals the weights that route just published."""
    st = _store(f"{tmp}/routes")
    other = tiny_qwen2(3)  # the store's weights: another model entirely

    def follow(tag: str, publish: str | None, **kw: Any) -> dict[str, Any]:
        if publish is not None:
            _publish(st, other, publish)
        got = llm.collective_rpc("deltackpt_follow", args=(f"{tmp}/routes",), kwargs=kw)[0]
        return {"tag": tag, **got, "holds": _holds(llm, other)}

    def push(tag: str, name: str) -> dict[str, Any]:
        _nudge(trainer, name)
        stats = eng.send_weights(trainer.state_dict())
        return {"tag": tag, "full": stats.full, "holds": _holds(llm, trainer)}

    steps = [follow("store s0", "s0")]
    steps.append(push("trainer: layer 1 only", "model.layers.1.mlp.down_proj.weight"))
    _nudge(other, "model.layers.0.mlp.down_proj.weight")
    steps.append(follow("store s1: layer 0 only", "s1"))
    steps.append(push("trainer: layer 0 only", "model.layers.0.self_attn.o_proj.weight"))
    steps.append(follow("store: nothing new", None))
    # weights changed outside both routes: unseen, until a follow is told (whole=True)
    llm.collective_rpc(_scribble)
    steps.append(follow("scribbled: nothing new", None))
    steps.append(follow("scribbled: whole", None, whole=True))
    steps.append(push("trainer: layer 1 again", "model.layers.1.self_attn.o_proj.weight"))
    return {"steps": steps}


def serve_step(llm: Any, tmp: str) -> dict[str, Any]:
    """A snapshot with a training step (``metadata={"step": 500}``, as a Checkpointer records
    it) followed from the driver (``store_link.follow``): the engine's weight version becomes
    the step, and (the caller checks) a trainer that joins next continues after it."""
    import deltackpt
    from deltackpt.integrations.vllm import store_link

    model = tiny_qwen2(7)
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    st = _store(f"{tmp}/routes")
    deltackpt.save({"model": sd}, st, "step-00000500", metadata={"step": 500}, encoding="smallest")
    got = store_link.follow(llm, f"{tmp}/routes")
    return {"follow": got, "label": llm.get_weight_version(), "holds": _holds(llm, model)}


def main(out_path: str) -> None:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # collective_rpc(fn)
    tmp = tempfile.mkdtemp(prefix="deltackpt-vllm-store-")
    tiny_qwen2(0).save_pretrained(f"{tmp}/start")  # the engine starts from other weights
    res = store_scenarios(engine(f"{tmp}/start", transfer=False, extension=True), tmp)
    with open(out_path, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])

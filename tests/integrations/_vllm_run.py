"""Run by tests/integrations/test_vllm.py in the ``.venv-vllm`` interpreter (vLLM is not in the
project's test environment): a real CPU vLLM engine with ``backend="deltackpt"``, a trainer in
this process, several RL-like rounds; writes what it saw as JSON to ``argv[1]``.

Usage: ``.venv-vllm/bin/python tests/integrations/_vllm_run.py OUT.json [--short]
[--links=gloo|shm|ipc|auto]`` (``--short``: the rounds, the tampered worker and the weights
reloaded by vLLM only; no killed, replaced or refusing trainer: test_vllm.py runs it with linear
weights repacked, ``_vllm_linear/``, on the links ``"auto"`` takes (ipc on one host), and the full
run with them kept, on gloo links, this script's default). The full run's engine also has the
deltackpt worker extension, and after its own checks it runs the refit through the store,
``_vllm_store.py``, reported under ``"store"``, then vLLM's sparse apply of deltackpt's
checkpoint patches, ``_vllm_sparse.py``, under ``"sparse"``: that saves the engine starts of
runs of their own.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import tempfile
import time
from typing import Any

import torch
from _vllm_kill import Doomed, kill_round

PROMPTS = [[1, 2, 3, 4], [17, 300, 5], [400, 9, 9, 2, 77]]


def tiny_qwen2(seed: int, tied: bool = False) -> torch.nn.Module:
    """A random-initialised two-layer Qwen2 (head_dim 64: CPU attention kernels need it);
    ``tied``: its LM head is its embedding (as in Qwen2.5-0.5B)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(
        vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256,
        tie_word_embeddings=tied,
    )  # fmt: skip
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(cfg).to(torch.bfloat16)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def engine(
    model_dir: str,
    transfer: bool,
    extension: bool = False,
    core_here: bool = False,
    store: dict[str, Any] | None = None,
) -> Any:
    """``transfer``: with the ``deltackpt`` weight-transfer backend; ``extension``: with the
    deltackpt worker extension (``deltackpt_follow``, ...). Both can be on one engine.
    ``core_here``: the engine core in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, as
    colocated RL trainers run vLLM), its worker still a process of its own (the multiprocess
    executor): one interpreter fewer to start and stop; else vLLM's default (the engine core
    in a process of its own). ``store``: the weights from a store's snapshot
    (``load_format="deltackpt"``, this ``model_loader_extra_config``), not ``model_dir``."""
    if core_here:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM
    from vllm.config import WeightTransferConfig

    from deltackpt.integrations.vllm.extension import EXTENSION

    kw: dict[str, Any] = {}
    if transfer:
        kw["weight_transfer_config"] = WeightTransferConfig(backend="deltackpt")
    if extension:
        kw["worker_extension_cls"] = EXTENSION
    if store is not None:
        kw.update(load_format="deltackpt", model_loader_extra_config=store)
    return LLM(
        model=model_dir, skip_tokenizer_init=True, enforce_eager=True, dtype="bfloat16",
        max_model_len=256, max_num_seqs=4, enable_prefix_caching=True,
        distributed_executor_backend="mp" if core_here else None, **kw,
    )  # fmt: skip


def greedy(llm: Any) -> list[list[int]]:
    from vllm import SamplingParams

    sp = SamplingParams(temperature=0, max_tokens=12, detokenize=False)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], sp, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


# ---- run on the worker through collective_rpc (cloudpickled by value) ---------------------


def _pack(obj: Any) -> bytes:
    """Tensors as bytes: collective_rpc's serializer turns nested tensors into lists."""
    import io

    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _unpack(raw: bytes) -> Any:
    import io

    return torch.load(io.BytesIO(raw))


def _committed(worker: Any) -> bytes:
    eng = worker.weight_transfer_engine
    return _pack((eng.version, eng.committed()))


def _readable(worker: Any) -> bytes:
    """The model's parameters that still hold their values (vLLM's CPU build repacks the linear
    weights into kernels and leaves the parameters empty where the processor has the kernels,
    AVX-512 or AMX; on AVX2 it keeps them)."""
    model = worker.model_runner.get_model()
    return _pack({n: p.detach().clone() for n, p in model.named_parameters() if p.numel()})


def _emptied(worker: Any) -> list[str]:
    """The model's parameters vLLM left empty (their values live in a CPU kernel)."""
    model = worker.model_runner.get_model()
    return sorted(n for n, p in model.named_parameters() if not p.numel())


def _released(worker: Any) -> dict[str, Any]:
    """What the worker's engine still holds of a trainer's link (after the trainer's shutdown)."""
    eng = worker.weight_transfer_engine
    return {"group": eng.group is not None, "receiver": eng.receiver is not None,
            "held": len(eng.committed()), "version": eng.version}  # fmt: skip


def _lost(worker: Any) -> dict[str, Any]:
    """What the worker holds of a link whose trainer died, and why it let go of it."""
    return {**_released(worker), "lost": worker.weight_transfer_engine.lost}


def _paths(worker: Any) -> dict[str, dict[str, str]]:
    return worker.weight_transfer_engine.param_paths()  # type: ignore[no-any-return]


def _last(worker: Any) -> dict[str, Any]:
    eng = worker.weight_transfer_engine
    st = eng.last_stats
    return {"full": st.full, "patched": st.patched, "payload": st.payload_bytes,
            "path": eng.last_path}  # fmt: skip


def _feed_on_host(worker: Any, on: bool) -> None:
    from deltackpt.integrations.vllm import feed

    feed.ON_HOST = on


def _last_commit(worker: Any) -> Any:
    return worker.weight_transfer_engine.last_commit


def _tamper(worker: Any) -> None:
    """Change one committed tensor behind the receiver's back."""
    held = worker.weight_transfer_engine._held
    held["model.layers.0.mlp.down_proj.weight"].view(-1)[:8] += 1


# ---- checks -------------------------------------------------------------------------------


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.view(-1), b.view(-1))


#: parameters vLLM's CPU build keeps wider than loaded: with its AMX GEMM kernels (sgl-kernel's
#: ``weight_packed_linear``) a linear layer's bias becomes float32
WIDENED = {(torch.bfloat16, torch.float32), (torch.float16, torch.float32)}


def readable_same(got: torch.Tensor, want: torch.Tensor) -> bool:
    """A parameter vLLM holds (``got``) is the trainer's tensor (``want``), bit for bit, also
    where vLLM widened it (:data:`WIDENED`: exact, so compared in the wider type)."""
    if (want.dtype, got.dtype) in WIDENED:
        want = want.to(got.dtype)
    return same(got, want)


# how vLLM's Qwen2 fuses checkpoint tensors (its ``packed_modules_mapping``)
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def expected_readable(sd: dict[str, torch.Tensor], names: list[str]) -> dict[str, torch.Tensor]:
    """What vLLM's Qwen2 (TP=1) holds under ``names``, from the trainer's state dict: fused
    parameters are their parts stacked along dim 0, the rest the tensor of the same name."""
    out = {}
    for n in names:
        *mod, fused, leaf = n.split(".")
        if fused in FUSED:
            out[n] = torch.cat([sd[".".join([*mod, part, leaf])] for part in FUSED[fused]])
        else:
            out[n] = sd[n]
    return out


def rl_step(model: torch.nn.Module, share: float, gen: torch.Generator) -> None:
    """Change about ``share`` of every tensor's elements, a little (an RL step in bf16)."""
    with torch.no_grad():
        for p in model.parameters():
            mask = torch.rand(p.shape, generator=gen) < share
            p[mask] += (torch.randn(p.shape, generator=gen) * 0.01).to(p.dtype)[mask]


class Untouchable:
    """A client that must never be called: any use of it is recorded as the failure."""

    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"the client's {name} was used")


def refused_init(factory: Any, info_cls: Any) -> dict[str, Any]:
    """``trainer_init`` with a dtype no torch has, through vLLM's factory: refused before the
    engine is asked anything (``init_args.py``)."""
    try:
        info = info_cls(rank=0, master_port=free_port(), dtype="bf16x")
        factory.trainer_init(info, client=Untouchable())
        return {"raised": None}
    except Exception as e:  # what it raised, for the test to read
        return {"raised": type(e).__name__, "message": str(e)}


def main(out_path: str, short: bool = False, links: str = "gloo") -> None:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # collective_rpc(fn)
    from vllm.distributed.weight_transfer import WeightTransferTrainerFactory

    from deltackpt.integrations.vllm.trainer import DeltackptTrainerInitInfo, LocalLLMClient
    from deltackpt.sync import SyncError

    bad_init = {} if short else refused_init(WeightTransferTrainerFactory, DeltackptTrainerInitInfo)
    tmp = tempfile.mkdtemp(prefix="deltackpt-vllm-")
    # the engine starts from other weights; the short run's model ties its embeddings; the
    # full run's engine takes them from a store's snapshot (load_format="deltackpt")
    start = None
    if short:
        tiny_qwen2(0, tied=True).save_pretrained(f"{tmp}/start")
    else:
        from _vllm_store import publish_start

        start = publish_start(tmp)
    trainer = tiny_qwen2(1, tied=short)
    # the trainer process the full run kills mid-round starts its interpreter meanwhile
    doomed = None if short else Doomed()
    # (the worker extension on both: engine_check.check after every round)
    llm = engine(f"{tmp}/start", transfer=True, extension=True, core_here=short, store=start)
    if not short:  # what it started from, and the first follow of that store (incremental)
        from _vllm_store import started

        started_from = started(llm, tmp)
    info = DeltackptTrainerInitInfo(rank=0, master_port=free_port(), dtype="bfloat16", links=links)
    eng = WeightTransferTrainerFactory.trainer_init(info, client=LocalLLMClient(llm))
    # the links the group took (links="auto": its choice) and why
    res: dict[str, Any] = {"rounds": [], "asked": links, "links": eng.group.links}
    res["links_reason"] = eng.group.links_reason
    res["bad_init"] = bad_init
    if not short:
        res["started"] = started_from
    res["ignores"] = sorted(eng.ignores)  # what the engine ignores: never sent
    gen = torch.Generator().manual_seed(2)

    def check(tag: str, stats: Any) -> None:
        from deltackpt.integrations.vllm import engine_check

        sd = {k: v.detach() for k, v in trainer.state_dict().items() if k not in eng.ignores}
        ec = engine_check.check(llm, sd)  # the parameters' regions against the trainer's
        version, got = _unpack(llm.collective_rpc(_committed)[0])
        readable = _unpack(llm.collective_rpc(_readable)[0])
        want = expected_readable(sd, list(readable))
        res["rounds"].append(
            {
                "tag": tag,
                "version": version,
                "engine_version": llm.get_weight_version(),
                "full": stats.full,
                "sent": stats.payload_bytes,
                "worker": llm.collective_rpc(_last)[0],
                "committed_identical": got.keys() == sd.keys()
                and all(same(got[k], sd[k]) for k in sd),
                "readable_identical": all(readable_same(readable[k], want[k]) for k in readable),
                "readable": sorted(readable),
                "engine_check": {"ok": ec.ok, "checked": ec.checked, "unchecked": ec.unchecked},
            }
        )

    check("full", eng.send_weights(trainer.state_dict(), version=1))
    rl_step(trainer, 0.02, gen)
    check("delta", eng.send_weights(trainer.state_dict(), version=2))
    rl_step(trainer, 0.02, gen)
    check("delta2", eng.send_weights(trainer.state_dict(), version=3))
    tokens_v3 = greedy(llm)
    # a worker whose copy changed behind its back: the round fails everywhere, nothing applied
    llm.collective_rpc(_tamper)
    before = {k: v.clone() for k, v in trainer.state_dict().items()}
    rl_step(trainer, 0.02, gen)
    try:
        eng.send_weights(trainer.state_dict(), version=4)
        res["tampered"] = {"raised": None}
    except SyncError as e:
        res["tampered"] = {"raised": type(e).__name__}
    res["tampered"]["engine_version"] = llm.get_weight_version()
    res["tampered"]["worker_version"] = _unpack(llm.collective_rpc(_committed)[0])[0]
    res["tampered"]["tokens_unchanged"] = greedy(llm) == tokens_v3
    del before
    check("heal", eng.send_weights(trainer.state_dict(), version=5))
    rl_step(trainer, 0.02, gen)
    check("delta3", eng.send_weights(trainer.state_dict(), version=6))
    res["emptied"] = llm.collective_rpc(_emptied)[0]
    res["paths"] = llm.collective_rpc(_paths)[0]
    if short:
        # a GPU worker's reload (linear weights repacked here: the commits reload): its tensors
        # moved before the loaders get them, host to host here (feed.ON_HOST), the code a GPU
        # worker runs: a staged round moves them ahead of its commit, a plain one in windows
        llm.collective_rpc(_feed_on_host, args=(True,))
        rl_step(trainer, 0.02, gen)
        stats = eng.send_weights(trainer.state_dict(), version=7, stage=True)
        eng.commit()
        check("moved ahead", stats)
        res["moved_ahead"] = llm.collective_rpc(_last_commit)[0]
        rl_step(trainer, 0.02, gen)
        check("moved in windows", eng.send_weights(trainer.state_dict(), version=8))
        llm.collective_rpc(_feed_on_host, args=(False,))
        finish(res, llm, trainer, tmp)
        eng.shutdown()
        report(res, out_path)
        return
    eng.shutdown()
    res["released"] = llm.collective_rpc(_released)[0]
    tokens_v6 = greedy(llm)
    # a trainer process killed mid-round (os._exit): the engine stays on what it committed
    killed = kill_round(llm, trainer.state_dict(), free_port(), 7, lambda: greedy(llm), doomed)
    killed["engine_version"] = llm.get_weight_version()
    killed["worker_version"] = _unpack(llm.collective_rpc(_committed)[0])[0]
    killed["tokens_unchanged"] = greedy(llm) == killed["marked"]
    killed["tokens_moved"] = killed["marked"] != tokens_v6
    # nothing calls the worker now: it lets go of the dead trainer's link by itself
    t0 = time.monotonic()
    while (side := llm.collective_rpc(_lost)[0])["group"] and time.monotonic() - t0 < 30:
        time.sleep(0.2)
    killed["released"], killed["released_s"] = side, time.monotonic() - t0
    res["killed"] = killed
    # a replacement trainer joins on a new port (init_weight_transfer_engine again): full round
    info = DeltackptTrainerInitInfo(rank=0, master_port=free_port(), dtype="bfloat16", links=links)
    eng = WeightTransferTrainerFactory.trainer_init(info, client=LocalLLMClient(llm))
    # its versions continue after the engine's (7: the killed trainer's last; its round 8 never
    # committed); one that would not go past it is refused before anything is sent
    res["continuity"] = {"serving": eng.serving}
    try:
        eng.send_weights(trainer.state_dict(), version=6)
        res["continuity"]["raised"] = None
    except SyncError as e:
        res["continuity"]["raised"] = f"{type(e).__name__}: {e}"
    res["continuity"]["engine_version"] = llm.get_weight_version()
    rl_step(trainer, 0.02, gen)
    check("replaced", eng.send_weights(trainer.state_dict()))  # version 8
    rl_step(trainer, 0.02, gen)
    check("replaced_delta", eng.send_weights(trainer.state_dict(), version=9))
    # a trainer that refuses its tensors (not what the schedule was built for) before a round
    bad = dict(trainer.state_dict())
    del bad["lm_head.weight"]
    t0 = time.monotonic()
    try:
        eng.send_weights(bad, version=10)
        res["refused"] = {"raised": None}
    except SyncError as e:
        res["refused"] = {"raised": type(e).__name__}
    res["refused"]["seconds"] = time.monotonic() - t0
    res["refused"]["engine_version"] = llm.get_weight_version()
    rl_step(trainer, 0.02, gen)
    check("after_refusal", eng.send_weights(trainer.state_dict(), version=10))
    # staged rounds, commits failed on purpose, the prefix cache (_vllm_commit.py)
    from _vllm_commit import commit_scenarios

    res["commit"] = commit_scenarios(llm, eng, trainer, gen, 1, 10)
    # the run went back to an earlier checkpoint: its next version is 3 again, said so
    rl_step(trainer, 0.02, gen)
    check("rewound", eng.send_weights(trainer.state_dict(), version=3, rewind=True))
    rl_step(trainer, 0.02, gen)
    check("after_rewind", eng.send_weights(trainer.state_dict()))  # version 4
    # the store link and the trainer's rounds in turn on this engine (_vllm_store.py)
    from _vllm_store import two_routes

    res["two_routes"] = two_routes(llm, eng, trainer, tmp)
    # the store brings a snapshot of training step 500: the engine's version is its step, and a
    # trainer that joins next continues after it (one version line across both routes)
    from _vllm_store import serve_step

    res["step"] = serve_step(llm, tmp)
    eng.shutdown()
    info = DeltackptTrainerInitInfo(rank=0, master_port=free_port(), dtype="bfloat16", links=links)
    eng = WeightTransferTrainerFactory.trainer_init(info, client=LocalLLMClient(llm))
    res["step"]["serving"] = eng.serving
    rl_step(trainer, 0.02, gen)
    check("after_step", eng.send_weights(trainer.state_dict()))  # version 501
    res["step"]["next_label"] = llm.get_weight_version()
    finish(res, llm, trainer, tmp)
    eng.shutdown()
    # the refit through the store on this engine, after its own checks (_vllm_store.py): its
    # linear weights are kept, so the follower's commits go in place too
    from _vllm_store import store_scenarios

    res["store"] = store_scenarios(llm, tmp)
    # deltackpt's checkpoint-coordinate patches through vLLM's own sparse apply (_vllm_sparse.py)
    from _vllm_sparse import sparse_scenarios

    res["sparse"] = sparse_scenarios(llm)
    report(res, out_path)


def finish(res: dict[str, Any], llm: Any, trainer: torch.nn.Module, tmp: str) -> None:
    """Greedy tokens and readable parameters against the trainer's weights loaded by vLLM itself
    from disk, into ``res``: this engine reloads them (``reload_weights``: vLLM's own loader and
    post-processing on every worker, what a fresh engine runs at its start, without a second
    engine start: ~20-30 s of the suite on 2 cores). Both runs end here; the full run's store
    scenarios start over with a full pull."""
    res["tokens"] = greedy(llm)
    mine = _unpack(llm.collective_rpc(_readable)[0])
    vllm_reload(llm, trainer, f"{tmp}/final")
    res["fresh_tokens"] = greedy(llm)
    fr = _unpack(llm.collective_rpc(_readable)[0])
    res["readable_same_as_fresh"] = fr.keys() == mine.keys() and all(
        same(fr[k], mine[k]) for k in fr
    )


def vllm_reload(llm: Any, trainer: torch.nn.Module, path: str) -> None:
    """vLLM's own load of ``trainer``'s weights in this engine: written to ``path`` as a
    Hugging Face checkpoint, ``reload_weights`` on every worker (its loader and
    post-processing), the prefix cache dropped. The comparison the tests make instead of a
    second engine start."""
    trainer.save_pretrained(path)
    llm.collective_rpc("reload_weights", kwargs={"weights_path": path})
    llm.reset_prefix_cache()


def report(res: dict[str, Any], out: str) -> None:
    with open(out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    links = next((a.split("=", 1)[1] for a in sys.argv[2:] if a.startswith("--links=")), "gloo")
    main(sys.argv[1], short="--short" in sys.argv[2:], links=links)

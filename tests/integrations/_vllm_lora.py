"""LoRA adapters from the store into a real CPU vLLM engine (``deltackpt.integrations.vllm.lora``),
run by tests/integrations/test_vllm_lora.py in the ``.venv-vllm`` interpreter; writes what it saw
as JSON to ``argv[1]``.

A trainer (this process) saves a PEFT-shaped state dict (peft's ``state_dict()`` names, built by
hand: peft is not in the vLLM environment; tests/interop/test_peft.py checks those names against
real peft) with its LoRA config in the snapshot metadata. The engine (``enable_lora=True``, two
adapters in its cache, the deltackpt worker extension) gets versions with ``add_lora`` and the
same versions exported with ``export_peft`` and loaded from their directories by vLLM itself;
the two must be bit-identical (digests of vLLM's ``lora_a`` / ``lora_b``) and generate the same
tokens, side by side in one batch. Then: eviction and a load again from the store, a refused
rank, a damaged store, a reused id, ``remove_lora``.

Surprise: vLLM 0.32's CPU build gives a request without an adapter the adapter of the last slot
when every slot is taken (a batch of the base model and two adapters with ``max_loras=2``), on
directory adapters alike; the base model runs here in a batch of its own.

vLLM's CPU build with LoRA dies of SIGILL in its attention kernel on AMX processors unless the
process asked Linux for AMX state first (without LoRA, oneDNN's matmuls ask before attention
runs): ``_vllm_amx/sitecustomize.py`` asks in every engine process.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from typing import Any

import torch
from _vllm_run import PROMPTS, tiny_qwen2

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
from tests._faults import flip_chunk_bytes

CFG = {
    "peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"],
    "bias": "none", "task_type": "CAUSAL_LM",
}  # fmt: skip


def adapter_state(seed: int, r: int = 4) -> dict[str, torch.Tensor]:
    """What ``get_peft_model(tiny_qwen2, LoraConfig(**CFG)).state_dict()`` holds of the
    adapter (the base weights are not needed by an adapter read)."""
    g = torch.Generator().manual_seed(seed)
    sd = {}
    for i in range(2):
        for mod, out in (("q_proj", 128), ("v_proj", 64)):
            p = f"base_model.model.model.layers.{i}.self_attn.{mod}"
            sd[f"{p}.lora_A.default.weight"] = (torch.randn(r, 128, generator=g) * 0.5).bfloat16()
            sd[f"{p}.lora_B.default.weight"] = (torch.randn(out, r, generator=g) * 0.5).bfloat16()
    return sd


def main(out_path: str) -> None:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    # the engine core in this process, its worker a process of its own (as _vllm_run.engine's
    # core_here): one interpreter fewer to start, ~10 s of this test's ~45
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    import deltackpt
    from deltackpt.integrations.vllm.extension import EXTENSION
    from deltackpt.integrations.vllm.lora import AdapterSource, add_lora, remove_lora

    tmp = tempfile.mkdtemp(prefix="deltackpt-vllm-lora-")
    # the base model from a store's snapshot (load_format="deltackpt"), the directory for its
    # config; vLLM's own load of the same weights is the reference (f"{tmp}/base-ref")
    base = tiny_qwen2(0)
    base.config.save_pretrained(f"{tmp}/base")
    base.save_pretrained(f"{tmp}/base-ref")
    base_sd = {k: v.detach().clone() for k, v in base.state_dict().items()}
    deltackpt.save({"model": base_sd}, f"{tmp}/base-store", "b0")
    store = f"{tmp}/store"
    meta = {"peft_config": CFG}
    sd1 = adapter_state(1)
    sd2 = dict(sd1)  # an RL-like step: one adapter tensor changed
    key2 = "base_model.model.model.layers.1.self_attn.v_proj.lora_B.default.weight"
    sd2[key2] = (sd1[key2].float() + 0.25).bfloat16()
    deltackpt.save({"model": sd1}, store, "v1", metadata=meta)
    deltackpt.save({"model": sd2}, store, "v2", metadata=meta)
    for v in ("v1", "v2"):
        deltackpt.export_peft(store, v, f"{tmp}/dir-{v}")

    os.environ["DELTACKPT_VLLM_LORA_STORE"] = store  # the plugin registers the resolver
    llm = LLM(
        model=f"{tmp}/base", skip_tokenizer_init=True, enforce_eager=True, dtype="bfloat16",
        max_model_len=256, max_num_seqs=4, enable_lora=True, max_lora_rank=8, max_loras=2,
        max_cpu_loras=2, worker_extension_cls=EXTENSION, distributed_executor_backend="mp",
        load_format="deltackpt", model_loader_extra_config={"store": f"{tmp}/base-store"},
    )  # fmt: skip
    sp = SamplingParams(temperature=0, max_tokens=10, detokenize=False)
    prompt = [{"prompt_token_ids": PROMPTS[0]}]

    def gen(reqs: list[Any]) -> list[list[int]]:
        outs = llm.generate(prompt * len(reqs), sp, lora_request=reqs, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    def digests(rid: int) -> dict[str, str]:
        (a,) = llm.collective_rpc("deltackpt_lora_digests", kwargs={"lora_int_id": rid})
        return a["digests"]

    def refused(**kw: Any) -> dict[str, Any]:
        try:
            add_lora(llm, **kw)
            return {"raised": None}
        except Exception as e:  # what it raised, for the test to read
            return {"raised": type(e).__name__, "message": str(e)}

    out: dict[str, Any] = {"started": llm.collective_rpc("deltackpt_started")[0]}
    plain = gen([None])
    llm.collective_rpc("reload_weights", kwargs={"weights_path": f"{tmp}/base-ref"})
    llm.reset_prefix_cache()
    out["base_as_vllm_loads"] = plain == gen([None])
    # first, before any add_lora: vLLM's own engine add_lora (what the server's
    # /v1/load_lora_adapter, --lora-modules and LoRA resolvers call) takes a deltackpt path,
    # the plugin having taught vLLM's worker loader; then load_inplace gives the id v2
    own = LoRARequest("own-v1", 77, AdapterSource(store, "v1").path)
    llm.llm_engine.add_lora(own)
    out["own_add"] = gen([own])[0]
    inplace = LoRARequest("own-v1", 77, AdapterSource(store, "v2").path, load_inplace=True)
    llm.llm_engine.add_lora(inplace)
    out["own_inplace"] = gen([inplace])[0]
    out["own_digests"] = digests(77)

    # the resolver a server asks about an unknown model name, and the engine add_lora of its
    # answer with the server's own id
    import asyncio

    from vllm.lora.resolver import LoRAResolverRegistry

    from deltackpt.integrations.vllm.resolver import RESOLVER

    out["resolvers"] = sorted(LoRAResolverRegistry.get_supported_resolvers())
    resolver = LoRAResolverRegistry.get_resolver(RESOLVER)
    ask = {n: asyncio.run(resolver.resolve_lora("base", n)) for n in
           ("v2", "default@v1", "latest", "nope", "other@v1", "a.b@v1")}  # fmt: skip
    out["resolved"] = {n: None if r is None else r.lora_path for n, r in ask.items()}
    from deltackpt.store.leases import scan_leases
    from deltackpt.store.store import open_store

    live = scan_leases(open_store(store, create=False).storage).live
    out["resolver_leases"] = [
        list(lease.snapshots) for lease in live if lease.holder.startswith("vllm-resolver-")
    ]
    found = ask["v2"]
    found.lora_int_id = 501  # what the server does
    llm.llm_engine.add_lora(found)
    out["resolved_tokens"] = gen([found])[0]

    r1 = add_lora(llm, store, "v1")
    r2 = add_lora(llm, store)  # the newest committed version, pinned by name
    out["names"] = [r1.lora_name, r2.lora_name]
    out["ids_differ"] = r1.lora_int_id != r2.lora_int_id
    out["store_digests"] = [digests(r1.lora_int_id), digests(r2.lora_int_id)]
    # the undo of a failed add_lora drops only what that call added (its token)
    out["wrong_token"] = llm.collective_rpc(
        "deltackpt_lora_remove", kwargs={"lora_int_id": r1.lora_int_id, "only_if_token": "x"}
    )
    out["again"] = llm.collective_rpc(
        "deltackpt_lora_add",
        kwargs={"path": r1.lora_path, "lora_int_id": r1.lora_int_id, "lora_name": r1.lora_name},
    )
    d1 = LoRARequest("dir-v1", 11, f"{tmp}/dir-v1")
    d2 = LoRARequest("dir-v2", 12, f"{tmp}/dir-v2")
    # one batch: both store versions, both directories (four adapters, two cache places: vLLM
    # evicts and loads again while it runs). The base model runs alone: vLLM 0.32's CPU build
    # gives a request without an adapter the last slot's adapter when both slots are taken
    out["base"] = gen([None])[0]
    out["tokens"] = gen([r1, r2, d1, d2])
    out["dir_digests"] = [digests(11), digests(12)]
    # r1 evicted by now (two cache places, d1 and d2 used last): held no more, then read again
    out["r1_held_after_dirs"] = bool(digests(r1.lora_int_id))
    out["r1_again"] = gen([r1])[0]
    out["r1_digests_again"] = digests(r1.lora_int_id)

    # refusals: a rank above max_lora_rank, a damaged store, an id that names another version
    deltackpt.save(
        {"model": adapter_state(3, r=16)}, store, "big", metadata={"peft_config": {**CFG, "r": 16}}
    )
    deltackpt.save({"model": adapter_state(4)}, f"{tmp}/bad", "v1", metadata=meta)
    flip_chunk_bytes(f"{tmp}/bad", "v1")
    out["big"] = refused(store=store, snapshot="big")
    out["damaged"] = refused(store=f"{tmp}/bad", snapshot="v1")
    out["reused_id"] = refused(store=store, snapshot="big", lora_int_id=r2.lora_int_id)
    out["dir_id"] = refused(store=store, snapshot="v1", lora_int_id=11)
    out["after_refusals"] = gen([r1, r2])
    out["r2_digests_after"] = digests(r2.lora_int_id)

    out["removed"] = remove_lora(llm, r2)
    out["r2_held_after_remove"] = bool(digests(r2.lora_int_id))
    out["r2_after_remove"] = gen([r2])[0]  # named again: loaded again from the store
    with open(out_path, "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main(sys.argv[1])

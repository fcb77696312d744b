"""Run by tests/integrations/test_vllm_store.py in the ``.venv-vllm`` interpreter: refit through
the store. A trainer (this process) publishes versions with ``deltackpt.save``; a real CPU vLLM
engine, started with the deltackpt worker extension and no weight-transfer backend, pulls each
one with ``collective_rpc("deltackpt_follow", args=(store,))``. Writes what it saw as JSON to
``argv[1]``.

Usage: ``.venv-vllm/bin/python tests/integrations/_vllm_store.py OUT.json``
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from typing import Any

import torch
from _vllm_run import _readable, _unpack, expected_readable, greedy, rl_step, same, tiny_qwen2


def _tamper(worker: Any) -> None:
    """Change the follower's held copy behind its back (as a stray write would)."""
    worker._deltackpt_loaded["model.layers.0.mlp.down_proj.weight"].view(-1)[:8] += 1


def main(out_path: str) -> None:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # collective_rpc(fn)
    from vllm import LLM

    import deltackpt
    from deltackpt.integrations.vllm.extension import EXTENSION, state_digests

    tmp = tempfile.mkdtemp(prefix="deltackpt-vllm-store-")
    store = f"{tmp}/store"
    # one store object (it keeps the delta bases across saves); chunks small enough that this
    # tiny model's tensors are chunked on their own (below small_bytes they share group chunks)
    st = deltackpt.open_store(store, chunk_bytes=1 << 16, small_bytes=1 << 12)
    tiny_qwen2(0).save_pretrained(f"{tmp}/start")  # the engine starts from other weights
    trainer = tiny_qwen2(1)
    gen = torch.Generator().manual_seed(2)

    def publish(name: str) -> dict[str, str]:
        sd = {k: v.detach().clone() for k, v in trainer.state_dict().items()}
        deltackpt.save({"model": sd}, st, name, encoding="smallest")
        return state_digests(sd)

    llm = LLM(
        model=f"{tmp}/start", skip_tokenizer_init=True, enforce_eager=True, dtype="bfloat16",
        max_model_len=256, max_num_seqs=4, worker_extension_cls=EXTENSION,
    )  # fmt: skip
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
    llm.collective_rpc(_tamper)
    rl_step(trainer, 0.02, gen)
    pull("tampered", publish("v4"))
    rl_step(trainer, 0.02, gen)
    pull("v5", publish("v5"))
    # staged: prepared while the engine serves v5, loaded at the commit
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
    stats = deltackpt.LoadStats()
    deltackpt.load(store, "v6", stats=stats)
    res["full_bytes"] = stats.bytes_read
    # what the model holds against the trainer's weights: every parameter vLLM keeps readable
    # (all of them where it keeps linear weights; embeddings, norms, biases and lm_head where it
    # repacks them into kernels). Greedy tokens against a fresh engine are test_vllm.py's check
    # of the same reload path (a fresh engine start is a third of this test's time).
    sd = {k: v.detach() for k, v in trainer.state_dict().items()}
    readable = _unpack(llm.collective_rpc(_readable)[0])
    want = expected_readable(sd, list(readable))
    res["readable_identical"] = bool(readable) and all(same(readable[k], want[k]) for k in readable)
    with open(out_path, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])

"""LoRA adapters from the store behind vLLM's OpenAI server: a request's ``model`` names a saved
adapter version (``v1``: adapter ``default`` of snapshot ``v1``), the server's resolver (the
deltackpt plugin, ``DELTACKPT_VLLM_LORA_STORE``) finds it and the engine loads it from the store.
Run by tests/integrations/test_vllm_lora_http.py in the ``.venv-vllm`` interpreter; writes what
it saw as JSON to ``argv[1]``. The reference: the same versions' ``export_peft`` directories
loaded by the server itself (``/v1/load_lora_adapter``); greedy tokens compared.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from typing import Any

import requests
from _vllm_http import serve, stop
from _vllm_lora import CFG, adapter_state
from _vllm_run import PROMPTS, free_port, tiny_qwen2


def main(out_path: str) -> None:
    import deltackpt

    tmp = tempfile.mkdtemp(prefix="vllm-lora-http-", dir=os.path.dirname(os.path.abspath(out_path)))
    tiny_qwen2(0).save_pretrained(f"{tmp}/base")
    store, meta = f"{tmp}/store", {"peft_config": CFG}
    sd1 = adapter_state(1)
    sd2 = {k: (v.float() * 1.5).bfloat16() for k, v in sd1.items()}  # another version
    for v, sd in (("v1", sd1), ("v2", sd2)):
        deltackpt.save({"model": sd}, store, v, metadata=meta)
        deltackpt.export_peft(store, v, f"{tmp}/dir-{v}")
    port = free_port()
    env = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1", "DELTACKPT_VLLM_LORA_STORE": store}
    lora = ["--enable-lora", "--max-lora-rank", "8", "--max-loras", "2", "--max-cpu-loras", "4"]
    url = f"http://127.0.0.1:{port}"
    proc = serve(f"{tmp}/base", port, f"{tmp}/server.log", args=lora, env=env)
    try:

        def tokens(model: str) -> Any:
            body = {"model": model, "prompt": PROMPTS[0], "max_tokens": 10, "temperature": 0,
                    "return_token_ids": True}  # fmt: skip
            r = requests.post(f"{url}/v1/completions", json=body, timeout=120)
            if not r.ok:
                return {"status": r.status_code}
            return list(r.json()["choices"][0]["token_ids"])

        out: dict[str, Any] = {"base": tokens(f"{tmp}/base")}
        out["store"] = {v: tokens(v) for v in ("v1", "default@v2")}  # resolved from the store
        out["unknown"] = tokens("v9")  # no such snapshot: the resolver answers None
        for v in ("v1", "v2"):
            body = {"lora_name": f"dir-{v}", "lora_path": f"{tmp}/dir-{v}"}
            r = requests.post(f"{url}/v1/load_lora_adapter", json=body, timeout=120)
            r.raise_for_status()
        out["dir"] = {v: tokens(f"dir-{v}") for v in ("v1", "v2")}
        out["models"] = sorted(m["id"] for m in requests.get(f"{url}/v1/models").json()["data"])
    finally:
        stop(proc)
    with open(out_path, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])

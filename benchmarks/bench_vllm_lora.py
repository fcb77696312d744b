"""A new LoRA adapter version into a CPU vLLM engine, side by side in one run: ``add_lora`` from
the store vs an adapter directory per version.

One engine (``enable_lora=True``, the deltackpt worker extension), one base model (a
random-initialised Qwen2 of ``--size`` written with ``transformers``), an adapter of rank
``--rank`` on every linear layer (q, k, v, o, gate, up, down: what RL post-training with LoRA
targets). Every version is new random bytes (a LoRA step moves nearly every adapter element, so
there is nothing to deduplicate). Per version, timed from "the trainer holds the new adapter in
memory" to "every worker holds it" (the adapter is built and cached, no request needed):

* ``checkpoint save``: ``deltackpt.save`` of the adapter state dict with its LoRA config, what
  a LoRA run does anyway to resume (the store path needs nothing else on the trainer side);
* ``peft directory``: what RL frameworks do today (TRL, SkyRL, verl with vLLM 0.32, which loads
  adapters only from a path): peft's files written (``adapter_model.safetensors`` by
  ``safetensors.torch.save_file``, ``adapter_config.json``) into a fresh directory, then
  ``llm.llm_engine.add_lora(LoRARequest(..., dir))``;
* ``export_peft directory``: the same from our store (``export_peft`` then ``add_lora`` of the
  directory);
* ``add_lora from the store``: ``deltackpt.integrations.vllm.lora.add_lora`` (each worker reads
  the snapshot's adapter, checks every chunk, builds it in memory).

Bytes written per version, the greedy tokens of each path's adapter (must be equal), and this
machine's memcpy, xxh3 and write+fsync ceilings, measured in the same run.

    .venv-vllm/bin/python benchmarks/bench_vllm_lora.py                       # 500m, rank 16
    .venv-vllm/bin/python benchmarks/bench_vllm_lora.py --size tiny --rank 8  # quick
    .venv-vllm/bin/python benchmarks/bench_vllm_lora.py --tmp /dev/shm        # no disk

vLLM 0.32's CPU build with LoRA needs the AMX request of ``tests/integrations/_vllm_amx`` on AMX
processors (SIGILL otherwise); this script puts it on the workers' ``PYTHONPATH``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from _harness.limits import measure_limits, median
from _harness.report import fmt_bytes, md_table
from bench_vllm import SIZES, write_model

ROOT = Path(__file__).resolve().parents[1]
MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PROMPT = [1, 2, 3, 4]


def shapes(size: str) -> dict[str, tuple[int, int]]:
    """(out, in) of each targeted linear layer of one decoder layer."""
    c = SIZES[size]
    h, f = c["hidden_size"], c["intermediate_size"]
    kv = h // c["num_attention_heads"] * c["num_key_value_heads"]
    return {"q_proj": (h, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, h),
            "gate_proj": (f, h), "up_proj": (f, h), "down_proj": (h, f)}  # fmt: skip


def adapter(size: str, rank: int, seed: int) -> dict[str, torch.Tensor]:
    """A PEFT model's adapter tensors (``peft_model.state_dict()`` names), small values."""
    g = torch.Generator().manual_seed(seed)
    sd = {}
    for layer in range(SIZES[size]["num_hidden_layers"]):
        for mod, (out, inp) in shapes(size).items():
            group = "self_attn" if mod in MODULES[:4] else "mlp"
            p = f"base_model.model.model.layers.{layer}.{group}.{mod}"
            sd[f"{p}.lora_A.default.weight"] = (
                torch.randn(rank, inp, generator=g) * 0.02
            ).bfloat16()
            sd[f"{p}.lora_B.default.weight"] = (
                torch.randn(out, rank, generator=g) * 0.02
            ).bfloat16()
    return sd


def peft_files(sd: dict[str, torch.Tensor], cfg: dict[str, Any], out: str) -> int:
    """What ``PeftModel.save_pretrained`` writes: the adapter (adapter name removed) and its
    config; the bytes written."""
    from safetensors.torch import save_file

    os.makedirs(out)
    save_file(
        {k.replace(".default.", "."): v for k, v in sd.items()}, f"{out}/adapter_model.safetensors"
    )
    with open(f"{out}/adapter_config.json", "w") as f:
        json.dump(cfg, f)
    return sum(os.path.getsize(f"{out}/{n}") for n in os.listdir(out))


def dir_bytes(path: str) -> int:
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="500m", choices=sorted(SIZES))
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--versions", type=int, default=4, help="timed versions per path (median)")
    ap.add_argument(
        "--tmp",
        default=None,
        help="where the store and the directories go (default: the system temp dir, on disk; "
        "/dev/shm: a colocated trainer's store in memory, shared with the engine's workers)",
    )
    args = ap.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    amx = str(ROOT / "tests" / "integrations" / "_vllm_amx")
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [amx, os.environ.get("PYTHONPATH")]))

    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    import deltackpt
    from deltackpt.integrations.vllm.extension import EXTENSION
    from deltackpt.integrations.vllm.lora import add_lora

    tmp = tempfile.mkdtemp(prefix="deltackpt-bench-vllm-lora-", dir=args.tmp)
    try:
        write_model(args.size, f"{tmp}/base")
        cfg = {"peft_type": "LORA", "r": args.rank, "lora_alpha": 2 * args.rank,
               "target_modules": list(MODULES), "bias": "none", "task_type": "CAUSAL_LM"}  # fmt: skip
        nbytes = sum(
            t.numel() * t.element_size() for t in adapter(args.size, args.rank, 0).values()
        )
        limits = measure_limits(Path(tmp) / "limits", max(nbytes, 64 << 20))
        llm = LLM(
            model=f"{tmp}/base", skip_tokenizer_init=True, enforce_eager=True, dtype="bfloat16",
            max_model_len=256, max_num_seqs=4, enable_lora=True, max_lora_rank=max(args.rank, 8),
            max_loras=2, max_cpu_loras=4, worker_extension_cls=EXTENSION,
        )  # fmt: skip
        sp = SamplingParams(temperature=0, max_tokens=8, detokenize=False)

        def tokens(req: Any) -> list[int]:
            out = llm.generate(
                [{"prompt_token_ids": PROMPT}], sp, lora_request=[req], use_tqdm=False
            )
            return list(out[0].outputs[0].token_ids)

        store = f"{tmp}/store"
        secs: dict[str, list[float]] = {k: [] for k in ("save", "peft", "export", "store")}
        written: dict[str, list[int]] = {k: [] for k in ("save", "peft", "export", "store")}
        same, next_id = [], 1
        for v in range(args.versions + 1):  # version 0 warms every path up, untimed
            sd = adapter(args.size, args.rank, 100 + v)
            before = dir_bytes(store) if os.path.exists(store) else 0
            t0 = time.perf_counter()
            deltackpt.save({"model": sd}, store, f"v{v}", metadata={"peft_config": cfg})
            t_save = time.perf_counter() - t0
            b_save = dir_bytes(store) - before

            t0 = time.perf_counter()
            b_peft = peft_files(sd, cfg, f"{tmp}/peft-v{v}")
            peft_req = LoRARequest(f"peft-v{v}", next_id, f"{tmp}/peft-v{v}")
            llm.llm_engine.add_lora(peft_req)
            t_peft = time.perf_counter() - t0

            t0 = time.perf_counter()
            deltackpt.export_peft(store, f"v{v}", f"{tmp}/export-v{v}")
            exp_req = LoRARequest(f"export-v{v}", next_id + 1, f"{tmp}/export-v{v}")
            llm.llm_engine.add_lora(exp_req)
            t_export = time.perf_counter() - t0
            b_export = dir_bytes(f"{tmp}/export-v{v}")
            next_id += 2

            t0 = time.perf_counter()
            store_req = add_lora(llm, store, f"v{v}")
            t_store = time.perf_counter() - t0

            same.append(tokens(peft_req) == tokens(exp_req) == tokens(store_req))
            if v:
                for k, s, b in (("save", t_save, b_save), ("peft", t_peft, b_peft),
                                ("export", t_export, b_export), ("store", t_store, 0)):  # fmt: skip
                    secs[k].append(s)
                    written[k].append(b)
            del sd
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    def row(what: str, key: str, base: float | None) -> list[Any]:
        s = median(secs[key])
        return [what, f"{s:.3f} [{min(secs[key]):.3f}-{max(secs[key]):.3f}]",
                "" if base is None else f"{s / base:.2f}x",
                fmt_bytes(median(written[key])),
                f"{nbytes / s / 1e9:.2f}"]  # fmt: skip

    peft_s = median(secs["peft"])
    rows = [
        row("checkpoint save (`deltackpt.save`, done to resume anyway)", "save", None),
        row("peft directory + vLLM `add_lora(dir)` (today's RL stacks)", "peft", peft_s),
        row("`export_peft` directory + vLLM `add_lora(dir)`", "export", peft_s),
        row("`add_lora` from the store (no directory)", "store", peft_s),
    ]
    print(f"\n`{' '.join([os.path.relpath(sys.executable), *sys.argv])}`: size {args.size}, "
          f"rank {args.rank}, adapter {fmt_bytes(nbytes)} bf16, {args.versions} versions "
          f"(median [range]), torch threads {torch.get_num_threads()}, {os.cpu_count()} cores; "
          f"the same tokens on every path: {all(same)}\n")  # fmt: skip
    for key in ("memcpy", "xxh3", "write_fsync", "read_warm"):
        if key in limits:
            print(f"- {limits[key]['what']}: {limits[key]['gbps']:.2f} GB/s")
    print()
    header = ["a new adapter version, until every worker holds it", "seconds", "vs peft dir",
              "written per version", "adapter GB/s"]  # fmt: skip
    print(md_table(header, rows))


if __name__ == "__main__":
    main()

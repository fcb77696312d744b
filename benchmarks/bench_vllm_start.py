"""A CPU vLLM engine started from a deltackpt store vs from a Hugging Face directory, side by side.

What a user pays for ``load_format="deltackpt"`` (docs/sync.md, "Starting an engine from the
store"): per model size (a random-initialised Qwen2 written with ``transformers``), the same
weights as a ``save_pretrained`` directory (safetensors) and as a deltackpt snapshot (the
default save), then

* **engine start**: ``LLM(...)`` from the directory (vLLM's default loader), then ``LLM(...)``
  from the store with a config-only directory (``load_format="deltackpt"``), each to its first
  greedy tokens (compared: they must be equal); each engine is shut down before the next;
* **weight load alone**, on the store-started engine, ``--repeats`` times each, alternating:
  ``reload_weights()`` (the store's snapshot through this loader: read, checked chunk by chunk,
  handed to the model's ``load_weights`` in vLLM's layerwise reload) vs
  ``reload_weights(weights_path=dir)`` (vLLM's default loader reading the safetensors file,
  same reload); both from the page cache (warm: the files were just written);
* **the read alone**: ``deltackpt.load`` of the snapshot into fresh host tensors in this
  process (every chunk checked against its xxh3-128), and ``safetensors.torch.load_file`` of
  the file with each tensor copied out of the mapping (no check);
* **host memory**: the growth of this process's peak resident memory during each start (the
  engine core and its one worker run here), against the model's bytes; without ``--follow``
  the store start reads in windows and keeps nothing, with it (``"follow": true``) the whole
  snapshot is loaded and kept for the first follow.

This machine's memcpy and xxh3 ceilings are measured in the same run (bench_vllm.py).

    .venv-vllm/bin/python benchmarks/bench_vllm_start.py --sizes qwen2.5-0.5b
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import tempfile
import time
from typing import Any

import torch
from _harness.limits import median
from _harness.report import fmt_bytes
from bench_vllm import SIZES, greedy, machine_limits, report, spread

HEADER = ["model", "what", "seconds (median [range])", "vs safetensors", "notes"]


def _engine(model_dir: str, store: dict[str, Any] | None) -> tuple[Any, float]:
    from vllm import LLM

    kw: dict[str, Any] = {}
    if store is not None:
        kw.update(load_format="deltackpt", model_loader_extra_config=store)
    t0 = time.perf_counter()
    llm = LLM(
        model=model_dir, skip_tokenizer_init=True, enforce_eager=True, dtype="bfloat16",
        max_model_len=256, max_num_seqs=4, **kw,
    )  # fmt: skip
    return llm, time.perf_counter() - t0


def _status_kb(field: str) -> int:
    """``VmRSS`` or ``VmHWM`` (the peak) of this process, in kB: the engine core and its one
    worker run here (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, one worker)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(f"{field}:"):
                return int(line.split()[1])
    return 0


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:  # Linux: VmHWM starts again from VmRSS
        f.write("5")


def bench_size(size: str, tmp: str, repeats: int, follow: bool) -> list[list[Any]]:
    from safetensors.torch import load_file
    from transformers import Qwen2Config, Qwen2ForCausalLM

    import deltackpt

    cfg = Qwen2Config(max_position_embeddings=256, torch_dtype="bfloat16", **SIZES[size])
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(cfg).to(torch.bfloat16)
    hf, conf = f"{tmp}/hf", f"{tmp}/config-only"
    model.save_pretrained(hf)
    model.config.save_pretrained(conf)
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    nbytes = sum(t.numel() * t.element_size() for t in sd.values())
    deltackpt.save({"model": sd}, f"{tmp}/store", "step-1")
    del model, sd
    gc.collect()
    rows: list[list[Any]] = []

    _reset_peak()
    base = _status_kb("VmRSS")
    llm, t_hf = _engine(hf, None)
    peak_hf = _status_kb("VmHWM") - base
    want = greedy(llm)
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
    store = {"store": f"{tmp}/store", "follow": follow}
    _reset_peak()
    base = _status_kb("VmRSS")
    llm, t_st = _engine(conf, store)
    peak_st = _status_kb("VmHWM") - base
    same = greedy(llm) == want
    rows.append([size, "engine start, HF directory (safetensors)", f"{t_hf:.2f}", "1.00", ""])
    rows.append([size, "engine start, deltackpt store", f"{t_st:.2f}", f"{t_st / t_hf:.2f}",
                 f"same greedy tokens: {same}"])  # fmt: skip
    st_times, hf_times = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        llm.collective_rpc("reload_weights")
        st_times.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        llm.collective_rpc("reload_weights", kwargs={"weights_path": hf})
        hf_times.append(time.perf_counter() - t0)
    same_after = greedy(llm) == want
    rows.append([size, "reload_weights(weights_path=dir): vLLM's loader", spread(hf_times),
                 "1.00", ""])  # fmt: skip
    rows.append([size, "reload_weights(): the store's snapshot", spread(st_times),
                 f"{median(st_times) / median(hf_times):.2f}",
                 f"same greedy tokens: {same_after}"])  # fmt: skip
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
    rd_st, rd_hf = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        got = deltackpt.load(f"{tmp}/store", "step-1")
        rd_st.append(time.perf_counter() - t0)
        del got
        t0 = time.perf_counter()  # load_file maps the file: the copy reads every page
        got = {k: v.clone() for k, v in load_file(f"{hf}/model.safetensors").items()}
        rd_hf.append(time.perf_counter() - t0)
        del got
    rows.append([size, "read alone: safetensors load_file + copy", spread(rd_hf), "1.00",
                 f"{nbytes / median(rd_hf) / 1e9:.2f} GB/s"])  # fmt: skip
    rows.append([size, "read alone: deltackpt.load (checked)", spread(rd_st),
                 f"{median(rd_st) / median(rd_hf):.2f}",
                 f"{nbytes / median(rd_st) / 1e9:.2f} GB/s"])  # fmt: skip
    note = "the copy kept for the first follow" if follow else "read in windows, nothing kept"
    rows.append([size, "peak RSS growth during the start, HF directory", fmt_bytes(peak_hf * 1024),
                 "", f"model {fmt_bytes(nbytes)}"])  # fmt: skip
    rows.append([size, f"peak RSS growth during the start, store ({note})",
                 fmt_bytes(peak_st * 1024), f"{peak_st / peak_hf:.2f}", ""])  # fmt: skip
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--sizes", default="100m,qwen2.5-0.5b", help=f"comma-separated, of {sorted(SIZES)}"
    )
    ap.add_argument(
        "--repeats", type=int, default=3, help="timed reloads and reads (median, range)"
    )
    ap.add_argument("--follow", action="store_true", help='"follow": true on the store start')
    args = ap.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine core here
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # collective_rpc(fn)
    limits = machine_limits()
    rows: list[list[Any]] = []
    for size in args.sizes.split(","):
        tmp = tempfile.mkdtemp(prefix=f"deltackpt-bench-vllm-start-{size}-")
        try:
            rows += bench_size(size, tmp, args.repeats, args.follow)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    report(limits, HEADER, rows)


if __name__ == "__main__":
    main()

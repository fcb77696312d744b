"""Weight updates into a CPU vLLM engine, side by side in one run: deltackpt vs safetensors reload.

Same engine (``LLM(..., weight_transfer_config=WeightTransferConfig(backend="deltackpt"))``),
same model, per model size (a random-initialised Qwen2 written with ``transformers``):

* ``deltackpt full`` / ``deltackpt delta``: ``send_weights`` of the trainer engine, timed as the
  trainer sees it (``start_weight_update`` -> round -> ``finish_weight_update``: pause to
  resume); bytes = the round's payload (``RoundStats.payload_bytes``; gloo over 127.0.0.1).
* ``deltackpt staged delta``: the same delta round with ``send_weights(..., stage=True)``
  (prepared while the engine serves: received, verified and applied to the workers' copies on a
  background thread; the engine is not paused; ``send_weights`` returns once every worker has)
  then ``commit()``, timed as the trainer sees it (its RPCs, the workers' vote, the version
  label, the prefix-cache reset) and inside the worker (its ``finish_weight_update``: the
  **pause**, the model's reload of the changed layers and the vote; issue 38). Beside it the
  reload alone: the worker's ``load_weights`` of the same layers from its copies.
* ``vLLM's own sparse apply``: the same change as vLLM's checkpoint patches
  (``sync.CheckpointPatcher``: int32 indices and values, the tensors that changed too much
  dense), applied in the worker by vLLM's ``load_checkpoint_weight_patches`` (what its
  ``sparse_nccl`` backend runs after the broadcast, the engine paused), timed inside the worker;
  needs linear weights kept (``--linear keep``: vLLM's apply writes parameters in place).
* worker memory: the worker process's peak and current RSS (``/proc/self/status``) at the end,
  against the model's bf16 bytes (the engine's own weights, the receiver's copies, its staging
  arena, and for a round sent whole the rollback's copy until the commit).
* serving while updating (RL step only): greedy tokens per second with no round running, then
  while a trainer thread runs staged delta rounds back to back on the same engine (its
  preparation and commits interleaved with the engine's steps).
* ``safetensors + reload_weights``: what a CPU vLLM user does without it: ``save_file`` of the
  new bf16 weights, then ``llm.collective_rpc("reload_weights", kwargs={"weights_path": d})``
  (vLLM's in-place layerwise reload from disk: ``Worker.reload_weights``); bytes = the file.

Steps: ``rl`` = bf16 copies of fp32 masters before/after one AdamW step at lr 1e-6 after 2
warm-up steps; ``pretrain`` = one AdamW step at lr 5e-6 (``_harness/rl_step.py``, run tensor by
tensor so a 0.5B model's optimizer state never sits in memory at once). Each repeat: a full
round of the "before" weights, a delta round of the "after" ones, then the baseline writes and
reloads the "after" weights; the greedy tokens of both paths are compared. The first round of
an engine (schedule setup) is reported on its own; the rows give the median and the range of
``--repeats`` runs. This machine's memcpy, xxh3 and disk-write ceilings are measured in the
same run.

    .venv-vllm/bin/python benchmarks/bench_vllm.py                 # tiny, ~100M and ~0.5B
    .venv-vllm/bin/python benchmarks/bench_vllm.py --sizes tiny    # quick
    .venv-vllm/bin/python benchmarks/bench_vllm.py --links gloo    # the cross-host link

``--tp-memory`` measures host memory per worker of a ``tensor_parallel_size=2`` engine (one
core bound per worker), once with every tensor received whole, once with ``tp_boxes`` (each
worker receives and holds only its tensor-parallel boxes), and twice with ``tp_boxes`` and
``staging="ring"`` with 16 MiB buckets (two message slots instead of a round's arena), the
rollback's old bytes kept in memory and in the undo file (the workers' default): the
receiver's bytes (``memory()``: held copies, staging arena, the model, the worker's share) and
each worker's RSS above the engine before its first round, at the peak and the end of each
step (the peak reset before it): a first full round, a second full round (its rollback copy
lives until the commit), a delta round and a staged delta with its ``commit()``; each step's
time as the trainer sees it, and the staged commit's pause inside the workers::

    .venv-vllm/bin/python benchmarks/bench_vllm.py --tp-memory --sizes 100m
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import socket
import sys
import tempfile
import time
from typing import Any

import torch
from _harness.limits import median, timed
from _harness.report import fmt_bytes, md_table
from _harness.rl_step import PRETRAIN_LR, changed_fraction, rl_like_versions

SIZES: dict[str, dict[str, int]] = {
    "tiny": dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                 num_attention_heads=2, num_key_value_heads=1),
    "100m": dict(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=8,
                 num_attention_heads=12, num_key_value_heads=4),
    "300m": dict(vocab_size=32000, hidden_size=1024, intermediate_size=3072, num_hidden_layers=16,
                 num_attention_heads=16, num_key_value_heads=4),
    # Qwen2.5-0.5B's shapes (its vocabulary: 27% of its parameters are the embedding)
    "qwen2.5-0.5b": dict(vocab_size=151936, hidden_size=896, intermediate_size=4864,
                         num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2),
    "500m": dict(vocab_size=32000, hidden_size=1024, intermediate_size=4864, num_hidden_layers=24,
                 num_attention_heads=16, num_key_value_heads=4),
}  # fmt: skip
PROMPTS = [[1, 2, 3, 4], [17, 300, 5], [400, 9, 9, 2, 77]]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


TIED = "lm_head.weight"  # with --tied: the embedding's tensor under a second name


def write_model(size: str, path: str, tied: bool = False) -> dict[str, tuple[int, ...]]:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(
        max_position_embeddings=256, tie_word_embeddings=tied, torch_dtype="bfloat16",
        **SIZES[size],
    )  # fmt: skip
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(path)
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def greedy(llm: Any) -> list[list[int]]:
    from vllm import SamplingParams

    sp = SamplingParams(temperature=0, max_tokens=8, detokenize=False)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], sp, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def reload_from_safetensors(llm: Any, sd: dict[str, torch.Tensor], tmp: str) -> tuple[float, int]:
    """The baseline: write the weights, reload them in the engine. (seconds, file bytes)"""
    from safetensors.torch import save_file

    d = tempfile.mkdtemp(dir=tmp)
    t0 = time.perf_counter()
    if TIED in sd and sd[TIED] is sd["model.embed_tokens.weight"]:  # as save_pretrained does
        sd = {k: v for k, v in sd.items() if k != TIED}
    save_file(sd, f"{d}/model.safetensors")
    llm.collective_rpc("reload_weights", kwargs={"weights_path": d})
    dt = time.perf_counter() - t0
    size = os.path.getsize(f"{d}/model.safetensors")
    shutil.rmtree(d)
    return dt, size


def versions(
    shapes: dict[str, tuple[int, ...]], lr: float, warmup: int, tied: bool = False
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], float]:
    """(before, after, changed fraction): the AdamW recipe tensor by tensor (bounded memory)."""
    before, after, changed, total = {}, {}, 0.0, 0
    for i, (name, shape) in enumerate(shapes.items()):
        if tied and name == TIED:
            continue
        (v0,), (v1,) = rl_like_versions([shape], lr=lr, warmup=warmup, seed=1 + i)
        before[name], after[name] = v0, v1
        changed += changed_fraction([v0], [v1]) * v0.numel()
        total += v0.numel()
    if tied:  # a trainer's state dict of a tied model: one tensor under both names
        before[TIED], after[TIED] = (
            before["model.embed_tokens.weight"],
            after["model.embed_tokens.weight"],
        )
    return before, after, changed / total


def force_linear_layout(mode: str) -> None:
    """Force how vLLM's CPU build keeps linear weights in this process and the engine's (the
    test suite's shim, ``tests/integrations/_vllm_linear/sitecustomize.py``: it patches
    ``dispatch_cpu_unquantized_gemm`` when vLLM imports it)."""
    import importlib.util

    folder = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests",
                          "integrations", "_vllm_linear")  # fmt: skip
    folder = os.path.normpath(folder)
    os.environ["DELTACKPT_TEST_VLLM_LINEAR"] = mode
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [folder, os.environ.get("PYTHONPATH")]))
    spec = importlib.util.spec_from_file_location("_vllm_linear", f"{folder}/sitecustomize.py")
    assert spec is not None and spec.loader is not None
    spec.loader.exec_module(importlib.util.module_from_spec(spec))


def serve_while_updating(
    llm: Any,
    eng: Any,
    before: dict[str, torch.Tensor],
    after: dict[str, torch.Tensor],
    version: int,
    rounds: int = 6,
    idle_s: float = 4.0,
) -> tuple[int, list[tuple[str, str, str]]]:
    """Tokens per second of greedy generation (8 prompts, 16 new tokens per call) with no round
    running, then while a trainer thread runs ``rounds`` staged delta rounds back to back (the
    same engine; vLLM interleaves the RPCs with its steps): the serving cost of updating,
    preparation and pauses included. Rows: (what, value, ratio)."""
    import threading

    from vllm import SamplingParams

    sp = SamplingParams(temperature=0, max_tokens=16, detokenize=False, ignore_eos=True)
    prompts = [{"prompt_token_ids": [3 + i, 17, 300, 5]} for i in range(8)]

    def generate() -> int:
        with eng.client.lock:  # vllm.LLM is not thread-safe: the trainer's calls take it too
            outs = llm.generate(prompts, sp, use_tqdm=False)
        return sum(len(o.outputs[0].token_ids) for o in outs)

    generate()  # warm
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < idle_s:
        n += generate()
    idle = n / (time.perf_counter() - t0)
    version += 1
    eng.send_weights(before, version=version, full=True)
    spans: dict[str, float] = {"prepare": 0.0, "commit": 0.0}
    errors: list[BaseException] = []
    done = threading.Event()

    def trainer(v: int) -> None:
        try:
            for k in range(rounds):
                t = time.perf_counter()
                eng.send_weights(after if k % 2 == 0 else before, version=v + k, stage=True)
                spans["prepare"] += time.perf_counter() - t
                t = time.perf_counter()
                eng.commit()
                spans["commit"] += time.perf_counter() - t
        except BaseException as e:  # reported below
            errors.append(e)
        finally:
            done.set()

    th = threading.Thread(target=trainer, args=(version + 1,), name="bench-trainer")
    n, t0 = 0, time.perf_counter()
    th.start()
    while not done.is_set():
        n += generate()
    busy = n / (time.perf_counter() - t0)
    th.join()
    if errors:
        raise errors[0]
    version += rounds
    total = spans["prepare"] + spans["commit"]
    return version, [
        ("generation, no round running (tokens/s)", f"{idle:.0f}", ""),
        (f"generation while {rounds} staged delta rounds run back to back (tokens/s)",
         f"{busy:.0f}", f"{busy / idle:.2f} of idle; preparation {spans['prepare'] / total:.0%}, "
         f"commits {spans['commit'] / total:.0%} of the rounds' time"),
    ]  # fmt: skip


def machine_limits(nbytes: int = 512 << 20, reps: int = 3) -> list[str]:
    """The ceilings a round runs against, measured now: memcpy and xxh3-128 (what a round
    does to every byte it sends and checks). Not the disk: the baseline's file stays in the
    page cache on one host, and dropping caches would disturb the other users of the box."""
    import xxhash

    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.zeros(nbytes, dtype=torch.uint8)
    cp = median([timed(lambda: dst.copy_(src))[0] for _ in range(reps)])
    arr = src.numpy()
    xx = median([timed(lambda: xxhash.xxh3_128_hexdigest(arr))[0] for _ in range(reps)])
    return [
        f"memcpy {nbytes / cp / 1e9:.2f} GB/s (torch copy_, {torch.get_num_threads()} threads)",
        f"xxh3-128 {nbytes / xx / 1e9:.2f} GB/s (one thread)",
    ]


def spread(xs: list[float]) -> str:
    return f"{median(xs):.3f} [{min(xs):.3f}-{max(xs):.3f}]"


def bench_size(
    size: str, tmp: str, repeats: int, links: str = "auto", tied: bool = False
) -> list[list[Any]]:
    from vllm import LLM
    from vllm.config import WeightTransferConfig
    from vllm.distributed.weight_transfer import WeightTransferTrainerFactory

    from deltackpt.integrations.vllm.trainer import DeltackptTrainerInitInfo, LocalLLMClient

    shapes = write_model(size, f"{tmp}/start", tied)
    nparams = sum(torch.Size(s).numel() for n, s in shapes.items() if not (tied and n == TIED))
    llm = LLM(
        model=f"{tmp}/start", skip_tokenizer_init=True, enforce_eager=True, dtype="bfloat16",
        max_model_len=256, max_num_seqs=4,
        weight_transfer_config=WeightTransferConfig(backend="deltackpt"),
    )  # fmt: skip
    info = DeltackptTrainerInitInfo(rank=0, master_port=free_port(), dtype="bfloat16", links=links)
    eng = WeightTransferTrainerFactory.trainer_init(info, client=LocalLLMClient(llm))
    label = f"{size} ({nparams / 1e6:.3g}M params, {fmt_bytes(2 * nparams)} bf16)"
    label += ", tied embeddings" if tied else ""
    chosen = eng.group.links  # links="auto": what the group took (link_choice.py)
    label += f", {chosen} links" + (" (auto)" if links == "auto" else "")
    mem0 = llm.collective_rpc(_rss)[0]  # the engine with its model, before any round
    rows: list[list[Any]] = []
    version = 0
    for step, lr, warmup in (("rl", 1e-6, 2), ("pretrain", PRETRAIN_LR, 0)):
        before, after, frac = versions(shapes, lr, warmup, tied)
        changed = f"{100 * frac:.1f}%"
        if version == 0:  # the engine's first round builds the schedule: on its own
            version += 1
            t0 = time.perf_counter()
            st = eng.send_weights(before, version=version, full=True)
            rows.append([label, step, changed, "deltackpt full, first round (setup)",
                         f"{time.perf_counter() - t0:.3f}", fmt_bytes(st.payload_bytes), ""])  # fmt: skip
        secs: dict[str, list[float]] = {
            "full": [], "delta": [], "base": [], "prepare": [], "commit": [], "inside": [],
            "inside_reload": [], "reload": [], "vllm_sparse": [],
        }  # fmt: skip
        # the same change as vLLM's own sparse format (sync.CheckpointPatcher), for its apply
        packed, patch_bytes = checkpoint_patches(before, after)
        sparse_error = ""
        paths: set[str] = set()
        sent: dict[str, int] = {}
        same = True
        for _ in range(repeats):
            for tag, sd, full in (("full", before, True), ("delta", after, False)):
                version += 1
                t0 = time.perf_counter()
                st = eng.send_weights(sd, version=version, full=full)
                secs[tag].append(time.perf_counter() - t0)
                assert st.full == full, (tag, st.full)
                sent[tag] = st.payload_bytes
            tokens = greedy(llm)
            version += 1  # back to "before", then the same delta staged: prepare, commit
            eng.send_weights(before, version=version, full=True)
            version += 1
            t0 = time.perf_counter()
            st = eng.send_weights(after, version=version, stage=True)
            secs["prepare"].append(time.perf_counter() - t0)
            sent["prepare"] = st.payload_bytes
            t0 = time.perf_counter()
            eng.commit()
            secs["commit"].append(time.perf_counter() - t0)
            secs["inside"].append(llm.collective_rpc(_commit_inside)[0])
            paths.add(llm.collective_rpc(_last_path)[0])
            secs["reload"].append(llm.collective_rpc(_reload_alone)[0])
            same = same and greedy(llm) == tokens
            # the same staged delta with in-place commits off: the model's reload in the pause
            llm.collective_rpc(_set_inplace, args=(False,))
            version += 1
            eng.send_weights(before, version=version, full=True)
            version += 1
            eng.send_weights(after, version=version, stage=True)
            eng.commit()
            secs["inside_reload"].append(llm.collective_rpc(_commit_inside)[0])
            llm.collective_rpc(_set_inplace, args=(True,))
            same = same and greedy(llm) == tokens
            # vLLM's own apply of the same change as checkpoint patches (what its sparse_nccl
            # backend runs on each worker after the broadcast): the engine's pause
            version += 1
            eng.send_weights(before, version=version, full=True)
            try:
                secs["vllm_sparse"].append(
                    llm.collective_rpc(_vllm_sparse_apply, args=(packed,))[0]
                )
                same = same and greedy(llm) == tokens
            except Exception as e:  # a repacked layout: vLLM's sparse apply needs it kept
                sparse_error = f"{type(e).__name__}: {str(e)[:80]}"
            dt, nbytes = reload_from_safetensors(llm, after, tmp)
            secs["base"].append(dt)
            sent["base"] = nbytes
            same = same and greedy(llm) == tokens
        base = median(secs["base"])
        for tag, what in (("full", "deltackpt full"), ("delta", "deltackpt delta"),
                          ("base", f"safetensors + reload_weights ({'same tokens' if same else 'TOKENS DIFFER'})")):  # fmt: skip
            ratio = "" if tag == "base" else (
                f"{base / median(secs[tag]):.2f}x time, {sent['base'] / max(sent[tag], 1):.1f}x bytes"
            )  # fmt: skip
            rows.append(
                [label, step, changed, what, spread(secs[tag]), fmt_bytes(sent[tag]), ratio]
            )
        one_call = median(secs["delta"])
        for tag, what in (
            ("prepare", "deltackpt staged delta: prepare (engine serving)"),
            ("commit", "deltackpt staged delta: commit() as the trainer sees it"),
            (
                "inside",
                f"the commit inside the worker: the engine's pause ({'/'.join(sorted(paths))})",
            ),
            ("inside_reload", "the same pause with in-place commits off (inplace=False: reload)"),
            ("reload", "the workers' reload of the changed layers alone"),
            (
                "vllm_sparse",
                "vLLM's own sparse apply of the same change (CheckpointPatcher's "
                "patches, load_checkpoint_weight_patches): its pause",
            ),
        ):
            if not secs[tag]:
                rows.append([label, step, changed, what, "-", "", sparse_error or "not run"])
                continue
            ratio = f"{median(secs[tag]) / one_call:.2f} of the one-call delta"
            if tag == "vllm_sparse":
                ratio += f", {median(secs[tag]) / median(secs['inside']):.2f}x deltackpt's pause"
            nbytes = {"prepare": fmt_bytes(sent["prepare"]), "vllm_sparse": fmt_bytes(patch_bytes)}
            rows.append([label, step, changed, what, spread(secs[tag]), nbytes.get(tag, ""), ratio])
        print(md_table(HEADER, rows[-9:]), flush=True)
        if step == "rl":  # generation while staged rounds are prepared and committed
            version, serving = serve_while_updating(llm, eng, before, after, version)
            rows += [
                [label, step, changed, what, secs_, "", ratio] for what, secs_, ratio in serving
            ]
            print(md_table(HEADER, rows[-len(serving) :]), flush=True)
        del before, after
        gc.collect()
    mem = llm.collective_rpc(_rss)[0]
    model_bytes = 2 * nparams
    extra, held = mem["VmHWM"] - mem0["VmRSS"], mem["VmRSS"] - mem0["VmRSS"]
    rows.append([label, "-", "-", "worker memory above the engine before its first round: "
                 f"peak / at the end (model {fmt_bytes(model_bytes)} bf16)", "-",
                 f"{fmt_bytes(extra)} / {fmt_bytes(held)}",
                 f"{extra / model_bytes:.2f}x / {held / model_bytes:.2f}x the model"])  # fmt: skip
    eng.shutdown()  # the workers release their side of the link too (docs/sync.md)
    gone = llm.collective_rpc(_rss)[0]["VmRSS"] - mem0["VmRSS"]
    rows.append([label, "-", "-", "worker memory above the engine after the trainer's "
                 "shutdown()", "-", fmt_bytes(gone), f"{gone / model_bytes:.2f}x the model"])  # fmt: skip
    print(md_table(HEADER, rows[-2:]), flush=True)
    del llm
    gc.collect()
    return rows


def bench_tp_memory(size: str, tmp: str, links: str = "auto") -> list[list[Any]]:
    """Host memory per worker of a TP=2 engine, without and with ``tp_boxes`` (module doc)."""
    from vllm import LLM
    from vllm.config import WeightTransferConfig
    from vllm.distributed.weight_transfer import WeightTransferTrainerFactory

    from deltackpt.integrations.vllm.trainer import DeltackptTrainerInitInfo, LocalLLMClient

    shapes = write_model(size, f"{tmp}/start")
    nparams = sum(torch.Size(s).numel() for s in shapes.values())
    model_bytes = 2 * nparams
    label = f"{size} ({nparams / 1e6:.3g}M params, {fmt_bytes(model_bytes)} bf16), TP=2"
    before, after, _ = versions(shapes, 1e-6, 2)
    rows: list[list[Any]] = []
    # ring: the old bytes of a round sent whole go to a file in the temporary directory (the
    # workers' default), or stay in memory
    for boxes, staging, bucket, undo in ((False, "round", 64 << 20, None),
                                         (True, "round", 64 << 20, None),
                                         (True, "ring", 16 << 20, "memory"),
                                         (True, "ring", 16 << 20, None)):  # fmt: skip
        llm = LLM(
            model=f"{tmp}/start", skip_tokenizer_init=True, enforce_eager=True,
            dtype="bfloat16", max_model_len=256, max_num_seqs=4, tensor_parallel_size=2,
            weight_transfer_config=WeightTransferConfig(backend="deltackpt"),
        )  # fmt: skip
        info = DeltackptTrainerInitInfo(
            rank=0,
            master_port=free_port(),
            dtype="bfloat16",
            num_workers=2,
            tp_boxes=boxes,
            staging=staging,
            bucket_bytes=bucket,
            undo_dir=undo,
            links=links,
        )
        eng = WeightTransferTrainerFactory.trainer_init(info, client=LocalLLMClient(llm))
        mem0 = llm.collective_rpc(_rss, kwargs={"reset": True})
        steps: list[str] = []
        peak = [0] * len(mem0)  # the highest RSS any step reached, above the engine
        for step, sd, kw in (
            ("full", before, {}), ("full again", before, {"full": True}), ("delta", after, {}),
            ("staged", before, {"stage": True}),
        ):  # fmt: skip
            llm.collective_rpc(_rss, kwargs={"reset": True})  # this step's peak from here
            t0 = time.perf_counter()
            eng.send_weights(sd, version=len(steps) + 1, **kw)
            took = f"{time.perf_counter() - t0:.2f}s"
            if kw.get("stage"):  # prepared while serving, then the commit (the pause inside)
                eng.commit()
                took += f" + pause {max(llm.collective_rpc(_commit_inside)):.3f}s"
            now = llm.collective_rpc(_rss)
            ends = "/".join(
                f"{(m['VmHWM'] - z['VmRSS']) / 1e6:.0f}>{(m['VmRSS'] - z['VmRSS']) / 1e6:.0f}"
                for m, z in zip(now, mem0, strict=True)
            )
            peak = [
                max(p, m["VmHWM"] - z["VmRSS"]) for p, m, z in zip(peak, now, mem0, strict=True)
            ]
            steps.append(f"{step} {ends} ({took})")
        print(f"{size} tp_boxes={boxes} staging={staging} undo_dir={undo}: MB above the engine "
              "per worker, peak>end of each step (its time): " + ", ".join(steps))  # fmt: skip
        mem = llm.collective_rpc(_rss)
        rec = llm.collective_rpc(_receiver_bytes)
        what = "tp_boxes: its boxes" if boxes else "every tensor whole"
        if staging == "ring":
            kept = "in memory" if undo == "memory" else "in a file"
            what += f", ring staging, {bucket >> 20} MiB buckets, undo {kept}"
        for w, (m0, m, r, top) in enumerate(zip(mem0, mem, rec, peak, strict=True)):
            end = m["VmRSS"] - m0["VmRSS"]
            rows.append([
                label, what, w, f"{fmt_bytes(r['held'])} ({r['held'] / model_bytes:.2f}x)",
                fmt_bytes(r["staging"]),
                f"{fmt_bytes(top)} / {fmt_bytes(end)}",
                f"{top / model_bytes:.2f}x / {end / model_bytes:.2f}x",
            ])  # fmt: skip
        print(md_table(TP_HEADER, rows[-2:]), flush=True)
        eng.shutdown()
        del llm, eng
        gc.collect()
    return rows


def _receiver_bytes(worker: Any) -> dict[str, Any]:
    return dict(worker.weight_transfer_engine.memory())


TP_HEADER = ["model", "worker receives", "worker", "held copies (x model)", "staging arena",
             "RSS above the engine: peak / end", "x model bf16"]  # fmt: skip


def _rss(worker: Any, reset: bool = False) -> dict[str, int]:
    """The worker process's resident memory now and at its peak (bytes, /proc/self/status);
    ``reset``: start the peak over from now (``/proc/self/clear_refs``)."""
    if reset:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmRSS:", "VmHWM:")):
                out[line.split(":")[0]] = int(line.split()[1]) * 1024
    return out


def checkpoint_patches(
    before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]
) -> tuple[bytes, int]:
    """``after`` as vLLM's checkpoint patches against ``before`` (``sync.CheckpointPatcher``,
    seeded with ``before``): the pickled (dense, sparse) lists and their bytes on the wire."""
    import io

    from deltackpt.sync import CheckpointPatcher

    patcher = CheckpointPatcher(dtype=torch.bfloat16)
    patcher.seed(before)
    rnd = patcher.diff(after)
    buf = io.BytesIO()
    torch.save((rnd.dense, rnd.sparse), buf)
    return buf.getvalue(), rnd.nbytes


def _vllm_sparse_apply(worker: Any, raw: bytes) -> float:
    """Seconds of vLLM's ``load_checkpoint_weight_patches`` of the pickled (dense, sparse)
    patches in this worker, dense first (vLLM takes one kind per call): what its sparse_nccl
    backend runs after the broadcast, in the engine's pause."""
    import io

    from vllm.model_executor.model_loader.checkpoint_weight_patch import (
        load_checkpoint_weight_patches,
    )

    dense, sparse = torch.load(io.BytesIO(raw), weights_only=False)
    model = worker.model_runner.get_model()
    t0 = time.perf_counter()
    for kind in (dense, sparse):
        if kind:
            load_checkpoint_weight_patches(model, kind)
    return time.perf_counter() - t0


def _commit_inside(worker: Any) -> float:
    """Seconds the worker's last commit took (its finish_weight_update: reload and vote)."""
    return float(worker.weight_transfer_engine.last_commit["seconds"])


def _last_path(worker: Any) -> str:
    """How the worker's last commit reached the model: "in place" or "reload"."""
    return str(worker.weight_transfer_engine.last_path)


def _set_inplace(worker: Any, on: bool) -> None:
    worker.weight_transfer_engine.inplace = on


def _reload_alone(worker: Any) -> float:
    """Seconds of the worker's reload of every layer from its copies (run on the worker)."""
    from deltackpt.integrations.vllm.worker import reload_layers

    eng = worker.weight_transfer_engine
    model = worker.model_runner.get_model()
    t0 = time.perf_counter()
    held = list(eng._held.items())
    reload_layers(model, eng.model_config, eng._held, held, expand=eng._expand)
    return time.perf_counter() - t0


HEADER = ["model", "step", "bf16 elements changed", "update",
          "seconds, median [range] (pause to resume)", "bytes", "baseline / this"]  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--sizes", default="tiny,100m,500m", help=f"comma-separated, of {sorted(SIZES)}"
    )
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per row (median, range)")
    ap.add_argument(
        "--tied",
        default="no",
        help="no, yes or no,yes: models that tie their word embeddings (as Qwen2.5-0.5B does; "
        "the trainer's state has the embedding under lm_head.weight too, which the engine "
        "ignores), each size once per choice",
    )
    ap.add_argument(
        "--tp-memory",
        action="store_true",
        help="only host memory per worker at TP=2, every tensor whole vs tp_boxes (module doc)",
    )
    ap.add_argument(
        "--linear",
        choices=["auto", "keep", "repack"],
        default="auto",
        help="how vLLM's CPU build keeps linear weights: as this processor has it (auto), or "
        "forced: keep = F.linear on the parameter (AVX2, and what a GPU does), repack = a "
        "kernel's private copy (module doc)",
    )
    ap.add_argument(
        "--links",
        choices=["auto", "gloo", "shm", "ipc"],
        default="auto",
        help="the rounds' links (DeltackptTrainerInitInfo(links=)): auto, the default (ipc "
        "where the workers share this host's memory, else gloo), or one by name",
    )
    args = ap.parse_args()
    ties = [{"no": False, "yes": True}[t] for t in args.tied.split(",")]
    if any(ties) and args.tp_memory:
        ap.error("--tied is for the rounds' rows, not --tp-memory")
    if args.linear != "auto":
        force_linear_layout(args.linear)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # collective_rpc(fn)
    if args.tp_memory:
        cores = sorted(os.sched_getaffinity(0))[:2]
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"{cores[0]}|{cores[-1]}")
        tp_rows: list[list[Any]] = []
        for size in args.sizes.split(","):
            tmp = tempfile.mkdtemp(prefix=f"deltackpt-bench-vllm-tp-{size}-")
            try:
                tp_rows += bench_tp_memory(size, tmp, args.links)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
        print(f"\n`{' '.join([os.path.relpath(sys.executable), *sys.argv])}`\n")
        print(md_table(TP_HEADER, tp_rows))
        return
    limits = machine_limits()
    rows: list[list[Any]] = []
    for size in args.sizes.split(","):
        for tied in ties:
            tmp = tempfile.mkdtemp(prefix=f"deltackpt-bench-vllm-{size}-")
            try:
                rows += bench_size(size, tmp, args.repeats, args.links, tied)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
    report(limits, HEADER, rows, f", {args.repeats} repeats")


def report(limits: list[str], header: list[str], rows: list[list[Any]], more: str = "") -> None:
    """The command line, the machine, its limits measured in the run, and the table."""
    print()
    print(f"`{' '.join([os.path.relpath(sys.executable), *sys.argv])}`, torch threads "
          f"{torch.get_num_threads()}, {os.cpu_count()} cores{more}\n")  # fmt: skip
    for line in limits:
        print(f"- {line}")
    print()
    print(md_table(header, rows))


if __name__ == "__main__":
    main()

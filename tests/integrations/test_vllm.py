"""The ``deltackpt`` vLLM weight-transfer backend against a real CPU vLLM engine.

vLLM is not in the project's test environment (it pins its own transformers, setuptools, ...):
the engine runs in ``.venv-vllm`` (made by ``.ci/vllm-env``), in a subprocess that runs
``_vllm_run.py`` and reports what it saw as JSON. Skipped when that environment is absent.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.integrations._vllm_env import MARKS, run_script

pytestmark = MARKS


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return run_script(tmp_path_factory, "_vllm_run.py")


def rounds(run: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {r["tag"]: r for r in run["rounds"]}


def test_every_round_commits_the_trainers_bits(run):
    for r in run["rounds"]:
        assert r["committed_identical"], r["tag"]
        assert r["readable_identical"], r["tag"]  # embeddings, norms, fused qkv bias, lm_head
        assert r["engine_version"] == str(r["version"]), r["tag"]


def test_first_round_is_full_then_element_sparse_patches(run):
    rs = rounds(run)
    assert rs["full"]["full"] and rs["full"]["worker"]["patched"] == 0
    for tag in ("delta", "delta2", "delta3", "replaced_delta", "after_refusal"):
        assert not rs[tag]["full"]
        assert rs[tag]["worker"]["patched"] > 0
        assert rs[tag]["sent"] < rs["full"]["sent"] / 10  # 2% of the elements changed


def test_a_tampered_worker_fails_closed_and_the_next_round_heals_it(run):
    t = run["tampered"]
    assert t["raised"] == "RoundAbortedError"
    assert t["engine_version"] == "3" and t["worker_version"] == 3
    assert t["tokens_unchanged"]
    heal = rounds(run)["heal"]
    assert heal["full"] and heal["committed_identical"]


def test_greedy_tokens_equal_a_fresh_engine_on_the_same_weights(run):
    assert run["tokens"] == run["fresh_tokens"]
    assert run["readable_same_as_fresh"]


def test_a_trainer_killed_mid_round_leaves_the_previous_version(run):
    k = run["killed"]
    assert k["exitcode"] == 17  # died in Packer.message, 2nd bucket of its second round
    assert k["calls"][-2:] == ["start_weight_update", "update_weights"]
    failed = k["failed"]
    assert failed["call"] == "update_weights"
    # vLLM hands the driver a plain Exception with the worker's message, which names the type
    assert "deltackpt PeerLostError" in failed["message"]
    assert failed["seconds"] < 10  # the group timeout is 60 s
    assert k["engine_version"] == "7" and k["worker_version"] == 7
    assert k["tokens_moved"] and k["tokens_unchanged"]  # still the tokens of version 7


def test_a_replacement_trainer_reconnects_and_a_full_round_heals(run):
    rs = rounds(run)
    assert rs["replaced"]["full"] and rs["replaced"]["committed_identical"]
    assert rs["replaced"]["engine_version"] == "8"
    assert not rs["replaced_delta"]["full"] and rs["replaced_delta"]["committed_identical"]


def test_a_trainer_refusing_its_tensors_fails_fast_and_leaves_the_engine(run):
    r = run["refused"]
    assert r["raised"] == "PlanError"
    assert r["seconds"] < 5 and r["engine_version"] == "9"
    assert rounds(run)["after_refusal"]["committed_identical"]

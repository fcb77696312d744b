"""Refit through the store into a real CPU vLLM engine: the trainer publishes versions to a
store, the engine's workers pull them (``deltackpt_follow`` of the worker extension),
incrementally after the first, fail closed on a held copy changed behind their back. The engine
runs ``_vllm_store.py`` in ``.venv-vllm``; skipped when that environment is absent."""

from __future__ import annotations

from typing import Any

import pytest

from tests.integrations._vllm_env import MARKS, run_script

pytestmark = MARKS


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return run_script(tmp_path_factory, "_vllm_store.py")


def pulls(run: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {p["tag"]: p for p in run["pulls"]}


def test_first_pull_is_full_then_incremental_and_bit_exact(run):
    p = pulls(run)
    assert p["v0"]["mode"] == "full" and p["v0"]["identical"] and p["v0"]["version"] == "v0"
    for tag in ("v1", "v2", "v3", "v5"):
        assert p[tag]["mode"] == "incremental", p[tag]
        assert p[tag]["identical"] and p[tag]["version"] == tag
        assert 0 < p[tag]["bytes_read"] < run["full_bytes"] / 4  # 2% of elements changed


def test_nothing_new_is_a_no_op(run):
    p = pulls(run)["nothing new"]
    assert p["mode"] is None and p["version"] == "v3" and p["bytes_read"] == 0


def test_a_held_copy_changed_behind_its_back_is_reloaded_whole(run):
    p = pulls(run)["tampered"]
    assert p["mode"] == "full" and "does not match" in p["reason"], p
    assert p["identical"] and p["version"] == "v4"


def test_the_model_holds_the_trainers_weights(run):
    assert run["readable_identical"]


def test_a_staged_follow_serves_the_old_version_until_its_commit(run):
    p = pulls(run)["v6 staged"]
    assert p["staged"] and p["served_v5_while_staged"]
    assert p["mode"] == "incremental" and p["version"] == "v6" and p["identical"], p
    assert p["moved"] and p["seconds"] > 0  # the commit loaded the new weights

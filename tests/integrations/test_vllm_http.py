"""The ``deltackpt`` backend behind vLLM's HTTP routes: a real CPU vLLM OpenAI server
(``--weight-transfer-config '{"backend": "deltackpt"}'``) on loopback, driven by vLLM's own
``HTTPVLLMWeightSyncClient`` and the deltackpt trainer engine.

One server start for the module (~20 s here): ``_vllm_http.py`` runs in ``.venv-vllm`` and
reports what it saw as JSON. Skipped when that environment is absent (``.ci/vllm-env``).
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.integrations._vllm_env import MARKS, run_script

pytestmark = MARKS


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return run_script(tmp_path_factory, "_vllm_http.py")


def rounds(run: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {r["tag"]: r for r in run["rounds"]}


def test_rounds_over_http_commit_the_trainers_bits_and_version(run):
    for r in run["rounds"]:
        assert r["identical"], r["tag"]  # digests read back through /collective_rpc
        assert r["engine_version"] == str(r["worker_version"]), r["tag"]  # /weight_info
    rs = rounds(run)
    tags = ["full", "delta", "replaced", "replaced_delta", "refull"]
    assert [r["tag"] for r in run["rounds"]] == tags
    assert [rs[t]["engine_version"] for t in rs] == ["1", "2", "5", "6", "7"]


def test_delta_rounds_over_http_are_element_sparse(run):
    rs = rounds(run)
    assert rs["full"]["full"] and rs["replaced"]["full"]
    for tag in ("delta", "replaced_delta"):
        assert not rs[tag]["full"]
        assert rs[tag]["sent"] < rs["full"]["sent"] / 10  # 2% of the elements changed


def test_completions_after_delta_rounds_equal_those_after_a_full_round(run):
    # /v1/completions with prompt token ids, after two delta rounds and after the same weights
    # sent whole (every tensor through load_weights, as a fresh engine loads them); that a fresh
    # engine on the trainer's weights gives these tokens is tests/integrations/test_vllm.py's
    r = {x["tag"]: x for x in run["rounds"]}["refull"]
    assert r["full"] and r["identical"] and r["engine_version"] == "7"
    assert run["tokens"] == run["full_tokens"]


def test_a_refused_round_leaves_the_served_version(run):
    r = run["refused"]
    assert r["raised"] == "PlanError"
    assert r["engine_version"] == "2" and r["tokens_unchanged"]


def test_a_trainer_killed_mid_round_over_http_leaves_the_served_version(run):
    k = run["killed"]
    assert k["exitcode"] == 17  # died packing the 2nd bucket of round 4
    assert k["engine_version"] == "3" and k["worker_version"] == 3
    assert k["identical_to_v3"]  # the workers hold exactly what the dead trainer committed
    assert k["tokens_moved"] and k["tokens_unchanged"]


def test_vllms_module_source_feeds_the_trainer_engine(run):
    rs = rounds(run)  # send_weights() without tensors: vLLM's ModuleSource over the trainer
    assert rs["replaced"]["identical"] and rs["replaced_delta"]["identical"]


def test_two_trainer_ranks_push_their_dtensor_shards_without_a_gather(run):
    ranks = run["ranks"]
    assert ranks["exitcodes"] == [0, 0]
    r0, r1 = ranks["rank0"], ranks["rank1"]
    assert r0["shards"] and r1["shards"]  # ModuleSource's tensors stay DTensor shards
    assert r0["dtensor_source"] and r1["dtensor_source"]  # so do DTensorModuleSource's
    tags = [r["tag"] for r in r0["rounds"]]
    assert tags == ["full", "delta", "after_refusal"]
    for r in r0["rounds"]:
        assert r["identical"], r["tag"]  # the engine holds the gathered (full_tensor) bits
        assert r["engine_version"] == str(r["worker_version"]), r["tag"]
    assert [r["engine_version"] for r in r0["rounds"]] == ["11", "12", "13"]
    # each rank sent its own half of the full round
    full = run["rounds"][0]["sent"]
    assert r0["rounds"][0]["sent"] + r1["rounds"][0]["sent"] == full
    assert not r0["rounds"][1]["full"] and not r1["rounds"][1]["full"]


def test_a_refusal_on_trainer_rank_1_fails_every_rank_before_the_round(run):
    ranks = run["ranks"]
    for r in (0, 1):
        refused = ranks[f"rank{r}"]["refused"]
        assert refused["raised"] == "PlanError", r
        assert (
            "trainer rank 1 refused" in refused["message"]
            and "lm_head.weight" in (refused["message"])
        )
        assert refused["seconds"] < 30, r  # the group timeout is 60 s
    assert ranks["rank0"]["refused"]["engine_version"] == "12"


def test_an_update_session_a_dead_trainer_left_open_is_ended(run):
    # by the worker extension (it reports whether one was open) ...
    assert run["stale"] == [{"ended": True}, {"ended": False}]
    # ... and by the next trainer's send_weights, whose start vLLM first refused
    r = rounds(run)["replaced"]
    assert r["full"] and r["identical"] and r["engine_version"] == "5"


def test_a_server_starts_from_a_store_by_its_command_line(run):
    # vllm serve <config-only dir> --load-format deltackpt --model-loader-extra-config '{...}':
    # the plugin registers the loader in the server's processes; "follow": true hands the
    # loaded copy to the first follow, which finds nothing newer and holds s0 exactly
    assert run["started"]["snapshot"] == "s0" and run["started"]["follow"] is True
    f = run["start_follow"]
    assert (f["version"], f["mode"], f["exact"]) == ("s0", None, True)

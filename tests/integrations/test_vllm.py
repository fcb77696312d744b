"""The ``deltackpt`` vLLM weight-transfer backend against a real CPU vLLM engine.

vLLM is not in the project's test environment (it pins its own transformers, setuptools, ...):
the engine runs in ``.venv-vllm`` (made by ``.ci/vllm-env``), in a subprocess that runs
``_vllm_run.py`` and reports what it saw as JSON. Skipped when that environment is absent.

vLLM's CPU build keeps linear weights in their parameters on some processors (AVX2) and repacks
them into kernels, leaving the parameters empty, on others (AVX-512, AMX). Both layouts are
forced (``_vllm_linear/``), so the worker's two paths run on every machine: ``run`` (every
scenario) keeps them, as a GPU does, so its commits write into the parameters (in-place
commits, ``inplace.py``); ``other`` (the short run) repacks them, so its commits reload.
``run``'s engine is vLLM's default multiprocess one (engine core and worker each a process of
their own), its rounds on gloo links; ``other``'s runs its engine core in the trainer's process
(as colocated RL trainers run vLLM; its worker still a process of its own), its rounds on
tensor-handle links (``links="ipc"``: the trainer's buckets shared with the worker, the link a
colocated GPU trainer uses, here with host tensors). Both end by comparing with vLLM's own load
of the trainer's weights from disk into the same engine (``reload_weights``: its loader and
post-processing, without a second engine start).

The refit through the store (the worker extension's ``deltackpt_follow``: a trainer publishes
versions to a store, the engine's workers pull them, incrementally after the first, and fail
closed on a held copy changed behind their back) runs on the engine of ``run`` after its own
checks (``_vllm_store.py``; that engine has the backend and the extension both, and keeps its
linear weights, so the follower's commits go in place), which saves an engine start.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.integrations._commit_checks import (
    check_failed_commits,
    check_prefix_cache,
    check_staged_round,
)
from tests.integrations._vllm_env import MARKS, run_script

pytestmark = MARKS


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return run_script(tmp_path_factory, "_vllm_run.py", linear="keep")


LINEAR = "model.layers.0.mlp.down_proj.weight"  # a linear weight no other layer shares


def layout(run: dict[str, Any]) -> str:
    return "repack" if LINEAR in run["emptied"] else "keep"


@pytest.fixture(scope="module")
def other(run: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The short run (rounds, tampering, and the same weights reloaded by vLLM from disk in the
    same engine instead of a fresh engine) with linear weights repacked, on the links the
    integration's default ``links="auto"`` takes: ipc, trainer and engine on one host."""
    return run_script(tmp_path_factory, "_vllm_run.py", "--short", "--links=auto", linear="repack")


@pytest.fixture(params=["run", "other"])
def either(request: pytest.FixtureRequest) -> dict[str, Any]:
    """Each run in turn: linear weights kept, then repacked."""
    return request.getfixturevalue(request.param)  # type: ignore[no-any-return]


def rounds(run: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {r["tag"]: r for r in run["rounds"]}


def test_every_round_commits_the_trainers_bits(either):
    for r in either["rounds"]:
        assert r["committed_identical"], r["tag"]
        assert r["readable_identical"], r["tag"]  # embeddings, norms, fused qkv bias, lm_head
        assert r["engine_version"] == str(r["version"]), r["tag"]


def test_engine_check_agrees_and_names_what_it_cannot_place(either):
    # engine_check.check(llm, the trainer's state) after each of the backend's rounds: every
    # placed tensor matches; where vLLM repacked the linear weights into CPU kernels (their
    # parameters emptied, or widened) those are unchecked, named, and the rest still checked
    linear = {n for n in either["paths"] if n.endswith(("proj.weight",))}
    for r in either["rounds"]:
        ec = r["engine_check"]
        assert ec["ok"] and ec["checked"] > 0, (r["tag"], ec)
        assert ec["checked"] + len(ec["unchecked"]) == len(either["paths"]), (r["tag"], ec)
        if layout(either) == "keep":
            assert ec["unchecked"] == [], (r["tag"], ec)
        else:  # the repacked weights (and biases vLLM widened to fp32 for its kernels)
            assert linear <= set(ec["unchecked"]), (r["tag"], ec["unchecked"])
            assert not any("norm" in n for n in ec["unchecked"])  # norms: never repacked


def test_an_lm_head_tied_to_the_embedding_is_not_sent(run, other):
    """The short run's model ties its embeddings (as Qwen2.5-0.5B does): the workers say their
    model ignores ``lm_head.weight`` (vLLM's LM head is then the embedding) and the trainer
    leaves it out of every round; the engine still equals vLLM's own load of the weights. The
    untied model of the full run sends it."""
    assert other["ignores"] == ["lm_head.weight"] and run["ignores"] == []
    tied, untied = rounds(other)["full"]["sent"], rounds(run)["full"]["sent"]
    assert untied - tied == 512 * 128 * 2  # the embedding's bytes, once instead of twice
    assert other["readable_same_as_fresh"] and other["tokens"] == other["fresh_tokens"]


def test_both_linear_layouts_run(run, other):
    assert (layout(run), layout(other)) == ("keep", "repack")
    # every parameter readable where they are kept, fused ones too
    assert "model.layers.1.self_attn.qkv_proj.weight" in rounds(run)["delta3"]["readable"]
    assert "model.layers.1.mlp.gate_up_proj.weight" in rounds(run)["delta3"]["readable"]


def test_every_parameter_reports_its_path(either):
    paths, repacked = either["paths"], layout(either) == "repack"
    tied = either["ignores"] == ["lm_head.weight"]  # (the short run: never sent)
    assert len(paths) == 2 * 12 + 3 - tied  # 2 layers of 12 tensors, embed, norm, lm_head
    weights = [n for n in paths if n.endswith("proj.weight")]
    assert len(weights) == 2 * 7
    norms = [n for n in paths if "norm" in n]
    assert all(paths[n]["path"] == "in place" for n in norms)  # never repacked
    # repacked weights reload (the kernel holds a copy); kept ones are written in place
    want = "load_weights" if repacked else "in place"
    assert all(paths[n]["path"] == want for n in weights), paths
    assert tied or paths["lm_head.weight"]["path"] == want
    tail = ", then repacked into a CPU kernel (the parameter is left empty)"
    q = paths["model.layers.0.self_attn.q_proj.weight"]
    assert q["param"] == "model.layers.0.self_attn.qkv_proj.weight"
    assert q["layout"] == "fused into qkv_proj as q_proj" + (tail if repacked else "")
    down = paths[LINEAR]["layout"]
    assert down == ("RowParallelLinear, whole" + tail if repacked else "whole"), down
    bias = paths["model.layers.0.self_attn.q_proj.bias"]["layout"]
    assert bias == "fused into qkv_proj as q_proj"  # biases are never repacked
    assert paths["model.embed_tokens.weight"]["layout"] == "whole"


def test_a_bad_init_info_is_refused_before_the_engine_is_asked_anything(run):
    bad = run["bad_init"]  # trainer_init with dtype="bf16x" and a client that must not be used
    assert bad["raised"] == "PlanError", bad
    assert "DeltackptTrainerInitInfo(dtype='bf16x')" in bad["message"], bad


def test_first_round_is_full_then_element_sparse_patches(run):
    rs = rounds(run)
    assert rs["full"]["full"] and rs["full"]["worker"]["patched"] == 0
    for tag in ("delta", "delta2", "delta3", "replaced_delta", "after_refusal"):
        assert not rs[tag]["full"]
        assert rs[tag]["worker"]["patched"] > 0
        assert rs[tag]["sent"] < rs["full"]["sent"] / 10  # 2% of the elements changed


def test_reloads_take_tensors_moved_ahead_or_in_windows_bit_exactly(other):
    """A GPU worker's reload path on this engine (its commits reload: linear weights repacked),
    with host tensors moved host to host as a GPU worker moves them to the device: the staged
    round moved every tensor of the changed layers before its commit and the commit used all of
    them; both rounds commit the trainer's bits (test_every_round_commits_the_trainers_bits)."""
    rs = rounds(other)
    assert [rs[t]["worker"]["path"] for t in ("moved ahead", "moved in windows")] == ["reload"] * 2
    moved = other["moved_ahead"]
    assert moved["ok"] and moved["version"] == 7
    assert moved["prepared_bytes"] > 0 and moved["prepared_unused"] == 0


def test_a_tampered_worker_fails_closed_and_the_next_round_heals_it(run):
    t = run["tampered"]
    assert t["raised"] == "RoundAbortedError"
    assert t["engine_version"] == "3" and t["worker_version"] == 3
    assert t["tokens_unchanged"]
    heal = rounds(run)["heal"]
    assert heal["full"] and heal["committed_identical"]


def test_the_default_links_are_ipc_on_one_host_and_patch_and_fail_closed_there(other):
    """``other`` runs over the default ``links="auto"``, which takes ipc links with its engine
    core in the trainer's process (as colocated RL trainers run vLLM; the worker is another
    process). ``encode="auto"`` patches there as on gloo: the delta rounds carry the changed
    elements, so a copy changed behind the worker's back is not the round's base and fails
    the round on every rank, the engine serving the last version; the next round (whole) heals
    it."""
    assert other["asked"] == "auto" and other["links"] == "ipc", other["links_reason"]
    assert other["links_reason"].startswith("links='auto': every rank shares /dev/shm")
    rs = rounds(other)
    assert rs["full"]["full"] and rs["full"]["worker"]["patched"] == 0
    assert not rs["delta"]["full"] and rs["delta"]["worker"]["patched"] > 0
    assert rs["delta"]["sent"] < rs["full"]["sent"] / 10
    t = other["tampered"]
    assert t["raised"] == "RoundAbortedError"
    assert t["engine_version"] == "3" and t["worker_version"] == 3
    assert t["tokens_unchanged"]
    heal = rs["heal"]
    assert heal["full"] and heal["committed_identical"]


def test_greedy_tokens_equal_vllm_loading_the_same_weights(either):
    # the same engine reloading them from disk (reload_weights), vLLM's own loader
    assert either["tokens"] == either["fresh_tokens"]
    assert either["readable_same_as_fresh"]


def test_a_trainer_killed_mid_round_leaves_the_previous_version(run):
    k = run["killed"]
    assert k["exitcode"] == 17  # died in Packer.message, 2nd bucket of its second round
    assert k["calls"][-2:] == ["start_weight_update", "update_weights"]
    failed = k["failed"]
    assert failed["call"] == "update_weights"
    # vLLM hands the driver a plain Exception with the worker's message, which names the type
    assert "deltackpt PeerLostError" in failed["message"]
    assert failed["seconds"] < 30  # seen, not waited for: the group timeout is 60 s
    assert k["engine_version"] == "7" and k["worker_version"] == 7
    assert k["tokens_moved"] and k["tokens_unchanged"]  # still the tokens of version 7


def test_a_worker_lets_go_of_a_dead_trainers_link_by_itself(run):
    # no shutdown came from the killed trainer and no call since: the worker saw that its
    # round failed on the lost trainer (or the trainer's store stop answering) and released
    # its side, keeping version 7
    side = run["killed"]["released"]
    assert side["lost"] is not None, side
    assert "a round failed" in side["lost"] or "store" in side["lost"], side
    assert {k: side[k] for k in ("group", "receiver", "held", "version")} == {
        "group": False, "receiver": False, "held": 0, "version": 7
    }  # fmt: skip
    assert run["killed"]["released_s"] < 30


def test_a_trainers_shutdown_releases_the_workers_side_of_the_link(run):
    # the trainer's shutdown() ran vLLM's shutdown_weight_transfer_engine first: the workers'
    # group (its heartbeat, links), receiver (its staging) and committed copies are gone; the
    # model and the version it serves stay
    assert run["released"] == {"group": False, "receiver": False, "held": 0, "version": 6}


def test_a_replacement_trainer_reconnects_and_a_full_round_heals(run):
    rs = rounds(run)
    assert rs["replaced"]["full"] and rs["replaced"]["committed_identical"]
    assert rs["replaced"]["engine_version"] == "8"  # after the engine's 7, not 1 again
    assert not rs["replaced_delta"]["full"] and rs["replaced_delta"]["committed_identical"]


def test_a_replacement_trainers_versions_continue_after_the_engines(run):
    c = run["continuity"]
    assert c["serving"] == 7  # what the workers served when it joined (round 8 was killed)
    assert c["raised"].startswith(
        "PlanError: send_weights(version=6): the engine serves version 7"
    ), c["raised"]
    assert "rewind=True" in c["raised"] and c["engine_version"] == "7"
    assert rounds(run)["replaced"]["version"] == 8


def test_a_rewind_relabels_the_engine_with_an_earlier_version_when_asked(run):
    rs = rounds(run)
    assert rs["rewound"]["engine_version"] == "3" and rs["rewound"]["committed_identical"]
    assert rs["after_rewind"]["engine_version"] == "4" and not rs["after_rewind"]["full"]
    assert rs["after_rewind"]["committed_identical"] and rs["after_rewind"]["readable_identical"]
    assert not rs["replaced_delta"]["full"] and rs["replaced_delta"]["committed_identical"]


def test_a_trainer_refusing_its_tensors_fails_fast_and_leaves_the_engine(run):
    r = run["refused"]
    assert r["raised"] == "PlanError"
    assert r["seconds"] < 30 and r["engine_version"] == "9"  # the group timeout is 60 s
    assert rounds(run)["after_refusal"]["committed_identical"]


# ---- staged rounds and failed commits (_vllm_commit.py, at the end of the main run) --------


def test_a_staged_round_serves_the_old_version_until_its_commit(run):
    check_staged_round(run["commit"])


def test_a_failed_commit_at_any_layer_leaves_the_previous_version(run):
    check_failed_commits(run["commit"])


def test_after_a_commit_requests_are_served_by_the_new_weights_only(run):
    check_prefix_cache(run["commit"])


def test_commits_write_into_kept_parameters_and_take_failures_back_there(run, other):
    """``run`` keeps its linear weights: the staged commit, every failed one and its rollback
    go in place (checked bit-exact by the tests above); ``other`` repacks them: reloads."""
    c = run["commit"]
    assert c["staged"]["path"] == ["in place"]
    assert [f["path"] for f in c["failures"]] == [["in place"]] * len(c["failures"])
    assert [r["worker"]["path"] for r in other["rounds"][1:]] == ["reload"] * (
        len(other["rounds"]) - 1
    )


# ---- refit through the store (_vllm_store.py, at the end of the main run) -------------------


def pulls(run: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {p["tag"]: p for p in run["store"]["pulls"]}


def test_first_pull_is_full_then_incremental_and_bit_exact(run):
    p = pulls(run)
    assert p["v0"]["mode"] == "full" and p["v0"]["identical"] and p["v0"]["version"] == "v0"
    for tag in ("v1", "v2", "v3", "v5"):
        assert p[tag]["mode"] == "incremental", p[tag]
        assert p[tag]["identical"] and p[tag]["version"] == tag
        assert 0 < p[tag]["bytes_read"] < run["store"]["full_bytes"] / 4  # 2% changed


def test_nothing_new_is_a_no_op(run):
    p = pulls(run)["nothing new"]
    assert p["mode"] is None and p["version"] == "v3" and p["bytes_read"] == 0


def test_a_held_copy_changed_behind_its_back_is_reloaded_whole(run):
    p = pulls(run)["tampered"]
    assert p["mode"] == "full" and "does not match" in p["reason"], p
    assert p["identical"] and p["version"] == "v4"


def test_the_model_holds_the_published_weights(run):
    assert run["store"]["readable_identical"]


def test_a_staged_follow_serves_the_old_version_until_its_commit(run):
    p = pulls(run)["v6 staged"]
    assert p["staged"] and p["served_v5_while_staged"]
    assert p["mode"] == "incremental" and p["version"] == "v6" and p["identical"], p
    assert p["moved"] and p["seconds"] > 0  # the commit loaded the new weights
    assert p["path"] == "in place"  # written into the kept parameters


def test_the_trainers_rounds_and_the_store_link_never_mix_versions_in_one_engine(run):
    # one engine fed by a trainer's rounds and a store in turn, each update one tensor of one
    # layer: a route that loaded its change alone would leave the other layers on the other
    # route's weights (probed before the fix: 9 of 17 parameters still the store's after a
    # trainer's delta round)
    steps = {s["tag"]: s for s in run["two_routes"]["steps"]}
    # a change outside both routes is not seen (documented) until a follow says whole=True
    unseen = steps.pop("scribbled: nothing new")
    assert (unseen["mode"], unseen["holds"]) == (None, False)
    assert [t for t, s in steps.items() if not s["holds"]] == []
    # the trainer's updates stay delta rounds on the wire: only the model's load is whole
    assert [s["full"] for s in steps.values() if "full" in s] == [False, False, False]
    assert steps["store s0"]["mode"] == "full"  # the store link's first load
    assert steps["store s1: layer 0 only"]["mode"] == "incremental"
    assert steps["store s1: layer 0 only"]["changed"] == 1
    # nothing newer in the store, but the trainer wrote the model: its version goes back whole
    for tag in ("store: nothing new", "scribbled: whole"):
        assert (steps[tag]["mode"], steps[tag]["version"]) == ("whole again", "s1")


def test_an_engine_starts_from_the_stores_newest_snapshot_and_follows_it_from_there(run):
    # load_format="deltackpt", snapshot "latest", follow: the model directory held the config
    # only; the engine came up on s1 (the newest when it started), every parameter bit-exact
    st = run["started"]
    assert {k: st["report"][k] for k in ("snapshot", "key", "follow")} == {
        "snapshot": "s1", "key": "model", "follow": True,
    }  # fmt: skip
    assert st["holds_s1"]
    # its first follow is incremental from what it started with: one changed tensor read
    f = st["follow"]
    assert (f["version"], f["mode"], f["changed"], f["workers"]) == ("s2", "incremental", 1, 1)
    assert st["holds_s2"]
    # store_link from the driver sets the engine's weight version to the snapshot's name (and
    # drops the prefix cache); a staged follow moves it at the commit only
    assert (st["label_s2"], st["label_while_staged"], st["label_s3"]) == ("s2", "s2", "s3")
    assert (st["commit"]["version"], st["commit"]["mode"]) == ("s3", "incremental")
    assert st["holds_s3"]


def test_a_snapshots_step_is_the_engines_version_and_a_joining_trainer_continues_after_it(run):
    # metadata={"step": 500} (a Checkpointer's record): store_link labels the engine "500", and
    # the next trainer is told the engine serves 500, so its first round is 501
    st = run["step"]
    assert (st["follow"]["version"], st["follow"]["step"], st["label"]) == (
        "step-00000500", 500, "500",
    )  # fmt: skip
    assert st["holds"] and st["serving"] == 500 and st["next_label"] == "501"
    r = {x["tag"]: x for x in run["rounds"]}["after_step"]
    assert r["version"] == 501 and r["full"] and r["committed_identical"]


# ---- deltackpt's checkpoint patches through vLLM's own sparse apply (_vllm_sparse.py) --------


def test_checkpoint_patches_applied_by_vllms_sparse_loader_are_bit_exact(run):
    """``sync.CheckpointPatcher``'s rounds, the patch objects handed as they are to vLLM's
    ``load_checkpoint_weight_patches`` (what its sparse_nccl backend runs on each worker), and
    accepted by its sparse NCCL sender's checks (in the trainer process)."""
    rounds = run["sparse"]["rounds"]
    first, steps = rounds[0], rounds[1:]
    assert first["dense"] == run["sparse"]["tensors"] and first["sparse"] == 0
    assert first["bytes"] == first["full_bytes"]
    for r in rounds:
        assert r["identical"], r  # every parameter the engine holds: the trainer's bf16 casts
        assert r["loaded"] > 0, r
    for r in steps:  # AdamW at lr 1e-6: a few % of the bf16 elements move
        assert r["sparse"] >= 12, r  # every weight matrix and norm of the two layers
        assert 0 < r["bytes"] < r["full_bytes"] / 8, r
        # the zero-initialised biases move wholly in the first steps: dense, said why
        assert set(r["why_dense"].values()) <= {"more than 0.125 of its elements changed"}, r
    for r in rounds:  # the engine's parameters against the committed bases, every tensor
        c = r["check"]
        assert c["ok"] and c["checked"] == run["sparse"]["tensors"] and c["unchecked"] == [], c


def test_a_parameter_changed_behind_the_patchers_back_is_named_by_its_check(run):
    got = run["sparse"]["scribbled"]
    assert not got["ok"]
    assert got["mismatched"] == {"0": ["model.layers.0.mlp.down_proj.weight"]}
    # integrations.vllm.engine_check against the trainer's state: the same answer
    assert got["state_check"] == {"ok": False, "mismatched": got["mismatched"]}
    assert all(r["state_check"] for r in run["sparse"]["rounds"])

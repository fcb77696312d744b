"""What test_vllm.py (one worker) and test_vllm_tp.py (TP=2) check of the staged rounds and
failed commits that ``_vllm_commit.commit_scenarios`` ran on their engines (issue 38): a round
is prepared while the engine serves the old version, committed in a short pause, and a commit
that fails at any layer boundary leaves every worker bit-exact on the previous version; after a
commit the prefix cache holds nothing the old weights computed."""

from __future__ import annotations

from typing import Any


def workers(c: dict[str, Any], value: Any) -> list[Any]:
    return [value] * c["tp"]


def check_staged_round(c: dict[str, Any]) -> None:
    s = c["staged"]
    old, new = s["previous"], s["previous"] + 1
    assert s["versions_while_staged"] == workers(c, old)  # in the copies only: not served
    assert s["served_old_while_staged"]  # the engine generated with the old version meanwhile
    # ... also from another thread while the round was being staged
    assert s["served_old_during_staging"] and all(s["served_old_during_staging"])
    assert s["committed"] == new and s["versions"] == workers(c, new)
    assert s["engine_version"] == str(new) and s["identical"] == workers(c, True)


def check_failed_commits(c: dict[str, Any]) -> None:
    points = [(r["mode"], r["point"]) for r in c["failures"]]
    assert points == [
        ("stage", ""),
        ("stage", "model.layers.0"),
        ("stage", "model.layers.1"),
        ("stage", "end"),
        ("plain", "model.layers.1"),
    ]
    for r in c["failures"]:
        where = (r["mode"], r["point"])
        assert r["raised"] and "RoundAbortedError" in r["raised"], where
        assert f"serves version {r['previous']}" in r["raised"], where
        assert r["versions"] == workers(c, r["previous"]), where
        assert r["engine_version"] == str(r["previous"]), where
        # bit-exact on every worker: its copies and (one worker) the parameters they make
        assert r["back_on_previous"] == workers(c, True), where
        assert r["readable_unchanged"] == workers(c, True), where
        assert r["next_full"] and r["next_identical"] == workers(c, True), where
        assert r["next_versions"] == workers(c, r["previous"] + 2), where
        if r["mode"] == "stage":
            assert [x["ok"] for x in r["last_commit"]] == workers(c, False), where


def check_prefix_cache(c: dict[str, Any]) -> None:
    # the long prompt was cached before the commit: served right after it, its logprobs are
    # those computed with nothing cached (with the old weights' KV blocks they differ)
    assert c["identical_at_end"] == workers(c, True)
    assert c["after_commit_logprobs"] == c["uncached_logprobs"]

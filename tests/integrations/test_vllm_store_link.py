"""``deltackpt.integrations.vllm.store_link`` against a stand-in ``LLM`` (no vLLM needed): what
it asks the workers, and when it drops the prefix cache and sets the weight version. Against a
real engine: ``tests/integrations/test_vllm.py`` (the full run's start from a store)."""

from __future__ import annotations

from typing import Any

import pytest

from deltackpt.integrations.vllm import store_link
from deltackpt.sync import SyncError


class FakeLLM:
    """Records the calls; ``answers`` is what every worker answers, per collective RPC."""

    def __init__(self, *answers: list[dict[str, Any]]) -> None:
        self.answers = list(answers)
        self.calls: list[tuple[Any, ...]] = []

    def collective_rpc(self, method: str, args: tuple = (), kwargs: dict | None = None) -> Any:
        self.calls.append((method, args, kwargs))
        return self.answers.pop(0)

    def reset_prefix_cache(self) -> None:
        self.calls.append(("reset_prefix_cache",))

    def update_weight_version(self, version: str) -> None:
        self.calls.append(("update_weight_version", version))


def test_a_follow_that_moved_the_weights_drops_the_cache_and_labels_the_step() -> None:
    moved = {"version": "step-00000500", "step": 500, "mode": "incremental"}
    llm = FakeLLM([moved, moved])
    got = store_link.follow(llm, "s3://b/run", tp_boxes=True)
    assert got["workers"] == 2 and got["version"] == "step-00000500"
    assert llm.calls[0][0:2] == ("deltackpt_follow", ("s3://b/run",))
    assert llm.calls[0][2]["tp_boxes"] is True  # each worker follows in its boxes
    assert llm.calls[1:] == [("reset_prefix_cache",), ("update_weight_version", "500")]


def test_a_snapshot_without_a_step_is_labelled_by_its_name_and_nothing_new_changes_nothing():
    llm = FakeLLM([{"version": "best", "step": None, "mode": "full"}])
    store_link.follow(llm, "ckpts")
    assert llm.calls[-1] == ("update_weight_version", "best")
    llm = FakeLLM([{"version": "best", "step": None, "mode": None}])
    store_link.follow(llm, "ckpts")
    assert [c[0] for c in llm.calls] == ["deltackpt_follow"]  # no cache reset, no new label


def test_workers_on_different_snapshots_or_a_failed_stage_raise() -> None:
    llm = FakeLLM([{"version": "a", "mode": "full"}, {"version": "b", "mode": "full"}])
    with pytest.raises(SyncError, match=r"hold different snapshots \['a', 'b'\]"):
        store_link.follow(llm, "ckpts")
    assert [c[0] for c in llm.calls] == ["deltackpt_follow"]  # nothing labelled
    llm = FakeLLM([{"staged": True}], [{"version": "a", "mode": "full"}, {"error": "boom"}])
    store_link.stage(llm, "ckpts")
    assert llm.calls[0][2]["stage"] is True
    with pytest.raises(SyncError, match=r"failed on worker\(s\) \[\(1, 'boom'\)\]"):
        store_link.commit(llm)

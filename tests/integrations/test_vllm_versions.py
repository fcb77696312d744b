"""The version an engine serves, read by a trainer that joins, and the rule of the next
version (``deltackpt.integrations.vllm.served``; the real engine: test_vllm.py's replacement
trainer and rewind)."""

from __future__ import annotations

import json
import logging
from typing import Any

import pytest

from deltackpt.integrations.vllm import served
from deltackpt.sync import PlanError


class Group:
    """A group whose store holds what each worker posted (the real one: a c10d TCPStore)."""

    def __init__(self, posted: dict[int, Any]) -> None:
        self.kv: dict[str, bytes] = {}
        self.rank = -1
        self.store = self
        for rank, body in posted.items():
            self.rank = rank
            if isinstance(body, bytes):
                self.kv[f"{served.KEY}/{rank}"] = body
            else:
                served.publish(self, body)  # type: ignore[arg-type]

    def set(self, key: str, value: bytes) -> None:
        self.kv[key] = value

    def check(self, keys: list[str]) -> bool:
        return all(k in self.kv for k in keys)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return [self.kv[k] for k in keys]

    def wait_until(self, ready: Any, what: str, seq: Any) -> None:
        assert ready(), f"waited for {what}"

    def guard(self, what: str, fn: Any) -> Any:
        return fn()


def test_the_engine_serves_what_its_workers_posted() -> None:
    assert served.read(Group({1: 120}), range(1, 2)) == 120  # type: ignore[arg-type]
    assert served.read(Group({2: 7, 3: 7}), range(2, 4)) == 7  # type: ignore[arg-type]
    assert served.read(Group({1: None, 2: None}), range(1, 3)) is None  # type: ignore[arg-type]


def test_workers_that_disagree_give_the_highest_and_a_warning(caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="deltackpt"):
        got = served.read(Group({1: 120, 2: None, 3: 118}), range(1, 4))  # type: ignore[arg-type]
    assert got == 120
    assert "serve different versions ({1: 120, 2: None, 3: 118}" in caplog.text


@pytest.mark.parametrize("body", [b"nope", json.dumps("7").encode(), b"-1", b"1.5", b"true"])
def test_a_version_that_is_not_one_is_refused_naming_the_worker(body: bytes) -> None:
    with pytest.raises(PlanError, match=r"worker rank 2 says it serves version .*vllm/served/2"):
        served.read(Group({1: 3, 2: body}), range(1, 3))  # type: ignore[arg-type]


def test_the_next_version_follows_the_trainer_and_the_engine() -> None:
    assert served.next_version(None, None, None, False) == 1  # a fresh engine, a new trainer
    assert served.next_version(None, None, 120, False) == 121  # a trainer that restarted
    assert served.next_version(None, 5, 3, False) == 6  # (3: a commit taken back meanwhile)
    assert served.next_version(121, None, 120, False) == 121
    assert served.next_version(4, 3, 3, False) == 4  # a round retried after a failure


def test_a_version_that_does_not_go_past_the_engines_is_refused_unless_rewound() -> None:
    for v in (120, 101):
        with pytest.raises(PlanError, match=rf"version={v}\): the engine serves version 120"):
            served.next_version(v, None, 120, False)
    assert served.next_version(101, None, 120, True) == 101
    assert served.next_version(101, 130, 120, True) == 101


@pytest.mark.parametrize("bad", [-1, 1.5, "7", True])
def test_a_version_that_is_not_an_integer_is_refused(bad: Any) -> None:
    with pytest.raises(PlanError, match=r"expected an integer >= 0"):
        served.next_version(bad, None, None, False)

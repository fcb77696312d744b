"""What a worker tells a trainer that joins (``deltackpt.integrations.vllm.joins``): the
version the engine serves and the rule of the next version, the names its model ignores (the
real engine: test_vllm.py's replacement trainer, rewind and tied embeddings)."""

from __future__ import annotations

import json
import logging
from typing import Any

import pytest
import torch

from deltackpt.integrations.vllm import joins
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
                self.kv[f"{joins.KEY}/{rank}"] = body
            elif isinstance(body, tuple):
                joins.publish(self, *body)  # type: ignore[arg-type]
            else:
                joins.publish(self, body, [])  # type: ignore[arg-type]

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
    assert joins.read(Group({1: 120}), range(1, 2)).serving == 120  # type: ignore[arg-type]
    assert joins.read(Group({2: 7, 3: 7}), range(2, 4)).serving == 7  # type: ignore[arg-type]
    got = joins.read(Group({1: None, 2: None}), range(1, 3))  # type: ignore[arg-type]
    assert got.serving is None and got.ignores == frozenset()


def test_workers_that_disagree_give_the_highest_and_a_warning(caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="deltackpt"):
        got = joins.read(Group({1: 120, 2: None, 3: 118}), range(1, 4))  # type: ignore[arg-type]
    assert got.serving == 120
    assert "serve different versions ({1: 120, 2: None, 3: 118}" in caplog.text


@pytest.mark.parametrize(
    "body",
    [
        b"nope",
        b"7",
        json.dumps({"version": "7", "ignores": []}).encode(),
        json.dumps({"version": -1, "ignores": []}).encode(),
        json.dumps({"version": True, "ignores": []}).encode(),
        json.dumps({"version": 1.5, "ignores": []}).encode(),
        json.dumps({"version": 1, "ignores": "lm_head.weight"}).encode(),
        json.dumps({"version": 1}).encode(),
    ],
)
def test_a_record_that_is_not_one_is_refused_naming_the_worker(body: bytes) -> None:
    with pytest.raises(PlanError, match=r"worker rank 2 joined with .*vllm/joined/2"):
        joins.read(Group({1: 3, 2: body}), range(1, 3))  # type: ignore[arg-type]


def test_the_next_version_follows_the_trainer_and_the_engine() -> None:
    assert joins.next_version(None, None, None, False) == 1  # a fresh engine, a new trainer
    assert joins.next_version(None, None, 120, False) == 121  # a trainer that restarted
    assert joins.next_version(None, 5, 3, False) == 6  # (3: a commit taken back meanwhile)
    assert joins.next_version(121, None, 120, False) == 121
    assert joins.next_version(4, 3, 3, False) == 4  # a round retried after a failure


def test_a_version_that_does_not_go_past_the_engines_is_refused_unless_rewound() -> None:
    for v in (120, 101):
        with pytest.raises(PlanError, match=rf"version={v}\): the engine serves version 120"):
            joins.next_version(v, None, 120, False)
    assert joins.next_version(101, None, 120, True) == 101
    assert joins.next_version(101, 130, 120, True) == 101


@pytest.mark.parametrize("bad", [-1, 1.5, "7", True])
def test_a_version_that_is_not_an_integer_is_refused(bad: Any) -> None:
    with pytest.raises(PlanError, match=r"expected an integer >= 0"):
        joins.next_version(bad, None, None, False)


def test_names_are_left_out_only_when_every_worker_ignores_them() -> None:
    both = Group({1: (3, ["lm_head.weight"]), 2: (3, ["lm_head.weight"])})
    assert joins.read(both, range(1, 3)).ignores == {"lm_head.weight"}  # type: ignore[arg-type]
    one = Group({1: (3, ["lm_head.weight"]), 2: (3, [])})
    assert joins.read(one, range(1, 3)).ignores == frozenset()  # type: ignore[arg-type]


def test_a_model_with_tied_embeddings_ignores_the_lm_head() -> None:
    """vLLM ties them by making ``lm_head`` the embedding module: its weight is listed once,
    under the embedding's name, and the loader skips ``lm_head.weight``."""

    class Config:
        def __init__(self, tie: bool) -> None:
            self.tie_word_embeddings = tie

    class Multimodal:  # the text model's config says whether it ties
        def get_text_config(self) -> Config:
            return Config(True)

    tied = torch.nn.Module()
    tied.model = torch.nn.Module()
    tied.model.embed_tokens = torch.nn.Embedding(8, 4)
    tied.lm_head = tied.model.embed_tokens
    assert joins.ignored_names(tied, Config(True)) == ["lm_head.weight"]
    assert joins.ignored_names(tied, Multimodal()) == ["lm_head.weight"]
    assert joins.ignored_names(tied, Config(False)) == []
    untied = torch.nn.Module()
    untied.lm_head = torch.nn.Linear(4, 8)  # a head of its own: loaded, whatever the config
    assert joins.ignored_names(untied, Config(True)) == []

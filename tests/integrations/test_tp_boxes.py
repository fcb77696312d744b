"""The pieces of the vLLM backend's ``tp_boxes`` that need no vLLM: a receiver that picks its
boxes of the trainers' tensors once it learns their shapes (``WeightReceiver(boxes=...)``), and
the full-shape views its boxes are handed to a narrowing weight loader as."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from deltackpt import sync
from deltackpt.errors import InvalidArgumentError
from deltackpt.integrations.vllm.inplace import enabled as inplace_enabled
from deltackpt.integrations.vllm.tp_boxes import enabled, full_view
from deltackpt.options import overrides, vllm_staging, vllm_undo_dir
from deltackpt.sync.schedule_decl import Box
from tests.sync._common import local_pair, run_threads

TIMEOUT = 10.0


@pytest.mark.parametrize(
    ("shape", "dim", "tp"),
    [((12, 10), 0, 2), ((12, 10), 1, 2), ((9, 8), 1, 4), ((16,), 0, 4), ((4, 6, 8), 1, 2)],
)
def test_a_full_view_narrowed_at_a_ranks_offset_is_its_box(
    shape: tuple[int, ...], dim: int, tp: int
) -> None:
    full = torch.randn(shape).to(torch.bfloat16)
    for r in range(tp):
        box = sync.shard_box(shape, dim, r, tp)
        if not box.numel:
            continue
        sl = box.within(Box((0,) * len(shape), shape))
        view = full_view(full[sl].clone(), box, shape)
        assert tuple(view.shape) == shape
        start, size = box.offset[dim], box.size[dim]
        got = view.narrow(dim, start, size)  # what vLLM's weight loaders do
        assert torch.equal(got, full[sl])
        # the buffer behind the view: the box's bytes and at most the span of the full tensor
        assert view.untyped_storage().nbytes() <= full.numel() * full.element_size() + (
            tp * size * full.element_size() * (full.numel() // full.shape[0])
        )


def test_whole_tensors_are_handed_over_as_they_are() -> None:
    t = torch.ones(3, 4)
    assert full_view(t, None, (3, 4)) is t


def test_the_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DELTACKPT_VLLM_TP_BOXES", raising=False)
    assert not enabled() and enabled(True)
    monkeypatch.setenv("DELTACKPT_VLLM_TP_BOXES", "1")
    assert enabled() and not enabled(False)
    monkeypatch.setenv("DELTACKPT_VLLM_TP_BOXES", " Off ")
    assert not enabled()


@pytest.mark.parametrize(
    ("name", "default"),
    [("DELTACKPT_VLLM_TP_BOXES", False), ("DELTACKPT_VLLM_INPLACE", True),
     ("DELTACKPT_VLLM_PREPARE", True)],
)  # fmt: skip
def test_a_workers_switch_refuses_a_value_it_cannot_read(
    monkeypatch: pytest.MonkeyPatch, name: str, default: bool
) -> None:
    """A typo is an error naming the variable, not a silent default (``tp_boxes=of`` read as
    off, ``inplace=of`` as on, before); unset or empty is the default."""
    switch = {"DELTACKPT_VLLM_TP_BOXES": enabled}.get(name, lambda: inplace_enabled(None, name))
    for unset in (None, "", "  "):
        if unset is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, unset)
        assert switch() is default
    monkeypatch.setenv(name, "of")
    with pytest.raises(InvalidArgumentError, match=rf"{name}='of' is invalid: expected one of"):
        switch()
    with overrides(**{name: "no" if default else "yes"}):  # the tests' overrides win
        assert switch() is not default


def test_the_workers_staging_and_undo_directory_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("DELTACKPT_VLLM_STAGING", "DELTACKPT_VLLM_UNDO_DIR"):
        monkeypatch.delenv(name, raising=False)
    assert vllm_staging() == "ring" and vllm_undo_dir() is None
    monkeypatch.setenv("DELTACKPT_VLLM_STAGING", " Round")
    monkeypatch.setenv("DELTACKPT_VLLM_UNDO_DIR", "memory")
    assert vllm_staging() == "round" and vllm_undo_dir() == "memory"
    monkeypatch.setenv("DELTACKPT_VLLM_STAGING", "arena")
    with pytest.raises(
        InvalidArgumentError,
        match=r"DELTACKPT_VLLM_STAGING='arena' is invalid: expected one of \('ring', 'round'\)",
    ):
        vllm_staging()


@pytest.fixture
def pair() -> Iterator[tuple[sync.SyncGroup, sync.SyncGroup]]:
    with local_pair(TIMEOUT) as groups:
        yield groups


def test_a_receiver_gets_only_the_boxes_it_picks(pair: tuple[Any, Any]) -> None:
    tg, rg = pair
    g = torch.Generator().manual_seed(0)
    state = {
        "col": torch.randn(8, 6, generator=g),
        "row": torch.randn(6, 8, generator=g),
        "norm": torch.randn(6, generator=g),
    }
    picks = {"col": sync.shard_box((8, 6), 0, 1, 2), "row": sync.shard_box((6, 8), 1, 0, 2)}
    asked: dict[str, tuple[int, ...]] = {}

    def boxes(name: str, shape: tuple[int, ...]) -> Box | None:
        asked[name] = shape
        return picks.get(name)

    sender = sync.WeightSender(tg, bucket_bytes=1 << 10)
    receiver = sync.WeightReceiver(rg, bucket_bytes=1 << 10, boxes=boxes)
    loaded: dict[str, torch.Tensor] = {}

    def load(ws: list[tuple[str, torch.Tensor]]) -> None:
        loaded.update((n, t.clone()) for n, t in ws)

    def expect(s: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {
            n: t if n not in picks else t[picks[n].within(Box((0,) * t.dim(), tuple(t.shape)))]
            for n, t in s.items()
        }

    st, rs = run_threads(lambda: sender.push(state, version=1), lambda: receiver.pull(load))
    assert not isinstance(st, BaseException), st
    assert not isinstance(rs, BaseException), rs
    assert asked == {n: tuple(t.shape) for n, t in state.items()}
    want = expect(state)
    assert loaded.keys() == want.keys()
    assert all(torch.equal(loaded[n], want[n]) for n in want)
    share = sum(t.numel() * 4 for t in want.values())
    assert rs.payload_bytes == share < sum(t.numel() * 4 for t in state.values())
    assert share <= receiver.staging_bytes <= share + 4096
    # a delta round patches the boxes; a rollback puts them back
    new = {n: t.clone() for n, t in state.items()}
    new["col"][5, 1] += 1.0  # in the box (rows 4..7)
    new["row"][0, 7] += 1.0  # outside the box (columns 0..3): nothing to send for it
    loaded.clear()
    st, rs = run_threads(
        lambda: sender.push(new, version=2), lambda: receiver.pull(load, undo=True)
    )
    assert not isinstance(rs, BaseException), rs
    assert not rs.full and set(loaded) == {"col"}
    assert torch.equal(loaded["col"], expect(new)["col"])
    assert receiver.undo_bytes > 0
    back = dict(receiver.revert())
    assert torch.equal(back["col"], want["col"]) and receiver.version == 1
    assert receiver.undo_bytes == 0


def test_boxes_need_the_every_tensor_receiver(pair: tuple[Any, Any]) -> None:
    _, rg = pair
    with pytest.raises(sync.PlanError, match="pass no wants"):
        sync.WeightReceiver(rg, [sync.Want("x")], boxes=lambda n, s: None)

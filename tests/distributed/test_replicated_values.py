"""Plain values that the ranks hold differently are refused, not replaced by rank 0's copy
(issue 37; distributed/replicas.py).

One scenario on 2 gloo ranks checks every case in turn: a large tensor (chunks of its own), a
small one (packed into a group chunk with others), an int, a nested string, a tied pair; the
typed error on every rank names the key and the rank; ``replicated="rank0"`` keeps rank 0's copy
on purpose; replicated values that agree save as before, and the plan caches stay in step (a
later save sends only changed digests and commits).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import deltackpt
from deltackpt.errors import InvalidArgumentError, ReplicaMismatchError
from tests._dist import free_port, init_gloo, run_ranks


def _base() -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(300_000, generator=g)  # 1.2 MB: chunks of its own (256 KiB chunks)
    return {
        "w": w,
        "tied": w[:10],  # a view of the same storage
        "norm": torch.randn(16, generator=g),  # small: packed into a group chunk
        "bias": torch.randn(16, generator=g),
        "step": 3,
        "cfg": {"name": "run", "lr": 0.5},
    }


def _ranks(rank: int, world: int, port: int, path: str) -> dict[str, Any]:
    pg = init_gloo(rank, world, port)
    store = deltackpt.open_store(path, chunk_bytes=256 << 10)
    out: dict[str, Any] = {}

    def attempt(tag: str, state: dict[str, Any], **kw: Any) -> None:
        try:
            deltackpt.save(state, store, tag, process_group=pg, **kw)
            out[tag] = None
        except ReplicaMismatchError as e:
            out[tag] = str(e)

    attempt("same", _base())
    edits = {
        "large": lambda s: s["w"].__setitem__(200_000, float(rank)),
        "small": lambda s: s["norm"].__setitem__(3, float(rank)),
        "int": lambda s: s.__setitem__("step", rank),
        "nested": lambda s: s["cfg"].__setitem__("name", f"rank-{rank}"),
    }
    for tag, edit in edits.items():
        state = _base()
        edit(state)
        attempt(tag, state)
    state = _base()
    state["norm"][0] = float(rank)
    state["step"] = 10 + rank
    attempt("rank0", state, replicated="rank0")
    got = deltackpt.load(store, "rank0")
    out["rank0_loaded"] = (float(got["norm"][0]), got["step"])
    state = _base()
    state["w"][5] = 2.0  # changed the same way on both ranks: a delta plan, then a commit
    attempt("after", state)
    got = deltackpt.load(store, "after")
    out["after_exact"] = all(torch.equal(got[k], state[k]) for k in ("w", "tied", "norm", "bias"))
    return out


@pytest.mark.multiproc
def test_plain_values_that_differ_between_ranks_are_refused(tmp_path):
    r0, r1 = run_ranks(_ranks, 2, free_port(), str(tmp_path / "s"), timeout=120)
    assert r0 == r1  # the same outcome and message on every rank
    assert r0["same"] is None and r0["rank0"] is None and r0["after"] is None
    expect = {
        "large": ["tensor 'w' on rank(s) 1"],
        "small": ["tensor 'norm' on rank(s) 1"],
        "int": ["value 'step' on rank(s) 1"],
        "nested": ["value 'cfg/name' on rank(s) 1"],
    }
    for tag, names in expect.items():
        message = r0[tag]
        assert message is not None, tag
        for name in names:
            assert name in message, (tag, message)
        assert "DTensor" in message and "replicated='rank0'" in message, message
        assert "'bias'" not in message and "'lr'" not in message, message  # only what differs
    assert r0["rank0_loaded"] == (0.0, 10)  # rank 0's copy, as asked
    assert r0["after_exact"]
    assert [deltackpt.snapshots(str(tmp_path / "s"))[i].name for i in range(3)] == [
        "same",
        "rank0",
        "after",
    ]


def test_replicated_is_validated(store_dir):
    with pytest.raises(InvalidArgumentError, match="replicated"):
        deltackpt.save({"x": torch.ones(1)}, store_dir, "a", replicated="rank1")


def _tiers(rank: int, world: int, port: int, root: str) -> dict[str, Any]:
    from pathlib import Path

    from deltackpt.tiers import TieredCheckpointer, Tiers

    pg = init_gloo(rank, world, port)
    tiers = Tiers(
        local=Path(root) / f"node{rank}", durable=Path(root) / "durable", replicas=1,
        persist_every=2, ranks_per_node=1,
    )  # fmt: skip
    ckpt = TieredCheckpointer(tiers, every=1, process_group=pg)
    state = {"x": torch.full((1000,), float(rank)), "step": 0}  # a per-rank plain tensor
    raised = []
    for step in range(4):
        state["x"] += 1
        state["step"] = step
        try:
            ckpt.maybe_save(step, state)
            ckpt.wait()
        except ReplicaMismatchError as e:
            raised.append((step, "tensor 'x' on rank(s) 1" in str(e)))
    durable = ckpt.durable_steps()
    ckpt.close()
    blank = {"x": torch.zeros(1000), "step": -1}
    again = TieredCheckpointer(tiers, every=1, process_group=pg)
    start = again.restore_latest(blank)
    again.close()
    return {
        "raised": raised,
        "durable": durable,
        "start": start,
        "exact": torch.equal(blank["x"], torch.full((1000,), rank + 4.0)) and blank["step"] == 3,
    }


@pytest.mark.multiproc
def test_tiers_refuse_to_persist_per_rank_plain_values(tmp_path):
    """A durable version keeps one copy of plain values, so persisting per-rank ones is refused
    with the same typed error (it would restore rank 0's values on every rank after a cluster
    loss); the local tier and its replicas, which are per rank, keep them."""
    results = run_ranks(_tiers, 2, free_port(), str(tmp_path), timeout=120)
    for rank, r in enumerate(results):
        assert r["raised"] and all(named for _, named in r["raised"]), (rank, r)
        assert r["durable"] == [], r
        assert r["start"] == 4 and r["exact"], (rank, r)

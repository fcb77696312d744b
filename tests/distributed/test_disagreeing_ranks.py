"""Ranks that disagree are refused before anything is committed (issue 25, item 2).

Rank 0 passes a ``Shard(0)`` DTensor and rank 1 a ``Shard(1)`` one of the same global shape, or
a plain full tensor: the plan step checks what the loader checks (the boxes tile the tensor
exactly once, one kind of value per key), every rank raises the same ``DistributedError``, and
the next correct save succeeds and loads bit-exactly, through ``save``, ``async_save`` and
``Checkpointer``. The plan caches (ranks send only changed digests) stay in step even when a
save failed on one rank only.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pytest
import torch

import deltackpt
from deltackpt.distributed.save_plan import (
    Layout,
    PlanCache,
    RankMsg,
    Resend,
    digests_key,
    rank_message,
    remember,
    remember_all,
    stale_ranks,
)
from deltackpt.errors import DistributedError
from deltackpt.format.boxes import tiling_problem
from tests._dist import free_port, init_gloo, run_ranks

SHAPE = (8, 6)


def _full(step: int) -> torch.Tensor:
    return torch.randn(*SHAPE, generator=torch.Generator().manual_seed(step))


def _init(rank: int, world: int, port: int, timeout: float = 60.0) -> Any:
    return init_gloo(rank, world, port, timeout)


def _sharded(full: torch.Tensor, dim: int, rank: int, world: int) -> Any:
    """This rank's DTensor of ``full`` sharded on ``dim``, built without communication."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (world,))
    local = full.chunk(world, dim)[rank].contiguous()
    return DTensor.from_local(
        local, mesh, [Shard(dim)], run_check=False, shape=full.shape, stride=full.stride()
    )


def _good(step: int, rank: int, world: int) -> dict[str, Any]:
    return {"w": _sharded(_full(step), 0, rank, world), "b": torch.arange(5) * step}


def _bad(case: str, step: int, rank: int, world: int) -> dict[str, Any]:
    full = _full(step)
    if rank == 0:
        w = _sharded(full, 0, rank, world)
    elif case == "shard0-vs-shard1":
        w = _sharded(full, 1, rank, world)
    else:  # "dtensor-vs-plain"
        w = full
    return {"w": w, "b": torch.arange(5) * step}


def _saves(rank: int, world: int, port: int, store: str) -> dict:
    import torch.distributed as dist

    pg = _init(rank, world, port)
    ckpt = deltackpt.Checkpointer(store, every=1, rng=False, async_=True, process_group=pg)
    # a correct save first: the plan caches hold this structure, later plans are deltas
    deltackpt.save(_good(1, rank, world), store, "ok-01", process_group=pg)
    out: dict[str, Any] = {}
    step = 1
    for case in ("shard0-vs-shard1", "dtensor-vs-plain"):
        for how in ("save", "async_save", "checkpointer"):
            step += 1
            t0 = time.monotonic()
            try:
                if how == "save":
                    deltackpt.save(_bad(case, step, rank, world), store, "bad", process_group=pg)
                elif how == "async_save":
                    h = deltackpt.async_save(
                        _bad(case, step, rank, world), store, "bad", process_group=pg
                    )
                    h.result(timeout=60)
                else:
                    ckpt.save(50 + step, _bad(case, step, rank, world))
                    ckpt.wait()
                got: Any = None
            except DistributedError as e:
                got = (str(e), [(f.rank, f.step, f.error) for f in e.failures])
            out[f"{case}/{how}"] = (got, time.monotonic() - t0)
            step += 1  # then a correct save of the same kind must succeed
            name = f"ok-{step:02d}"
            if how == "save":
                deltackpt.save(_good(step, rank, world), store, name, process_group=pg)
            elif how == "async_save":
                h = deltackpt.async_save(_good(step, rank, world), store, name, process_group=pg)
                h.result(timeout=60)
            else:
                ckpt.save(step, _good(step, rank, world))
                ckpt.wait()
    ckpt.close()
    dist.destroy_process_group()
    return out


@pytest.mark.multiproc
def test_ranks_that_disagree_on_placements_fail_alike_and_the_next_save_works(tmp_path):
    store = str(tmp_path / "s")
    r0, r1 = run_ranks(_saves, 2, free_port(), store, timeout=240)
    assert sorted(r0) == sorted(r1) and len(r0) == 6
    for case, (got0, seconds) in r0.items():
        got1 = r1[case][0]
        assert got0 is not None and got0 == got1, case  # the same error on every rank
        message, failures = got0
        assert failures == [(0, "plan", "DistributedError")], case
        assert "'w'" in message and "Nothing was committed" in message, message
        assert seconds < 30, (case, seconds)
        if case.startswith("shard0-vs-shard1"):
            assert "do not tile" in message and "overlap" in message, message
            assert "rank 0 holds offsets [0, 0] shape [4, 6]" in message, message
            assert "rank 1 holds offsets [0, 3] shape [8, 3]" in message, message
        else:
            assert "a DTensor on rank(s) [0] but a plain tensor on rank(s) [1]" in message
    # nothing bad was committed; every correct save loads bit-exactly
    names = [s.name for s in deltackpt.snapshots(store)]
    assert "bad" not in names
    expected = {"ok-01": 1}
    for n in names:
        step = int(n.split("-")[1])
        expected.setdefault(n, step)
    assert len(expected) == 7, names
    for n, step in expected.items():
        got = deltackpt.load(store, n)
        assert torch.equal(got["w"], _full(step)), n
        assert torch.equal(got["b"], torch.arange(5) * step), n
    assert deltackpt.verify(store).ok


def _drift(rank: int, world: int, port: int, store: str) -> dict:
    """Save x, then y (an async save that fails on rank 1 only, after rank 0 committed), then x
    again: rank 1's plan cache still holds x's digests, rank 0's holds y's for it."""
    import torch.distributed as dist

    from deltackpt.store.store import Store

    pg = _init(rank, world, port)
    out: dict[str, Any] = {}
    deltackpt.save(_good(1, rank, world), store, "x", process_group=pg)
    if rank == 1:
        info = Store.info

        def once(self: Store, name: str) -> Any:
            Store.info = info  # type: ignore[method-assign]
            raise OSError(5, "injected: lost the outcome on rank 1")

        Store.info = once  # type: ignore[method-assign]
    h = deltackpt.async_save(_good(2, rank, world), store, "y", process_group=pg)
    try:
        out["y"] = h.result(timeout=60).name
    except OSError as e:
        out["y"] = str(e)
    info3 = deltackpt.save(_good(1, rank, world), store, "x-again", process_group=pg)
    out["x-again"] = info3.name
    out["w"] = deltackpt.load(store, "x-again")["w"].numpy()
    dist.destroy_process_group()
    return out


@pytest.mark.multiproc
def test_plan_caches_that_drifted_apart_are_resent_in_full(tmp_path):
    store = str(tmp_path / "s")
    r0, r1 = run_ranks(_drift, 2, free_port(), store, timeout=120)
    assert r0["y"] == "y" and "injected" in r1["y"]  # the outcomes differed: caches drifted
    assert r0["x-again"] == r1["x-again"] == "x-again"
    for r in (r0, r1):
        assert np.array_equal(r["w"], _full(1).numpy())  # not y's rows of rank 1
    assert torch.equal(deltackpt.load(store, "y")["w"], _full(2))


def _layout(n: int) -> Layout:
    return Layout([], [], [], [n])


def test_a_delta_against_digests_rank_0_does_not_hold_asks_for_full_plans():
    layout = _layout(3)
    mine, rank0 = PlanCache(), PlanCache()
    remember(mine, layout, ["a", "b", "c"])
    m = rank_message(1, layout, ["a", "b", "d"], mine)
    assert m.layout is None and m.changed == {2: "d"} and m.base == digests_key(["a", "b", "c"])
    full = RankMsg(1, layout.key(), layout=layout, digests=["a", "b", "c"])
    remember_all(rank0, [full], [(layout, ["a", "b", "c"])])
    assert stale_ranks([m], rank0) == []  # the same base: the delta applies
    remember_all(rank0, [full], [(layout, ["a", "x", "c"])])  # rank 0 remembers other digests
    assert stale_ranks([m], rank0) == [1]
    again = rank_message(1, layout, ["a", "b", "d"], mine, full=True)
    assert again.digests == ["a", "b", "d"] and again.structure == layout.key()
    assert stale_ranks([again], rank0) == []
    assert Resend() == Resend()  # plain data: crosses ranks by pickle


@pytest.mark.parametrize(
    ("boxes", "problem"),
    [
        ([((0, 0), (4, 6)), ((4, 0), (4, 6))], None),
        ([((0, 0), (4, 6)), ((0, 3), (8, 3))], ("pieces 0 and 1 overlap", 0, 1)),
        ([((0, 0), (4, 6))], ("cover 24 of 48 elements", -1, -1)),
        ([((0, 0), (8, 6)), ((4, 0), (4, 6))], ("cover 72 of 48 elements", -1, -1)),
        ([((0, 0), (8, 3)), ((0, 3), (8, 3)), ((0, 0), (0, 6))], None),
    ],
)
def test_tiling_problem_is_the_loaders_rule(boxes, problem):
    assert tiling_problem(SHAPE, boxes) == problem

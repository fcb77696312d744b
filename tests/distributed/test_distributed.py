"""Sharded saves on 2 and 4 gloo ranks; loads on 1, 2, 3 and 4 ranks into other placements."""

from __future__ import annotations

import os
import time

import pytest
import torch

import deltackpt
from tests._dist import free_port, init_gloo, run_ranks
from tests.distributed._models import MLP

pytestmark = pytest.mark.multiproc


def _init(rank: int, world: int, port: int, timeout: float = 30.0) -> object:
    return init_gloo(rank, world, port, timeout)


def full_state(step: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return {
        "a": torch.randn(7, 6, generator=g),  # uneven over 2 and 4 ranks
        "b": torch.randn(6, 10, generator=g).to(torch.bfloat16),
        "r": torch.randn(300, 200, generator=g),  # replicated, several chunks at 64 KiB
        "plain": torch.arange(11, dtype=torch.int64) * (step + 1),
    }


def _dstate(world: int, step: int, placements: dict[str, object]) -> dict[str, object]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    full = full_state(step)
    out: dict[str, object] = {
        k: distribute_tensor(full[k], mesh, [p]) for k, p in placements.items()
    }
    out["plain"] = full["plain"]
    out["meta"] = {"step": step, "lr": 0.5}
    return out


def _save_two(rank: int, world: int, port: int, store: str) -> dict:
    import torch.distributed as dist
    from torch.distributed.tensor import Replicate, Shard

    _init(rank, world, port)
    deltackpt.open_store(store, chunk_bytes=64 << 10) if rank == 0 else None
    dist.barrier()
    placements = {"a": Shard(0), "b": Shard(1), "r": Replicate()}
    info0 = deltackpt.save(
        _dstate(world, 0, placements), store, "s0", process_group=dist.group.WORLD
    )
    info1 = deltackpt.save(
        _dstate(world, 0, placements), store, "s0-again", process_group=dist.group.WORLD
    )
    info2 = deltackpt.save(
        _dstate(world, 1, placements), store, "s1", process_group=dist.group.WORLD
    )
    # async: returns after planning and staging; mutating the shards then must not matter
    live = _dstate(world, 2, placements)
    h = deltackpt.async_save(live, store, "s2", process_group=dist.group.WORLD, encoding="smallest")
    for k in ("a", "b", "r"):
        live[k].to_local().fill_(-1)
    info3 = h.result(timeout=60)
    # a small update of the same state: stored as xor deltas against the previous save
    # (encoding="smallest" here and for s2, whose chunks are the bases: the default stores
    # changed chunks raw on a local disk and keeps no delta bases)
    nudged = _dstate(world, 2, placements)
    nudged["r"].to_local().mul_(1 + 2**-20)
    deltackpt.save(nudged, store, "s3", process_group=dist.group.WORLD, encoding="smallest")
    codecs3 = {c.codec for c in deltackpt.open_store(store).manifest("s3").chunks.values()}
    m = deltackpt.open_store(store).manifest("s0-again")
    m0 = deltackpt.open_store(store).manifest("s0")
    dist.destroy_process_group()
    return {
        "infos": [
            (i.chunks_new, i.chunks_reused, i.bytes_written, i.logical_bytes)
            for i in (info0, info1, info2)
        ],
        "plan_bytes": [m0.dist["plan_bytes"], m.dist["plan_bytes"]],
        "info_plan_bytes": [info0.plan_bytes, info1.plan_bytes, info0.world_size],
        "async": (info3.name, info3.blocked_seconds <= info3.seconds),
        "xor_in_s3": "xor" in codecs3,
    }


def _load_resharded(rank: int, world: int, port: int, store: str, save_world: int) -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    _init(rank, world, port)
    mesh = init_device_mesh("cpu", (world,))
    results = {}
    for name, step in (("s0", 0), ("s1", 1)):
        zeros = {k: torch.zeros_like(v) for k, v in full_state(step).items()}
        target = {
            "a": distribute_tensor(zeros["a"], mesh, [Shard(1)]),
            "b": distribute_tensor(zeros["b"], mesh, [Shard(0)]),
            "r": distribute_tensor(zeros["r"], mesh, [Shard(0)]),
            "plain": zeros["plain"],
            "meta": {"step": -1, "lr": 0.0},
        }
        deltackpt.load(store, name, into=target, process_group=dist.group.WORLD)
        expected = full_state(step)
        ok = {k: bool(torch.equal(target[k].full_tensor(), expected[k])) for k in ("a", "b", "r")}
        ok["plain"] = bool(torch.equal(target["plain"], expected["plain"]))
        ok["meta"] = target["meta"] == {"step": step, "lr": 0.5}
        results[name] = ok
    if world == 4:  # save from 4 ranks too, for the 3-rank and 1-process loads
        deltackpt.save(
            _dstate(world, 2, {"a": Shard(0), "b": Shard(0), "r": Shard(1)}), store, "w4",
            process_group=dist.group.WORLD,
        )  # fmt: skip
    if world == 3:
        target = {k: torch.zeros_like(v) for k, v in full_state(2).items()}
        target["a"] = distribute_tensor(target["a"], mesh, [Replicate()])
        deltackpt.load(store, "w4", into=target, strict=False)
        exp = full_state(2)
        results["w4"] = {
            "a": bool(torch.equal(target["a"].full_tensor(), exp["a"])),
            "r": bool(torch.equal(target["r"], exp["r"])),
        }
    dist.destroy_process_group()
    return results


def test_save_on_2_ranks_then_reshard_onto_1_3_4_ranks(tmp_path):
    store = str(tmp_path / "s")
    out = run_ranks(_save_two, 2, free_port(), store, timeout=120)
    (_new0, _reused0, written0, logical0), (new1, _, written1, _), (new2, _, _written2, _) = out[0][
        "infos"
    ]
    assert out[0] == out[1]  # every rank returns the same committed SnapshotInfo
    assert new1 == 0 and written1 < 0.05 * written0  # unchanged state: metadata only
    assert new2 > 0
    # replicated "r" (240 KB) is written once, not once per rank
    assert written0 < 1.3 * logical0
    # the repeated save sends only changes: its planning messages are smaller
    assert out[0]["plan_bytes"][1] < 0.5 * out[0]["plan_bytes"][0]
    assert out[0]["info_plan_bytes"] == [*out[0]["plan_bytes"], 2]

    assert out[0]["async"] == ("s2", True)
    assert out[0]["xor_in_s3"]
    # one process, no process group: full tensors
    for name, step in (("s0", 0), ("s1", 1), ("s2", 2)):
        got = deltackpt.load(store, name)
        for k, v in full_state(step).items():
            assert torch.equal(got[k], v), (name, k)
        assert got["meta"] == {"step": step, "lr": 0.5}

    for world in (4, 3):
        results = run_ranks(_load_resharded, world, free_port(), store, 2, timeout=150)
        for r in results:
            for snap in r.values():
                assert all(snap.values()), (world, r)
    got = deltackpt.load(store, "w4")
    for k in ("a", "b", "r"):
        assert torch.equal(got[k], full_state(2)[k])
    assert deltackpt.verify(store).ok


def _die_mid_save(rank: int, world: int, port: int, store: str) -> dict:
    import torch.distributed as dist
    from torch.distributed.tensor import Shard

    from deltackpt.store import packs as pack

    _init(rank, world, port, timeout=15)
    placements = {"a": Shard(0), "b": Shard(0), "r": Shard(0)}
    deltackpt.save(_dstate(world, 0, placements), store, "good", process_group=dist.group.WORLD)
    if rank == 1:

        def die(self, payload):
            os._exit(3)

        pack.PackWriter.append = die
    t0 = time.monotonic()
    try:
        deltackpt.save(
            _dstate(world, 1, placements), store, "doomed", process_group=dist.group.WORLD
        )
    except deltackpt.errors.DistributedError as e:
        return {"error": type(e).__name__, "seconds": time.monotonic() - t0, "msg": str(e)}
    return {"error": None}


def test_a_rank_dying_mid_save_fails_the_others_in_bounded_time(tmp_path):
    store = str(tmp_path / "s")
    from tests._dist import spawn

    port = free_port()
    outcomes = spawn([(_die_mid_save, (r, 2, port, store)) for r in range(2)], timeout=120)
    r0 = outcomes[0].unwrap()
    assert r0["error"] == "DistributedError" and r0["seconds"] < 60, r0
    assert outcomes[1].exitcode == 3
    assert [s.name for s in deltackpt.snapshots(store)] == ["good"]
    got = deltackpt.load(store, "good")
    assert torch.equal(got["a"], full_state(0)["a"])


def test_a_world_of_one_runs_the_same_collectives_without_a_process_group():
    from deltackpt.distributed.collectives import Failed, Group
    from deltackpt.errors import RankFailure

    g = Group()
    assert (g.rank, g.world, g.coordinator, g.distributed) == (0, 1, True, False)
    assert g.gather("plan") == ["plan"]
    assert g.scatter([{1, 2}]) == {1, 2}
    assert g.broadcast("outcome") == "outcome"
    cause = OSError(28, "No space left on device")
    failure = Failed((RankFailure.of(0, "write", cause),))
    with pytest.raises(OSError) as raised:  # the original exception, not a DistributedError
        g.raise_failed("distributed save of 'x'", failure, cause, "")
    assert raised.value is cause


def _failing_saves(rank: int, world: int, port: int, store: str) -> dict:
    import torch.distributed as dist
    from torch.distributed.tensor import Replicate, Shard

    from deltackpt.errors import DistributedError
    from deltackpt.saving.hooks import hooks

    def seen(e: DistributedError) -> tuple:
        cause = type(e.__cause__).__name__ if e.__cause__ is not None else None
        return str(e), [(f.rank, f.step, f.error) for f in e.failures], cause

    _init(rank, world, port)
    pg = dist.group.WORLD
    placements = {"a": Shard(0), "b": Shard(0), "r": Replicate()}
    out: dict = {}
    # step 1 fails on rank 1 only: its state holds a value deltackpt refuses without pickle
    state = _dstate(world, 0, placements)
    if rank == 1:
        state["meta"] = {"bad": object()}
    try:
        deltackpt.save(state, store, "bad-plan", process_group=pg)
    except DistributedError as e:
        out["plan"] = seen(e)

    # step 6 fails on rank 0 (the only rank that publishes): no space for the manifest
    def no_space(name: str) -> None:
        raise OSError(28, "No space left on device")

    with hooks.override(before_commit=no_space):
        try:
            deltackpt.save(_dstate(world, 0, placements), store, "bad-commit", process_group=pg)
        except DistributedError as e:
            out["commit"] = seen(e)
    # an async save that may not stage (memory budget) runs steps 4-6 before it returns, so
    # mutating the state afterwards cannot reach the snapshot; after_commit runs on every rank
    calls: list[int] = []
    live = _dstate(world, 1, placements)
    h = deltackpt.async_save(
        live, store, "inline", process_group=pg, memory_budget=1,
        after_commit=lambda: calls.append(rank),
    )  # fmt: skip
    out["inline_done"] = h.done()
    for k in ("a", "b", "r"):
        live[k].to_local().fill_(-1)
    out["inline"] = h.result(timeout=60).name
    out["after_commit"] = calls
    deltackpt.save(_dstate(world, 2, placements), store, "good", process_group=pg)
    dist.destroy_process_group()
    return out


def test_every_rank_raises_the_same_typed_failures(tmp_path):
    store = str(tmp_path / "s")
    r0, r1 = run_ranks(_failing_saves, 2, free_port(), store, timeout=120)
    assert r0["plan"][0] == r1["plan"][0]  # the same message on every rank
    assert r0["plan"][1] == r1["plan"][1] == [(1, "plan", "UnsupportedValueError")]
    assert (r0["plan"][2], r1["plan"][2]) == (None, "UnsupportedValueError")  # chained locally
    assert "Nothing was committed" in r0["plan"][0]
    assert r0["commit"][0] == r1["commit"][0]
    assert r0["commit"][1] == r1["commit"][1] == [(0, "commit", "StoreIOError")]
    assert "No space left" in r0["commit"][0]
    assert r0["inline_done"] and r1["inline_done"]
    assert (r0["after_commit"], r1["after_commit"]) == ([0], [1])
    assert [s.name for s in deltackpt.snapshots(store)] == ["inline", "good"]
    got = deltackpt.load(store, "inline")
    for k, v in full_state(1).items():
        assert torch.equal(got[k], v), k
    assert deltackpt.verify(store).ok


def _batch(step: int) -> torch.Tensor:
    return torch.randn(4, 16, generator=torch.Generator().manual_seed(1000 + step))


def _fsdp_train(rank: int, world: int, port: int, store: str) -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    _init(rank, world, port)
    torch.manual_seed(0)
    model = MLP()
    # a CPU mesh: without one FSDP2 shards onto CUDA wherever it is visible (gloo, CPU batches)
    mesh = init_device_mesh("cpu", (world,))
    fully_shard(model.l1, mesh=mesh)
    fully_shard(model.l2, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(5):
        model(_batch(step)).pow(2).mean().backward()  # same batch on every rank
        opt.step()
        opt.zero_grad()
        if step <= 2:
            sd = {"model": model.state_dict(), "optim": opt.state_dict(), "step": step}
            deltackpt.save(sd, store, f"step-{step}", process_group=dist.group.WORLD)
    # numpy, not tensors: torch would pass tensors as shared-memory handles that die with us
    final = {k: v.full_tensor().numpy() for k, v in model.state_dict().items()}
    dist.destroy_process_group()
    return final


def test_fsdp2_training_resumes_on_a_different_world_size(tmp_path):
    store = str(tmp_path / "s")
    finals = run_ranks(_fsdp_train, 2, free_port(), store, timeout=150)
    # resume from step 2 on a single process without FSDP, train the same 2 steps
    state = deltackpt.load(store, "step-2")
    assert state["step"] == 2
    model = MLP()
    model.load_state_dict(state["model"])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    opt.load_state_dict(state["optim"])
    for step in (3, 4):
        model(_batch(step)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    for k, v in model.state_dict().items():
        assert torch.equal(v, torch.from_numpy(finals[0][k])), k

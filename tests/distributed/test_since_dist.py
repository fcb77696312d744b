"""Incremental load (``since=``) with a process group: 2 gloo ranks on 127.0.0.1, each holding a
resharded part of a snapshot saved by one process, catch up bit-exactly; a rank whose state does
not hold ``since`` stops both ranks before either writes."""

from __future__ import annotations

import datetime
from typing import Any

import pytest
import torch

import deltackpt
from tests._dist import free_port, run_ranks
from tests.loading._history import bits, new_store, publish, state_at

pytestmark = pytest.mark.multiproc

WORLD = 2


def _init(rank: int, port: int) -> Any:
    import torch.distributed as dist

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD,
        timeout=datetime.timedelta(seconds=60),
    )  # fmt: skip
    return dist.group.WORLD


def _rows(rank: int, t: torch.Tensor) -> torch.Tensor:
    return t.chunk(WORLD)[rank] if t.dim() else t


def _dtensors(rank: int, world: int, root: str, port: int, held: int, name: int) -> dict[str, Any]:
    """Every tensor a DTensor Shard(0) over 2 ranks: a window of whole rows of each tensor's
    bytes (the chunks at its edges are read whole and clipped)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    pg = _init(rank, port)
    mesh = init_device_mesh("cpu", (WORLD,))
    held_state = state_at(held)
    sd = {
        "model": {
            k: distribute_tensor(t, mesh, [Shard(0)]) for k, t in held_state["model"].items()
        },
        "step": -1,
    }
    stats = deltackpt.LoadStats()
    deltackpt.load(root, f"s{name}", into=sd, since=f"s{held}", process_group=pg, stats=stats)
    want = state_at(name)["model"]
    ok = all(
        torch.equal(bits(sd["model"][k].to_local()), bits(_rows(rank, want[k]).contiguous()))
        for k in want
    )
    full = deltackpt.LoadStats()
    fresh = {"model": {k: distribute_tensor(torch.zeros_like(t), mesh, [Shard(0)])
                       for k, t in held_state["model"].items()}}  # fmt: skip
    deltackpt.load(root, f"s{name}", into=fresh, process_group=pg, stats=full)
    dist.destroy_process_group()
    return {"ok": ok, "step": sd["step"], "unchanged": stats.chunks_unchanged,
            "patched": stats.chunks_patched, "read": stats.bytes_read, "full": full.bytes_read}  # fmt: skip


def _halves(rank: int, world: int, root: str, port: int, held: int, name: int) -> dict[str, Any]:
    """Each rank holds half of the keys as plain tensors (keys=): incremental on both."""
    import torch.distributed as dist

    pg = _init(rank, port)
    mine = ["model/w0", "model/w2", "model/bias"] if rank == 0 else ["model/w1", "model/w3"]
    s = state_at(held)["model"]
    sd = {"model": {k.split("/")[1]: s[k.split("/")[1]] for k in mine}}
    stats = deltackpt.LoadStats()
    with deltackpt.open_snapshot(root, f"s{name}") as f:
        f.load(into=sd, since=f"s{held}", keys=mine, process_group=pg, stats=stats)
    want = state_at(name)["model"]
    ok = all(torch.equal(bits(t), bits(want[k])) for k, t in sd["model"].items())
    dist.destroy_process_group()
    return {"ok": ok, "unchanged": stats.chunks_unchanged, "read": stats.bytes_read}


def _mismatch(rank: int, world: int, root: str, port: int, dtensor: bool) -> dict[str, Any]:
    import torch.distributed as dist

    pg = _init(rank, port)
    sd = state_at(1)
    if dtensor:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Shard, distribute_tensor

        mesh = init_device_mesh("cpu", (WORLD,))
        sd["model"] = {k: distribute_tensor(t, mesh, [Shard(0)]) for k, t in sd["model"].items()}
    local = {k: t.to_local() if dtensor else t for k, t in sd["model"].items()}
    if rank == 1:
        local["w3"].view(-1)[3] += 1  # rank 1 does not hold s1 (in its own rows)
    before = {k: t.clone() for k, t in local.items()}
    try:
        # w3 is unchanged: only verify="full" hashes it (the default checks what changes)
        deltackpt.load(root, "s3", into=sd, since="s1", process_group=pg, verify="full")
        err = None
    except Exception as e:
        err = type(e).__name__
    same = all(torch.equal(before[k], local[k]) for k in before)
    dist.destroy_process_group()
    return {"err": err, "unchanged": same}


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("since-dist") / "s"
    st = new_store(path)
    for k in range(5):
        publish(st, k)
    return str(path)


@pytest.mark.parametrize("held,name", [(0, 1), (1, 4)])  # from a keyframe / mid-chain
def test_two_ranks_dtensor_shards_catch_up(root: str, held: int, name: int) -> None:
    out = run_ranks(_dtensors, WORLD, root, free_port(), held, name, timeout=120)
    assert [o["ok"] for o in out] == [True, True]
    assert [o["step"] for o in out] == [name, name]
    for o in out:  # each rank skips the chunks of its rows that did not change
        assert o["unchanged"] > 0 and 0 < o["read"] < o["full"] / 2, o
    if held == 0:  # s1's changed chunks are xor deltas onto s0's: patched inside each window
        assert all(o["patched"] >= 1 for o in out), out  # rank 0: w0's; rank 1: w5's second


@pytest.mark.parametrize("held,name", [(0, 1), (1, 4)])
def test_two_ranks_holding_different_keys_catch_up_incrementally(
    root: str, held: int, name: int
) -> None:
    out = run_ranks(_halves, WORLD, root, free_port(), held, name, timeout=120)
    assert [o["ok"] for o in out] == [True, True]
    assert all(o["unchanged"] > 0 for o in out)  # w2 / w3 were not read at all


@pytest.mark.parametrize("dtensor", [False, True])
def test_one_rank_not_holding_since_stops_both(root: str, dtensor: bool) -> None:
    out = run_ranks(_mismatch, WORLD, root, free_port(), dtensor, timeout=120)
    assert out[1]["err"] == "HeldVersionMismatchError"
    assert out[0]["err"] == "DistributedError"
    assert [o["unchanged"] for o in out] == [True, True]


def _publish_sharded(rank: int, world: int, root: str, port: int, versions: int) -> bool:
    """A 2-rank trainer (FSDP2-like: every tensor Shard(0) over the ranks) publishes
    ``s0 .. s<versions-1>`` through distributed saves: its entries are row blocks."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    pg = _init(rank, port)
    mesh = init_device_mesh("cpu", (WORLD,))
    for k in range(versions):
        s = state_at(k)
        sd = {
            "model": {n: distribute_tensor(t, mesh, [Shard(0)]) for n, t in s["model"].items()},
            "step": k,
        }
        deltackpt.save(sd, root, f"s{k}", encoding="smallest", process_group=pg)
    dist.destroy_process_group()
    return True


def test_a_follower_of_a_distributed_trainer_catches_up_by_what_changed(tmp_path):
    from tests.loading._history import same

    root = str(tmp_path / "s")
    new_store(root)
    assert run_ranks(_publish_sharded, WORLD, root, free_port(), 3, timeout=120) == [True] * 2
    m = deltackpt.open_store(root).manifest("s2")
    assert all(e.shards is not None for e in m.tensors if e.shape)  # saved as row blocks
    held = state_at(1)
    stats = deltackpt.LoadStats()
    deltackpt.load(root, "s2", into=held, since="s1", stats=stats)
    assert same(held, state_at(2)) and held["step"] == 2
    full = deltackpt.LoadStats()
    deltackpt.load(root, "s2", into=state_at(0), stats=full)
    assert stats.chunks_unchanged > 0
    assert stats.bytes_read < full.bytes_read / 3, (stats, full)  # was: every row block read
    # 2 ranks holding Shard(0) windows of the same snapshots catch up bit-exactly too
    got = run_ranks(_dtensors, WORLD, str(root), free_port(), 1, 2, timeout=120)
    assert all(r["ok"] and r["step"] == 2 for r in got)
    assert all(r["read"] < r["full"] for r in got), got


def test_dtensor_windows_in_device_memory_catch_up_by_what_changed(tmp_path, monkeypatch):
    # Shard(0) DTensors whose local pieces stand in for GPU ones (DELTACKPT_DEVICE_SCAN=always):
    # the chunks in each rank's rows that changed are read, clipped at the window's edges
    root = str(tmp_path / "s")
    st = new_store(root)
    for k in range(3):
        publish(st, k)
    monkeypatch.setenv("DELTACKPT_DEVICE_SCAN", "always")
    got = run_ranks(_dtensors, WORLD, root, free_port(), 1, 2, timeout=120)
    assert all(r["ok"] and r["step"] == 2 for r in got), got
    assert all(r["unchanged"] > 0 and r["patched"] == 0 for r in got), got  # no patch on a GPU
    # each rank reads its changed chunks whole (no patch is applied on a device): rank 0 holds
    # rows every step changes in three tensors, so ~1/2 of a full load; rank 1 ~1/4
    assert all(r["read"] < 0.6 * r["full"] for r in got) and got[1]["read"] < got[1]["full"] / 3

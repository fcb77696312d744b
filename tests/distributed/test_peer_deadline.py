"""A peer that dies during an async save's background phase (issue 25, item 3).

The survivor waits for the dead rank's files under the store's ``tmp/`` only as long as the
process group's timeout (not ``lock_timeout``), raises a ``DistributedError`` naming that rank,
and releases the store lock: a gc of the store right after runs at once.
"""

from __future__ import annotations

import datetime
import os
import time
from typing import Any

import pytest
import torch

import deltackpt
from deltackpt.distributed.collectives import Group, group_timeout
from tests._dist import free_port, spawn

pytestmark = pytest.mark.multiproc

PG_TIMEOUT = 8.0  # seconds; lock_timeout stays at its default (600 s)


def _state(step: int, rank: int, world: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    full = torch.randn(64, 32, generator=torch.Generator().manual_seed(step))
    mesh = init_device_mesh("cpu", (world,))
    local = full.chunk(world, 0)[rank].contiguous()
    w = DTensor.from_local(
        local, mesh, [Shard(0)], run_check=False, shape=full.shape, stride=full.stride()
    )
    return {"w": w, "step": step}


def _die_in_background(rank: int, world: int, port: int, store: str, dying: int) -> dict:
    import torch.distributed as dist

    from deltackpt.store import packs

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
        timeout=datetime.timedelta(seconds=PG_TIMEOUT),
    )  # fmt: skip
    pg = dist.group.WORLD
    out: dict[str, Any] = {"timeout": group_timeout(pg), "group_timeout": Group(pg).timeout}
    deltackpt.save(_state(1, rank, world), store, "good", process_group=pg)
    if rank == dying:

        def die(self: Any, payload: Any) -> Any:  # the write step, on the background thread
            os._exit(3)

        packs.PackWriter.append = die  # type: ignore[method-assign]
    h = deltackpt.async_save(_state(2, rank, world), store, "doomed", process_group=pg)
    t0 = time.monotonic()  # the caller is unblocked: the background phase runs
    try:
        h.result(timeout=PG_TIMEOUT + 120)
        out["error"] = None
    except deltackpt.errors.DistributedError as e:
        out["error"] = (str(e), [(f.rank, f.step, f.error) for f in e.failures])
    out["seconds"] = time.monotonic() - t0
    t1 = time.monotonic()
    deltackpt.gc(store, lock_timeout=5)  # would raise StoreLockedError if we still held it
    out["gc_seconds"] = time.monotonic() - t1
    return out  # no destroy_process_group: its peer is gone (the child exits fast)


@pytest.mark.parametrize("dying", [1, 0])
def test_a_peer_dying_in_the_background_phase_fails_the_survivor_within_the_pg_timeout(
    tmp_path, dying
):
    store = str(tmp_path / "s")
    port = free_port()
    targets = [(_die_in_background, (r, 2, port, store, dying)) for r in range(2)]
    outcomes = spawn(targets, timeout=PG_TIMEOUT + 150, fast_exit=True)
    assert outcomes[dying].exitcode == 3
    got = outcomes[1 - dying].unwrap()
    assert got["timeout"] == got["group_timeout"] == PG_TIMEOUT
    assert got["error"] is not None, got
    message, failures = got["error"]
    assert [f[0] for f in failures] == [dying] and failures[0][2] == "TimeoutError", failures
    assert f"on rank(s) {dying} of 2" in message and "process group's timeout" in message
    assert "Nothing was committed" in message, message
    assert got["seconds"] < PG_TIMEOUT + 30, got  # not lock_timeout (600 s)
    assert got["gc_seconds"] < 60, got  # the lock was released (a busy machine adds seconds)
    # the store: nothing of the doomed save is listed, the earlier snapshot loads, gc runs
    assert [s.name for s in deltackpt.snapshots(store)] == ["good"]
    deltackpt.gc(store, lock_timeout=5)
    w = deltackpt.load(store, "good")["w"]
    assert torch.equal(w, torch.randn(64, 32, generator=torch.Generator().manual_seed(1)))

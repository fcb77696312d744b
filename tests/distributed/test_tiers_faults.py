"""Tiers under the faults an outside attack found (issue 37): a restore that ends with nothing
leaves every rank's state as it found it, and a peer's death is a typed DistributedError on the
survivor, whether it is seen by the SIGTERM agreement or by the background replication."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

import deltackpt
from tests._dist import free_port, init_gloo, run_ranks, spawn
from tests._faults import flip_chunk_bytes


def _tiers(root: str, rank: int) -> Any:
    from deltackpt.tiers import Tiers

    return Tiers(
        local=Path(root) / f"node{rank}", durable=None, replicas=1, ranks_per_node=1,
        keep_last=2,
    )  # fmt: skip


def _state(step: int, rank: int) -> dict[str, Any]:
    return {"w": torch.full((70_000,), float(100 * rank + step)), "step": step}


def _flip_every_chunk(store_dir: Path) -> None:
    flip_chunk_bytes(store_dir, xor=1)


def _no_mix(rank: int, world: int, port: int, root: str) -> dict[str, Any]:
    import torch.distributed as dist

    from deltackpt.tiers import TieredCheckpointer

    pg = init_gloo(rank, world, port)
    tiers = _tiers(root, rank)
    ckpt = TieredCheckpointer(tiers, every=1, process_group=pg)
    for step in range(4):
        ckpt.maybe_save(step, _state(step, rank))
    ckpt.close()
    dist.barrier()
    # rank 1's own snapshots and its replicas on node 0: one byte of every chunk flipped
    _flip_every_chunk(tiers.own_dir(1) if rank == 1 else tiers.replica_dir(1, 0))
    dist.barrier()
    state = {"w": torch.zeros(70_000), "step": -1}
    again = TieredCheckpointer(tiers, every=1, process_group=pg)
    start = again.restore_latest(state)
    again.close()
    return {
        "start": start,
        "step": again.last_restore.step if again.last_restore else "?",
        "untouched": bool((state["w"] == 0).all()) and state["step"] == -1,
        "refused": len(again.last_restore.refused) if again.last_restore else 0,
    }


@pytest.mark.multiproc
def test_a_restore_that_ends_with_nothing_leaves_every_rank_as_it_was(tmp_path):
    results = run_ranks(_no_mix, 2, free_port(), str(tmp_path), timeout=120)
    for rank, r in enumerate(results):
        assert r["start"] == 0 and r["step"] is None, (rank, r)
        assert r["refused"] >= 2, (rank, r)  # steps were tried, and refused
        assert r["untouched"], (rank, r)  # rank 0 had loaded steps 3 and 2: put back


def _peer_dies(rank: int, world: int, port: int, root: str, sigterm: bool) -> dict[str, Any]:
    from deltackpt.tiers import TieredCheckpointer

    pg = init_gloo(rank, world, port, timeout=15)
    ckpt = TieredCheckpointer(_tiers(root, rank), every=1, process_group=pg, handle_sigterm=sigterm)
    try:
        for step in range(8):
            ckpt.maybe_save(step, _state(step, rank))
            if rank == 1 and step == 2:
                os._exit(5)
        ckpt.wait()
    except deltackpt.errors.DistributedError as e:
        return {"error": type(e).__name__, "message": str(e)}
    except Exception as e:  # an untyped error is the bug
        return {"error": type(e).__name__, "message": str(e)}
    return {"error": None}


@pytest.mark.multiproc
@pytest.mark.parametrize("sigterm", [True, False], ids=["sigterm-agreement", "replication"])
def test_a_dead_peer_is_a_typed_error_on_the_survivor(tmp_path, sigterm):
    port = free_port()
    targets = [(_peer_dies, (r, 2, port, str(tmp_path), sigterm)) for r in range(2)]
    outcomes = spawn(targets, timeout=120, fast_exit=True)
    assert outcomes[1].exitcode == 5
    got = outcomes[0].unwrap()
    assert got["error"] == "DistributedError", got
    assert "died or did not answer" in got["message"] and "restore_latest" in got["message"], got

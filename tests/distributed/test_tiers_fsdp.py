"""Tiered checkpoints with FSDP2 (``fully_shard``) and AdamW on 2 gloo ranks posing as 2 nodes:
node 1's local tier is lost; a fresh model and a fresh optimizer (no moments yet) resume from
rank 0's replica of rank 1's shards and from rank 0's own tier, bit-exactly, the moments come back
as DTensors, and training on gives the weights of the uninterrupted run."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest

from tests._dist import free_port, init_gloo, run_ranks
from tests.distributed.test_checkpointer_fsdp import _fsdp, _same, _train, _values

pytestmark = pytest.mark.multiproc


def _ckpt(root: str, rank: int, pg: Any) -> Any:
    from deltackpt.tiers import TieredCheckpointer, Tiers

    tiers = Tiers(local=Path(root) / f"node{rank}", replicas=1, ranks_per_node=1)
    return TieredCheckpointer(tiers, every=1, process_group=pg)


def _first_run(rank: int, world: int, port: int, root: str) -> dict[str, Any]:
    pg = init_gloo(rank, world, port, 60.0)
    model, opt = _fsdp(0)
    ckpt = _ckpt(root, rank, pg)
    out: dict[str, Any] = {}
    for step in range(4):
        _train(model, opt, step, rank)
        ckpt.maybe_save(step, {"model": model, "optim": opt, "data": {"seen": step + 1}})
    ckpt.close()
    out["saved"] = _values(model, opt)
    for step in (4, 5):
        _train(model, opt, step, rank)
    out["final"] = _values(model, opt)
    return out


def _resume(rank: int, world: int, port: int, root: str) -> dict[str, Any]:
    from torch.distributed.tensor import DTensor

    pg = init_gloo(rank, world, port, 60.0)
    model, opt = _fsdp(seed=1)  # other weights, no moments: the restore must replace it all
    state = {"model": model, "optim": opt, "data": {"seen": 0}}
    ckpt = _ckpt(root, rank, pg)
    out: dict[str, Any] = {"start": ckpt.restore_latest(state), "report": ckpt.last_restore}
    out["seen"] = state["data"]["seen"]
    out["moments_are_dtensors"] = bool(opt.state) and all(
        isinstance(v, DTensor) for s in opt.state.values() for k, v in s.items() if k != "step"
    )
    out["restored"] = _values(model, opt)
    for step in (4, 5):
        _train(model, opt, step, rank)
    out["final"] = _values(model, opt)
    ckpt.close()
    return out


def test_fsdp2_resumes_from_a_peer_replica_with_a_fresh_optimizer(tmp_path: Path) -> None:
    first = run_ranks(_first_run, 2, free_port(), str(tmp_path), timeout=180)
    shutil.rmtree(tmp_path / "node1")
    again = run_ranks(_resume, 2, free_port(), str(tmp_path), timeout=180)
    for a, b in zip(first, again, strict=True):
        assert b["start"] == 4 and b["seen"] == 4
        assert b["report"].sources == ("local", "peer 0") and b["report"].refused == ()
        assert b["moments_are_dtensors"]
        _same(b["restored"], a["saved"])
        _same(b["final"], a["final"])

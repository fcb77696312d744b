"""Tiered checkpoints through torch.distributed.checkpoint (deltackpt/tiers/dcp.py): 4 gloo
ranks as 2 nodes save every step with ``dcp.save(..., storage_writer=TieredWriter(ckpt, step))``
and restore with ``dcp.load(..., storage_reader=TieredReader(ckpt))``."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest

from deltackpt.store.store import open_store
from tests._dist import free_port, run_ranks
from tests.distributed._tiers_dcp_worker import run

pytestmark = pytest.mark.multiproc


def _run(root: Path, world: int, **cfg: Any) -> list[dict[str, Any]]:
    return run_ranks(run, world, free_port(), str(root), cfg, timeout=150)


def _steps(*steps: int) -> list[str]:
    return [f"step-{s:08d}" for s in steps]


def test_dcp_through_tiers_survives_a_node_loss_and_reshards_from_durable(tmp_path: Path) -> None:
    out = _run(tmp_path, 4, fresh=True, steps=4, persist_every=2)
    assert all(o["final_ok"] and o["stats"].replicas_committed == 4 for o in out), out
    assert open_store(tmp_path / "node1" / "rank-00003").names() == _steps(2, 3)
    assert open_store(tmp_path / "node0" / "replica-00003-on-00001").names() == _steps(2, 3)
    assert open_store(tmp_path / "durable").names() == _steps(1, 3)

    shutil.rmtree(tmp_path / "node1")  # node 1 lost: ranks 2 and 3 restore from their peers
    out = _run(tmp_path, 4, steps=6, persist_every=2)
    for o in out:
        assert o["start"] == 4 and o["restored_ok"] and o["final_ok"], o
        assert o["report"].sources == ("local", "local", "peer 0", "peer 1")
    assert open_store(tmp_path / "node1" / "rank-00002").names() == _steps(4, 5)

    # another sharding with the same world size: the local pieces do not fit, a typed error
    # says so; the durable tier reshards (loaded next, in the same processes)
    out = _run(tmp_path, 4, shard_dim=1, retry_tier="durable")
    assert all("StateMismatchError" in o["error"] and "tier='durable'" in o["error"] for o in out)
    for o in out:
        assert o["start"] == 6 and o["restored_ok"], o
        assert o["report"].sources == ("durable",) * 4

    out = _run(tmp_path, 2, ranks_per_node=1)  # another world size: only the durable tier
    for o in out:
        assert o["start"] == 6 and o["restored_ok"] and o["report"].sources == ("durable",) * 2

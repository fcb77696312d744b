"""Tiered checkpoints (issue 28): 4 gloo ranks on one host posing as 2 nodes of 2 ranks, each
node its own local-tier directory (``<root>/node0``, ``<root>/node1``), replicas on the other
node (jump 2), a durable directory shared by all. The rank body is
``tests/distributed/_tiers_worker.py`` (a DTensor-sharded state whose value at every step is
known, so "bit-exact" is checked against what the state must be, not against another run).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from deltackpt.errors import InvalidArgumentError
from deltackpt.store.store import open_store
from deltackpt.store.verify import verify
from deltackpt.tiers import Tiers
from tests._dist import free_port, run_ranks, spawn
from tests.distributed._tiers_worker import run

pytestmark = pytest.mark.multiproc


def _run(root: Path, world: int, timeout: float = 120.0, **cfg: Any) -> list[dict[str, Any]]:
    return run_ranks(run, world, free_port(), str(root), cfg, timeout=timeout)


def _names(path: Path) -> list[str]:
    return sorted(open_store(path, create=False).names())


def _steps(*steps: int) -> list[str]:
    return [f"step-{s:08d}" for s in steps]


def _corrupt_newest_chunk(store_dir: Path, newer: str, older: str) -> str:
    """Flip one byte of a chunk that snapshot ``newer`` has and ``older`` has not."""
    st = open_store(store_dir, create=False)
    new, old = st.manifest(newer).chunks, st.manifest(older).chunks
    d = sorted(set(new) - set(old))[0]
    rec = new[d]
    pack = st.pack_path(rec.pack)
    data = np.fromfile(pack, dtype=np.uint8)
    data[rec.offset + rec.length // 2] ^= 0xFF
    data.tofile(pack)
    return d


def test_tiers_arguments_are_checked() -> None:
    with pytest.raises(InvalidArgumentError, match="replicas"):
        Tiers(local="/tmp/x", replicas=-1)
    with pytest.raises(InvalidArgumentError, match="durable="):
        Tiers(local="/tmp/x", persist_every=10)
    with pytest.raises(InvalidArgumentError, match="local directory"):
        Tiers(local="s3://bucket/run")
    with pytest.raises(InvalidArgumentError, match="cannot place replicas"):
        Tiers(local="/tmp/x").check_world(2, 2)  # the replica would land on the rank itself
    Tiers(local="/tmp/x").check_world(4, 2)
    assert Tiers(local="/tmp/x", replicas=2).peers(1, 6, 2) == [3, 5]


def test_node_loss_resumes_bit_exactly_from_peers_and_each_tier_keeps_its_count(
    tmp_path: Path,
) -> None:
    out = _run(tmp_path, 4, steps=6, measure=True, persist_every=2, durable_keep_last=1)
    # retention of each tier: keep_last=2 local and per replica, durable_keep_last=1
    for node, ranks in (("node0", (0, 1)), ("node1", (2, 3))):
        for r in ranks:
            assert _names(tmp_path / node / f"rank-{r:05d}") == _steps(4, 5)
            peer = (r + 2) % 4
            held = tmp_path / ("node1" if node == "node0" else "node0")
            assert _names(held / f"replica-{r:05d}-on-{peer:05d}") == _steps(4, 5)
    assert _names(tmp_path / "durable") == _steps(5)
    # replication sends only the chunks the peer lacks: the first step sends w and e, later
    # steps only w's changed chunk (e never changes)
    for o in out:
        per_step = np.diff([0, *o["sent"]])
        assert per_step[0] > 0 and all(0 < b < per_step[0] for b in per_step[1:]), per_step
        assert o["stats"].refused == []

    shutil.rmtree(tmp_path / "node1")  # node 1 lost: its ranks' local tier and the replicas
    out = _run(tmp_path, 4, steps=8)
    for o in out:
        assert o["start"] == 6
        assert o["restored_ok"]
        assert o["report"].sources == ("local", "local", "peer 0", "peer 1")
        assert o["report"].refused == ()
    # the restarted node's tier is whole again: its own snapshots and the replicas it holds
    assert _names(tmp_path / "node1" / "rank-00002") == _steps(6, 7)
    assert _names(tmp_path / "node1" / "replica-00000-on-00002") == _steps(6, 7)


@pytest.fixture(scope="module")
def four_steps(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """4 ranks, 4 steps saved (replicas on the other node, nothing durable): the starting
    point of the damage tests, made once and copied by each."""
    root = tmp_path_factory.mktemp("four-steps")
    _run(root, 4, steps=4)
    return root


def _from(base: Path, tmp_path: Path) -> Path:
    root = tmp_path / "run"
    shutil.copytree(base, root, symlinks=True)
    return root


def test_a_damaged_replica_is_refused_and_restore_falls_back(
    four_steps: Path, tmp_path: Path
) -> None:
    tmp_path = _from(four_steps, tmp_path)
    shutil.rmtree(tmp_path / "node0")  # ranks 0 and 1 must come from their replicas
    bad = _corrupt_newest_chunk(
        tmp_path / "node1" / "replica-00000-on-00002", *_steps(3, 2)
    )  # fmt: skip
    out = _run(tmp_path, 4)
    for o in out:
        rep = o["report"]
        assert rep.step == 2 and o["start"] == 3
        assert o["restored_ok"]
        assert rep.sources == ("peer 2", "peer 3", "local", "local")
        assert len(rep.refused) == 1
        assert "step 3, rank 0, peer 2" in rep.refused[0] and "damaged" in rep.refused[0]
    # the damaged chunk was never written into rank 0's rebuilt local tier
    st = open_store(tmp_path / "node0" / "rank-00000", create=False)
    assert st.names() == _steps(2)
    assert bad not in st.chunk_index()


def test_a_damaged_own_snapshot_is_replaced_by_the_peers_replica(
    four_steps: Path, tmp_path: Path
) -> None:
    tmp_path = _from(four_steps, tmp_path)
    _corrupt_newest_chunk(tmp_path / "node1" / "rank-00003", *_steps(3, 2))
    out = _run(tmp_path, 4)
    for o in out:
        rep = o["report"]
        assert rep.step == 3 and o["restored_ok"]
        assert rep.sources == ("local", "local", "local", "peer 1")
        assert len(rep.refused) == 1 and "step 3, rank 3, local" in rep.refused[0]
    assert verify(tmp_path / "node1" / "rank-00003", _steps(3)).ok  # healed from the replica


def test_a_rank_whose_local_tier_cannot_be_opened_falls_back_without_a_timeout(
    tmp_path: Path,
) -> None:
    _run(tmp_path, 4, steps=4, persist_every=2)
    shutil.rmtree(tmp_path / "node1")  # ranks 2 and 3 must fetch from their peers, but ...
    out = _run(tmp_path, 4, timeout=60, damage_own=3)  # ... rank 3 cannot open its own tier
    for o in out:
        rep = o["report"]
        assert rep.step == 3 and rep.sources == ("durable",) * 4 and o["restored_ok"]
        refused = [r for r in rep.refused if "rank 3, peer 1" in r]
        assert len(refused) == 1 and "cannot be opened" in refused[0], rep


def test_a_crash_mid_replication_leaves_no_half_replica(tmp_path: Path) -> None:
    port = free_port()
    cfg = {"steps": 4, "keep_last": 3, "timeout": 10.0, "crash_replica": (2, "step-00000003")}
    outcomes = spawn([(run, (r, 4, port, str(tmp_path), cfg)) for r in range(4)], timeout=120)
    assert outcomes[2].exitcode == 17  # died with rank 0's chunks written, before the commit
    held = tmp_path / "node1" / "replica-00000-on-00002"
    assert _names(held) == _steps(0, 1, 2)  # step 3: no manifest, so no replica
    assert verify(held).ok

    shutil.rmtree(tmp_path / "node0")
    out = _run(tmp_path, 4)
    for o in out:
        assert o["report"].step == 2 and o["restored_ok"]
        assert o["report"].sources == ("peer 2", "peer 3", "local", "local")


def test_a_crash_mid_persist_keeps_the_previous_durable_version(tmp_path: Path) -> None:
    port = free_port()
    cfg = {"steps": 4, "persist_every": 2, "timeout": 10.0, "crash_persist": "step-00000003"}
    outcomes = spawn([(run, (r, 4, port, str(tmp_path), cfg)) for r in range(4)], timeout=120)
    assert outcomes[0].exitcode == 18  # rank 0 died right before committing step 3
    assert _names(tmp_path / "durable") == _steps(1)
    assert verify(tmp_path / "durable").ok
    # another world size: only the durable tier applies (local snapshots are of 4 ranks)
    out = _run(tmp_path, 2, ranks_per_node=1, dcp_check=True)  # 2 nodes of 1 rank now
    for o in out:
        assert o["report"].step == 1 and o["report"].sources == ("durable", "durable")
        assert o["restored_ok"]  # resharded from 4 shards to 2
        assert o["dcp_ok"]  # and torch.distributed.checkpoint.load of it, with StoreReader


def test_sigterm_flushes_to_durable_and_another_world_size_resumes(tmp_path: Path) -> None:
    out = _run(tmp_path, 4, steps=6, sigterm=(1, 2))
    assert [o["stopped_at"] for o in out] == [2, 2, 2, 2]  # every rank agreed on the signal
    assert _names(tmp_path / "durable") == _steps(2)
    out = _run(tmp_path, 2, steps=4, ranks_per_node=1)
    for o in out:
        assert o["start"] == 3 and o["restored_ok"]
        assert o["report"].sources == ("durable", "durable")


def _construct(rank: int, world: int, port: int, root: str) -> str:
    from deltackpt.tiers import TieredCheckpointer
    from tests._dist import init_gloo

    pg = init_gloo(rank, world, port)
    try:
        TieredCheckpointer(Tiers(local=root), process_group=pg)  # ranks per node from host names
    except InvalidArgumentError as e:
        return str(e)
    return "constructed"


def test_replicas_on_one_host_are_refused_on_every_rank(tmp_path: Path) -> None:
    # every rank runs on this host: no other node could hold a replica
    out = run_ranks(_construct, 2, free_port(), str(tmp_path), timeout=60)
    assert all("2 rank(s) per node cannot place replicas" in o for o in out), out

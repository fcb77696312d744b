"""The DCP path's bytes are pinned too: ``dcp.save`` through ``StoreWriter``, on one process and
on two gloo ranks, reproduces the golden stores (packs byte for byte, manifests but for their
timings), as the local and distributed saves do in test_format.py.

The golden stores were written by the DCP plug-in before it committed through the shared
manifest builder (``saving/commit.py``), so these tests prove that move changed no byte.
"""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

import deltackpt
from deltackpt.dcp import StoreReader, StoreWriter
from deltackpt.format.codecs import RAW, EncodePolicy
from deltackpt.saving.hooks import hooks
from deltackpt.store import packs as pack
from tests.format.test_format import GOLDEN_NS, _stable, golden_rank

GOLDEN_DCP = Path(__file__).parents[1] / "golden" / "v2-dcp"  # one process, snapshots c0 and c1
GOLDEN_DCP_DIST = Path(__file__).parents[1] / "golden" / "v2-dcp-dist"  # 2 gloo ranks, d0 and d1

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def dcp_golden_state(step: int) -> dict:
    """A fixed state touching every kind of DCP write item: tensors (a parameter, bfloat16, an
    empty one, one of several chunks), inline values, and a value holding a tensor (stored as
    its torch.save bytes). ``step`` 1 changes one tensor, so ``c1`` reuses the other chunks."""
    w = torch.arange(12, dtype=torch.float32).reshape(3, 4) / 8
    return {
        "model": {
            "weight": torch.nn.Parameter(w + step),
            "bias": torch.tensor([1.5, -2.0], dtype=torch.bfloat16),
        },
        "big": torch.arange(5000, dtype=torch.int32),  # 20000 bytes: split into chunks
        "empty": torch.zeros(0, 3),
        "step": step,
        "values": {"s": "x", "f": 0.25, "flags": (True, None)},
        "held": (torch.arange(4, dtype=torch.int64), "t"),  # holds a tensor: torch.save bytes
    }


def _writer(store: str | Path, name: str) -> StoreWriter:
    w = StoreWriter(
        store, name, threads=1, encoding=EncodePolicy(codecs=(RAW,)), metadata={"golden": name}
    )
    w.save_id = f"save-{name}"  # DCP's StorageMeta.save_id (random otherwise)
    return w


def save_dcp_golden(store_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ids = iter(f"dcp{i:017d}" for i in range(100))
    monkeypatch.setattr(pack, "new_pack_id", lambda: next(ids))
    monkeypatch.setattr(hooks, "clock", lambda: GOLDEN_NS)
    deltackpt.open_store(store_dir, chunk_bytes=8192, small_bytes=4096)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is (disabled|unavailable)")
        for step in (0, 1):
            dcp.save(dcp_golden_state(step), storage_writer=_writer(store_dir, f"c{step}"))


def _same_store(new: Path, old: Path, names: tuple[str, ...]) -> None:
    for name in names:
        got = json.loads((new / f"snapshots/{name}/MANIFEST.json").read_bytes())
        want = json.loads((old / f"snapshots/{name}/MANIFEST.json").read_bytes())
        assert _stable(got) == _stable(want), name
    assert sorted(p.name for p in (new / "packs").iterdir()) == sorted(
        p.name for p in (old / "packs").iterdir()
    )
    for p in sorted((old / "packs").iterdir()):
        assert (new / "packs" / p.name).read_bytes() == p.read_bytes(), p.name
    assert (new / "STORE.json").read_bytes() == (old / "STORE.json").read_bytes()


def test_dcp_save_reproduces_golden_bytes(tmp_path, monkeypatch):
    save_dcp_golden(tmp_path / "s", monkeypatch)
    _same_store(tmp_path / "s", GOLDEN_DCP, ("c0", "c1"))
    stats = json.loads((GOLDEN_DCP / "snapshots/c1/MANIFEST.json").read_bytes())["stats"]
    assert stats["chunks_new"] >= 1 and stats["chunks_reused"] >= 1  # c1 reuses c0's chunks


def test_dcp_golden_store_loads(tmp_path):
    copy = tmp_path / "golden"
    shutil.copytree(GOLDEN_DCP, copy)
    assert deltackpt.verify(copy).ok
    want = dcp_golden_state(1)
    out = deltackpt.load(copy, "c1")  # nested again from the stored planner_data
    assert torch.equal(out["model"]["weight"], want["model"]["weight"].detach())
    assert torch.equal(out["big"], want["big"]) and out["values"]["s"] == "x"
    into = {k: v for k, v in dcp_golden_state(0).items() if k in ("model", "big", "step")}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is (disabled|unavailable)")
        dcp.load(into, storage_reader=StoreReader(copy, "c1"))
    assert torch.equal(into["model"]["weight"], want["model"]["weight"]) and into["step"] == 1


def dcp_dist_golden_state(world: int, step: int) -> dict:
    """Per rank: row- and column-sharded DTensors, a replicated tensor of several chunks and
    values; ``step`` 1 changes some of the chunks."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    rows = torch.arange(24, dtype=torch.float32).reshape(6, 4) / 8 + step
    cols = (torch.arange(30, dtype=torch.float32).reshape(3, 10) / 4).to(torch.bfloat16)
    rep = torch.arange(5000, dtype=torch.int32)
    return {
        "rows": distribute_tensor(rows, mesh, [Shard(0)]),
        "cols": distribute_tensor(cols, mesh, [Shard(1)]),
        "replicated": rep,
        "values": {"step": step, "s": "x"},
    }


def save_dcp_dist_golden(rank: int, world: int, port: int, store: str) -> None:
    import torch.distributed as dist

    golden_rank(rank, world, port, store, iter(f"dcp{rank}pack{i:013d}" for i in range(100)))
    for step in (0, 1):
        dcp.save(dcp_dist_golden_state(world, step), storage_writer=_writer(store, f"d{step}"))
    dist.destroy_process_group()


@pytest.mark.multiproc
def test_distributed_dcp_save_reproduces_golden_bytes(tmp_path):
    from tests._dist import free_port, run_ranks

    store = tmp_path / "s"
    run_ranks(save_dcp_dist_golden, 2, free_port(), str(store), timeout=120)
    _same_store(store, GOLDEN_DCP_DIST, ("d0", "d1"))
    out = deltackpt.load(store, "d1")
    assert torch.equal(out["rows"], torch.arange(24, dtype=torch.float32).reshape(6, 4) / 8 + 1)
    assert torch.equal(out["replicated"], torch.arange(5000, dtype=torch.int32))

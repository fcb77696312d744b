"""A 2-rank distributed save (DTensor Shard(0), gloo on 127.0.0.1) to an S3 object store (a moto
server started here): every rank uploads its own packs, rank 0 commits; a load on 1 rank is
bit-exact. Sync and async saves, by URL + storage_options and by an opened Store."""

from __future__ import annotations

import datetime
from typing import Any

import pytest
import torch

import deltackpt
from tests._dist import free_port, run_ranks

pytest.importorskip("s3fs")
pytest.importorskip("moto.server")
pytest.importorskip("boto3")

from tests._s3 import new_bucket, s3_options, s3_server

pytestmark = pytest.mark.multiproc


def _full(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7 + step)
    return {
        "w": torch.randn(10, 300, generator=g),  # uneven rows over 2 ranks? 5 + 5
        "b": torch.randn(9, 33, generator=g).to(torch.bfloat16),  # 5 + 4 rows
        "r": torch.arange(1000, dtype=torch.int64) * (step + 1),  # replicated plain tensor
    }


def _save(rank: int, world: int, port: int, url: str, opts: dict[str, Any]) -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
        timeout=datetime.timedelta(seconds=60),
    )  # fmt: skip
    mesh = init_device_mesh("cpu", (world,))
    pg = dist.group.WORLD
    st = deltackpt.open_store(url, storage_options=opts, chunk_bytes=64 << 10)
    infos = []
    for step in range(2):
        full = _full(step)
        state = {
            "w": distribute_tensor(full["w"], mesh, [Shard(0)]),
            "b": distribute_tensor(full["b"], mesh, [Shard(0)]),
            "r": full["r"],
            "meta": {"step": step},
        }
        if step == 0:  # by URL + storage_options
            info = deltackpt.save(state, url, f"s{step}", process_group=pg, storage_options=opts)
        else:  # async, through the opened Store
            info = deltackpt.async_save(state, st, f"s{step}", process_group=pg).result(60)
        infos.append(info.chunks_new)
    dist.barrier()
    dist.destroy_process_group()
    return {"rank": rank, "chunks_new": infos}


def test_two_ranks_save_to_s3_then_load_on_one_rank() -> None:
    with s3_server() as endpoint:
        bucket = new_bucket(endpoint)
        url, opts = f"s3://{bucket}/run", s3_options(endpoint)
        out = run_ranks(_save, 2, free_port(), url, opts, timeout=120)
        assert [o["rank"] for o in out] == [0, 1]
        st = deltackpt.open_store(url, storage_options=opts)
        assert [i.name for i in deltackpt.snapshots(st)] == ["s0", "s1"]
        packs = {c.pack for m in ("s0", "s1") for c in st.manifest(m).chunks.values()}
        assert len(packs) >= 2  # each rank uploaded its own packs
        for step in range(2):
            got = deltackpt.load(st, f"s{step}")
            for k, v in _full(step).items():
                assert got[k].dtype == v.dtype and torch.equal(got[k], v), (step, k)
            assert got["meta"] == {"step": step}
        assert not deltackpt.verify(st).problems

"""``deltackpt.open_snapshot``: lazy, bit-exact reads of whole tensors and slices that touch only
the chunks they need (single-process saves, a 2-rank sharded save, the golden distributed store)."""

from __future__ import annotations

import datetime
import shutil
from pathlib import Path

import pytest
import torch

import deltackpt
from deltackpt.errors import InvalidArgumentError, KeyNotInSnapshotError
from deltackpt.format.codecs import RAW, EncodePolicy
from tests._dist import free_port, run_ranks
from tests.loading.test_keys import count_reads

RAW_ONLY = EncodePolicy(codecs=(RAW,))
GOLDEN_DIST = Path(__file__).parent.parent / "golden" / "v2-dist"


def _bits(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _global(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "rows": torch.randn(256, 64, generator=g),  # 64 KiB: 16 chunks of 4 KiB
        "cols": torch.randn(32, 96, generator=g).to(torch.bfloat16),
        "rep": torch.arange(3000, dtype=torch.int32),
    }


def _save_sharded(rank: int, world: int, port: int, store: str) -> bool:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
        timeout=datetime.timedelta(seconds=30),
    )  # fmt: skip
    if rank == 0:
        deltackpt.open_store(store, chunk_bytes=4096, small_bytes=1024)
    dist.barrier()
    mesh = init_device_mesh("cpu", (world,))
    full = _global()
    state = {
        "rows": distribute_tensor(full["rows"], mesh, [Shard(0)]),
        "cols": distribute_tensor(full["cols"], mesh, [Shard(1)]),
        "rep": distribute_tensor(full["rep"], mesh, [Replicate()]),
        "step": 3,
    }
    deltackpt.save(state, store, "d", process_group=dist.group.WORLD, encoding=RAW_ONLY)
    dist.destroy_process_group()
    return True


@pytest.fixture(scope="module")
def sharded_store(tmp_path_factory: pytest.TempPathFactory) -> str:
    store = str(tmp_path_factory.mktemp("lazy") / "s")
    assert run_ranks(_save_sharded, 2, free_port(), store, timeout=90) == [True, True]
    return store


@pytest.mark.multiproc
def test_whole_tensors_and_slices_of_a_two_rank_sharded_save(sharded_store: str) -> None:
    full = deltackpt.load(sharded_store, "d")
    with deltackpt.open_snapshot(sharded_store) as f:
        assert f.name == "d" and sorted(f.keys()) == ["cols", "rep", "rows"]
        assert f.values == {"step": 3}
        for k in list(f.keys()):
            assert _bits(f.get_tensor(k)) == _bits(full[k]), k
        rows, cols = f.get_slice("rows"), f.get_slice("cols")
        assert rows.shape == (256, 64) and cols.dtype == torch.bfloat16
        for sl in [
            (slice(100, 140),),
            (slice(120, 136), slice(3, 50)),
            (5,),
            (-1, slice(None, None, 3)),
            (slice(0, 256, 7), 2),
            (Ellipsis, slice(10, 12)),
            (slice(127, 129),),  # across the two ranks' shards
            (slice(50, 50),),
        ]:
            assert torch.equal(rows[sl], full["rows"][sl]), sl
        for sl in [(slice(3, 9), slice(40, 60)), (slice(None), slice(45, 50)), (0,)]:
            assert _bits(cols[sl]) == _bits(full["cols"][sl]), sl  # 45:50 spans both shards


@pytest.mark.multiproc
def test_a_row_slice_reads_only_its_chunks(sharded_store: str) -> None:
    with deltackpt.open_snapshot(sharded_store, "d") as f:
        with count_reads() as n:
            part = f.get_slice("rows")[160:176]  # 16 rows x 256 B: exactly one 4 KiB chunk
        assert n[0] == 16 * 64 * 4
        with count_reads() as n:
            f.get_slice("rows")[100:200]
        assert n[0] <= (100 + 2 * 16) * 64 * 4  # at most one chunk of slack at each end
        with count_reads() as n:
            f.get_tensor("rows")
        assert n[0] == 256 * 64 * 4
    assert torch.equal(part, _global()["rows"][160:176])


def test_single_process_save_tied_views_and_errors(store_dir: Path) -> None:
    deltackpt.open_store(store_dir, chunk_bytes=4096, small_bytes=512)
    w = torch.randn(64, 32)
    state = {"emb": w, "head": w, "half": w[10:20], "scalar": torch.tensor(2.5), "lr": 0.1}
    deltackpt.save(state, store_dir, "s", metadata={"step": 7}, encoding=RAW_ONLY)
    full = deltackpt.load(store_dir, "s")
    f = deltackpt.open_snapshot(store_dir, verify=True, threads=1)
    assert f.metadata == {"step": 7} and f.values == {"lr": 0.1}
    for k in ("emb", "head", "half", "scalar"):
        t = f.get_tensor(k)
        assert _bits(t) == _bits(full[k]), k
        assert t.untyped_storage().nbytes() == t.nbytes  # owns only its own bytes
    assert torch.equal(f.get_slice("half")[2:4, 5], w[12:14, 5])
    assert f.get_slice("scalar")[...].item() == 2.5
    with pytest.raises(KeyNotInSnapshotError, match="no tensor 'model/emb'"):
        f.get_tensor("model/emb")
    with pytest.raises(InvalidArgumentError, match="positive steps"):
        f.get_slice("emb")[::-1]
    with pytest.raises(InvalidArgumentError, match="3 indices"):
        f.get_slice("emb")[1, 2, 3]
    with pytest.raises(IndexError):
        f.get_slice("emb")[64]
    f.close()


def test_get_tensors_reads_a_shared_chunk_once(store_dir: Path) -> None:
    """Small tensors share group chunks: get_tensors reads each chunk once (get_tensor in a loop
    reads a group chunk once per tensor in it), with the same bits, and refuses a missing key
    before reading anything."""
    deltackpt.open_store(store_dir, chunk_bytes=1 << 16, small_bytes=1 << 12)
    g = torch.Generator().manual_seed(3)
    state = {f"lora.{i}": torch.randn(8, 16, generator=g) for i in range(32)}  # 512 B each
    w = torch.randn(64, 32, generator=g)
    state |= {"emb": w, "half": w[10:20]}
    deltackpt.save(state, store_dir, "s", encoding=RAW_ONLY)
    keys = sorted(state)
    with deltackpt.open_snapshot(store_dir, "s") as f:
        with count_reads() as one_by_one:
            each = {k: f.get_tensor(k) for k in keys}
        with count_reads() as batched:
            got = f.get_tensors(keys)
        assert list(got) == keys and all(_bits(got[k]) == _bits(state[k]) for k in keys)
        assert all(_bits(got[k]) == _bits(each[k]) for k in keys)
        assert got["half"].untyped_storage().nbytes() == got["half"].nbytes
        assert batched[0] * 4 < one_by_one[0], (batched[0], one_by_one[0])
        with count_reads() as none, pytest.raises(KeyNotInSnapshotError, match="'nope'"):
            f.get_tensors(["lora.0", "nope"])
        assert none[0] == 0
        assert f.get_tensors([]) == {}


def test_read_boxes_reads_a_shared_chunk_once(store_dir: Path) -> None:
    """What the tiers' DCP reader asks for: boxes of many small tensors (and of a view of a
    shared storage) in one pass, each the bits read_box gives, their group chunks read once."""
    deltackpt.open_store(store_dir, chunk_bytes=1 << 16, small_bytes=1 << 12)
    g = torch.Generator().manual_seed(4)
    state = {f"norm.{i}": torch.randn(16, 8, generator=g) for i in range(32)}
    w = torch.randn(64, 32, generator=g)
    state |= {"emb": w, "half": w[10:20]}
    deltackpt.save(state, store_dir, "s", encoding=RAW_ONLY)
    with deltackpt.open_snapshot(store_dir, "s") as f:
        items = [(f.entry(k), ((2, 0), (6, 8))) for k in sorted(state) if k.startswith("norm")]
        items += [(f.entry("half"), ((1, 3), (4, 5))), (f.entry("emb"), ((0, 0), (0, 32)))]
        with count_reads() as one_by_one:
            each = [f.read_box(e, box) for e, box in items]
        with count_reads() as batched:
            got = f.read_boxes(items)
        assert all(_bits(a) == _bits(b) for a, b in zip(got, each, strict=True))
        assert torch.equal(got[-2], w[11:15, 3:8]) and got[-1].shape == (0, 32)
        assert torch.equal(got[0], state["norm.0"][2:8])
        assert batched[0] * 4 < one_by_one[0], (batched[0], one_by_one[0])


def test_golden_distributed_store_reads_like_a_full_load(tmp_path: Path) -> None:
    store = tmp_path / "g"
    shutil.copytree(GOLDEN_DIST, store)
    for name in ("d0", "d1"):
        full = deltackpt.load(store, name)
        with deltackpt.open_snapshot(store, name) as f:
            for k in list(f.keys()):
                assert _bits(f.get_tensor(k)) == _bits(_leaf(full, k)), (name, k)
            assert torch.equal(f.get_slice("rows")[2:5, 1:3], full["rows"][2:5, 1:3])
            assert _bits(f.get_slice("cols")[1, 4:8]) == _bits(full["cols"][1, 4:8])


def _leaf(state: dict, path: str) -> torch.Tensor:
    node: object = state
    for seg in path.split("/"):
        node = node[int(seg)] if isinstance(node, (list, tuple)) else node[seg]  # type: ignore[index]
    assert isinstance(node, torch.Tensor)
    return node

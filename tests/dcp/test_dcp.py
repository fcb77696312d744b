"""torch.distributed.checkpoint through deltackpt.dcp.StoreWriter / StoreReader."""

from __future__ import annotations

import datetime
import json
import pickle
import warnings
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

import deltackpt
from deltackpt.dcp import StoreReader, StoreWriter
from deltackpt.errors import PickleNotAllowedError, StoreLockedError
from deltackpt.format.codecs import EncodePolicy
from deltackpt.format.dcp_values import decode_byte_values
from tests._dist import free_port, run_ranks

# DCP warns on every call without a process group ("assuming the intent is to save in a single
# process"); that is exactly what these single-process tests do.
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
warnings.filterwarnings("ignore", message="torch.distributed is (disabled|unavailable)")


@dataclass
class Custom:  # a value DCP pickles: stored as its torch.save bytes, not inline
    a: int
    b: str


def _train_state(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3 * (seed + 1))
    for _ in range(2):
        model(torch.randn(8, 32)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def _assert_same(a, b, path="") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), path
        assert a.dtype == b.dtype and a.shape == b.shape, path
        if a.numel():  # compare bytes: bit-exact, NaN payloads and -0.0 included
            assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)), (
                path
            )
    elif isinstance(a, dict):
        assert set(a) == set(b), (path, set(a) ^ set(b))
        for k in a:
            _assert_same(a[k], b[k], f"{path}/{k}")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _assert_same(x, y, f"{path}/{i}")
    else:
        assert a == b, (path, a, b)


def _flat(sd: dict, prefix: str = "") -> dict:
    """DCP-style flattening for comparisons: nested dict keys joined with '.'."""
    out = {}
    for k, v in sd.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flat(v, key + "."))
        else:
            out[key] = v
    return out


# ------------------------------------------------------------------------------ single process


def test_save_load_model_and_optimizer_single_process(tmp_path):
    store = tmp_path / "s"
    model, opt = _train_state(0)
    state = {
        "model": model.state_dict(),
        "optim": opt.state_dict(),
        "step": 7,
        "tup": (1, 2.5, "x"),
    }
    w = StoreWriter(store, "dcp-1", metadata={"step": 7})
    dcp.save(state, storage_writer=w)
    assert w.info is not None and w.info.name == "dcp-1" and w.info.chunks_new > 0

    # dcp.load into a differently initialised model/optimizer: bit-exact
    model2, opt2 = _train_state(1)
    target = {"model": model2.state_dict(), "optim": opt2.state_dict(), "step": 0, "tup": None}
    dcp.load(target, storage_reader=StoreReader(store, "dcp-1"))
    _assert_same(state, target)

    # deltackpt.load of the DCP snapshot: the nesting that was saved, values inline
    got = deltackpt.load(store, "dcp-1")
    for k, v in state["model"].items():
        assert torch.equal(got["model"][k], v), k
    for i, st in state["optim"]["state"].items():
        for k, v in st.items():
            _assert_same(v, got["optim"]["state"][i][k])
    for k, v in state["optim"]["param_groups"][0].items():
        assert got["optim"]["param_groups"][0][k] == v, k
    assert got["step"] == 7 and got["tup"] == (1, 2.5, "x")
    m = deltackpt.open_store(store).manifest("dcp-1")
    assert m.metadata["dcp"]["bytes"] == [] and m.metadata["step"] == 7
    jsonschema = pytest.importorskip("jsonschema")
    schema = json.loads(
        (Path(deltackpt.__file__).parent / "format/schema/manifest.schema.json").read_text()
    )
    jsonschema.validate(json.loads((store / "snapshots/dcp-1/MANIFEST.json").read_bytes()), schema)

    assert deltackpt.verify(store).ok
    assert [s.name for s in deltackpt.snapshots(store)] == ["dcp-1"]


def test_values_that_need_pickle_or_hold_tensors_are_stored_as_their_bytes(tmp_path):
    store = tmp_path / "s"
    state = {"w": torch.ones(3), "custom": Custom(3, "y"), "tt": (torch.arange(3), "z")}
    dcp.save(state, storage_writer=StoreWriter(store, "odd"))
    target = {"w": torch.zeros(3), "custom": None, "tt": None}
    dcp.load(target, storage_reader=StoreReader(store, "odd"))
    assert target["custom"] == Custom(3, "y") and target["tt"][1] == "z"
    assert torch.equal(target["tt"][0], torch.arange(3))
    m = deltackpt.open_store(store).manifest("odd")
    assert sorted(m.metadata["dcp"]["bytes"]) == ["custom", "tt"]
    # deltackpt.load returns their torch.save bytes as uint8 tensors; decode_byte_values (the
    # hook proposed for loading.py, a no-op on already decoded values) turns them into values
    got = deltackpt.load(store, "odd", allow_pickle=True)
    if isinstance(got["custom"], torch.Tensor):
        with pytest.raises(PickleNotAllowedError):
            decode_byte_values(m, [got[e.path] for e in m.tensors], allow_pickle=False)
    values = [got[e.path] for e in m.tensors]
    decode_byte_values(m, values, allow_pickle=True)
    by_path = {e.path: v for e, v in zip(m.tensors, values, strict=True)}
    assert by_path["custom"] == Custom(3, "y")
    assert torch.equal(by_path["tt"][0], torch.arange(3)) and by_path["tt"][1] == "z"
    assert torch.equal(by_path["w"], torch.ones(3))


def test_encoding_applies_to_dcp_saves(tmp_path):
    store = tmp_path / "s"
    state = {"ids": torch.arange(1 << 17, dtype=torch.int64), "noise": torch.randn(1 << 15)}
    w = StoreWriter(store, "enc")
    dcp.save(state, storage_writer=w)
    assert w.info.bytes_written < 0.5 * w.info.logical_bytes  # byte-grouped zstd on the ids
    codecs = {r.codec for r in deltackpt.open_store(store).manifest("enc").chunks.values()}
    assert "zstd" in codecs
    raw = StoreWriter(store, "raw", encoding=EncodePolicy(codecs=("raw",)))
    state["ids"] = state["ids"] + 1
    dcp.save(state, storage_writer=raw)
    recs = deltackpt.open_store(store).manifest("raw").chunks.values()
    assert {r.codec for r in recs} == {"raw"} or raw.info.chunks_new == 0
    out = {k: torch.zeros_like(v) for k, v in state.items()}
    dcp.load(out, storage_reader=StoreReader(store, "raw"))
    _assert_same(state, out)


def test_unchanged_save_writes_only_metadata_and_one_changed_tensor_is_a_tenth(tmp_path):
    store = deltackpt.open_store(tmp_path / "s", chunk_bytes=64 << 10)
    g = torch.Generator().manual_seed(1)
    state = {f"t{i}": torch.randn(64 << 10, generator=g) for i in range(10)}  # 256 KiB each
    first = StoreWriter(store, "a")
    dcp.save(state, storage_writer=first)
    logical = first.info.logical_bytes
    assert logical == 10 * (256 << 10)
    assert first.info.bytes_written >= logical  # random floats do not compress

    again = StoreWriter(store, "b")
    dcp.save(state, storage_writer=again)
    m = store.manifest("b")
    assert m.stats.chunks_new == 0 and m.stats.pack_bytes == 0
    assert again.info.chunks_new == 0 and again.info.chunks_reused == 40
    assert again.info.bytes_written < 20_000  # the manifest

    state["t3"] = state["t3"] + 1
    third = StoreWriter(store, "c")
    dcp.save(state, storage_writer=third)
    assert third.info.chunks_new == 4
    assert 0.08 * logical < third.info.bytes_written < 0.13 * logical
    out = {k: torch.zeros_like(v) for k, v in state.items()}
    dcp.load(out, storage_reader=StoreReader(store))  # latest == "c"
    _assert_same(state, out)
    assert deltackpt.verify(store).ok


def test_async_save_commits_a_loadable_snapshot(tmp_path):
    store = tmp_path / "s"
    model, opt = _train_state(2)
    state = {"model": model.state_dict(), "optim": opt.state_dict()}
    expected = {"model": {k: v.clone() for k, v in state["model"].items()}}
    w = StoreWriter(store, "async-1")
    fut = dcp.async_save(state, storage_writer=w)
    fut = getattr(fut, "upload_completion", fut)
    fut.result(timeout=60)
    assert deltackpt.open_store(store).names() == ["async-1"]
    target_model, target_opt = _train_state(3)
    target = {"model": target_model.state_dict(), "optim": target_opt.state_dict()}
    dcp.load(target, storage_reader=StoreReader(store, "async-1"))
    _assert_same(expected["model"], target["model"])
    _assert_same(state["optim"], target["optim"])
    got = deltackpt.load(store, "async-1")
    for k, v in expected["model"].items():
        assert torch.equal(got["model"][k], v)


def test_dcp_load_of_a_snapshot_saved_by_deltackpt(tmp_path):
    store = tmp_path / "s"
    model, opt = _train_state(4)
    tied = torch.randn(5, 6)
    state = {
        "model": model.state_dict(),
        "optim": opt.state_dict(),
        "tied": {"w": tied, "w_t": tied.t()},  # one storage, two views
        "step": 11,
        "sched": [1, 2, 3],
    }
    deltackpt.save(state, store, "native")
    model2, opt2 = _train_state(5)
    target = {
        "model": model2.state_dict(),
        "optim": opt2.state_dict(),
        "tied": {"w": torch.zeros(5, 6), "w_t": torch.zeros(6, 5)},
        "step": 0,
        "sched": [],
    }
    dcp.load(target, storage_reader=StoreReader(store, "native"))
    _assert_same(state["model"], target["model"])
    _assert_same(state["optim"], target["optim"])
    assert torch.equal(target["tied"]["w"], tied) and torch.equal(target["tied"]["w_t"], tied.t())
    assert target["step"] == 11 and target["sched"] == [1, 2, 3]

    # partial targets reshard: a plain tensor read as a block of a bigger saved one
    md = StoreReader(store, "native").read_metadata()
    assert md.state_dict_metadata["model.0.weight"].size == torch.Size([64, 32])
    assert md.planner_data["optim.state.0.exp_avg"] == ("optim", "state", "0", "exp_avg")


def test_failed_finish_commits_nothing_and_releases_the_lock(tmp_path, monkeypatch):
    store = tmp_path / "s"
    good = {"w": torch.arange(1000, dtype=torch.float32), "step": 1}
    dcp.save(good, storage_writer=StoreWriter(store, "ok"))

    def boom(self, metadata, results):
        raise OSError("disk gone")

    monkeypatch.setattr(StoreWriter, "_finish", boom)
    bad = {"w": torch.randn(50_000), "step": 2}
    with pytest.raises(CheckpointException, match="disk gone"):
        dcp.save(bad, storage_writer=StoreWriter(store, "bad"))
    monkeypatch.undo()

    assert [s.name for s in deltackpt.snapshots(store)] == ["ok"]
    out = {"w": torch.zeros(1000), "step": 0}
    dcp.load(out, storage_reader=StoreReader(store, "latest"))
    assert torch.equal(out["w"], good["w"]) and out["step"] == 1
    report = deltackpt.gc(store, lock_timeout=2)  # lock released; the orphan pack is removed
    assert report.packs_removed >= 1
    assert deltackpt.verify(store).ok
    dcp.save(bad, storage_writer=StoreWriter(store, "bad"))  # the name is free
    assert deltackpt.load(store, "bad")["w"].equal(bad["w"])


def test_lock_name_checks_pickling_and_corruption(tmp_path):
    store = tmp_path / "s"
    state = {"w": torch.randn(4000)}
    w = StoreWriter(store, "x")
    w.set_up_storage_writer(True)  # a save in flight holds the shared lock ...
    with pytest.raises(StoreLockedError):
        deltackpt.gc(store, lock_timeout=0.2)  # ... so gc cannot delete what it will reference
    w.close()
    deltackpt.gc(store, lock_timeout=2)

    dcp.save(state, storage_writer=StoreWriter(store, "x"))
    with pytest.raises(CheckpointException, match="already has a committed snapshot"):
        dcp.save(state, storage_writer=StoreWriter(store, "x", overwrite=False))
    state2 = {"w": state["w"] * 2}
    dcp.save(state2, storage_writer=StoreWriter(store, "x", overwrite=True))
    # the name may come from checkpoint_id; the writer survives pickling (process-based async)
    w2 = pickle.loads(pickle.dumps(StoreWriter(store, metadata={"k": 1})))
    dcp.save(state, checkpoint_id="y", storage_writer=w2)
    assert deltackpt.open_store(store).manifest("y").metadata["k"] == 1
    assert torch.equal(deltackpt.load(store, "x")["w"], state2["w"])

    # a flipped byte in a pack is caught by the digest check on load
    pack = next((store / "packs").glob("*.pack"))
    rec = next(r for r in deltackpt.open_store(store).manifest("y").chunks.values())
    pack = store / "packs" / f"{rec.pack}.pack"
    raw = bytearray(pack.read_bytes())
    raw[rec.offset + rec.length // 2] ^= 0xFF
    pack.write_bytes(bytes(raw))
    with pytest.raises(CheckpointException, match="corrupt"):
        dcp.load({"w": torch.zeros(4000)}, storage_reader=StoreReader(store, "y"))


# ------------------------------------------------------------------------------- two ranks


def _full(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(500 + step)
    return {
        "a": torch.randn(7, 6, generator=g),  # uneven over 2 ranks
        "b": torch.randn(10, 9, generator=g).to(torch.bfloat16),
        "big": torch.randn(300, 100, generator=g),  # several 64 KiB chunks per shard
        "plain": torch.arange(11, dtype=torch.int64) * (step + 1),  # replicated plain tensor
        "tiny": torch.randn(1, 4, generator=g),  # Shard(0) over 2 ranks: rank 1 holds nothing
    }


def _dcp_ranks(rank: int, world: int, port: int, store: str) -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
        timeout=datetime.timedelta(seconds=30),
    )  # fmt: skip
    if rank == 0:
        deltackpt.open_store(store, chunk_bytes=64 << 10)
    dist.barrier()
    mesh = init_device_mesh("cpu", (world,))
    full = _full(0)
    state = {k: distribute_tensor(full[k], mesh, [Shard(0)]) for k in ("a", "b", "big", "tiny")}
    state["plain"] = full["plain"]
    state["meta"] = {"step": 3, "lr": 0.25}
    w = StoreWriter(store, "d0")
    dcp.save(state, storage_writer=w)
    w2 = StoreWriter(store, "d1")
    dcp.save(state, storage_writer=w2)  # unchanged: only the manifest
    infos = (
        [(i.chunks_new, i.chunks_reused, i.bytes_written) for i in (w.info, w2.info)]
        if rank == 0
        else None
    )

    zeros = {k: torch.zeros_like(v) for k, v in full.items()}
    target = {k: distribute_tensor(zeros[k], mesh, [Shard(1)]) for k in ("a", "b", "big", "tiny")}
    target["plain"] = zeros["plain"]
    target["meta"] = {"step": -1, "lr": 0.0}
    dcp.load(target, storage_reader=StoreReader(store, "d0"))
    ok = {k: bool(torch.equal(target[k].full_tensor(), full[k])) for k in ("a", "b", "big", "tiny")}
    ok["plain"] = bool(torch.equal(target["plain"], full["plain"]))
    ok["meta"] = target["meta"] == {"step": 3, "lr": 0.25}
    local_shape = tuple(target["big"].to_local().shape)
    ok["plain_value"] = target["plain"].tolist()
    dist.destroy_process_group()
    return {"ok": ok, "infos": infos, "local_shape": local_shape}


@pytest.mark.multiproc
def test_two_ranks_dtensor_shard0_saved_loaded_as_shard1_and_on_one_process(tmp_path):
    store = str(tmp_path / "s")
    out = run_ranks(_dcp_ranks, 2, free_port(), store, timeout=90)
    for r in out:
        assert all(v for k, v in r["ok"].items() if k != "plain_value"), r["ok"]
    assert out[0]["local_shape"] == (300, 50)
    (new0, _, written0), (new1, reused1, written1) = out[0]["infos"]
    assert new0 > 0 and new1 == 0 and reused1 > 0 and written1 < written0 / 4

    full = _full(0)
    m = deltackpt.open_store(store).manifest("d0")
    entries = {e.path: e for e in m.tensors}
    assert entries["a"].shards is not None and len(entries["a"].shards) == 2
    assert [sh.offsets for sh in entries["a"].shards] == [(0, 0), (4, 0)]
    assert entries["plain"].data is not None  # replicated: written once, as a whole tensor
    assert m.metadata["dcp"]["world_size"] == 2
    jsonschema = pytest.importorskip("jsonschema")
    schema = json.loads(
        (Path(deltackpt.__file__).parent / "format/schema/manifest.schema.json").read_text()
    )
    jsonschema.validate(
        json.loads(deltackpt.open_store(store).manifest_path("d0").read_bytes()), schema
    )

    got = deltackpt.load(store, "d0")  # one process, no process group: full tensors
    for k, v in full.items():
        assert torch.equal(got[k], v), k
    assert got["meta"]["step"] == 3 and got["meta"]["lr"] == 0.25

    # one process, no process group, DCP into plain tensors (resharding 2 -> 1)
    target = {k: torch.zeros_like(v) for k, v in full.items()}
    target["meta"] = {"step": 0, "lr": 0.0}
    dcp.load(target, storage_reader=StoreReader(store, "d1"))
    for k, v in full.items():
        assert torch.equal(target[k], v), k
    assert deltackpt.verify(store).ok
    deltackpt.gc(store, lock_timeout=2)  # no rank left the store locked

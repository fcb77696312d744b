"""The on-disk format is pinned: golden bytes, a JSON Schema, deterministic manifests."""

from __future__ import annotations

import json
import shutil
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import pytest
import torch

import deltackpt
from deltackpt.format.codecs import RAW, EncodePolicy
from deltackpt.saving.hooks import hooks
from deltackpt.store import packs as pack

GOLDEN_V1 = Path(__file__).parents[1] / "golden" / "v1"  # written before manifests had a digest
GOLDEN = Path(__file__).parents[1] / "golden" / "v2"
GOLDEN_DIST = Path(__file__).parents[1] / "golden" / "v2-dist"  # 2 gloo ranks, snapshots d0 and d1
GOLDEN_NS = 1_700_000_000_000_000_000
SCHEMA = json.loads(
    (Path(deltackpt.__file__).parent / "format" / "schema" / "manifest.schema.json").read_text()
)


def golden_state() -> dict:
    """Small, fully deterministic state touching every tree tag and tensor layout."""
    w = torch.arange(12, dtype=torch.float32).reshape(3, 4) / 8
    od = OrderedDict([("weight", w), ("bias", torch.tensor([1.5, -2.0], dtype=torch.bfloat16))])
    od._metadata = OrderedDict([("", {"version": 1})])
    emb = torch.arange(6, dtype=torch.int16).reshape(2, 3)
    return {
        "model": od,
        "tied": [emb, emb],
        "big": torch.arange(5000, dtype=torch.int32),  # 20000 bytes: split into chunks
        "values": {1: 0.25, "s": "x", "b": b"\x01", "t": (True, None), "size": torch.Size([2])},
    }


def save_golden(store_dir: Path, monkeypatch) -> deltackpt.SnapshotInfo:
    ids = iter(f"pack{i:016d}" for i in range(100))
    monkeypatch.setattr(pack, "new_pack_id", lambda: next(ids))
    monkeypatch.setattr(hooks, "clock", lambda: GOLDEN_NS)
    store = deltackpt.open_store(store_dir, chunk_bytes=8192, small_bytes=4096)
    return deltackpt.save(
        golden_state(), store, "golden", threads=1, encoding=EncodePolicy(codecs=(RAW,))
    )


def _stable(doc: dict) -> dict:
    doc = dict(doc)
    doc["stats"] = {k: v for k, v in doc["stats"].items() if "seconds" not in k}
    doc.pop("digest", None)  # covers the timings dropped above
    return doc


@pytest.mark.parametrize("golden", [GOLDEN_V1, GOLDEN], ids=["v1", "v2"])
def test_golden_store_loads(tmp_path, golden):
    copy = tmp_path / "golden"
    shutil.copytree(golden, copy)
    out = deltackpt.load(copy, "golden")
    expected = golden_state()
    assert torch.equal(out["model"]["weight"], expected["model"]["weight"])
    assert torch.equal(out["model"]["bias"], expected["model"]["bias"])
    assert out["model"]._metadata == expected["model"]._metadata
    assert torch.equal(out["big"], expected["big"])
    assert out["tied"][0].data_ptr() == out["tied"][1].data_ptr()
    assert out["values"] == expected["values"]
    report = deltackpt.verify(copy)
    assert report.ok
    # verify names the snapshots whose manifests predate the digest
    assert report.undigested == (["golden"] if golden == GOLDEN_V1 else [])


def test_manifest_digest_covers_the_canonical_document(tmp_path):
    from deltackpt.format.manifest import document_digest

    raw = (GOLDEN / "snapshots/golden/MANIFEST.json").read_bytes()
    doc = json.loads(raw)
    assert doc["version"] == 2 and doc["digest"] == document_digest(doc)
    # a flipped digit in a shape, a slice or a float value is damage, found on read
    copy = tmp_path / "g"
    shutil.copytree(GOLDEN, copy)
    path = copy / "snapshots/golden/MANIFEST.json"
    for old, new in [
        (b'"shape":[3,4]', b'"shape":[4,3]'),
        (b'"0x1.0000000000000p-2"', b'"0x1.0000000000000p-1"'),
    ]:
        assert old in raw, old
        path.write_bytes(raw.replace(old, new, 1))
        with pytest.raises(deltackpt.errors.ManifestError, match="digest"):
            deltackpt.load(copy, "golden")
        report = deltackpt.verify(copy)
        assert [(p.snapshots, p.keys) for p in report.problems] == [(("golden",), ("<manifest>",))]


def test_save_reproduces_golden_bytes(tmp_path, monkeypatch):
    save_golden(tmp_path / "s", monkeypatch)
    new = json.loads((tmp_path / "s/snapshots/golden/MANIFEST.json").read_bytes())
    old = json.loads((GOLDEN / "snapshots/golden/MANIFEST.json").read_bytes())
    assert _stable(new) == _stable(old)
    for p in sorted((GOLDEN / "packs").iterdir()):
        assert (tmp_path / "s/packs" / p.name).read_bytes() == p.read_bytes(), p.name
    assert (tmp_path / "s/STORE.json").read_bytes() == (GOLDEN / "STORE.json").read_bytes()


def dist_golden_state(world: int, step: int) -> dict:
    """Per rank: row- and column-sharded DTensors, a replicated tensor of several chunks, tied
    views and plain values; ``step`` 1 changes some of the chunks."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    rows = torch.arange(24, dtype=torch.float32).reshape(6, 4) / 8
    cols = (torch.arange(30, dtype=torch.float32).reshape(3, 10) / 4).to(torch.bfloat16)
    rep = torch.arange(5000, dtype=torch.int32)
    if step:
        rows = rows + 1
        rep = rep.clone()
        rep[:10] = -1
    emb = torch.arange(6, dtype=torch.int16).reshape(2, 3)
    return {
        "rows": distribute_tensor(rows, mesh, [Shard(0)]),
        "cols": distribute_tensor(cols, mesh, [Shard(1)]),
        "replicated": rep,
        "tied": [emb, emb],
        "values": {"step": step, "s": "x"},
    }


def golden_rank(rank: int, world: int, port: int, store: str, pack_ids: Iterator[str]) -> None:
    """In a child rank of a golden save: deterministic pack ids and clock, a gloo group, and the
    golden store's chunking (created by rank 0)."""
    import datetime

    import torch.distributed as dist

    pack.new_pack_id = lambda: next(pack_ids)  # this child process only
    hooks.clock = lambda: GOLDEN_NS
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
        timeout=datetime.timedelta(seconds=30),
    )  # fmt: skip
    if rank == 0:
        deltackpt.open_store(store, chunk_bytes=8192, small_bytes=4096)
    dist.barrier()


def _save_dist_golden(rank: int, world: int, port: int, store: str) -> None:
    import torch.distributed as dist

    golden_rank(rank, world, port, store, iter(f"rank{rank}pack{i:011d}" for i in range(100)))
    for step in (0, 1):
        deltackpt.save(
            dist_golden_state(world, step), store, f"d{step}", process_group=dist.group.WORLD,
            threads=1, encoding=EncodePolicy(codecs=(RAW,)), metadata={"step": step},
        )  # fmt: skip
    dist.destroy_process_group()


@pytest.mark.multiproc
def test_distributed_save_reproduces_golden_bytes(tmp_path):
    """The distributed path: every rank's packs and rank 0's manifests, byte for byte (the
    manifests but for their timings), including ``dist.plan_bytes`` (the second save sends only
    changed digests)."""
    from tests._dist import free_port, run_ranks

    store = tmp_path / "s"
    run_ranks(_save_dist_golden, 2, free_port(), str(store), timeout=120)
    for name in ("d0", "d1"):
        new = json.loads((store / f"snapshots/{name}/MANIFEST.json").read_bytes())
        old = json.loads((GOLDEN_DIST / f"snapshots/{name}/MANIFEST.json").read_bytes())
        assert _stable(new) == _stable(old), name
    assert sorted(p.name for p in (store / "packs").iterdir()) == sorted(
        p.name for p in (GOLDEN_DIST / "packs").iterdir()
    )
    for p in sorted((GOLDEN_DIST / "packs").iterdir()):
        assert (store / "packs" / p.name).read_bytes() == p.read_bytes(), p.name
    out = deltackpt.load(store, "d1")
    assert torch.equal(out["rows"], torch.arange(24, dtype=torch.float32).reshape(6, 4) / 8 + 1)
    assert out["tied"][0].data_ptr() == out["tied"][1].data_ptr()


def test_manifest_is_deterministic_and_sorted(tmp_path, monkeypatch):
    save_golden(tmp_path / "s", monkeypatch)
    raw = (tmp_path / "s/snapshots/golden/MANIFEST.json").read_bytes()
    doc = json.loads(raw)
    assert raw == json.dumps(doc, sort_keys=True, separators=(",", ":")).encode() + b"\n"
    assert raw.count(b"\n") == 1


def test_manifests_match_the_schema(tmp_path, monkeypatch):
    save_golden(tmp_path / "s", monkeypatch)
    doc = json.loads((tmp_path / "s/snapshots/golden/MANIFEST.json").read_bytes())
    jsonschema.validate(doc, SCHEMA)
    # and a richer one: parameters, shards are exercised elsewhere; zstd chunks here
    deltackpt.save({"p": torch.nn.Parameter(torch.zeros(100_000))}, tmp_path / "s", "z")
    doc = json.loads((tmp_path / "s/snapshots/z/MANIFEST.json").read_bytes())
    jsonschema.validate(doc, SCHEMA)
    assert any(c["codec"] == "zstd" for c in doc["chunks"].values())
    bad = dict(doc, tensors=[{"path": "x", "dtype": "float32", "shape": [1]}])  # no data at all
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, SCHEMA)


def test_pack_header(tmp_path, monkeypatch):
    save_golden(tmp_path / "s", monkeypatch)
    for p in (tmp_path / "s/packs").iterdir():
        data = p.read_bytes()
        assert data[:8] == b"DCKPACK\x01" and len(data) % 4096 == 0

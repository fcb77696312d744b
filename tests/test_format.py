"""The on-disk format is pinned: golden bytes, a JSON Schema, deterministic manifests."""

from __future__ import annotations

import json
import shutil
from collections import OrderedDict
from pathlib import Path

import jsonschema
import pytest
import torch

import deltackpt
from deltackpt.format.codecs import RAW, EncodePolicy
from deltackpt.store import packs as pack

GOLDEN_V1 = Path(__file__).parent / "golden" / "v1"  # written before manifests had a digest
GOLDEN = Path(__file__).parent / "golden" / "v2"
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
    monkeypatch.setattr("deltackpt.saving.write.time.time_ns", lambda: 1_700_000_000_000_000_000)
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

"""``--json`` on ls, show, diff, du, verify and gc: one JSON document on stdout with the documented
fields (sizes in bytes, times ISO-8601 UTC), checked against the store it describes."""

from __future__ import annotations

import json
import time
from datetime import datetime, timezone

import pytest
import torch

import deltackpt
from tests.cli._store import flip_byte, run, run_json, state, two_snapshots


@pytest.fixture
def store(tmp_path):
    return two_snapshots(tmp_path / "ckpts")


def _utc(s: str) -> datetime:
    assert s.endswith("Z"), s
    return datetime.fromisoformat(s[:-1] + "+00:00")


def test_ls_json(capsys, store):
    code, doc, err = run_json(capsys, "ls", store)
    assert code == 0 and err == ""
    assert doc["store"] == str(store) and doc["damaged"] == []
    infos = {s.name: s for s in deltackpt.snapshots(store)}
    assert [s["name"] for s in doc["snapshots"]] == ["a", "b"]
    for s in doc["snapshots"]:
        info = infos[s["name"]]
        assert _utc(s["created"]) == info.created.astimezone(timezone.utc)
        assert s["tensors"] == info.tensors
        assert (
            s["logical_bytes"]
            == info.logical_bytes
            == sum(
                t.numel() * t.element_size()
                for t in deltackpt.load(store, s["name"])["model"].values()
            )
        )
        assert s["bytes_written"] == info.bytes_written > 0
        assert isinstance(s["chunks_new"], int) and isinstance(s["seconds"], float)
    assert doc["snapshots"][0]["metadata"] == {"step": 1, "note": "first"}


def test_ls_json_lists_damaged_snapshots_on_stdout_not_stderr(capsys, store):
    (store / "snapshots" / "b" / "MANIFEST.json").write_text("{not json")
    code, doc, err = run_json(capsys, "ls", store)
    assert code == 0 and err == ""
    assert [s["name"] for s in doc["snapshots"]] == ["a"]
    assert [d["name"] for d in doc["damaged"]] == ["b"] and doc["damaged"][0]["reason"]


def test_show_json_has_every_tensor_and_value(capsys, tmp_path):
    path = tmp_path / "s"
    many = {f"t{i:02d}": torch.full((i + 1,), float(i)) for i in range(70)}
    sd = {"model": many, "step": 7, "lr": float("nan"), "name": "x" * 100, "shape": torch.Size([2])}
    deltackpt.save(sd, path, "only", metadata={"k": [1, 2]})
    code, doc, err = run_json(capsys, "show", path)  # no --all needed: JSON is always complete
    assert code == 0 and err == ""
    assert doc["snapshot"]["name"] == "only" and doc["snapshot"]["metadata"] == {"k": [1, 2]}
    keys = [t["key"] for t in doc["tensors"]]
    assert keys == [f"model/t{i:02d}" for i in range(70)]
    t5 = doc["tensors"][5]
    assert t5 == {
        "key": "model/t05",
        "dtype": "float32",
        "shape": [6],
        "bytes": 24,
        "chunks": 1,
        "shards": None,
        "storage": None,
    }
    values = {v["key"]: v for v in doc["values"]}
    assert values["step"] == {"key": "step", "type": "int", "value": 7, "repr": "7"}
    assert values["lr"]["type"] == "float" and values["lr"]["value"] == "nan"  # strict JSON
    assert values["name"]["value"] == "x" * 100 and values["name"]["repr"] == repr("x" * 100)
    assert values["shape"]["type"] == "size" and values["shape"]["value"] == [2]
    m = deltackpt.open_store(path, create=False).manifest("only")
    assert doc["chunks_referenced"] == len(m.chunks)
    assert doc["referenced_bytes"] == sum(r.length for r in m.chunks.values())


def test_diff_json_different_exits_1(capsys, store):
    code, doc, err = run_json(capsys, "diff", store, "a", "b")
    assert code == 1 and err == ""
    assert doc["a"] == "a" and doc["b"] == "b" and doc["same"] is False
    rows = {t["key"]: t for t in doc["tensors"]}
    assert set(rows) == {"model/b", "model/extra"}  # model/w shares a chunk but did not change
    assert rows["model/b"]["status"] == "changed" and rows["model/b"]["bytes"] == 1024
    assert rows["model/extra"] == {
        "status": "added",
        "key": "model/extra",
        "dtype": "float32",
        "shape": [3],
        "bytes": 12,
        "was": None,
    }
    (step,) = doc["values"]
    assert step["status"] == "changed" and step["key"] == "step"
    assert step["old"]["value"] == 1 and step["new"]["value"] == 2
    assert doc["summary"] == {
        "changed": 1,
        "changed_bytes": 1024,
        "added": 1,
        "removed": 0,
        "unchanged": 1,
        "values_differ": 1,
    }


def test_diff_json_same_exits_0_and_layout_change_says_was(capsys, tmp_path):
    p = tmp_path / "s"
    deltackpt.save(state(1), p, "x")
    deltackpt.save(state(1), p, "y")
    code, doc, _ = run_json(capsys, "diff", p, "x", "y")
    assert code == 0 and doc["same"] is True and doc["tensors"] == [] and doc["values"] == []
    sd = state(1)
    sd["model"]["b"] = torch.zeros(2, 2, dtype=torch.float16)
    del sd["lr"]
    deltackpt.save(sd, p, "z")
    code, doc, _ = run_json(capsys, "diff", p, "x", "z")
    assert code == 1
    (b,) = doc["tensors"]
    assert b["key"] == "model/b" and b["dtype"] == "float16" and b["shape"] == [2, 2]
    assert b["was"] == {"dtype": "float32", "shape": [256]}
    (lr,) = doc["values"]
    assert lr["status"] == "removed" and lr["new"] is None and lr["old"]["value"] == 0.5


def test_du_json(capsys, tmp_path):
    p = tmp_path / "s"
    deltackpt.save(state(1), p, "x")
    deltackpt.save(state(1), p, "y")
    code, doc, err = run_json(capsys, "du", p)
    assert code == 0 and err == ""
    assert [s["name"] for s in doc["snapshots"]] == ["x", "y"]
    for s in doc["snapshots"]:
        assert s["shared_bytes"] == s["referenced_bytes"] > 0 and s["unique_bytes"] == 0
    assert doc["logical_bytes"] == sum(s["logical_bytes"] for s in doc["snapshots"])
    packs = list((p / "packs").glob("*.pack"))
    assert doc["packs"] == len(packs)
    assert doc["on_disk_bytes"] == sum(f.stat().st_size for f in packs)
    assert doc["dedupe_ratio"] == pytest.approx(doc["logical_bytes"] / doc["on_disk_bytes"])
    assert doc["dedupe_ratio"] > 1.5


def test_verify_json_ok_then_damaged(capsys, store):
    code, doc, err = run_json(capsys, "verify", store)
    assert code == 0 and err == ""
    assert doc["ok"] is True and doc["problems"] == [] and doc["damaged"] == []
    assert doc["snapshots"] == ["a", "b"] and doc["undigested"] == []
    assert doc["bytes_checked"] == deltackpt.verify(store).bytes_checked > 0
    flip_byte(store, "b", "model/extra")
    code, doc, err = run_json(capsys, "verify", store, "b")
    assert code == 1 and err == ""
    assert doc["ok"] is False and doc["damaged"] == ["b"]
    (p,) = doc["problems"]
    assert p["snapshots"] == ["b"] and "model/extra" in p["keys"]
    assert isinstance(p["chunk"], str) and len(p["chunk"]) > 8 and p["reason"]


def test_verify_json_damaged_manifest_has_null_chunk(capsys, store):
    (store / "snapshots" / "a" / "MANIFEST.json").write_text("{}")
    code, doc, _ = run_json(capsys, "verify", store)
    assert code == 1 and doc["damaged"] == ["a"]
    (p,) = doc["problems"]
    assert p["chunk"] is None and p["keys"] == ["<manifest>"]


def test_gc_json(capsys, store):
    code, doc, err = run_json(capsys, "gc", store, "--keep-last", "1", "--dry-run")
    assert code == 0 and err == ""
    assert doc["dry_run"] is True and doc["deleted"] == ["a"] and doc["save_in_flight"] is False
    assert [s.name for s in deltackpt.snapshots(store)] == ["a", "b"]
    code, doc, _ = run_json(capsys, "gc", store, "--keep-last", "1")
    assert code == 0
    assert doc["dry_run"] is False and doc["deleted"] == ["a"] and doc["save_in_flight"] is None
    assert doc["bytes_freed"] >= 0 and doc["damaged"] == [] and doc["refused"] == []
    assert [s.name for s in deltackpt.snapshots(store)] == ["b"]


def test_json_error_document(capsys, store, tmp_path):
    code, out, err = run(capsys, "show", store, "nope", "--json")
    assert code == 3
    doc = json.loads(out)
    assert doc == {
        "error": {
            "type": "SnapshotNotFoundError",
            "message": doc["error"]["message"],
            "exit_code": 3,
        }
    }
    assert "nope" in doc["error"]["message"]
    assert err.startswith("error: ") and "nope" in err and len(err.strip().splitlines()) == 1
    code, out, _ = run(capsys, "ls", tmp_path / "missing", "--json")
    assert code == 3 and json.loads(out)["error"]["type"] == "StoreError"
    code, out, err = run(capsys, "ls", "--json")  # usage: no STORE
    assert code == 2 and json.loads(out)["error"]["type"] == "UsageError"
    assert "usage:" in err
    code, out, _ = run(capsys, "ls", "--bogus")  # without --json: nothing on stdout
    assert code == 2 and out == ""


def test_gc_json_and_table_name_followers_leases(capsys, store):
    from deltackpt.store.leases import write_lease

    st = deltackpt.open_store(store)
    write_lease(st.storage, "eval-0", ["a"], ttl=600)
    write_lease(st.storage, "gone", ["b"], ttl=0.01)
    time.sleep(0.05)
    (store / "leases" / "junk.json").write_text("{not json")
    code, doc, _ = run_json(capsys, "gc", store, "--keep-last", "1", "--dry-run")
    assert code == 0 and doc["deleted"] == [] and doc["leased"] == ["a"]
    assert doc["leases_expired"] == ["gone"] and len(doc["bad_leases"]) == 1
    assert "junk" in doc["bad_leases"][0]
    code, out, _ = run(capsys, "gc", store, "--keep-last", "1")
    assert code == 0 and "kept for followers' leases" in out
    assert "bad lease" in out and "expired leases removed" in out and "gone" in out
    assert [s.name for s in deltackpt.snapshots(store)] == ["a", "b"]

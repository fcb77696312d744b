"""Followers' leases (deltackpt/store/leases.py): retention keeps leased snapshots while the lease
is unexpired; expired leases are swept by gc; bad leases are reported, ignored and left alone."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import deltackpt
from deltackpt.errors import InvalidArgumentError, InvalidNameError
from deltackpt.store.leases import (
    LEASES,
    MAX_LEASE_BYTES,
    MAX_TTL_S,
    drop_lease,
    scan_leases,
    write_lease,
)


def _store(tmp_path: Path, n: int) -> deltackpt.Store:
    st = deltackpt.open_store(tmp_path / "s")
    w = torch.zeros(1000)
    for k in range(n):
        w[k] = k + 1.0
        deltackpt.save({"w": w}, st, f"s{k}")
    return st


def _raw(tmp_path: Path, name: str, body: Any) -> Path:
    d = tmp_path / "s" / LEASES
    d.mkdir(exist_ok=True)
    p = d / name
    p.write_bytes(body if isinstance(body, bytes) else json.dumps(body).encode())
    return p


def _lease(holder: str, snaps: Any, expires: Any) -> dict[str, Any]:
    return {"format": "deltackpt-lease", "version": 1, "holder": holder, "snapshots": snaps,
            "expires_unix": expires}  # fmt: skip


def test_leased_snapshot_survives_gc_until_it_expires(tmp_path: Path) -> None:
    st = _store(tmp_path, 4)
    write_lease(st.storage, "f1", ["s1"], ttl=600)
    write_lease(st.storage, "f2", ["s0", "nope"], ttl=0.05)  # a name the store lacks: harmless
    time.sleep(0.1)  # f2 expires
    report = deltackpt.gc(st, keep_last=1)
    assert report.deleted == ["s0", "s2"] and report.leased == ["s1"]
    assert report.leases_expired == ["f2"] and report.bad_leases == []
    assert [s.name for s in deltackpt.snapshots(st)] == ["s1", "s3"]
    assert deltackpt.load(st, "s1")["w"][1] == 2.0
    assert [x.holder for x in scan_leases(st.storage).live] == ["f1"]  # f2's object is gone
    assert not (tmp_path / "s" / LEASES / "f2.json").exists()
    drop_lease(st.storage, "f1")
    drop_lease(st.storage, "f1")  # absent: nothing to do
    assert deltackpt.gc(st, keep_last=1).deleted == ["s1"]


def test_dry_run_reports_leases_and_changes_nothing(tmp_path: Path) -> None:
    st = _store(tmp_path, 3)
    write_lease(st.storage, "f1", ["s0"], ttl=600)
    write_lease(st.storage, "old", ["s1"], ttl=0.01)
    time.sleep(0.05)
    r = deltackpt.gc(st, keep_last=1, dry_run=True)
    assert r.deleted == ["s1"] and r.leased == ["s0"] and r.leases_expired == ["old"]
    assert (tmp_path / "s" / LEASES / "old.json").exists()
    assert len(deltackpt.snapshots(st)) == 3


def test_gc_without_retention_sweeps_expired_leases_only(tmp_path: Path) -> None:
    st = _store(tmp_path, 2)
    write_lease(st.storage, "old", ["s0"], ttl=0.01)
    write_lease(st.storage, "live", ["s0"], ttl=600)
    time.sleep(0.05)
    r = deltackpt.gc(st)
    assert r.deleted == [] and r.leased == [] and r.leases_expired == ["old"]
    assert [x.holder for x in scan_leases(st.storage).live] == ["live"]


BAD = {
    "not-json.json": b"{nope",
    "binary.json": b"\xff\xfe\x00",
    "list.json": [1, 2],
    "wrong-format.json": {**_lease("wrong-format", ["s0"], 1e12), "format": "x"},
    "wrong-version.json": {**_lease("wrong-version", ["s0"], 1e12), "version": 9},
    "extra.json": {**_lease("extra", ["s0"], 1e12), "pickle": "x"},
    "other-holder.json": _lease("someone-else", ["s0"], 1e12),
    "bad-name.json": _lease("bad-name", ["../../etc"], 1e12),
    "not-str.json": _lease("not-str", [7], 1e12),
    "no-snaps.json": _lease("no-snaps", [], 1e12),
    "many.json": _lease("many", [f"s{i}" for i in range(50)], 1e12),
    "nan.json": b'{"format": "deltackpt-lease", "version": 1, "holder": "nan", '
    b'"snapshots": ["s0"], "expires_unix": NaN}',
    "bool.json": _lease("bool", ["s0"], True),
    "forever.json": _lease("forever", ["s0"], time.time() + 10 * MAX_TTL_S),
    "huge.json": b" " * (MAX_LEASE_BYTES + 1),
    "repeat.json": b'{"format": "deltackpt-lease", "version": 1, "holder": "repeat", '
    b'"snapshots": ["s0"], "expires_unix": 1, "expires_unix": 1e12}',
    "no-suffix": _lease("no-suffix", ["s0"], 1e12),
    ".hidden.json": _lease(".hidden", ["s0"], 1e12),
}


def test_bad_leases_are_reported_ignored_and_left_alone(tmp_path: Path) -> None:
    st = _store(tmp_path, 2)
    for name, body in BAD.items():
        _raw(tmp_path, name, body)
    (tmp_path / "s" / LEASES / "dir.json").mkdir()
    outside = tmp_path / "outside.json"
    outside.write_text(json.dumps(_lease("link", ["s0"], time.time() + 600)))
    os.symlink(outside, tmp_path / "s" / LEASES / "link.json")
    report = deltackpt.gc(st, keep_last=1)
    assert report.deleted == ["s0"] and report.leased == [] and report.leases_expired == []
    bad = {b.split(":")[0].removeprefix(f"{LEASES}/") for b in report.bad_leases}
    junk = {"no-suffix", ".hidden.json"}  # not lease names: reported in one line, never read
    assert bad == (set(BAD) - junk) | {"dir.json", "link.json", LEASES}
    assert any("2 entries are not lease names" in b for b in report.bad_leases)
    assert any("over the" in b for b in report.bad_leases if "huge" in b)
    for name in BAD:  # gc deletes only leases that were valid and expired
        assert (tmp_path / "s" / LEASES / name).exists()
    assert outside.exists()


def test_unlistable_leases_dir_does_not_break_gc(tmp_path: Path) -> None:
    st = _store(tmp_path, 2)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    os.symlink(elsewhere, tmp_path / "s" / LEASES)
    report = deltackpt.gc(st, keep_last=1)
    assert report.deleted == ["s0"] and len(report.bad_leases) == 1
    assert "cannot be listed" in report.bad_leases[0]


def test_write_lease_checks_its_arguments(tmp_path: Path) -> None:
    st = _store(tmp_path, 1)
    with pytest.raises(InvalidArgumentError, match="holder"):
        write_lease(st.storage, "a/b", ["s0"], ttl=10)
    with pytest.raises(InvalidArgumentError, match="ttl"):
        write_lease(st.storage, "a", ["s0"], ttl=MAX_TTL_S * 2)
    with pytest.raises(InvalidArgumentError, match="ttl"):
        write_lease(st.storage, "a", ["s0"], ttl=0)
    with pytest.raises(InvalidArgumentError, match="1 to 8"):
        write_lease(st.storage, "a", [], ttl=10)
    with pytest.raises(InvalidNameError):
        write_lease(st.storage, "a", ["../x"], ttl=10)
    assert not (tmp_path / "s" / LEASES).exists() or not list((tmp_path / "s" / LEASES).iterdir())


def test_checkpointer_retention_keeps_leased_snapshots(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    state = {"w": torch.zeros(4)}
    with deltackpt.Checkpointer(root, every=1, keep_last=1, async_=False) as ckpt:
        for step in range(3):
            state["w"].add_(1)
            ckpt.maybe_save(step, state)
        write_lease(deltackpt.open_store(root).storage, "eval", ["step-00000002"], ttl=600)
        for step in range(3, 6):
            state["w"].add_(1)
            ckpt.maybe_save(step, state)
    names = [s.name for s in deltackpt.snapshots(root)]
    assert names == ["step-00000002", "step-00000005"]
    assert torch.equal(deltackpt.load(root, "step-00000002")["w"], torch.full((4,), 3.0))


def test_lease_count_is_bounded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import deltackpt.store.leases as leases

    st = _store(tmp_path, 3)
    monkeypatch.setattr(leases, "MAX_LEASES", 2)
    for h, snap in (("a", "s0"), ("b", "s0"), ("c", "s1")):
        write_lease(st.storage, h, [snap], ttl=600)
    scan = scan_leases(st.storage)
    assert [x.holder for x in scan.live] == ["a", "b"] and "over the 2 read" in scan.bad[0]
    assert not scan.complete
    # c's lease was not read, so it may keep anything: retention deletes nothing (fail closed)
    report = deltackpt.gc(st, keep_last=1)
    assert report.deleted == [] and any("deletes no snapshot" in b for b in report.bad_leases)
    with deltackpt.Checkpointer(st, every=1, keep_last=1, async_=False) as ckpt:
        ckpt.maybe_save(0, {"w": torch.ones(2)})
    assert [s.name for s in deltackpt.snapshots(st)] == ["s0", "s1", "s2", "step-00000000"]


def test_junk_in_leases_cannot_crowd_out_a_lease(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import deltackpt.store.leases as leases

    st = _store(tmp_path, 3)
    monkeypatch.setattr(leases, "MAX_LEASES", 2)
    for i in range(5):  # sort before the real lease, and are not lease names
        _raw(tmp_path, f"0junk-{i}", b"x")
    write_lease(st.storage, "z", ["s0"], ttl=600)
    scan = scan_leases(st.storage)
    assert [x.holder for x in scan.live] == ["z"] and scan.complete
    assert len(scan.bad) == 1 and "5 entries are not lease names" in scan.bad[0]
    report = deltackpt.gc(st, keep_last=1)
    assert report.deleted == ["s1"] and report.leased == ["s0"]

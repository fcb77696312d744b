"""Incremental load and Follower on an object store: the real S3 API server of tests/_s3.py
(moto on 127.0.0.1). Bytes read are counted where they are read (LoadStats)."""

from __future__ import annotations

from typing import Any

import pytest

import deltackpt
from deltackpt import LoadStats
from deltackpt.errors import HeldVersionMismatchError
from deltackpt.store.leases import scan_leases
from deltackpt.store.objstore import FsspecStorage
from tests.loading._history import is_mid_chain, new_store, publish, same, state_at

pytest.importorskip("s3fs")
pytest.importorskip("moto.server")


def _run(bucket: str, opts: dict[str, Any], versions: int) -> tuple[str, deltackpt.Store]:
    url = f"s3://{bucket}/run"
    st = new_store(url, storage_options=opts)
    for k in range(versions):
        publish(st, k)
    return url, st


@pytest.mark.parametrize("held,name", [(0, 1), (0, 4), (1, 2), (1, 4)])
def test_s3_catch_up_reads_only_what_differs(bucket: str, opts: dict, held: int, name: int) -> None:
    _, st = _run(bucket, opts, 5)
    assert not is_mid_chain(st, "s0") and is_mid_chain(st, "s1")  # keyframe / mid-chain held
    full = LoadStats()
    deltackpt.load(st, f"s{name}", stats=full)
    into, inc = state_at(held), LoadStats()
    out = deltackpt.load(st, f"s{name}", into=into, since=f"s{held}", stats=inc)
    assert out is into and same(into, state_at(name)) and into["step"] == name
    assert inc.chunks_unchanged > 0
    assert 0 < inc.bytes_read < full.bytes_read / 3  # w2..w4 and most of w0, w1 are not read
    assert inc.chunks_read + inc.chunks_patched + inc.chunks_unchanged == full.chunks_read


def test_s3_open_snapshot_load_since(bucket: str, opts: dict) -> None:
    _, st = _run(bucket, opts, 3)
    into = state_at(0)
    with deltackpt.open_snapshot(st, "s2") as f:
        assert set(f.changed_since("s0")) >= {"model/w0", "model/w1", "model/bias"}
        assert "model/w3" not in f.changed_since("s0")
        one, k = LoadStats(), LoadStats()
        f.load(into=into, since="s0", stats=k)
    assert same(into, state_at(2))
    with deltackpt.open_snapshot(st, "s2") as f:  # the same again: nothing left to read
        f.load(into=into, since="s2", stats=one)
    assert one.bytes_read == 0 and k.bytes_read > 0
    bad = state_at(0)
    bad["model"]["w3"].view(-1)[0] += 1
    # w3 is unchanged: only verify="full" hashes it (the default checks what changes)
    full = deltackpt.open_snapshot(st, "s2", verify="full")
    with full as f, pytest.raises(HeldVersionMismatchError):
        f.load(into=bad, since="s0")
    with deltackpt.open_snapshot(st, "s1") as f:  # without since: a full load
        assert same(f.load(), state_at(1))


def test_s3_follower_lease_gc_and_fall_behind(bucket: str, opts: dict) -> None:
    url, st = _run(bucket, opts, 2)
    into = state_at(0)
    f = deltackpt.Follower(url, into=into, since="s0", holder="eval-0",
                           storage_options=opts, lease_ttl=600)  # fmt: skip
    s = f.poll()
    assert s is not None and s.mode == "incremental" and same(into, state_at(1))
    lost = deltackpt.Follower(url, into=state_at(0), since="s0", storage_options=opts,
                              lease_ttl=None)  # fmt: skip
    for k in range(2, 5):
        publish(st, k)
    assert [x.snapshots for x in scan_leases(st.storage).live] == [("s1",)]
    gc_st = deltackpt.open_store(url, storage=FsspecStorage(url, opts, no_concurrent_saves=True))
    report = deltackpt.gc(gc_st, keep_last=1)
    assert report.deleted == ["s0", "s2", "s3"] and report.leased == ["s1"]
    s = f.poll()  # its lease kept s1: still incremental
    assert s is not None and (s.previous, s.version, s.mode) == ("s1", "s4", "incremental")
    assert same(into, state_at(4))
    s = lost.poll()  # s0 is gone: a full load
    assert s is not None and s.mode == "full" and "deleted" in s.reason
    assert same(lost.state, state_at(4))
    f.close()
    assert scan_leases(st.storage).live == []


def test_s3_bytes_read_grow_with_the_versions_caught_up(bucket: str, opts: dict) -> None:
    _, st = _run(bucket, opts, 5)
    full = LoadStats()
    deltackpt.load(st, "s4", stats=full)
    read = []
    for k in (1, 2, 4):
        into, stats = state_at(0), LoadStats()
        deltackpt.load(st, f"s{k}", into=into, since="s0", stats=stats)
        assert same(into, state_at(k))
        read.append(stats.bytes_read)
    assert 0 < read[0] <= read[1] <= read[2] < full.bytes_read / 3, (read, full.bytes_read)


def _s3_trainer(url: str, opts: dict[str, Any], versions: int) -> None:
    st = new_store(url, storage_options=opts)
    for k in range(versions):
        publish(st, k)


def test_s3_concurrent_publish_and_follow(bucket: str, opts: dict) -> None:
    import multiprocessing as mp
    import time

    url, versions = f"s3://{bucket}/live", 5
    new_store(url, storage_options=opts)
    proc = mp.get_context("spawn").Process(target=_s3_trainer, args=(url, opts, versions))
    proc.start()
    try:
        into = {"model": {k: t.clone() for k, t in state_at(0)["model"].items()}, "step": 0}
        for t in into["model"].values():
            t.zero_()
        f = deltackpt.Follower(url, into=into, storage_options=opts, lease_ttl=60)
        modes = []
        deadline = time.monotonic() + 120
        while f.version != f"s{versions - 1}":
            assert time.monotonic() < deadline, f"follower stuck at {f.version}"
            s = f.poll()
            if s is None:
                time.sleep(0.01)
                continue
            assert same(into, state_at(int(s.version[1:])))  # only whole, committed versions
            modes.append(s.mode)
        proc.join(60)
        assert proc.exitcode == 0
    finally:
        if proc.is_alive():
            proc.kill()
    assert modes[0] == "full" and set(modes[1:]) <= {"incremental"}
    f.close()

"""Deleting snapshots and garbage collection: space comes back, live data never goes away."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest
import torch

import deltackpt
from deltackpt.errors import SnapshotNotFoundError, StoreError, StoreLockedError
from deltackpt.format.manifest import Manifest
from deltackpt.store.durable import store_lock
from deltackpt.store.packs import PackWriter
from deltackpt.store.store import PACK_ALIGN
from tests._workers import assert_same_state

CHUNK = 64 << 10  # small chunks: a few MB of state gives dozens of chunks


def rand(seed: int, numel: int = 256 << 10) -> torch.Tensor:
    """1 MiB of float32 by default, deterministic per seed, with random bits: incompressible,
    so every chunk is stored raw and byte counts below are exact."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-(2**31), 2**31 - 1, (numel,), dtype=torch.int32, generator=g).view(
        torch.float32
    )


def pack_sizes(store: Path) -> dict[str, int]:
    return {p.stem: p.stat().st_size for p in (store / "packs").glob("*.pack")}


def packs_bytes(store: Path) -> int:
    return sum(pack_sizes(store).values())


def manifest_packs(store: Path, name: str) -> set[str]:
    m = deltackpt.open_store(store, create=False).manifest(name)
    return {r.pack for r in m.chunks.values()}


def nbytes(*ts: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in ts)


@pytest.fixture
def store(tmp_path: Path) -> Path:
    path = tmp_path / "store"
    deltackpt.open_store(path, chunk_bytes=CHUNK, small_bytes=16 << 10)
    return path


def load_equal(store: Path, name: str, want: dict[str, object]) -> None:
    assert_same_state(deltackpt.load(store, name, verify=True), want, name)


# ---------------------------------------------------------------------------- freeing space


def test_delete_then_gc_frees_the_deleted_snapshots_bytes(store: Path) -> None:
    s1 = {"a": rand(1, 1 << 20)}  # 4 MiB, unique to s1
    s2 = {"b": rand(2, 1 << 20)}
    deltackpt.save(s1, store, "s1")
    deltackpt.save(s2, store, "s2")
    st = deltackpt.open_store(store)
    s1_pack_bytes = st.manifest("s1").stats.pack_bytes
    before = packs_bytes(store)

    deltackpt.delete(store, "s1")
    assert [s.name for s in deltackpt.snapshots(store)] == ["s2"]
    assert not (store / "snapshots" / "s1").exists()
    with pytest.raises(SnapshotNotFoundError):
        deltackpt.load(store, "s1")
    with pytest.raises(SnapshotNotFoundError):
        deltackpt.delete(store, "s1")
    assert packs_bytes(store) == before  # delete only un-commits; gc frees

    report = deltackpt.gc(store)
    freed = before - packs_bytes(store)
    assert freed == report.bytes_freed == s1_pack_bytes
    assert nbytes(s1["a"]) <= freed <= nbytes(s1["a"]) + PACK_ALIGN * 4  # + pack headers
    assert report.packs_removed >= 1 and report.packs_compacted == 0
    load_equal(store, "s2", s2)
    assert deltackpt.verify(store).ok

    again = deltackpt.gc(store)  # nothing left to do
    assert (again.packs_removed, again.packs_compacted, again.bytes_freed) == (0, 0, 0)


@pytest.mark.parametrize("threads", [1, 2, 4])
def test_chunks_shared_with_kept_snapshots_survive(store: Path, threads: int) -> None:
    a, b, c = rand(1, 1 << 20), rand(2, 1 << 20), rand(3, 1 << 20)
    s1 = {"a": a, "b": b}
    s2 = {"a": a, "c": c}
    deltackpt.save(s1, store, "s1", threads=threads)
    info2 = deltackpt.save(s2, store, "s2", threads=threads)
    assert info2.chunks_reused == nbytes(a) // CHUNK  # a is shared, not written again

    deltackpt.delete(store, "s1")
    deltackpt.gc(store)  # packs still >= 75% live are kept as they are
    load_equal(store, "s2", s2)
    assert deltackpt.verify(store).ok
    assert set(pack_sizes(store)) == manifest_packs(store, "s2")
    live = nbytes(a, c)
    assert live <= packs_bytes(store) <= (live + PACK_ALIGN * len(pack_sizes(store))) / 0.75

    deltackpt.gc(store, compact_below=1.0)  # rewrite every pack holding any dead byte
    load_equal(store, "s2", s2)
    assert deltackpt.verify(store).ok
    assert live <= packs_bytes(store) <= live + PACK_ALIGN * len(pack_sizes(store))  # b is gone


def test_gc_compacts_a_partly_dead_pack(store: Path) -> None:
    a, b = rand(1, 1 << 20), rand(2, 1 << 20)
    deltackpt.save({"a": a, "b": b}, store, "s1", threads=1)  # one pack holding a and b
    (old_pack,) = pack_sizes(store)
    old_size = pack_sizes(store)[old_pack]
    info2 = deltackpt.save({"a": a}, store, "s2", threads=1)
    assert info2.chunks_new == 0 and len(pack_sizes(store)) == 1  # fully deduplicated
    assert manifest_packs(store, "s2") == {old_pack}

    deltackpt.delete(store, "s1")
    report = deltackpt.gc(store)
    assert (report.packs_removed, report.packs_compacted) == (0, 1)
    (new_pack,) = pack_sizes(store)
    assert new_pack != old_pack
    assert pack_sizes(store)[new_pack] == PACK_ALIGN + nbytes(a)  # header + a's aligned chunks
    assert report.bytes_freed == old_size - pack_sizes(store)[new_pack]
    assert manifest_packs(store, "s2") == {new_pack}
    load_equal(store, "s2", {"a": a})
    assert deltackpt.verify(store).ok

    again = deltackpt.gc(store)  # the rewritten pack is fully live
    assert (again.packs_removed, again.packs_compacted) == (0, 0)
    assert set(pack_sizes(store)) == {new_pack}


def test_compaction_repoints_a_manifest_that_spans_two_compacted_packs(store: Path) -> None:
    a, b, x, y = (rand(i, 1 << 20) for i in range(4))
    deltackpt.save({"a": a, "x": x}, store, "s1", threads=1)  # pack P1: a, x
    deltackpt.save({"b": b, "y": y}, store, "s2", threads=1)  # pack P2: b, y
    s3 = {"a": a, "b": b}
    assert deltackpt.save(s3, store, "s3").chunks_new == 0  # points into P1 and P2
    p1, p2 = manifest_packs(store, "s1"), manifest_packs(store, "s2")
    assert manifest_packs(store, "s3") == p1 | p2

    deltackpt.delete(store, "s1")
    deltackpt.delete(store, "s2")
    report = deltackpt.gc(store)
    assert report.packs_compacted == 2
    assert manifest_packs(store, "s3") <= set(pack_sizes(store))
    assert not (manifest_packs(store, "s3") & (p1 | p2))
    load_equal(store, "s3", s3)
    assert deltackpt.verify(store).ok
    assert packs_bytes(store) <= nbytes(a, b) + 2 * PACK_ALIGN


def test_gc_leaves_fully_live_small_packs_alone(store: Path) -> None:
    """A pack whose only chunk is small is mostly header and padding, but rewriting it cannot
    shrink it: gc must not rewrite it (and its manifests) on every run."""
    state = {"bias": rand(5, 100), "scale": rand(6, 10)}
    deltackpt.save(state, store, "tiny")
    m_path = store / "snapshots" / "tiny" / "MANIFEST.json"
    packs, manifest = set(pack_sizes(store)), m_path.read_bytes()
    for _ in range(2):
        report = deltackpt.gc(store)
        assert (report.packs_removed, report.packs_compacted, report.bytes_freed) == (0, 0, 0)
    assert set(pack_sizes(store)) == packs
    assert m_path.read_bytes() == manifest
    load_equal(store, "tiny", state)


# ---------------------------------------------------------------------------- retention


def test_keep_last_and_keep(store: Path) -> None:
    states = {f"s{i}": {"w": rand(100 + i), "i": i} for i in range(5)}
    for name, state in states.items():
        deltackpt.save(state, store, name)

    def names() -> list[str]:
        return [s.name for s in deltackpt.snapshots(store)]

    with pytest.raises(ValueError):
        deltackpt.gc(store, keep_last=-1)
    assert deltackpt.gc(store).deleted == []  # keep_last=None: garbage only
    assert deltackpt.gc(store, keep_last=5).deleted == []
    assert deltackpt.gc(store, keep_last=7).deleted == []  # more than there are: keep all
    assert deltackpt.gc(store, keep_last=50).deleted == []
    assert names() == list(states)

    # a name in keep that matches nothing is most likely a typo: gc refuses and deletes nothing
    with pytest.raises(deltackpt.errors.SnapshotNotFoundError, match="no-such-snapshot"):
        deltackpt.gc(store, keep_last=2, keep=["s1", "no-such-snapshot"])
    assert names() == list(states)
    bytes_before = packs_bytes(store)
    report = deltackpt.gc(store, keep_last=2, keep=["s1"])
    assert report.deleted == ["s0", "s2"]
    assert names() == ["s1", "s3", "s4"]
    assert report.bytes_freed == bytes_before - packs_bytes(store) >= 2 * nbytes(rand(0))
    for name in names():
        load_equal(store, name, states[name])

    report = deltackpt.gc(store, keep_last=0, keep=("s3",))
    assert report.deleted == ["s1", "s4"]
    assert names() == ["s3"]
    assert set(pack_sizes(store)) == manifest_packs(store, "s3")
    load_equal(store, "latest", states["s3"])

    assert deltackpt.gc(store, keep_last=0).deleted == ["s3"]
    assert names() == [] and pack_sizes(store) == {}


def test_gc_on_an_empty_store(store: Path, tmp_path: Path) -> None:
    for keep_last in (None, 0, 3):
        report = deltackpt.gc(store, keep_last=keep_last)
        assert report.deleted == []
        assert (report.packs_removed, report.packs_compacted) == (0, 0)
        assert (report.bytes_freed, report.leftovers_removed) == (0, 0)
    assert deltackpt.snapshots(store) == []
    assert deltackpt.verify(store).ok

    missing = tmp_path / "not-a-store"
    with pytest.raises(StoreError):
        deltackpt.gc(missing)
    assert not missing.exists()


def test_gc_removes_leftovers_of_crashed_saves(store: Path) -> None:
    state = {"w": rand(1)}
    deltackpt.save(state, store, "s1")
    live_packs = set(pack_sizes(store))
    (store / "tmp" / "s2.123.456.json").write_bytes(b'{"format": "deltack')  # torn temp file
    (store / "tmp" / "somedir").mkdir()
    (store / "tmp" / "somedir" / "x").write_bytes(b"x")
    (store / "snapshots" / "s2").mkdir()  # mkdir'ed, killed before the manifest was linked
    (store / "snapshots" / "s3").mkdir()
    (store / "snapshots" / "s3" / "junk").write_bytes(b"junk")
    (store / "packs" / "0123456789abcdef0123.pack").write_bytes(b"DCKPACK\x01" + bytes(9000))

    report = deltackpt.gc(store)
    assert report.leftovers_removed == 4
    assert report.packs_removed == 1 and report.bytes_freed == 9008
    assert list((store / "tmp").iterdir()) == []
    assert sorted(p.name for p in (store / "snapshots").iterdir()) == ["s1"]
    assert set(pack_sizes(store)) == live_packs
    load_equal(store, "s1", state)
    deltackpt.save(state | {"x": 1}, store, "s2")  # the swept name is free again
    assert [s.name for s in deltackpt.snapshots(store)] == ["s1", "s2"]


# ---------------------------------------------------------------------------- gc vs saves


def test_gc_refuses_or_waits_while_a_save_is_in_flight(
    store: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    old = {"old": rand(1, 1 << 20)}
    deltackpt.save(old, store, "old")
    old_packs = set(pack_sizes(store))
    deltackpt.delete(store, "old")  # its packs are garbage: gc would delete them

    paused, release = threading.Event(), threading.Event()
    real_append = PackWriter.append

    def append(self: PackWriter, payload: memoryview) -> tuple[int, int]:
        out = real_append(self, payload)
        me = threading.current_thread()
        if me is not threading.main_thread() and me.name != "gc-waiter" and not paused.is_set():
            paused.set()  # the first payload of the save is in a pack, the rest is not
            assert release.wait(60), "test never released the save"
        return out

    monkeypatch.setattr(PackWriter, "append", append)
    new = {"new": rand(2, 1 << 20), "step": 7}
    results: dict[str, object] = {}

    def run(key: str, fn, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        try:
            results[key] = fn(*args, **kwargs)
        except BaseException as e:
            results[key] = e
        results[key + "_t"] = time.monotonic()

    saver = threading.Thread(target=run, args=("save", deltackpt.save, new, store, "new"))
    saver.start()
    waiter = None
    try:
        assert paused.wait(30), "save never wrote its first payload"
        in_flight = set(pack_sizes(store)) - old_packs
        assert in_flight, "the paused save has no pack yet"

        t0 = time.monotonic()
        with pytest.raises(StoreLockedError, match="save is in flight"):
            deltackpt.gc(store, lock_timeout=0.3)
        assert 0.3 <= time.monotonic() - t0 < 30  # its lock_timeout, not the 600 s default
        assert in_flight <= set(pack_sizes(store))  # gc touched nothing

        waiter = threading.Thread(
            target=run,
            args=("gc", deltackpt.gc, store),
            kwargs={"lock_timeout": 60},
            name="gc-waiter",
        )
        waiter.start()
        time.sleep(0.3)
        assert waiter.is_alive() and "gc" not in results  # gc waits for the save
        t_release = time.monotonic()
        release.set()
        saver.join(60)
        waiter.join(60)
        assert not saver.is_alive() and not waiter.is_alive()
    finally:
        release.set()
        saver.join(60)
        if waiter is not None:
            waiter.join(60)

    info, report = results["save"], results["gc"]
    assert isinstance(info, deltackpt.SnapshotInfo), info
    assert isinstance(report, deltackpt.GcReport), report
    assert results["gc_t"] >= results["save_t"] >= t_release  # type: ignore[operator]
    assert report.packs_removed == len(old_packs)  # only the deleted snapshot's packs
    assert set(pack_sizes(store)) == manifest_packs(store, "new")
    load_equal(store, "new", new)
    assert deltackpt.verify(store).ok


def test_save_refuses_or_waits_while_gc_holds_the_store(store: Path) -> None:
    st = deltackpt.open_store(store)
    state = {"w": rand(1)}
    with store_lock(st.lock_path, exclusive=True, timeout=5, what="test gc"):
        with pytest.raises(StoreLockedError, match="gc is running"):
            deltackpt.save(state, store, "s1", lock_timeout=0.2)
        assert pack_sizes(store) == {} and os.listdir(store / "tmp") == []

        done = threading.Event()
        t = threading.Thread(
            target=lambda: (deltackpt.save(state, store, "s1", lock_timeout=60), done.set())
        )
        t.start()
        time.sleep(0.3)
        assert not done.is_set() and not st.has("s1")
    t.join(60)
    assert done.is_set()
    load_equal(store, "s1", state)


def test_delete_waits_for_a_running_gc_instead_of_being_undone(
    store: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """gc's compaction rewrites the manifests pointing into the pack it compacts; a snapshot
    deleted meanwhile must not come back."""
    a, b = rand(1, 1 << 20), rand(2, 1 << 20)
    deltackpt.save({"a": a, "b": b}, store, "s1", threads=1)
    deltackpt.save({"a": a}, store, "s2")  # points into s1's pack
    deltackpt.save({"c": rand(3)}, store, "s3")
    deltackpt.delete(store, "s1")  # s1's pack is half dead: gc compacts it, rewriting s2

    in_gc, release = threading.Event(), threading.Event()
    real_append = PackWriter.append

    def append(self: PackWriter, payload: memoryview) -> tuple[int, int]:
        if threading.current_thread().name == "gc" and not in_gc.is_set():
            in_gc.set()
            assert release.wait(60)
        return real_append(self, payload)

    monkeypatch.setattr(PackWriter, "append", append)
    results: dict[str, object] = {}

    def run(key: str, fn, *args) -> None:  # type: ignore[no-untyped-def]
        try:
            results[key] = fn(*args)
        except BaseException as e:
            results[key] = e

    gc_thread = threading.Thread(target=run, args=("gc", deltackpt.gc, store), name="gc")
    deleter = threading.Thread(target=run, args=("delete", deltackpt.delete, store, "s2"))
    gc_thread.start()
    try:
        assert in_gc.wait(30), "gc never started compacting"
        deleter.start()
        time.sleep(0.3)
        assert deleter.is_alive(), "delete did not wait for the running gc"
        assert "s2" in [s.name for s in deltackpt.snapshots(store)]
    finally:
        release.set()
        gc_thread.join(60)
        if deleter.is_alive() or deleter.ident is not None:
            deleter.join(60)
    assert isinstance(results["gc"], deltackpt.GcReport), results
    assert results["delete"] is None, results
    assert [s.name for s in deltackpt.snapshots(store)] == ["s3"]
    deltackpt.gc(store)
    assert set(pack_sizes(store)) == manifest_packs(store, "s3")
    assert deltackpt.verify(store).ok


def test_gc_does_not_compact_a_truncated_pack(store: Path) -> None:
    """Compaction copies live chunks; from a pack cut short it would copy garbage in place of the
    missing bytes and delete what is left. It must leave such a pack alone (verify reports it)."""
    a, b = rand(1, 1 << 20), rand(2, 1 << 20)
    deltackpt.save({"b": b, "a": a}, store, "s1", threads=1)  # one pack: b's chunks, then a's
    deltackpt.save({"a": a}, store, "s2")
    deltackpt.save({"c": rand(3)}, store, "s3")
    s3_packs = manifest_packs(store, "s3")
    (pack,) = manifest_packs(store, "s2")
    deltackpt.delete(store, "s1")  # b is dead: the pack is half live, gc would compact it
    path = store / "packs" / f"{pack}.pack"
    cut = path.stat().st_size - 1000  # the last chunk of "a" loses its tail
    os.truncate(path, cut)
    before = deltackpt.verify(store)
    assert not before.ok and before.damaged == ["s2"]

    report = deltackpt.gc(store)
    assert report.packs_compacted == 0
    assert path.stat().st_size == cut  # untouched, not rewritten nor deleted
    assert manifest_packs(store, "s2") == {pack}
    after = deltackpt.verify(store)
    assert [(p.snapshots, p.chunk) for p in after.problems] == [
        (p.snapshots, p.chunk) for p in before.problems
    ]
    load_equal(store, "s3", {"c": rand(3)})
    assert set(pack_sizes(store)) == {pack} | s3_packs


def _moved_by_gc(store: Path) -> tuple[torch.Tensor, Manifest]:
    """Snapshot "only-a" and its manifest as read just before a gc compacted the pack it points
    into (after "both", which shared it, was deleted): the stale manifest's pack is gone."""
    a, b = torch.randn(1 << 18), torch.randn(1 << 18)
    deltackpt.save({"a": a, "b": b}, store, "both", threads=1)
    deltackpt.save({"a": a}, store, "only-a", threads=1)
    stale = deltackpt.open_store(store).manifest("only-a")
    deltackpt.delete(store, "both")
    deltackpt.gc(store)
    return a, stale


def test_load_retries_once_when_gc_moved_its_chunks(tmp_path: Path) -> None:
    store = tmp_path / "store"
    a, stale = _moved_by_gc(store)
    assert deltackpt.open_store(store).manifest("only-a") is not stale
    real = deltackpt.store.store.Store.manifest
    calls = []

    def stale_first(self, name):  # the manifest as read just before gc compacted
        calls.append(name)
        return stale if len(calls) == 1 else real(self, name)

    deltackpt.store.store.Store.manifest = stale_first
    try:
        out = deltackpt.load(store, "only-a")
    finally:
        deltackpt.store.store.Store.manifest = real
    assert len(calls) == 2 and torch.equal(out["a"], a)


def test_load_of_a_snapshot_moved_then_deleted_meanwhile_says_not_found(tmp_path: Path) -> None:
    """gc compacted the snapshot's pack while it was read, then retention deleted the snapshot
    before the retry was done: the load says the snapshot is gone (a follower then takes the
    newest), not that the store is damaged."""
    store = tmp_path / "store"
    _, stale = _moved_by_gc(store)
    real = deltackpt.store.store.Store.manifest
    calls = []

    def moved_then_deleted(self, name):
        calls.append(name)
        if len(calls) == 1:
            return stale  # read just before gc compacted
        fresh = real(self, name)
        if len(calls) == 2:  # retention deletes it while the retry reads
            deltackpt.store.store.Store.manifest = real
            try:
                deltackpt.delete(store, "only-a")
                deltackpt.gc(store)
            finally:
                deltackpt.store.store.Store.manifest = moved_then_deleted
        return fresh

    deltackpt.store.store.Store.manifest = moved_then_deleted
    try:
        with pytest.raises(SnapshotNotFoundError, match="only-a"):
            deltackpt.load(store, "only-a")
    finally:
        deltackpt.store.store.Store.manifest = real
    assert len(calls) == 3

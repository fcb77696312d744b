"""The storage seam, through LocalStorage directly: atomic publish-if-absent, ranged reads (mapped
and preadv), whole-object reads, writing, listing, deleting and locking. Containment (keys that
would leave the store, symlinks inside it) is in test_storage_containment.py."""

from __future__ import annotations

import dataclasses
import errno
import os
import socket
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

import deltackpt
from deltackpt.errors import (
    CorruptChunkError,
    InvalidArgumentError,
    SnapshotExistsError,
    StoreIOError,
    StoreLockedError,
    UnsafePathError,
)
from deltackpt.format.codecs import RAW
from deltackpt.format.hashing import digest
from deltackpt.format.manifest import ChunkRecord
from deltackpt.saving.engine import saver_for
from deltackpt.store import durable
from deltackpt.store.chunks import ChunkReader, ChunkTargets
from deltackpt.store.local import DurableOps, LocalStorage
from deltackpt.store.packs import (
    PACK_ALIGN,
    PACK_MAGIC,
    PackReaders,
    PackWriter,
    pack_id_of,
    pack_key,
)
from deltackpt.store.storage import (
    MANIFEST,
    PACKS,
    SNAPSHOTS,
    TMP,
    ObjectTooLargeError,
    Storage,
    manifest_key,
)
from deltackpt.store.store import Store, open_store

KEY = manifest_key("s1")


def _put(s: Storage, key: str, data: bytes) -> None:
    w = s.create(key)
    w.write([memoryview(data)])
    w.finish(durable=True)


def _read(s: Storage, key: str, offset: int, *sizes: int) -> bytes:
    bufs = [bytearray(n) for n in sizes]
    r = s.open_reader(key)
    try:
        n = r.read_into(offset, [memoryview(b) for b in bufs])
    finally:
        r.close()
    return b"".join(bytes(b) for b in bufs)[:n]


# ---------------------------------------------------------------------------- atomic publish


def test_publish_only_if_absent(storage: LocalStorage) -> None:
    storage.publish(KEY, b"first")
    with pytest.raises(SnapshotExistsError) as ei:
        storage.publish(KEY, b"second")
    assert isinstance(ei.value, FileExistsError)
    assert storage.read(KEY).data == b"first"  # the loser changed nothing
    assert storage.list(TMP) == []  # and left no temp file behind
    storage.replace(KEY, b"third")
    assert storage.read(KEY).data == b"third"
    assert storage.list(TMP) == []


def test_concurrent_publishers_exactly_one_wins(storage: LocalStorage) -> None:
    def race(key: str) -> tuple[list[bytes], list[BaseException]]:
        barrier = threading.Barrier(4)
        won: list[bytes] = []
        lost: list[BaseException] = []

        def publisher(data: bytes) -> None:
            barrier.wait()
            try:
                storage.publish(key, data)
                won.append(data)
            except SnapshotExistsError as e:
                lost.append(e)

        threads = [threading.Thread(target=publisher, args=(bytes([i]) * 64,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return won, lost

    for round_ in range(10):
        key = manifest_key(f"r{round_}")
        won, lost = race(key)
        assert len(won) == 1 and len(lost) == 3
        assert storage.read(key).data == won[0]


def test_publish_creates_the_directory_and_refuses_missing_parents(
    storage: LocalStorage, tmp_path: Path
) -> None:
    storage.publish("STORE.json", b"{}")
    assert (storage.root / "STORE.json").read_bytes() == b"{}"
    bare = LocalStorage(tmp_path / "bare")
    bare.make_dirs(())
    with pytest.raises(FileNotFoundError):  # snapshots/ must exist: the store is not there
        bare.publish(KEY, b"x")
    assert not (tmp_path / "bare" / SNAPSHOTS).exists()


def test_a_failed_commit_step_publishes_nothing(storage: LocalStorage) -> None:
    def eio(*args: object, **kwargs: object) -> None:
        raise OSError(errno.EIO, "injected")

    for ops in (DurableOps(write_durable=eio), DurableOps(publish=eio)):
        s = LocalStorage(storage.root, ops=ops)
        with pytest.raises(OSError, match="injected"):
            s.publish(KEY, b"x")
        assert not storage.exists(KEY)


def test_the_store_commits_through_its_storage(tmp_path: Path) -> None:
    """write_manifest goes through Storage.publish: a storage whose publish fails commits
    nothing, and the name stays free."""
    root = tmp_path / "s"
    deltackpt.save({"w": torch.arange(10.0)}, root, "a")
    st = open_store(root)
    calls: list[str] = []

    def failing(tmp: Path, final: Path, overwrite: bool = False) -> None:
        calls.append(final.name)
        raise OSError(errno.ENOSPC, "injected")

    cfg = {"chunk_bytes": st.chunk_bytes, "small_bytes": st.small_bytes}
    broken = Store(root, cfg, LocalStorage(root, ops=DurableOps(publish=failing)))
    m = dataclasses.replace(st.manifest("a"), name="b")
    with pytest.raises(OSError, match="injected"):
        broken.write_manifest(m, overwrite=False)
    assert calls == [MANIFEST]
    assert st.names() == ["a"] and not st.has("b")
    assert st.write_manifest(m, overwrite=False) > 0
    assert st.names() == ["a", "b"]
    with pytest.raises(SnapshotExistsError):
        st.write_manifest(m, overwrite=False)


def test_open_store_takes_a_storage_of_its_own(tmp_path: Path) -> None:
    """``open_store(path, storage=...)``: every byte of that store goes through the storage; the
    store is the caller's own, and ``open_store(path)`` keeps returning the shared one."""
    root = tmp_path / "s"
    calls: list[str] = []

    def counting(tmp: Path, final: Path, overwrite: bool = False) -> None:
        calls.append(final.name)
        durable.publish(tmp, final, overwrite=overwrite)

    own = open_store(root, storage=LocalStorage(root, ops=DurableOps(publish=counting)))
    assert calls == ["STORE.json"]  # created through it
    deltackpt.save({"w": torch.arange(10.0)}, own, "a")
    assert calls == ["STORE.json", MANIFEST]
    shared = open_store(root)
    assert shared is not own and open_store(root) is shared and shared.names() == ["a"]
    deltackpt.save({"w": torch.arange(3.0)}, shared, "b")
    assert calls == ["STORE.json", MANIFEST]  # the shared store's storage is its own
    again = open_store(root, storage=LocalStorage(root))
    assert again is not own and again is not shared and again.names() == ["a", "b"]
    with pytest.raises(InvalidArgumentError, match="already has its storage"):
        open_store(shared, storage=LocalStorage(root))
    saver_for(own).close()
    saver_for(again).close()


# ------------------------------------------------------------------------------ ranged reads


@pytest.mark.parametrize("map_reads", [True, False], ids=["mmap", "preadv"])
def test_ranged_reads(tmp_path: Path, map_reads: bool) -> None:
    s = LocalStorage(tmp_path, map_reads=map_reads)
    (tmp_path / PACKS).mkdir()
    data = np.random.default_rng(1).integers(0, 256, 10_000, dtype=np.uint8).tobytes()
    _put(s, "packs/x.pack", data)
    assert _read(s, "packs/x.pack", 0, 10_000) == data
    assert _read(s, "packs/x.pack", 123, 7, 0, 1000, 5) == data[123 : 123 + 1012]
    # short at the end: only what is there, and the count says so
    assert _read(s, "packs/x.pack", 9_990, 4, 100) == data[9_990:]
    assert _read(s, "packs/x.pack", 10_000, 16) == b""
    assert _read(s, "packs/x.pack", 50_000, 16) == b""
    # more buffers than one preadv takes (IOV_MAX), each a byte
    bufs = [bytearray(1) for _ in range(3000)]
    r = s.open_reader("packs/x.pack")
    assert r.read_into(17, [memoryview(b) for b in bufs]) == 3000
    r.close()
    assert b"".join(bufs) == data[17:3017]


@pytest.mark.parametrize("map_reads", [True, False], ids=["mmap", "preadv"])
def test_reads_of_short_and_empty_objects(tmp_path: Path, map_reads: bool) -> None:
    s = LocalStorage(tmp_path, map_reads=map_reads)
    (tmp_path / "empty").write_bytes(b"")
    assert _read(s, "empty", 0, 10) == b""
    (tmp_path / "cut").write_bytes(b"abcdef" * 1000)
    os.truncate(tmp_path / "cut", 100)  # truncated before it is opened: reads stop at 100
    assert _read(s, "cut", 90, 50) == (b"abcdef" * 20)[90:100]
    with pytest.raises(FileNotFoundError):
        s.open_reader("missing")


def test_readers_are_shared_by_threads(tmp_path: Path) -> None:
    s = LocalStorage(tmp_path)
    data = bytes(range(256)) * 512
    _put(s, "obj", data)
    r = s.open_reader("obj")
    errors: list[int] = []

    def worker(seed: int) -> None:
        rng = np.random.default_rng(seed)
        for _ in range(200):
            off = int(rng.integers(0, len(data)))
            n = int(rng.integers(1, 5000))
            buf = bytearray(n)
            got = r.read_into(off, [memoryview(buf)])
            if bytes(buf[:got]) != data[off : off + n]:
                errors.append(off)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    r.close()
    assert errors == []


def test_read_whole_objects_with_versions(storage: LocalStorage) -> None:
    storage.publish(KEY, b"v1")
    b1 = storage.read(KEY)
    assert (b1.data, b1.size) == (b"v1", 2)
    assert storage.read(KEY, known=b1.version).data is None  # unchanged: not read again
    storage.replace(KEY, b"v2-longer")
    b2 = storage.read(KEY, known=b1.version)
    assert b2.data == b"v2-longer" and b2.version != b1.version
    with pytest.raises(ObjectTooLargeError) as ei:
        storage.read(KEY, max_bytes=4)
    assert ei.value.size == 9 and ei.value.max_bytes == 4
    with pytest.raises(FileNotFoundError):
        storage.read(manifest_key("nope"))
    (storage.root / SNAPSHOTS / "stray").write_bytes(b"a file, not a snapshot directory")
    with pytest.raises(FileNotFoundError):
        storage.read(manifest_key("stray"))
    (storage.root / SNAPSHOTS / "dir" / MANIFEST).mkdir(parents=True)
    with pytest.raises(UnsafePathError, match="not a regular file"):
        storage.read(manifest_key("dir"))


# --------------------------------------------------------------------------- writing objects


def test_create_refuses_an_existing_object_and_abort_keeps_what_was_written(
    storage: LocalStorage,
) -> None:
    _put(storage, "packs/a.pack", b"one")
    with pytest.raises(FileExistsError):
        storage.create("packs/a.pack")
    assert storage.read("packs/a.pack").data == b"one"
    w = storage.create("packs/b.pack")
    w.write([memoryview(b"par"), memoryview(b"tial")])
    w.abort()
    w.abort()  # idempotent
    assert storage.read("packs/b.pack").data == b"partial"


def test_pack_writer_and_readers_over_a_storage(storage: LocalStorage) -> None:
    payloads = [os.urandom(n) for n in (1, 4096, 5000)]
    w = PackWriter(storage, pack_id="p1")
    spans = [w.append(memoryview(p)) for p in payloads]
    size = w.finish()
    assert w.key == pack_key("p1") == "packs/p1.pack"
    assert w.path == storage.root / "packs" / "p1.pack"
    assert size == storage.read(w.key).size
    assert [off % PACK_ALIGN for off, _ in spans] == [0, 0, 0]
    assert storage.read(w.key).data[: len(PACK_MAGIC)] == PACK_MAGIC  # type: ignore[index]
    for path_or_storage in (storage, storage.root / PACKS):  # a Storage, or the packs dir
        with PackReaders(path_or_storage) as packs:
            for (off, n), p in zip(spans, payloads, strict=True):
                out = np.empty(n, np.uint8)
                assert packs.read_into("p1", off, out) == n and out.tobytes() == p
    d = PackWriter(storage, pack_id="p2")
    d.append(memoryview(b"x"))
    d.discard()
    assert not storage.exists("packs/p2.pack")


def test_missing_pack_is_typed_on_the_error(storage: LocalStorage) -> None:
    data = np.arange(4096, dtype=np.uint8)
    w = PackWriter(storage)
    off, n = w.append(memoryview(data))
    w.finish()
    d = digest(data)
    rec = ChunkRecord(w.pack_id, off, n, n, RAW)

    def load() -> CorruptChunkError:
        out = np.empty(n, np.uint8)
        with PackReaders(storage) as packs, pytest.raises(CorruptChunkError) as ei:
            ChunkReader(packs, {d: rec}).read(ChunkTargets(d, [(0, n, out)], "key 'k'"))
        return ei.value

    with (storage.root / w.key).open("r+b") as f:  # damage: not a missing pack
        f.seek(off + 10)
        f.write(b"\xff")
    e = load()
    assert e.missing_pack is False and "hash to" in str(e)
    storage.delete(w.key)
    e = load()
    assert e.missing_pack is True and "is missing" in str(e)


# ------------------------------------------------------------------------- listing, deleting


def test_list_names_kinds_and_sizes(storage: LocalStorage, bait: Path) -> None:
    _put(storage, "packs/a.pack", b"12345")
    (storage.root / PACKS / "sub").mkdir()
    os.symlink(bait / "precious", storage.root / PACKS / "link.pack")
    got = {e.name: (e.kind, e.size) for e in storage.list(PACKS)}
    assert got == {"a.pack": ("file", 5), "sub": ("dir", 0), "link.pack": ("link", 0)}
    assert {e.name for e in storage.list("")} == {SNAPSHOTS, PACKS, TMP}
    assert storage.list("nowhere") == []
    (storage.root / "afile").write_bytes(b"")
    with pytest.raises(UnsafePathError, match="not a directory"):
        storage.list("afile")
    os.symlink(bait, storage.root / "linkdir")
    with pytest.raises(UnsafePathError, match="symlink"):
        storage.list("linkdir")
    assert pack_id_of("a.pack") == "a" and pack_id_of("a.pack.tmp") is None
    assert pack_id_of("../x.pack") is None and pack_id_of(".pack") is None


def test_delete_objects_links_and_trees(storage: LocalStorage, bait: Path) -> None:
    _put(storage, "packs/a.pack", b"x")
    storage.delete("packs/a.pack")
    assert not storage.exists("packs/a.pack")
    with pytest.raises(FileNotFoundError):
        storage.delete("packs/a.pack")
    os.symlink(bait / "precious", storage.root / PACKS / "l.pack")
    assert storage.exists("packs/l.pack")  # a link is an entry (reading it is refused)
    storage.delete("packs/l.pack")  # the link itself, not its target
    assert not os.path.lexists(storage.root / PACKS / "l.pack")
    tree = storage.root / SNAPSHOTS / "dead"
    (tree / "deep").mkdir(parents=True)
    (tree / "deep" / "f").write_bytes(b"f")
    os.symlink(bait, tree / "out")
    storage.delete("snapshots/dead", recursive=True)
    assert not tree.exists()
    assert (bait / "precious").read_bytes() == b"not yours"
    storage.sync(SNAPSHOTS)
    with pytest.raises(UnsafePathError):
        storage.delete("")


def test_store_lock_shared_and_exclusive(storage: LocalStorage) -> None:
    with storage.lock(exclusive=False, timeout=1, what="save a"):
        with storage.lock(exclusive=False, timeout=1, what="save b"):
            pass
        with (
            pytest.raises(StoreLockedError, match="a save is in flight"),
            storage.lock(exclusive=True, timeout=0, what="gc"),
        ):
            pass
    with storage.lock(exclusive=True, timeout=1, what="gc"):
        pass


def test_unopenable_manifest_is_a_typed_store_error(tmp_path: Path) -> None:
    """An OSError other than "missing" while opening a manifest (here ENXIO: a socket where the
    file should be) is a StoreIOError keeping its errno; listing reports it as damaged."""
    root = tmp_path / "s"
    deltackpt.save({"w": torch.ones(3)}, root, "a")
    d = root / SNAPSHOTS / "b"
    d.mkdir()
    sock = socket.socket(socket.AF_UNIX)
    try:
        sock.bind(str(d / MANIFEST))
        st = open_store(root)
        good, bad = st.scan()
        assert [m.name for m in good] == ["a"] and [b.name for b in bad] == ["b"]
        with pytest.raises(StoreIOError) as ei:
            st.manifest("b")
        assert ei.value.errno == errno.ENXIO and str(d / MANIFEST) in str(ei.value)
    finally:
        sock.close()

"""Object stores (FsspecStorage) through the public API, against a real S3 API server (moto's
ThreadedMotoServer on 127.0.0.1, started here) and fsspec's memory://: save / load / dedupe /
verify / gc / delete, the conditional-create commit race, failed uploads, missing buckets."""

from __future__ import annotations

import threading
import time
import uuid
from typing import Any

import pytest
import torch

import deltackpt
from deltackpt.errors import (
    InvalidArgumentError,
    SaveFailedError,
    SnapshotExistsError,
    StoreError,
    StoreIOError,
    UnsupportedURLError,
)
from deltackpt.store.objstore import FsspecStorage, NoLockError
from deltackpt.store.storage import PACKS, Storage, manifest_key
from tests.store._s3 import client, keys, uploads

s3fs = pytest.importorskip("s3fs")  # a guard only: the test extra installs s3fs and moto
pytest.importorskip("moto.server")

CHUNK = 1 << 20


def _state(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "big": torch.randn(3 << 20, generator=g),  # 12 MiB: multipart parts of 5 MiB
        "half": torch.randn(1000, 7, generator=g).to(torch.bfloat16),
        "ids": torch.arange(100, dtype=torch.int64),
    }


def _small_parts(url: str, opts: dict[str, Any], **kw: Any) -> FsspecStorage:
    return FsspecStorage(url, opts, block_size=5 << 20, part_bytes=1 << 20, **kw)


def test_s3_save_load_dedupe_verify_gc_delete(endpoint: str, bucket: str, opts: dict) -> None:
    url = f"s3://{bucket}/run"
    st = deltackpt.open_store(url, storage_options=opts, chunk_bytes=CHUNK)
    assert deltackpt.open_store(url, storage_options=opts) is st  # shared, like a directory
    fast = deltackpt.open_store(url, storage=_small_parts(url, opts))
    sd = _state()
    r1 = deltackpt.save(sd, fast, "s1")
    assert r1.chunks_new > 0
    out = deltackpt.load(st, "s1")
    for k, v in sd.items():
        assert out[k].dtype == v.dtype and torch.equal(out[k], v), k
    r2 = deltackpt.save(sd, st, "s2")  # unchanged: only the manifest is written
    assert r2.chunks_new == 0 and r2.bytes_written < 64 << 10
    assert [i.name for i in deltackpt.snapshots(st)] == ["s1", "s2"]
    assert not deltackpt.verify(st).problems
    assert not uploads(endpoint, bucket)
    with pytest.raises(NoLockError, match="no_concurrent_saves=True") as e:
        deltackpt.gc(st, keep_last=1)
    assert url in str(e.value)
    gc_st = deltackpt.open_store(url, storage=FsspecStorage(url, opts, no_concurrent_saves=True))
    assert deltackpt.gc(gc_st, keep_last=1).deleted == ["s1"]
    sd["big"][:10] += 1  # one changed chunk, written whole (auto would write an xor delta)
    deltackpt.save(sd, st, "s3", encoding="fast-restore")
    deltackpt.delete(st, "s2")
    assert [i.name for i in deltackpt.snapshots(st)] == ["s3"]
    assert torch.equal(deltackpt.load(fast, "latest")["big"], sd["big"])
    report = deltackpt.gc(gc_st, compact_below=0.99)  # s1 and s2 are gone: one dead chunk
    assert report.packs_removed + report.packs_compacted >= 1
    assert not deltackpt.verify(st).problems
    assert not any(k.startswith("run/tmp/") for k in keys(endpoint, bucket))
    with pytest.raises(StoreError, match="object store"):
        _ = st.packs_dir


def test_s3_publish_race_exactly_one_wins(bucket: str, opts: dict) -> None:
    url = f"s3://{bucket}/race"
    st = deltackpt.open_store(url, storage_options=opts)
    for i in range(4):
        key = manifest_key(f"r{i}")
        barrier = threading.Barrier(2)
        results: list[object] = []

        def publish(
            data: bytes, key: str = key, barrier: threading.Barrier = barrier, results=results
        ) -> None:
            barrier.wait()
            try:
                st.storage.publish(key, data)
                results.append(data)
            except Exception as e:
                results.append(e)

        ts = [threading.Thread(target=publish, args=(d,)) for d in (b"A" * 100, b"B" * 100)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(30)
        wins = [r for r in results if isinstance(r, bytes)]
        losses = [r for r in results if isinstance(r, SnapshotExistsError)]
        assert len(wins) == 1 and len(losses) == 1, results
        assert url in str(losses[0])
        assert st.storage.read(key).data == wins[0]  # the winner's bytes, whole


def test_s3_second_save_of_a_name_is_refused(bucket: str, opts: dict) -> None:
    st = deltackpt.open_store(f"s3://{bucket}/dup", storage_options=opts)
    deltackpt.save({"x": torch.ones(3)}, st, "a")
    with pytest.raises(SnapshotExistsError):
        deltackpt.save({"x": torch.zeros(3)}, st, "a")
    deltackpt.save({"x": torch.zeros(3)}, st, "a", overwrite=True)
    assert torch.equal(deltackpt.load(st, "a")["x"], torch.zeros(3))


class _FailingWrites:
    """A Storage whose pack uploads fail after ``after`` writes each (a network error
    mid-upload, after the first 5 MiB part went out)."""

    def __init__(self, inner: Storage, after: int) -> None:
        self._inner, self._after = inner, after

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def create(self, key: str) -> Any:
        w = self._inner.create(key)
        left = [self._after]  # per pack: each upload fails after its own ``after`` writes

        class Writer:
            def write(self, bufs: Any) -> None:
                if left[0] <= 0:
                    raise ConnectionResetError("injected: connection reset mid-upload")
                left[0] -= 1
                w.write(bufs)

            def finish(self, durable: bool) -> None:
                w.finish(durable)

            def abort(self) -> None:
                w.abort()

        return Writer()


def test_s3_save_failing_mid_upload_leaves_nothing(endpoint: str, bucket: str, opts) -> None:
    url = f"s3://{bucket}/fail"
    deltackpt.open_store(url, storage_options=opts, chunk_bytes=CHUNK)  # STORE.json
    st = deltackpt.open_store(url, storage=_FailingWrites(_small_parts(url, opts), after=7))
    with pytest.raises((SaveFailedError, OSError)):
        deltackpt.save(_state(), st, "broken")
    assert deltackpt.snapshots(st) == []
    assert keys(endpoint, bucket) == ["fail/STORE.json"]  # no pack, no manifest
    assert not uploads(endpoint, bucket)  # the multipart upload was aborted, not completed
    assert st.storage.list(PACKS) == []


def test_s3_missing_bucket_and_network_errors_are_typed(bucket: str, opts: dict) -> None:
    url = f"s3://no-such-bucket-{uuid.uuid4().hex[:8]}/run"
    with pytest.raises(StoreIOError) as e:
        deltackpt.open_store(url, storage_options=opts)
    assert url in str(e.value)
    with pytest.raises(StoreError, match="no deltackpt store"):
        deltackpt.open_store(f"s3://{bucket}/none", storage_options=opts, create=False)
    dead = {**opts, "endpoint_url": "http://127.0.0.1:9", "retries": 1}
    dead["config_kwargs"] = {"retries": {"max_attempts": 1}, "connect_timeout": 2}
    with pytest.raises(StoreError) as e2:
        deltackpt.open_store("s3://bucket/run", storage_options=dead)
    assert "s3://bucket/run" in str(e2.value)


def test_memory_round_trip_and_race() -> None:
    url = f"memory://deltackpt-test-{uuid.uuid4().hex[:8]}/run"
    st = deltackpt.open_store(url)
    sd = _state(1)
    deltackpt.save(sd, st, "m1")
    r = deltackpt.save(sd, st, "m2")
    assert r.chunks_new == 0
    out = deltackpt.load(st, "m1")
    assert all(torch.equal(out[k], sd[k]) for k in sd)
    assert not deltackpt.verify(st).problems
    with pytest.raises(SnapshotExistsError):
        st.storage.publish(manifest_key("m1"), b"{}")
    deltackpt.delete(st, "m1")
    assert [i.name for i in deltackpt.snapshots(st)] == ["m2"]


def test_urls_and_options_are_checked(tmp_path) -> None:
    with pytest.raises(UnsupportedURLError, match=r"gs://"):
        deltackpt.open_store("gs://bucket/run")
    with pytest.raises(UnsupportedURLError, match=r"s3://bucket"):
        deltackpt.open_store("s3://bucket/../x")
    with pytest.raises(InvalidArgumentError, match="storage_options"):
        deltackpt.open_store(tmp_path / "s", storage_options={"key": "k"})


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_s3_async_save_dcp_and_pickled_writer(bucket: str, opts: dict) -> None:
    import pickle

    import torch.distributed.checkpoint as dcp

    from deltackpt.dcp import StoreReader, StoreWriter

    url = f"s3://{bucket}/dcp"
    st = deltackpt.open_store(url, storage_options=opts, chunk_bytes=CHUNK)
    sd = {"w": torch.randn(300, 300), "step": 3}
    deltackpt.async_save(sd, st, "a1").result(timeout=60)
    assert torch.equal(deltackpt.load(st, "a1")["w"], sd["w"])
    dcp.save(sd, storage_writer=StoreWriter(st, "d1"), no_dist=True)
    into = {"w": torch.zeros(300, 300), "step": 0}
    dcp.load(into, storage_reader=StoreReader(st, "d1"), no_dist=True)
    assert torch.equal(into["w"], sd["w"]) and into["step"] == 3
    clone = pickle.loads(pickle.dumps(StoreWriter(st, "d2")))  # DCP's process-based async
    assert clone.store is st  # reopened from the URL and its storage_options
    assert not deltackpt.verify(st).problems


def test_memory_publish_race() -> None:
    st = deltackpt.open_store(f"memory://deltackpt-race-{uuid.uuid4().hex[:8]}")
    barrier = threading.Barrier(4)
    results: list[object] = []

    def publish(i: int) -> None:
        barrier.wait()
        try:
            st.storage.publish(manifest_key("x"), bytes([i]) * 10)
            results.append(i)
        except SnapshotExistsError as e:
            results.append(e)

    ts = [threading.Thread(target=publish, args=(i,)) for i in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(30)
    assert sum(isinstance(r, int) for r in results) == 1 and len(results) == 4


def test_s3_abandon_uploads_only_under_the_prefix_and_by_age(
    endpoint: str, bucket: str, opts: dict, tmp_path
) -> None:
    url = f"s3://{bucket}/run"
    st = deltackpt.open_store(url, storage_options=opts)
    c = client(endpoint)
    for key in ("run/packs/p1", "run/packs/p2", "run2/packs/p3", "other/x"):
        up = c.create_multipart_upload(Bucket=bucket, Key=key)
        c.upload_part(Bucket=bucket, Key=key, UploadId=up["UploadId"], PartNumber=1, Body=b"x")
    # moto stamps every upload with one fixed time (2010): the threshold is relative to it
    age = time.time() - min(u["Initiated"].timestamp() for u in uploads(endpoint, bucket))
    assert st.storage.abandon_uploads(age + 3600) == []  # none is that old
    assert len(uploads(endpoint, bucket)) == 4
    assert sorted(st.storage.abandon_uploads(0, dry_run=True)) == ["packs/p1", "packs/p2"]
    assert len(uploads(endpoint, bucket)) == 4
    assert sorted(st.storage.abandon_uploads(0)) == ["packs/p1", "packs/p2"]
    assert sorted(u["Key"] for u in uploads(endpoint, bucket)) == ["other/x", "run2/packs/p3"]
    gc_st = deltackpt.open_store(url, storage=FsspecStorage(url, opts, no_concurrent_saves=True))
    assert deltackpt.gc(gc_st).uploads_aborted == []
    assert len(uploads(endpoint, bucket)) == 2  # other stores' uploads are left alone
    mem = deltackpt.open_store(f"memory://deltackpt-ab-{uuid.uuid4().hex[:8]}")
    assert mem.storage.abandon_uploads(0) == []
    local = deltackpt.open_store(tmp_path / "local")
    assert local.storage.abandon_uploads(0) == []
    assert deltackpt.gc(local).uploads_aborted == []

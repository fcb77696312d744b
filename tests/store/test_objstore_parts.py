"""Object stores, second part: S3 packs upload several parts at once (and a failed part aborts
the upload), ``encoding="auto"`` writes xor deltas on an object store, missing credentials and
missing client packages are typed errors naming the URL. Against moto's S3 server on 127.0.0.1
(fixtures in tests/conftest.py)."""

from __future__ import annotations

import importlib.util
import threading
from typing import Any

import pytest
import torch

import deltackpt
from deltackpt.errors import SaveFailedError, StoreIOError, UnsupportedURLError
from deltackpt.format.policy import AUTO_REMOTE, ENCODINGS
from deltackpt.options import SaveOptions
from deltackpt.store.objstore import FsspecStorage
from deltackpt.store.storage import PACKS
from tests.store._s3 import keys, uploads

pytest.importorskip("s3fs")  # a guard only: the test extra installs s3fs and moto
pytest.importorskip("moto.server")

MiB = 1 << 20


class _CallSpy:
    """Wraps a storage's ``fs._call_s3`` (the coroutine every S3 call of FsspecStorage awaits):
    counts the upload_part calls running at once, and can fail the ``fail_part``-th one (a
    network error mid-upload)."""

    def __init__(self, storage: FsspecStorage, fail_part: int = 0) -> None:
        self.inner = storage.fs._call_s3
        self.fail_part = fail_part
        self.running = self.peak = self.parts = 0
        self.lock = threading.Lock()
        storage.fs._call_s3 = self  # an instance attribute: only this storage's calls

    async def __call__(self, method: str, *args: Any, **kw: Any) -> Any:
        if method != "upload_part":
            return await self.inner(method, *args, **kw)
        with self.lock:
            self.parts += 1
            n = self.parts
            self.running += 1
            self.peak = max(self.peak, self.running)
        try:
            if n == self.fail_part:
                raise ConnectionResetError("injected: connection reset during a part")
            return await self.inner(method, *args, **kw)
        finally:
            with self.lock:
                self.running -= 1


def _storage(url: str, opts: dict[str, Any]) -> FsspecStorage:
    import fsspec

    # s3fs caches file systems by options: a fresh instance, so the spy touches no other test
    fresh = {**opts, "skip_instance_cache": True}
    st = FsspecStorage(url, fresh, block_size=5 * MiB, parts_in_flight=3)
    assert isinstance(st.fs, fsspec.AbstractFileSystem)
    return st


def test_s3_pack_uploads_several_parts_at_once(endpoint: str, bucket: str, opts: dict) -> None:
    url = f"s3://{bucket}/parts"
    storage = _storage(url, opts)
    spy = _CallSpy(storage)
    st = deltackpt.open_store(url, storage=storage, chunk_bytes=4 * MiB)
    sd = {"w": torch.randn(8 * MiB // 4 * 3)}  # 24 MiB: five 5 MiB parts and a last one
    deltackpt.save(sd, st, "a", threads=1)  # one pack writer: the parallelism is the parts'
    assert spy.parts >= 4
    assert spy.peak >= 2, f"parts went out one at a time (peak {spy.peak})"
    assert torch.equal(deltackpt.load(st, "a")["w"], sd["w"])
    assert not uploads(endpoint, bucket)
    assert not deltackpt.verify(st).problems


def test_s3_failed_part_aborts_the_upload(endpoint: str, bucket: str, opts: dict) -> None:
    url = f"s3://{bucket}/failpart"
    deltackpt.open_store(url, storage_options=opts, chunk_bytes=4 * MiB)  # STORE.json
    storage = _storage(url, opts)
    _CallSpy(storage, fail_part=3)
    st = deltackpt.open_store(url, storage=storage)
    with pytest.raises((SaveFailedError, OSError)) as e:
        deltackpt.save({"w": torch.randn(6 * MiB)}, st, "broken", threads=1)
    assert url in str(e.value) or "connection reset" in str(e.value)
    assert deltackpt.snapshots(st) == []
    assert keys(endpoint, bucket) == ["failpart/STORE.json"]  # no pack, no manifest
    assert not uploads(endpoint, bucket)  # aborted, not left behind
    assert st.storage.list(PACKS) == []


def test_auto_writes_xor_deltas_on_an_object_store(bucket: str, opts: dict, tmp_path) -> None:
    assert SaveOptions().for_storage(remote=True).encoding is AUTO_REMOTE
    assert SaveOptions().for_storage(remote=False).encoding is ENCODINGS["auto"]
    mine = SaveOptions(encoding="fast-restore")
    assert mine.for_storage(remote=True) is mine  # a choice the caller made stays
    g = torch.Generator().manual_seed(0)
    w = torch.randn(2 * MiB, generator=g).to(torch.bfloat16)
    stepped = w + (torch.randn(w.shape, generator=g) * 1e-3).to(torch.bfloat16)
    s3 = deltackpt.open_store(f"s3://{bucket}/auto", storage_options=opts, chunk_bytes=MiB)
    local = deltackpt.open_store(tmp_path / "local", chunk_bytes=MiB)
    for st in (s3, local):
        deltackpt.save({"w": w}, st, "s1")
    remote = deltackpt.save({"w": stepped}, s3, "s2")
    disk = deltackpt.save({"w": stepped}, local, "s2")
    assert disk.bytes_written >= w.nbytes  # a local disk: changed chunks raw
    assert remote.bytes_written < 0.6 * w.nbytes  # over a network: xor deltas
    assert torch.equal(deltackpt.load(s3, "s2")["w"], stepped)
    again = stepped + (torch.randn(w.shape, generator=g) * 1e-3).to(torch.bfloat16)
    raw = deltackpt.save({"w": again}, s3, "s3", encoding="fast-restore")
    assert raw.bytes_written >= w.nbytes


def test_missing_credentials_are_a_typed_error(
    endpoint: str, bucket: str, monkeypatch: pytest.MonkeyPatch, tmp_path
) -> None:
    for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    url = f"s3://{bucket}/nocreds"
    no_creds = {"endpoint_url": endpoint, "skip_instance_cache": True}
    with pytest.raises(StoreIOError) as e:
        deltackpt.open_store(url, storage_options=no_creds)
    assert url in str(e.value) and "credentials" in str(e.value).lower()


@pytest.mark.parametrize(
    ("url", "package"), [("gs://bucket/run", "gcsfs"), ("az://container/run", "adlfs")]
)
def test_gcs_and_azure_urls_name_their_package(url: str, package: str) -> None:
    if importlib.util.find_spec(package) is not None:
        pytest.skip(f"{package} is installed here: the missing-package message cannot show")
    with pytest.raises(UnsupportedURLError) as e:
        deltackpt.open_store(url)
    assert url in str(e.value) and f"pip install {package}" in str(e.value)


@pytest.mark.parametrize("url", ["gs://", "az://", "s3://"])
def test_object_store_urls_need_a_bucket(url: str) -> None:
    with pytest.raises(UnsupportedURLError, match="bucket"):
        FsspecStorage(url, {"skip_instance_cache": True} if url == "s3://" else None)

"""A saving process SIGKILLed mid-upload to an object store (a moto S3 server on 127.0.0.1):
nothing is listed, earlier snapshots load bit-exact, and gc (on the no_concurrent_saves promise)
aborts the unfinished multipart upload and removes every pack no snapshot references."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import deltackpt
from deltackpt.store.objstore import FsspecStorage
from deltackpt.store.packs import pack_id_of
from deltackpt.store.storage import PACKS
from tests.store._s3 import client, keys, uploads

pytest.importorskip("s3fs")
pytest.importorskip("moto.server")
pytestmark = pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="needs SIGKILL")

ROOT = Path(__file__).resolve().parents[2]
CHUNK = 1 << 20

# The child saves 48 MiB of fresh random data in 5 MiB multipart parts and is killed as soon as
# the server holds a first part of it. Every later part stalls first, so the kill always lands
# mid-upload (parts go out several at once: unstalled, the upload could complete in between).
CHILD = """
import asyncio, json, sys, torch, deltackpt
from deltackpt.store.objstore import FsspecStorage
url, opts = sys.argv[1], json.loads(sys.argv[2])
storage = FsspecStorage(url, opts, block_size=5 << 20)
call, done = storage.fs._call_s3, []
async def stalling(method, *a, **kw):
    if method == "upload_part" and done:
        await asyncio.sleep(60)
    out = await call(method, *a, **kw)
    if method == "upload_part":
        done.append(1)
    return out
storage.fs._call_s3 = stalling
st = deltackpt.open_store(url, storage=storage)
g = torch.Generator().manual_seed(7)
sd = {"w": torch.randn(12 << 20, generator=g), "b": torch.randn(1000, generator=g)}
print("saving", flush=True)
deltackpt.save(sd, st, "killed")
print("saved", flush=True)
"""


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return {"a": torch.randn(1 << 20, generator=g), "h": torch.randn(999).to(torch.bfloat16)}


def _parts_uploaded(endpoint: str, bucket: str) -> int:
    c = client(endpoint)
    return sum(
        len(c.list_parts(Bucket=bucket, Key=u["Key"], UploadId=u["UploadId"]).get("Parts", []))
        for u in uploads(endpoint, bucket)
    )


def test_sigkill_mid_upload_leaves_nothing_listed_and_gc_cleans_up(
    endpoint: str, bucket: str, opts: dict[str, Any]
) -> None:
    url = f"s3://{bucket}/run"
    st = deltackpt.open_store(url, storage_options=opts, chunk_bytes=CHUNK)
    sd = _state()
    deltackpt.save(sd, st, "s0")
    before = set(keys(endpoint, bucket))

    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, url, json.dumps(opts)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
    )
    try:
        deadline = time.monotonic() + 25
        while _parts_uploaded(endpoint, bucket) == 0:
            assert child.poll() is None, child.communicate()[1].decode()[-2000:]
            assert time.monotonic() < deadline, "the child never uploaded a part"
            time.sleep(0.01)
        child.send_signal(signal.SIGKILL)
    finally:
        if child.poll() is None:
            child.kill()
        out, _ = child.communicate(timeout=10)
    assert child.returncode == -signal.SIGKILL
    assert b"saved" not in out

    # nothing of the killed save is visible; the earlier snapshot is intact
    assert [i.name for i in deltackpt.snapshots(st)] == ["s0"]
    loaded = deltackpt.load(st, "s0")
    for k, v in sd.items():
        assert loaded[k].dtype == v.dtype and torch.equal(loaded[k], v), k
    assert not deltackpt.verify(st).problems
    assert uploads(endpoint, bucket), "the killed upload should still be unfinished"

    gc_st = deltackpt.open_store(url, storage=FsspecStorage(url, opts, no_concurrent_saves=True))
    dry = deltackpt.gc(gc_st, dry_run=True)
    assert dry.uploads_aborted and uploads(endpoint, bucket)  # a dry run aborts nothing
    report = deltackpt.gc(gc_st)
    assert report.uploads_aborted == dry.uploads_aborted
    assert all(k.startswith(f"{PACKS}/") for k in report.uploads_aborted)
    assert not uploads(endpoint, bucket)
    live = {r.pack for r in st.manifest("s0").chunks.values()}
    assert {pack_id_of(e.name) for e in st.storage.list(PACKS)} <= live
    assert set(keys(endpoint, bucket)) <= before  # no leftover object of the killed save
    assert torch.equal(deltackpt.load(st, "s0")["a"], sd["a"])
    assert deltackpt.gc(gc_st).uploads_aborted == []  # idempotent

"""Fixtures shared by the storage tests: a fresh LocalStorage and a directory it must not touch;
for the object-store tests a real S3 API server on 127.0.0.1 (moto's ThreadedMotoServer, one per
module), its storage_options and a fresh bucket."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from deltackpt.store.local import LocalStorage
from deltackpt.store.storage import PACKS, SNAPSHOTS, TMP
from tests.store._s3 import client


@pytest.fixture
def storage(tmp_path: Path) -> LocalStorage:
    s = LocalStorage(tmp_path / "store")
    s.make_dirs((SNAPSHOTS, PACKS, TMP))
    return s


@pytest.fixture
def bait(tmp_path: Path) -> Path:
    """A directory outside the store with a file that must never be read, changed or removed."""
    d = tmp_path / "elsewhere"
    d.mkdir()
    (d / "precious").write_bytes(b"not yours")
    return d


@pytest.fixture(scope="module")
def endpoint() -> Iterator[str]:
    moto_server = pytest.importorskip("moto.server")  # the test extra installs moto and s3fs
    mp = pytest.MonkeyPatch()
    for k, v in {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_SESSION_TOKEN": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
    }.items():
        mp.setenv(k, v)
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    try:
        yield f"http://{host}:{port}"
    finally:
        server.stop()
        mp.undo()


@pytest.fixture
def opts(endpoint: str) -> dict[str, Any]:
    return {"endpoint_url": endpoint, "key": "testing", "secret": "testing"}


@pytest.fixture
def bucket(endpoint: str) -> str:
    name = f"b-{uuid.uuid4().hex[:12]}"
    client(endpoint).create_bucket(Bucket=name)
    return name

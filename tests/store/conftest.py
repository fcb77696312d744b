"""Fixtures shared by the storage tests: a fresh LocalStorage and a directory it must not touch;
for the object-store tests a real S3 API server on 127.0.0.1 (moto's ThreadedMotoServer, one per
module), its storage_options and a fresh bucket."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from deltackpt.store.local import LocalStorage
from deltackpt.store.storage import PACKS, SNAPSHOTS, TMP
from tests._s3 import new_bucket, s3_options, s3_server


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
    pytest.importorskip("moto.server")  # the test extra installs moto and s3fs
    with s3_server() as url:
        yield url


@pytest.fixture
def opts(endpoint: str) -> dict[str, Any]:
    return s3_options(endpoint)


@pytest.fixture
def bucket(endpoint: str) -> str:
    return new_bucket(endpoint)

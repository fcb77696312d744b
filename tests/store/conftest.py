"""Fixtures shared by the storage tests: a fresh LocalStorage and a directory it must not touch.
(The S3 server fixtures, ``endpoint``, ``opts`` and ``bucket``, are in tests/conftest.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from deltackpt.store.local import LocalStorage
from deltackpt.store.storage import PACKS, SNAPSHOTS, TMP


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

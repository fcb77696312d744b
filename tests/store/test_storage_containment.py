"""Containment of the storage seam: keys that would leave the store and names built from stored
data are refused, and a symlink anywhere inside a store is never followed, whatever the operation
(UnsafePathError), with nothing outside the store read, written or removed."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from deltackpt.errors import UnsafePathError
from deltackpt.store.local import LocalStorage
from deltackpt.store.packs import pack_key, pack_name
from deltackpt.store.storage import (
    MANIFEST,
    PACKS,
    SNAPSHOTS,
    TMP,
    check_component,
    manifest_key,
    parts,
)

KEY = manifest_key("s1")


@pytest.mark.parametrize(
    "key", ["../x", "packs/../../x", "/etc/passwd", "packs//a.pack", "packs/.", "a/\0/b", "."]
)
def test_keys_that_leave_the_store_are_refused(storage: LocalStorage, key: str) -> None:
    for op in (
        lambda: storage.read(key),
        lambda: storage.open_reader(key),
        lambda: storage.exists(key),
        lambda: storage.list(key),
        lambda: storage.create(key),
        lambda: storage.publish(key, b"x"),
        lambda: storage.replace(key, b"x"),
        lambda: storage.delete(key, recursive=True),
        lambda: storage.sync(key),
    ):
        with pytest.raises(UnsafePathError):
            op()


@pytest.mark.parametrize("bad", ["a/b", "..", "../evil", "", "x" * 65, "a.b", "/abs"])
def test_names_built_from_stored_data_are_refused(bad: str) -> None:
    with pytest.raises(UnsafePathError):
        pack_name(bad)
    with pytest.raises(UnsafePathError):
        pack_key(bad)
    if "/" in bad or bad in ("..", ""):
        with pytest.raises(UnsafePathError):
            check_component(bad, "snapshot name")
        with pytest.raises(UnsafePathError):
            manifest_key(bad)
    else:
        assert manifest_key(bad) == f"snapshots/{bad}/MANIFEST.json"
    assert parts("packs/a.pack") == ["packs", "a.pack"] and parts("") == []


def test_symlinks_inside_the_store_are_never_followed(storage: LocalStorage, bait: Path) -> None:
    root = storage.root
    os.symlink(bait / "precious", root / PACKS / "evil.pack")
    with pytest.raises(UnsafePathError, match="symlink"):
        storage.open_reader("packs/evil.pack")
    with pytest.raises(UnsafePathError, match="symlink"):
        storage.read("packs/evil.pack")
    with pytest.raises(FileExistsError):
        storage.create("packs/evil.pack")  # O_EXCL: never writes through it
    # a directory component that is a link: reads, writes, publish and delete all refuse
    os.symlink(bait, root / SNAPSHOTS / "s9")
    (bait / MANIFEST).write_bytes(b"{}")
    key = manifest_key("s9")
    for op in (
        lambda: storage.read(key),
        lambda: storage.open_reader(key),
        lambda: storage.publish(key, b"{}"),
        lambda: storage.replace(key, b"{}"),
        lambda: storage.delete(key),
        lambda: storage.create(f"{SNAPSHOTS}/s9/x"),
        lambda: storage.sync(f"{SNAPSHOTS}/s9"),
    ):
        with pytest.raises(UnsafePathError, match="symlink"):
            op()
    assert sorted(p.name for p in bait.iterdir()) == [MANIFEST, "precious"]
    assert (bait / MANIFEST).read_bytes() == b"{}"
    # tmp/ replaced by a link: publish refuses before writing anything through it
    shutil.rmtree(root / TMP)
    os.symlink(bait, root / TMP)
    with pytest.raises(UnsafePathError, match="symlink"):
        storage.publish(manifest_key("ok"), b"{}")
    assert sorted(p.name for p in bait.iterdir()) == [MANIFEST, "precious"]
    assert (bait / "precious").read_bytes() == b"not yours"


def test_the_store_root_may_itself_be_reached_through_a_link(tmp_path: Path) -> None:
    """Links *inside* a store are refused; the path to the store is the user's business."""
    real = tmp_path / "real"
    LocalStorage(real).make_dirs((SNAPSHOTS, PACKS, TMP))
    os.symlink(real, tmp_path / "alias")
    s = LocalStorage(tmp_path / "alias")
    s.publish(KEY, b"ok")
    assert LocalStorage(real).read(KEY).data == b"ok"

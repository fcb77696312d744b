"""StoreWriter/StoreReader speak DCP: FileSystemWriter's arguments, defaults and refusals."""

from __future__ import annotations

import inspect
import os
import pickle
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException

import deltackpt
from deltackpt.dcp import StoreReader, StoreWriter
from deltackpt.errors import InvalidArgumentError, SnapshotExistsError

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
warnings.filterwarnings("ignore", message="torch.distributed is (disabled|unavailable)")


def _state(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(64, 32, generator=g), "b": torch.arange(10) * step, "step": step}


def _zeros() -> dict:
    return {"w": torch.zeros(64, 32), "b": torch.zeros(10, dtype=torch.int64), "step": -1}


def _same(a: dict, b: dict) -> bool:
    return torch.equal(a["w"], b["w"]) and torch.equal(a["b"], b["b"]) and a["step"] == b["step"]


def test_resaving_to_one_checkpoint_id_replaces_it_as_filesystemwriter_does(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    st = deltackpt.open_store(tmp_path / "s")
    first, second = _state(1), _state(2)
    dcp.save(first, checkpoint_id="ckpt", storage_writer=StoreWriter(st))
    w = StoreWriter(st)  # default arguments, like FileSystemWriter(path)
    assert w.overwrite is True
    dcp.save(second, checkpoint_id="ckpt", storage_writer=w)
    assert w.info is not None and w.info.name == "ckpt"
    out = _zeros()
    dcp.load(out, checkpoint_id="ckpt", storage_reader=StoreReader(st))
    assert _same(out, second)
    assert [s.name for s in deltackpt.snapshots(st)] == ["ckpt"]
    dcp.save(first, checkpoint_id="ckpt", storage_writer=w)  # the same writer, once more
    out = _zeros()
    dcp.load(out, storage_reader=StoreReader(st, "ckpt"))
    assert _same(out, first)
    assert deltackpt.verify(st).ok

    # The old snapshot stays committed until the new manifest replaces it: it is still there
    # when the commit starts, and a commit that fails leaves it as it was.
    seen = []

    def failing_commit(m, overwrite):
        seen.append((overwrite, deltackpt.load(st, "ckpt")["step"]))
        raise OSError("injected: the commit failed")

    monkeypatch.setattr(st, "write_manifest", failing_commit)
    with pytest.raises(CheckpointException, match="injected"):
        dcp.save(second, checkpoint_id="ckpt", storage_writer=StoreWriter(st))
    monkeypatch.undo()
    assert seen == [(True, 1)]
    out = _zeros()
    dcp.load(out, storage_reader=StoreReader(st, "ckpt"))
    assert _same(out, first)


def test_overwrite_false_refuses_with_dcps_error(tmp_path: Path) -> None:
    state = _state(1)
    fs = tmp_path / "fs"
    dcp.save(state, storage_writer=FileSystemWriter(fs))
    with pytest.raises(CheckpointException) as theirs:
        dcp.save(state, storage_writer=FileSystemWriter(fs, overwrite=False))
    store = tmp_path / "s"
    dcp.save(state, storage_writer=StoreWriter(store, "x"))
    with pytest.raises(CheckpointException) as ours:
        dcp.save(_state(2), storage_writer=StoreWriter(store, "x", overwrite=False))
    ((their_error, _),) = theirs.value.failures.values()
    ((our_error, _),) = ours.value.failures.values()
    assert type(their_error) is RuntimeError and isinstance(our_error, RuntimeError)
    assert str(our_error).startswith(str(their_error))  # "Checkpoint already exists and ..."
    assert isinstance(our_error, SnapshotExistsError)  # and deltackpt's own type
    assert "already has a committed snapshot 'x'" in str(our_error)
    assert deltackpt.load(store, "x")["step"] == 1
    assert [s.name for s in deltackpt.snapshots(store)] == ["x"]


def test_every_filesystemwriter_and_reader_argument_is_accepted(tmp_path: Path) -> None:
    skip = {"self", "path", "_extensions", "serialization_format"}
    theirs = set(inspect.signature(FileSystemWriter.__init__).parameters) - skip
    assert theirs <= set(inspect.signature(StoreWriter.__init__).parameters)
    theirs = set(inspect.signature(FileSystemReader.__init__).parameters) - {"self", "path"}
    assert theirs <= set(inspect.signature(StoreReader.__init__).parameters)

    store = tmp_path / "s"
    w = StoreWriter(
        store,
        "a",
        overwrite=False,
        thread_count=2,
        sync_files=False,
        single_file_per_rank=False,
        per_thread_copy_ahead=0,
        cache_staged_state_dict=True,
    )
    assert (w.overwrite, w.thread_count, w.sync_files) == (False, 2, False)
    assert (w.options.overwrite, w.options.threads, w.options.fsync) == (False, 2, False)
    ignored = ("single_file_per_rank", "per_thread_copy_ahead", "cache_staged_state_dict")
    assert [getattr(w, k) for k in ignored] == [False, 0, True]
    copy = pickle.loads(pickle.dumps(w))  # process-based async_save sends the writer over
    assert [getattr(copy, k) for k in ignored] == [False, 0, True] and copy.thread_count == 2
    state = _state(3)
    dcp.save(state, storage_writer=w)
    out = _zeros()
    dcp.load(out, storage_reader=StoreReader(store, "a", _extension_registry=None))
    assert _same(out, state)
    # an explicit options object keeps its own overwrite (False by default) unless told
    opts = deltackpt.SaveOptions(threads=1)
    assert not StoreWriter(store, "b", options=opts).overwrite
    assert StoreWriter(store, "b", options=opts, overwrite=True).overwrite

    with pytest.raises(InvalidArgumentError, match="unknown option"):
        StoreWriter(store, "b", bogus=1)
    with pytest.raises(InvalidArgumentError, match="thread_count=2 and threads=3"):
        StoreWriter(store, "b", thread_count=2, threads=3)
    with pytest.raises(InvalidArgumentError, match="sync_files"):
        StoreWriter(store, "b", sync_files=True, fsync=False)
    with pytest.raises(InvalidArgumentError, match="threads"):
        StoreWriter(store, "b", thread_count=0)
    with pytest.raises(InvalidArgumentError, match="single_file_per_rank"):
        StoreWriter(store, "b", single_file_per_rank="yes")
    with pytest.raises(InvalidArgumentError, match="_extension_registry"):
        StoreReader(store, "a", _extension_registry=object())


def test_a_refused_writer_creates_no_store(tmp_path: Path) -> None:
    """Every argument is checked before the writer opens (and so creates) its store."""
    from deltackpt.dcp.writer import DCP_KEY

    new = tmp_path / "new"
    for kwargs in ({"name": "../up"}, {"name": "a", "bogus": 1},
                   {"name": "a", "metadata": {DCP_KEY: 1}}, {"name": "a", "thread_count": 0}):  # fmt: skip
        with pytest.raises((InvalidArgumentError, ValueError)) as e:
            StoreWriter(new, **kwargs)
        assert isinstance(e.value, deltackpt.errors.DeltackptError), repr(e.value)
        assert not new.exists(), kwargs
    assert StoreWriter(new, "a").store is not None and new.exists()


def _big_state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {f"t{i}": torch.randn(64 << 10, generator=g) for i in range(32)}  # 128 chunks


def test_thread_count_sets_the_writing_threads(tmp_path: Path) -> None:
    st = deltackpt.open_store(tmp_path / "s", chunk_bytes=64 << 10)
    packs = tmp_path / "s" / "packs"
    before = set(os.listdir(packs))
    dcp.save(_big_state(0), storage_writer=StoreWriter(st, "one", thread_count=1))
    one = set(os.listdir(packs)) - before
    assert len(one) == 1  # each writing thread appends to a pack of its own
    dcp.save(_big_state(1), storage_writer=StoreWriter(st, "four", thread_count=4))
    four = set(os.listdir(packs)) - before - one
    assert 2 <= len(four) <= 4
    out = {k: torch.zeros_like(v) for k, v in _big_state(1).items()}
    dcp.load(out, storage_reader=StoreReader(st, "four"))
    assert all(torch.equal(out[k], v) for k, v in _big_state(1).items())


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc/self/fd")
def test_sync_files_decides_whether_packs_are_fsynced(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    st = deltackpt.open_store(tmp_path / "s", chunk_bytes=64 << 10)
    packs = os.path.realpath(tmp_path / "s" / "packs")
    synced: list[str] = []
    real_fsync = os.fsync

    def spy(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", spy)
    dcp.save(_big_state(0), storage_writer=StoreWriter(st, "nosync", sync_files=False))
    assert synced  # the manifest is still made durable before it is published
    assert not [p for p in synced if p.startswith(packs)]
    synced.clear()
    dcp.save(_big_state(1), storage_writer=StoreWriter(st, "sync", sync_files=True))
    assert [p for p in synced if p.startswith(packs)]
    monkeypatch.undo()
    assert deltackpt.verify(st).ok

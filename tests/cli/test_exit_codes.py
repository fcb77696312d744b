"""One exit-code table for every command (deltackpt/cli/exit_codes.py): 0 ok, 1 a problem found,
2 usage, 3 not found or not valid, 4 other errors, 130 interrupted."""

from __future__ import annotations

import pytest

import deltackpt
import deltackpt.cli.upkeep
from deltackpt.cli import exit_codes
from deltackpt.cli.exit_codes import ERROR, INTERRUPTED, NOT_FOUND, OK, PROBLEM, USAGE
from deltackpt.errors import (
    CorruptChunkError,
    ImportFormatError,
    InvalidArgumentError,
    InvalidNameError,
    ManifestError,
    OutputExistsError,
    SaveFailedError,
    SnapshotNotFoundError,
    StateKeyError,
    StoreError,
    StoreIOError,
    StoreLockedError,
    UnsupportedURLError,
)
from deltackpt.store.objstore import NoLockError
from tests.cli._store import flip_byte, run, two_snapshots


@pytest.fixture
def store(tmp_path):
    return two_snapshots(tmp_path / "ckpts")


def test_the_table_is_what_the_docs_say():
    assert (OK, PROBLEM, USAGE, NOT_FOUND, ERROR, INTERRUPTED) == (0, 1, 2, 3, 4, 130)
    assert [c for c, _ in exit_codes.EXIT_CODES] == [0, 1, 2, 3, 4, 130]


@pytest.mark.parametrize(
    ("error", "code"),
    [
        (SnapshotNotFoundError("x"), NOT_FOUND),
        (StateKeyError("x"), NOT_FOUND),
        (StoreError("x"), NOT_FOUND),
        (ManifestError("x"), NOT_FOUND),
        (CorruptChunkError("x"), NOT_FOUND),
        (UnsupportedURLError("x"), NOT_FOUND),
        (ImportFormatError("x"), NOT_FOUND),
        (FileNotFoundError(2, "x"), NOT_FOUND),
        (InvalidArgumentError("x"), USAGE),
        (InvalidNameError("x"), USAGE),
        (OutputExistsError("x"), USAGE),
        (NoLockError("x"), USAGE),
        (StoreIOError(5, "x"), ERROR),
        (StoreLockedError("x"), ERROR),
        (SaveFailedError("x"), ERROR),
        (PermissionError(13, "x"), ERROR),
        (RuntimeError("a bug"), ERROR),
        (KeyboardInterrupt(), INTERRUPTED),
    ],
    ids=lambda v: type(v).__name__ if isinstance(v, BaseException) else str(v),
)
def test_exit_code_for(error, code):
    assert exit_codes.exit_code_for(error) == code


def test_help_lists_the_exit_codes(capsys):
    assert deltackpt.cli.main.main(["--help"]) == OK
    out = capsys.readouterr().out
    assert "exit codes:" in out
    for code, what in exit_codes.EXIT_CODES:
        assert f"{code:<4} {what}" in out


@pytest.mark.parametrize("argv", [["ls"], ["show"], ["du"], ["verify"], ["gc"], ["diff", "a", "b"]])
def test_missing_store_is_3_for_every_command(capsys, tmp_path, argv):
    code, out, err = run(capsys, argv[0], tmp_path / "nowhere", *argv[1:])
    assert code == NOT_FOUND and "STORE.json" in err and out == ""
    assert not (tmp_path / "nowhere").exists()


def test_missing_and_damaged_snapshots_are_3(capsys, store):
    assert run(capsys, "show", store, "nope")[0] == NOT_FOUND
    assert run(capsys, "diff", store, "a", "nope")[0] == NOT_FOUND
    assert run(capsys, "verify", store, "nope")[0] == NOT_FOUND  # a typo, not damage
    (store / "snapshots" / "b" / "MANIFEST.json").write_text("{not json")
    code, _, err = run(capsys, "show", store, "b")
    assert code == NOT_FOUND and "b" in err
    assert run(capsys, "verify", store)[0] == PROBLEM  # damage: reported, not raised
    assert run(capsys, "verify", store, "b")[0] == PROBLEM


def test_damaged_chunk_verify_1_diff_3(capsys, store):
    assert run(capsys, "verify", store)[0] == OK
    flip_byte(store, "b", "model/b")  # model/b shares a grouped chunk: diff must read it
    assert run(capsys, "verify", store)[0] == PROBLEM
    code, _, err = run(capsys, "diff", store, "a", "b")
    assert code == NOT_FOUND and "Traceback" not in err


def test_diff_0_when_equal_1_when_different(capsys, store):
    assert run(capsys, "diff", store, "a", "a")[0] == OK
    assert run(capsys, "diff", store, "a", "b")[0] == PROBLEM


@pytest.mark.parametrize(
    "argv",
    [
        ["frobnicate"],
        [],
        ["ls"],
        ["diff", "STORE", "a"],
        ["gc", "STORE", "--keep-last", "-1"],
        ["gc", "STORE", "--keep-last", "x"],
        ["ls", "STORE", "--storage-options", "[1]"],
        ["show", "STORE", "--bogus"],
    ],
)
def test_bad_command_lines_are_2(capsys, argv):
    code, out, err = run(capsys, *argv)
    assert code == USAGE and out == "" and "usage:" in err


def test_invalid_name_is_2(capsys, store):
    code, _, err = run(capsys, "show", store, "../x")
    assert code == USAGE and "not allowed" in err


def test_locked_store_is_4(capsys, store, monkeypatch):
    monkeypatch.setenv("DELTACKPT_LOCK_TIMEOUT", "0")
    st = deltackpt.open_store(store, create=False)
    with st.lock(exclusive=False, timeout=5, what="a test save"):
        code, _, err = run(capsys, "gc", store, "--keep-last", "1")
    assert code == ERROR and "error" in err
    assert [s.name for s in deltackpt.snapshots(store)] == ["a", "b"]


def test_io_error_is_4_and_a_bug_shows_its_traceback(capsys, store, monkeypatch):
    def io_error(*a, **k):
        raise StoreIOError(5, "pack read failed: Input/output error")

    monkeypatch.setattr(deltackpt.cli.upkeep.deltackpt, "verify", io_error)
    code, _, err = run(capsys, "verify", store)
    assert code == ERROR and "Input/output error" in err and "Traceback" not in err

    def bug(*a, **k):
        raise RuntimeError("unexpected")

    monkeypatch.setattr(deltackpt.cli.upkeep.deltackpt, "verify", bug)
    code, out, err = run(capsys, "verify", store, "--json")
    assert code == ERROR and "Traceback" in err and "unexpected" in err
    assert '"RuntimeError"' in out

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(deltackpt.cli.upkeep.deltackpt, "verify", interrupted)
    assert run(capsys, "verify", store)[0] == INTERRUPTED

"""Progress bars (deltackpt/cli/progress.py): rendered when forced on, with rich or as plain text;
never on stdout, never with --json; the library's progress callbacks add up to the work done."""

from __future__ import annotations

import argparse
import io
import json
import threading

import pytest
import torch

import deltackpt
from deltackpt.cli import progress as progress_mod
from deltackpt.cli.progress import progress, show_progress
from tests.cli._store import run, state, two_snapshots


@pytest.fixture
def store(tmp_path):
    return two_snapshots(tmp_path / "ckpts")


@pytest.mark.parametrize("rich", [True, False], ids=["rich", "plain"])
def test_bar_renders_when_forced(monkeypatch, rich):
    if rich:
        pytest.importorskip("rich")
    monkeypatch.setattr(progress_mod, "HAVE_RICH", rich)
    monkeypatch.setattr(progress_mod._PlainBar, "advance", _unthrottled(progress_mod._PlainBar))
    buf = io.StringIO()
    with progress(4 << 20, "verifying", enabled=True, file=buf) as advance:
        for _ in range(4):
            advance(1 << 20)
    text = buf.getvalue()
    assert "verifying" in text and "\r" in text
    assert ("4.0/4.0 MiB" if rich else "4.0 MiB / 4.0 MiB") in text
    buf = io.StringIO()
    with progress(None, "collecting", enabled=True, file=buf, unit="packs") as advance:
        advance(3)
    assert "collecting" in buf.getvalue() and "3" in buf.getvalue()


def _unthrottled(cls):
    """The plain bar draws at most 10 times a second; tests draw every step."""
    original = cls.advance

    def advance(self, n):
        self._last = 0.0
        original(self, n)

    return advance


def test_plain_bar_counts_from_many_threads_and_erases_itself(monkeypatch):
    monkeypatch.setattr(progress_mod, "HAVE_RICH", False)
    buf = io.StringIO()
    with progress(8000, "importing", enabled=True, file=buf) as advance:
        threads = [
            threading.Thread(target=lambda: [advance(1) for _ in range(2000)]) for _ in range(4)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        bar = advance.__self__  # the _PlainBar behind advance
        assert bar._done == 8000
    assert buf.getvalue().endswith("\r")  # the line is blanked at the end


def test_disabled_writes_nothing():
    buf = io.StringIO()
    with progress(100, "x", enabled=False, file=buf) as advance:
        advance(50)
    assert buf.getvalue() == ""


def test_show_progress_needs_terminals_and_no_json(monkeypatch):
    assert show_progress() is False  # pytest captures stdout: not a terminal
    monkeypatch.setattr(progress_mod, "_isatty", lambda f: True)
    assert show_progress() is True
    assert show_progress(argparse.Namespace(json=False, no_progress=False)) is True
    assert show_progress(argparse.Namespace(json=True, no_progress=False)) is False
    assert show_progress(argparse.Namespace(json=False, no_progress=True)) is False


def test_verify_progress_callback_adds_up_to_bytes_checked(store):
    seen: list[int] = []
    report = deltackpt.verify(store, progress=seen.append)
    assert report.ok and seen and all(n > 0 for n in seen)
    assert sum(seen) == report.bytes_checked


def test_gc_progress_callback_adds_up_to_packs_removed(tmp_path):
    p = tmp_path / "s"
    for i in range(3):
        g = torch.Generator().manual_seed(i)
        deltackpt.save({"w": torch.randn(128, 128, generator=g)}, p, f"s{i}")
    sizes = {f.name: f.stat().st_size for f in (p / "packs").glob("*.pack")}
    seen: list[int] = []
    r = deltackpt.gc(p, keep_last=1, progress=seen.append)
    gone = sum(n for name, n in sizes.items() if not (p / "packs" / name).exists())
    assert r.packs_removed == 2 and len(seen) == 2 and sum(seen) == gone > 0


@pytest.mark.parametrize("command", [["verify"], ["du"], ["gc", "--keep-last", "1"]])
def test_cli_bar_goes_to_stderr_and_never_into_json(capsys, store, monkeypatch, command):
    monkeypatch.setattr(progress_mod, "_isatty", lambda f: True)  # as if on a terminal
    name, *rest = command
    if name == "gc":  # a second store for the --json run: gc changes the first
        other = two_snapshots(store.parent / "other")
    what = {"verify": "verifying", "du": "reading manifests", "gc": "collecting"}[name]
    code, out, err = run(capsys, name, store, *rest)
    assert code == 0
    assert what in err and what not in out  # the bar is drawn on stderr only
    code, out, err = run(capsys, name, other if name == "gc" else store, *rest, "--json")
    assert code == 0 and err == ""
    json.loads(out)  # one document, nothing else
    code, out, err = run(capsys, name, other if name == "gc" else store, *rest, "--no-progress")
    assert code == 0 and err == ""


def test_cli_without_terminal_draws_nothing(capsys, tmp_path):
    p = tmp_path / "s"
    deltackpt.save(state(1), p, "x")
    code, _, err = run(capsys, "verify", p)
    assert code == 0 and err == ""

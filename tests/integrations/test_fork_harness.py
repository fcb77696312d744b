"""The crash tests' harness (``_fork.run_and_kill``) on its fresh-interpreter path, the one GPU
machines take (``DELTACKPT_TEST_SPAWN=1`` forces it here): a closure runs in the child and is
killed at its kill point; a child that fails reports its traceback."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.integrations._fork import run_and_kill


def test_a_spawned_child_runs_a_closure_and_is_killed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DELTACKPT_TEST_SPAWN", "1")
    marker = tmp_path / "reached"

    def target(at_kill_point):  # type: ignore[no-untyped-def]
        marker.write_text("before")  # a closure over this test's tmp_path
        at_kill_point()
        marker.write_text("after")  # never: killed at the point

    run_and_kill(target, timeout=60)
    assert marker.read_text() == "before"


def test_a_spawned_child_that_fails_reports_why(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DELTACKPT_TEST_SPAWN", "1")

    def target(at_kill_point):  # type: ignore[no-untyped-def]
        raise ValueError("the child broke")

    with pytest.raises(AssertionError, match="the child broke"):
        run_and_kill(target, timeout=60)

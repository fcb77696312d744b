"""``deltackpt show``: at most 50 tensors and 8 short non-tensor values by default, and every
one of them, uncut, with ``--all`` (rich tables and plain text alike)."""

from __future__ import annotations

import re

import pytest
import torch

import deltackpt
from deltackpt.cli import format as format_mod
from tests.cli._store import run

LONG = "a long note " * 10  # 120 characters: cut to 60 by default


@pytest.fixture
def store(tmp_path):
    p = tmp_path / "s"
    sd = {
        "model": {f"layer{i:02d}": torch.full((4,), float(i)) for i in range(60)},
        "opt": {f"v{i:02d}": i for i in range(12)},
        "note": LONG,
        "dtype": torch.bfloat16,
    }
    deltackpt.save(sd, p, "only")
    return p


@pytest.mark.parametrize("rich", [True, False], ids=["rich", "plain"])
def test_show_truncates_and_show_all_lists_everything(capsys, store, monkeypatch, rich):
    if not rich:  # the plain-text rendering, as without rich installed
        monkeypatch.setattr(format_mod, "HAVE_RICH", False)
        monkeypatch.setattr(format_mod, "escape", format_mod._plain_escape)
        monkeypatch.setattr("deltackpt.cli.snapshots.escape", format_mod._plain_escape)
        monkeypatch.setattr("deltackpt.cli.main.make_console", format_mod.PlainConsole)
    code, out, _ = run(capsys, "show", store)
    assert code == 0
    shown = set(re.findall(r"model/layer\d\d", out))
    assert len(shown) == 50 and "model/layer59" not in shown
    assert "… 10 more tensors (show --all lists every one)" in out
    assert "non-tensor values 14:" in out and "… 6 more" in out
    assert LONG not in out
    code, out, _ = run(capsys, "show", store, "--all")
    assert code == 0
    assert ("┏" in out) == rich  # rich's table, or the plain one
    assert set(re.findall(r"model/layer\d\d", out)) == {f"model/layer{i:02d}" for i in range(60)}
    assert "more tensors" not in out
    for i in range(12):
        assert re.search(rf"opt/v{i:02d}\s*│\s*{i}\s", out), f"opt/v{i:02d}"
    assert "torch.bfloat16" in out
    # the long value, uncut (a table may fold it over lines)
    flat = re.sub(r"\s*│\s*", " ", out).replace("\n", " ")
    assert " ".join(repr(LONG).split()) in " ".join(flat.split())

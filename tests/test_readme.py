"""The README is a front page whose examples run: every ```python block of README.md (and the
first block of docs/api.md) runs as written in a fresh directory, unless its first line says it
is a fragment (``# fragment: why``); every relative link of README.md and docs/*.md resolves."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
LINK = re.compile(r"\]\(([^)#\s]+)(#[^)\s]*)?\)")


def _blocks(path: Path) -> list[str]:
    return BLOCK.findall(path.read_text())


def _runnable() -> list[tuple[str, str]]:
    out = [
        (f"README.md#{i}", code)
        for i, code in enumerate(_blocks(ROOT / "README.md"))
        if not code.startswith("# fragment")
    ]
    out.append(("docs/api.md#0", _blocks(ROOT / "docs" / "api.md")[0]))
    return out


def test_the_readme_is_a_front_page():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 250, len(lines)
    assert [c for c in _blocks(ROOT / "README.md") if c.startswith("# fragment")], "none marked"


@pytest.mark.parametrize(("where", "code"), _runnable(), ids=[w for w, _ in _runnable()])
def test_code_blocks_run_as_written(where, code, tmp_path):
    p = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert p.returncode == 0, f"{where} failed:\n{code}\n{p.stdout[-2000:]}{p.stderr[-4000:]}"


def test_every_relative_link_resolves():
    docs = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    broken = []
    for doc in docs:
        for target, _ in LINK.findall(doc.read_text()):
            if "://" in target or target.startswith("mailto:"):
                continue
            if not (doc.parent / target).exists():
                broken.append(f"{doc.relative_to(ROOT)} -> {target}")
    assert broken == []

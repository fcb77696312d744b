"""Markdown tables, byte sizes and JSON results."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def md_table(header: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


def fmt_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit, div in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= div:
            return f"{n / div:.3g} {unit}"
    return f"{int(n)} B"


def write_json(path: Path, data: Any) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1, default=str) + "\n")
    return path


def write_results(out: str | Path, name: str, doc: Any, text: str) -> Path:
    """A benchmark's ``doc`` as JSON and its table ``text`` as Markdown beside it: in the
    directory ``out`` as ``name``.json / .md, or at ``out`` itself when it names a .json."""
    out = Path(out)
    path = write_json(out if out.suffix == ".json" else out / f"{name}.json", doc)
    path.with_suffix(".md").write_text(text + "\n")
    return path

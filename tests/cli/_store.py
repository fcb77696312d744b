"""Small stores and helpers shared by the CLI tests (--json, exit codes, progress)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

import deltackpt
from deltackpt.cli.main import main


def state(step: int, *, shift: float = 0.0, extra: bool = False) -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    model = {"w": torch.randn(256, 256, generator=g), "b": torch.randn(256, generator=g) + shift}
    if extra:
        model["extra"] = torch.ones(3)
    return {"model": model, "step": step, "lr": 0.5}


def two_snapshots(path: Path) -> Path:
    """'a', then 'b' with model/b changed, model/extra added and step changed."""
    deltackpt.save(state(1), path, "a", metadata={"step": 1, "note": "first"})
    deltackpt.save(state(2, shift=1.0, extra=True), path, "b", metadata={"step": 2})
    return path


def run(capsys: Any, *argv: Any) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def run_json(capsys: Any, *argv: Any) -> tuple[int, Any, str]:
    """Run with --json; stdout must be exactly one JSON document."""
    code, out, err = run(capsys, *argv, "--json")
    return code, json.loads(out), err


def flip_byte(store: Path, name: str, key: str) -> None:
    """Corrupt one byte of the chunk holding ``key`` in snapshot ``name``."""
    m = deltackpt.open_store(store, create=False).manifest(name)
    entry = next(e for e in m.tensors if e.path == key)
    rec = m.chunks[entry.data[0][0]]
    with open(store / "packs" / f"{rec.pack}.pack", "r+b") as f:
        f.seek(rec.offset + rec.length // 2)
        byte = f.read(1)
        f.seek(rec.offset + rec.length // 2)
        f.write(bytes([byte[0] ^ 0xFF]))

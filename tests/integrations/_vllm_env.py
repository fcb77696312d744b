"""Where the vLLM tests find their interpreter, and how they run a script in it.

vLLM is not in the project's test environment (it pins its own transformers, setuptools, ...):
each test module runs a ``_vllm_*.py`` script in ``.venv-vllm`` (made by ``.ci/vllm-env``) in a
subprocess that reports what it saw as JSON. The modules skip when that environment is absent.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
PY = Path(os.environ.get("DELTACKPT_VLLM_PYTHON", ROOT / ".venv-vllm" / "bin" / "python"))

MARKS = [
    pytest.mark.slow,
    pytest.mark.multiproc,
    pytest.mark.skipif(not PY.exists(), reason=f"no vLLM environment at {PY} (.ci/vllm-env)"),
]


def real(test: Any) -> Any:
    """The marks of a test that runs a real engine (slow, several processes, the vLLM
    environment), in a module whose other tests need no vLLM."""
    for mark in MARKS:
        test = mark(test)
    return test


def run_script(
    tmp_path_factory: pytest.TempPathFactory,
    script: str,
    *args: str,
    env: dict[str, str] | None = None,
    linear: str | None = None,
) -> dict[str, Any]:
    """Run ``tests/integrations/<script> OUT.json *args`` in the vLLM interpreter; its JSON
    report. ``linear`` (``"keep"`` or ``"repack"``) forces how vLLM's CPU build keeps linear
    weights in every engine process (``_vllm_linear/sitecustomize.py``); None: as this
    processor has it."""
    env = dict(os.environ if env is None else env)
    if linear is not None:
        folder = str(Path(__file__).with_name("_vllm_linear"))
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [folder, env.get("PYTHONPATH")]))
        env["DELTACKPT_TEST_VLLM_LINEAR"] = linear
    tag = script.removesuffix(".py").lstrip("_") + (f"-{linear}" if linear else "")
    out = tmp_path_factory.mktemp(tag) / "out.json"
    proc = subprocess.run(
        [str(PY), str(Path(__file__).with_name(script)), str(out), *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-8000:])
        pytest.fail(f"{script} failed (exit {proc.returncode}); its output is above")
    return json.loads(out.read_text())

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


def run_script(
    tmp_path_factory: pytest.TempPathFactory, script: str, env: dict[str, str] | None = None
) -> dict[str, Any]:
    """Run ``tests/integrations/<script>`` in the vLLM interpreter; its JSON report."""
    out = tmp_path_factory.mktemp(script.removesuffix(".py").lstrip("_")) / "out.json"
    proc = subprocess.run(
        [str(PY), str(Path(__file__).with_name(script)), str(out)],
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

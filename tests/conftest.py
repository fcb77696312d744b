from __future__ import annotations

import os
import re
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from tests._s3 import new_bucket, s3_options, s3_server

# The files with the longest module setups (a real vLLM engine each; measured: 60-170 s of the
# suite's ~600 s on 2 workers), run first: with `--dist loadfile --no-loadscope-reorder`
# (.ci/run) the two workers start on them and the many short files even out the end, instead
# of one worker finishing a 2-minute file alone.
LONGEST_FIRST = (
    "tests/integrations/test_vllm.py",
    "tests/integrations/test_vllm_http.py",
    "tests/integrations/test_vllm_tp.py",
    "tests/integrations/test_vllm_lora.py",
)


def _file_rank(item: pytest.Item, slow_files: set[str]) -> int:
    path = item.nodeid.split("::", 1)[0]
    if path in LONGEST_FIRST:
        return LONGEST_FIRST.index(path)
    return len(LONGEST_FIRST) + (0 if path in slow_files else 1)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # pytest-xdist workers must collect the same ids: an id made from a default repr
    # ("<object object at 0x...>") differs per process and stops `pytest -n` from collecting.
    unstable = [item.nodeid for item in items if re.search(r" at 0x[0-9a-f]+", item.nodeid)]
    if unstable:
        raise pytest.UsageError(
            f"test ids that differ per process (give them stable ids): {unstable}"
        )
    # the longest files first, then files with slow tests, then the rest; each file's own
    # order kept (a stable sort on the file's rank)
    slow_files = {i.nodeid.split("::", 1)[0] for i in items if "slow" in i.keywords}
    items.sort(key=lambda i: _file_rank(i, slow_files))
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (no GPU on this machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """With DELTACKPT_TEST_FAILURES=FILE, each failure's report is appended to FILE as it happens
    (by the controller under pytest-xdist), so a run stopped at its time box (the device check,
    benchmarks/gpu/check.sh) still says why its tests failed."""
    path = os.environ.get("DELTACKPT_TEST_FAILURES")
    if path and report.failed and "PYTEST_XDIST_WORKER" not in os.environ:
        with open(path, "a") as f:
            f.write(f"==== {report.nodeid} ({report.when})\n{report.longreprtext}\n\n")


@pytest.fixture(autouse=True)
def _wide_console(monkeypatch: pytest.MonkeyPatch) -> None:
    """CLI output is not a terminal in tests: rich wraps it at $COLUMNS (120 by default), so a
    long temporary path (pytest-xdist's, a deep $TMPDIR) would split the lines tests look for."""
    monkeypatch.setenv("COLUMNS", "400")


@pytest.fixture
def store_dir(tmp_path):
    return tmp_path / "ckpts"


# A real S3 API server on 127.0.0.1 for the object-store tests (moto's ThreadedMotoServer, one per
# test module that asks for it), its s3fs storage_options, and a fresh bucket per test.
@pytest.fixture(scope="module")
def endpoint() -> Iterator[str]:
    pytest.importorskip("moto.server")  # the test extra installs moto and s3fs
    with s3_server() as url:
        yield url


@pytest.fixture
def opts(endpoint: str) -> dict[str, Any]:
    return s3_options(endpoint)


@pytest.fixture
def bucket(endpoint: str) -> str:
    return new_bucket(endpoint)

"""Tiered checkpoints with an object store as the durable tier (a moto S3 server on loopback):
2 ranks persist to ``s3://``, then 1 process restores the newest durable version, resharded."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests._dist import free_port, run_ranks
from tests._s3 import new_bucket, s3_options, s3_server
from tests.distributed._tiers_worker import run

pytestmark = pytest.mark.multiproc
pytest.importorskip("s3fs")


def test_durable_tier_on_s3_resumes_another_world_size(tmp_path: Path) -> None:
    with s3_server() as endpoint:
        url = f"s3://{new_bucket(endpoint)}/run"
        cfg = {"durable_url": url, "storage_options": s3_options(endpoint), "ranks_per_node": 1}
        out = run_ranks(
            run, 2, free_port(), str(tmp_path), {**cfg, "steps": 4, "persist_every": 2},
            timeout=120,
        )  # fmt: skip
        assert all(o["stats"].persisted == 2 for o in out)  # after steps 1 and 3
        (one,) = run_ranks(
            run, 1, free_port(), str(tmp_path), {**cfg, "replicas": 0}, timeout=120
        )  # fmt: skip
        assert one["report"].step == 3 and one["report"].sources == ("durable",)
        assert one["restored_ok"]

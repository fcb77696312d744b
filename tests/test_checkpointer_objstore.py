"""``Checkpointer`` on an S3 object store (a moto server on 127.0.0.1, started here): saves,
``restore_latest`` bit-exact, retention without locks (own manifests only, no gc) and with
``sole_writer=True`` (gc too: no unreferenced packs are left)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import deltackpt
from deltackpt.errors import InvalidArgumentError

pytest.importorskip("s3fs")
pytest.importorskip("moto.server")
pytest.importorskip("boto3")

from tests._s3 import new_bucket, s3_options


def _state(step: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(64, 1024, generator=g), "ids": torch.arange(10) + step, "step": step}


def _packs(st: deltackpt.Store) -> tuple[set[str], set[str]]:
    listed = {e.name.removesuffix(".pack") for e in st.storage.list("packs")}
    used = {c.pack for m in st.manifests() for c in m.chunks.values()}
    return listed, used


@pytest.mark.parametrize("sole_writer", [False, True])
@pytest.mark.parametrize("async_", [False, True])
def test_checkpointer_on_s3_saves_resumes_and_keeps_last(
    endpoint: str, sole_writer: bool, async_: bool
) -> None:
    url, opts = f"s3://{new_bucket(endpoint)}/run", s3_options(endpoint)
    ck = deltackpt.Checkpointer(
        url, every=1, keep_last=2, async_=async_, storage_options=opts, sole_writer=sole_writer
    )
    deltackpt.save({"x": torch.ones(3)}, url, "best", storage_options=opts)  # not its own
    for step in range(5):
        ck.maybe_save(step, _state(step))
        snaps = [i.name for i in deltackpt.snapshots(ck.store)]
        assert len(snaps) <= 3  # "best" + at most keep_last (+1 while async retention runs)
    ck.close()
    st = deltackpt.open_store(url, storage_options=opts)
    assert [i.name for i in deltackpt.snapshots(st)] == ["best", "step-00000003", "step-00000004"]
    listed, used = _packs(st)
    assert used <= listed
    if sole_writer:  # retention ran gc: nothing unreferenced is left
        assert listed == used
    else:
        assert listed > used  # deleted snapshots' packs wait for a gc the user runs
    assert not deltackpt.verify(st).problems
    fresh = {"w": torch.zeros(64, 1024), "ids": torch.zeros(10, dtype=torch.int64), "step": -1}
    resumed = deltackpt.Checkpointer(url, every=1, keep_last=2, storage_options=opts)
    assert resumed.restore_latest(fresh) == 5
    want = _state(4)
    assert torch.equal(fresh["w"], want["w"]) and torch.equal(fresh["ids"], want["ids"])
    assert fresh["step"] == 4


def test_sole_writer_needs_an_object_store_url(tmp_path: Any) -> None:
    with pytest.raises(InvalidArgumentError, match="sole_writer"):
        deltackpt.Checkpointer(tmp_path / "c", sole_writer=True)
    with pytest.raises(InvalidArgumentError, match="sole_writer"):
        deltackpt.Checkpointer("memory://x", sole_writer="yes")

"""The tiers' snapshot transfer in many batches, both ways at once (two gloo ranks): every batch
arrives, a damaged chunk in a middle batch is refused without leaving the sender waiting, and
nothing half-received is committed."""

from __future__ import annotations

from pathlib import Path

import pytest

from deltackpt.store.store import open_store
from tests._dist import free_port, run_ranks
from tests.distributed._tiers_transfer_worker import corrupt_chunk, run, save_local

pytestmark = pytest.mark.multiproc


def test_many_batches_both_ways_arrive_bit_exact(tmp_path: Path) -> None:
    for r in (0, 1):
        save_local(str(tmp_path), r)
    out = run_ranks(run, 2, free_port(), str(tmp_path), timeout=90)
    for o in out:
        assert o["problems"] == [] and o["committed"] == "step-00000003" and o["exact"], o
        assert o["sent"] == o["received"] == 6 * 256 * 1024


def test_a_damaged_chunk_in_a_middle_batch_is_refused_and_both_sides_finish(
    tmp_path: Path,
) -> None:
    for r in (0, 1):
        save_local(str(tmp_path), r)
    bad = corrupt_chunk(tmp_path / "own0", 3)
    out = run_ranks(run, 2, free_port(), str(tmp_path), timeout=90)
    assert out[0]["committed"] == "step-00000003" and out[0]["exact"]  # rank 1's was intact
    assert out[1]["committed"] is None
    assert any(bad in p and "arrived damaged" in p for p in out[1]["problems"]), out[1]
    assert out[0]["sent"] == 6 * 256 * 1024  # the sender sent every batch it was asked for
    held = open_store(tmp_path / "held0-on1", create=False)
    assert held.names() == []  # no half replica

"""The restore choice of tiered checkpoints (deltackpt/tiers/restore.py ``choose``), without
processes: which step, which source per rank, and what is never used (a stale replica, one of
another layout, a source already refused)."""

from __future__ import annotations

from typing import Any

from deltackpt.tiers.restore import RestoreReport, choose


def _inv(own: dict[int, str], held: dict[int, dict[int, str]], layout: str = "L") -> Any:
    return {"own": own, "held": held, "layout": layout, "notes": []}


def test_newest_step_every_rank_has_from_its_own_tier_first() -> None:
    invs = [
        _inv({4: "L", 5: "L"}, {1: {4: "L", 5: "L"}}),
        _inv({4: "L"}, {0: {4: "L", 5: "L"}}),  # rank 1 lacks step 5 locally: peer 0 has it
    ]
    assert choose(invs, [], set()) == (5, ["local", "peer 0"])


def test_a_replica_of_another_layout_or_world_is_never_used() -> None:
    invs = [
        _inv({5: "L"}, {}),
        _inv({}, {}, layout="M"),  # rank 1 restarted with another layout
        _inv({5: "L"}, {1: {5: "L"}}),  # holds rank 1's step 5, but of layout L, not M
    ]
    assert choose(invs, [], set()) is None
    assert choose(invs, [3], set()) == (3, ["durable"] * 3)


def test_a_refused_source_moves_to_the_next_source_then_an_older_step() -> None:
    invs = [_inv({4: "L", 5: "L"}, {1: {4: "L", 5: "L"}}), _inv({4: "L", 5: "L"}, {})]
    assert choose(invs, [], {(5, 1, "local")}) == (5, ["local", "peer 0"])
    refused = {(5, 1, "local"), (5, 1, "peer 0")}
    assert choose(invs, [], refused) == (4, ["local", "local"])


def test_a_newer_durable_version_wins_over_older_local_steps() -> None:
    invs = [_inv({4: "L"}, {}), _inv({4: "L"}, {})]
    assert choose(invs, [2, 6], set()) == (6, ["durable", "durable"])
    assert choose(invs, [4], set()) == (4, ["local", "local"])  # same step: the fast tier


def test_report_names_its_tier() -> None:
    assert RestoreReport(None, ()).tier == "none"
    assert RestoreReport(3, ("local", "peer 0")).tier == "local"
    assert RestoreReport(3, ("durable",)).tier == "durable"

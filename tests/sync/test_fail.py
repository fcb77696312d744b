"""Weight sync when a rank dies mid-round: every surviving peer raises PeerLostError (not a
timeout: the group timeout is 60 s), nothing is applied, and after ``group.reconnect`` with a
replacement process the next round succeeds bit-exact.

World: trainers 0 and 1 (explicit ``LocalShard`` row halves of each tensor), receiver 2
(the whole tensors, trainer dtypes), plus the replacement process for the killed rank.
"""

from __future__ import annotations

import os
import time
from typing import Any

import pytest
import torch

from tests._dist import free_port, spawn
from tests.sync._common import BUCKET, TRAINERS, make_state, mismatches, wants_for

pytestmark = pytest.mark.multiproc

WORLD = 3
TIMEOUT = 60.0  # the group timeout: detection must not wait for it
LAYOUT = ("full",)


def _shards(rank: int, version: int) -> dict[str, Any]:
    from deltackpt import sync

    out = {}
    for name, t in make_state(version).items():
        box = sync.shard_box(t.shape, 0, rank, TRAINERS)
        out[name] = sync.LocalShard(
            t[box.within(sync.Box((0,) * t.dim(), tuple(t.shape)))], box.offset, tuple(t.shape)
        )
    return out


def _die_at(cls: Any, method: str, call: int) -> None:
    """The ``call``-th call of ``cls.method`` from now kills the process, as a crash would."""
    orig = getattr(cls, method)
    count = [0]

    def dying(*args: Any, **kw: Any) -> Any:
        count[0] += 1
        if count[0] == call:
            os._exit(17)
        return orig(*args, **kw)

    setattr(cls, method, dying)


def _trainer(rank: int, port: int, port2: int, victim: int | None) -> dict[str, Any]:
    from deltackpt import sync
    from deltackpt.sync import packer as packer_mod

    group = sync.SyncGroup(
        "127.0.0.1", port, rank, WORLD, range(TRAINERS), timeout=TIMEOUT, links="gloo"
    )
    sender = sync.WeightSender(group, bucket_bytes=BUCKET, zero_copy_min=0)
    sender.push(_shards(rank, 1), version=1)
    if victim == rank:
        _die_at(packer_mod.Packer, "message", 2)  # 2 buckets: dies mid-round
    out: dict[str, Any] = {}
    t0 = time.monotonic()
    try:
        sender.push(_shards(rank, 2), version=2, full=True)
        out["error"] = None
    except sync.SyncError as e:
        out["error"], out["message"] = type(e).__name__, str(e)
    out["seconds_to_error"] = time.monotonic() - t0
    group.reconnect(port2)
    out["stats"] = sender.push(_shards(rank, 3), version=3)
    group.pg.barrier().wait()  # rank 0 hosts the store: nobody leaves before all read the vote
    return out


def _receiver(rank: int, port: int, port2: int, victim: int | None) -> dict[str, Any]:
    from deltackpt import sync
    from deltackpt.sync import wire

    group = sync.SyncGroup(
        "127.0.0.1", port, rank, WORLD, range(TRAINERS), timeout=TIMEOUT, links="gloo"
    )
    wants = wants_for(LAYOUT)
    receiver = sync.WeightReceiver(group, wants, bucket_bytes=BUCKET)
    loaded: dict[str, torch.Tensor] = {}

    def load(ws: list[tuple[str, torch.Tensor]]) -> None:
        loaded.update((n, t.clone()) for n, t in ws)

    receiver.pull(load)
    out: dict[str, Any] = {"v1_bad": mismatches(wants, loaded, LAYOUT, 1)}
    if victim == rank:
        _die_at(wire, "verify", 3)
    t0 = time.monotonic()
    try:
        receiver.pull(load)
        out["error"] = None
    except sync.SyncError as e:
        out["error"], out["message"] = type(e).__name__, str(e)
    out["seconds_to_error"] = time.monotonic() - t0
    out["version_after_failure"] = receiver.version
    out["bad_after_failure"] = mismatches(wants, loaded, LAYOUT, 1)  # nothing applied
    group.reconnect(port2)
    out["stats"] = receiver.pull(load)
    out["version"] = receiver.version
    out["bad"] = mismatches(wants, loaded, LAYOUT, 3)
    group.pg.barrier().wait()
    return out


def _replacement(rank: int, port2: int) -> dict[str, Any]:
    """A fresh process for the killed rank: joins the new group, takes part in round 3."""
    from deltackpt import sync

    group = sync.SyncGroup(
        "127.0.0.1", port2, rank, WORLD, range(TRAINERS), timeout=TIMEOUT, links="gloo"
    )
    if rank < TRAINERS:
        st = sync.WeightSender(group, bucket_bytes=BUCKET, zero_copy_min=0).push(
            _shards(rank, 3), version=3
        )
        group.pg.barrier().wait()
        return {"stats": st}
    wants = wants_for(LAYOUT)
    loaded: dict[str, torch.Tensor] = {}
    rc = sync.WeightReceiver(group, wants, bucket_bytes=BUCKET)
    st = rc.pull(lambda ws: loaded.update((n, t.clone()) for n, t in ws))
    group.pg.barrier().wait()
    return {"stats": st, "version": rc.version, "bad": mismatches(wants, loaded, LAYOUT, 3)}


def _run(victim: int) -> list[Any]:
    port, port2 = free_port(), free_port()
    targets: list[Any] = [(_trainer, (r, port, port2, victim)) for r in range(TRAINERS)]
    targets.append((_receiver, (TRAINERS, port, port2, victim)))
    targets.append((_replacement, (victim, port2)))
    return spawn(targets, timeout=150, fast_exit=True)


def _check_survivor(r: dict[str, Any]) -> None:
    assert r["error"] == "PeerLostError", r.get("message")
    assert r["seconds_to_error"] < TIMEOUT / 2, r  # detected, not the group timeout
    assert r["stats"].version == 3 and r["stats"].full


@pytest.mark.slow
def test_killed_sender_fails_every_peer_then_recovers() -> None:
    outcomes = _run(victim=1)
    assert outcomes[1].exitcode == 17 and not outcomes[1].reported
    _check_survivor(outcomes[0].unwrap())
    rec = outcomes[2].unwrap()
    _check_survivor(rec)
    assert rec["v1_bad"] == [] and rec["bad_after_failure"] == []
    assert rec["version_after_failure"] == 1
    assert rec["version"] == 3 and rec["bad"] == []
    assert outcomes[3].unwrap()["stats"].full


@pytest.mark.slow
def test_killed_receiver_fails_every_peer_then_recovers() -> None:
    outcomes = _run(victim=TRAINERS)
    assert outcomes[2].exitcode == 17 and not outcomes[2].reported
    for i in range(TRAINERS):
        _check_survivor(outcomes[i].unwrap())
    new = outcomes[3].unwrap()
    assert new["stats"].full and new["version"] == 3 and new["bad"] == []

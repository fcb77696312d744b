"""Replicas among trainer ranks are compared at full rounds (``deltackpt/sync/replicas.py``):
a tensor that ranks hold differently under one name (expert-parallel experts, a tensor-parallel
shard kept as a plain tensor) fails the round on every rank instead of reaching every receiver
as one rank's bytes. Two trainers and one receiver of one group, in threads of this process."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch

from deltackpt import sync
from deltackpt.sync.replicas import replicas_differ, vote_value
from tests._dist import free_port
from tests.sync._common import run_threads


@contextmanager
def three(trainers: int = 2) -> Iterator[list[sync.SyncGroup]]:
    """Trainers 0 .. ``trainers`` - 1 and one receiver after them, of one gloo group."""
    port = free_port()
    n = trainers + 1
    groups = run_threads(
        *[
            lambda r=r: sync.SyncGroup(
                "127.0.0.1", port, r, n, range(trainers), timeout=10, links="gloo"
            )
            for r in range(n)
        ]
    )
    for g in groups:
        if isinstance(g, BaseException):
            raise g
    try:
        yield groups
    finally:
        for g in groups:
            g.close()


def experts(rank: int, step: int = 0) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s state: its own two experts under the names every rank uses (the
    expert-parallel mistake), beside a norm every rank holds alike."""
    g = torch.Generator().manual_seed(100 * rank + step)
    return {"experts.w": torch.randn(2, 8, 4, generator=g), "norm": torch.ones(8) + step}


def rounds(
    groups: list[sync.SyncGroup],
    states: Callable[[int, int], dict[str, torch.Tensor]],
    versions: list[int],
    full: Callable[[int], bool] = lambda v: False,
    **kw: Any,
) -> tuple[list[list[Any]], list[dict[str, torch.Tensor]], sync.WeightReceiver]:
    """Push ``versions`` in turn from both trainers; each round's outcomes per rank, and what
    the receiver held after each round."""
    ts = range(len(groups) - 1)
    senders = [sync.WeightSender(groups[r], **kw) for r in ts]
    held: dict[str, torch.Tensor] = {}
    receiver = sync.WeightReceiver(groups[-1])
    outcomes, after = [], []
    for v in versions:
        out = run_threads(
            *[lambda r=r, v=v: senders[r].push(states(r, v), version=v, full=full(v)) for r in ts],
            lambda: receiver.pull(lambda items: held.update({n: t.clone() for n, t in items})),
        )
        outcomes.append(out)
        after.append({n: t.clone() for n, t in held.items()})
    return outcomes, after, receiver


def test_different_bytes_under_one_name_fail_the_round_on_every_rank() -> None:
    with three() as groups:
        (out,), (held,), receiver = rounds(groups, lambda r, v: experts(r), [1])
    assert all(isinstance(o, sync.RoundAbortedError) for o in out), out
    for o in out:
        assert "'experts.w' (rank 0 vs rank 1)" in str(o), o
        assert "sync.LocalShard(tensor, offset, global shape)" in str(o)
    assert "'norm'" not in str(out[0])  # held alike: not named
    assert receiver.version is None and held == {}  # nothing was handed over


def test_the_same_experts_declared_as_local_shards_go_through() -> None:
    def declared(rank: int, v: int) -> dict[str, Any]:
        s: dict[str, Any] = experts(rank)
        s["experts.w"] = sync.LocalShard(s["experts.w"], (2 * rank, 0, 0), (4, 8, 4))
        return s

    with three() as groups:
        (out,), (held,), receiver = rounds(groups, declared, [1])
    assert all(not isinstance(o, BaseException) for o in out), out
    want = torch.cat([experts(0)["experts.w"], experts(1)["experts.w"]])
    assert torch.equal(held["experts.w"], want) and receiver.version == 1


def test_shards_replicated_over_groups_of_ranks_are_compared_within_each_group() -> None:
    """HSDP: ranks 0 and 1 hold rows 0..3 of ``w``, ranks 2 and 3 rows 4..7 (each shard
    replicated over its own pair): each pair is compared within itself, then rank 3's copy
    drifts and only its shard is named."""
    full = torch.arange(64, dtype=torch.float32).reshape(8, 8)

    def state(rank: int, v: int) -> dict[str, Any]:
        rows = slice(0, 4) if rank < 2 else slice(4, 8)
        t = full[rows].clone()
        if v == 2 and rank == 3:
            t[0, 0] += 1
        return {"w": sync.LocalShard(t, (rows.start, 0), (8, 8))}

    with three(trainers=4) as groups:
        outs, held, receiver = rounds(groups, state, [1, 2], full=lambda v: True)
    assert all(not isinstance(o, BaseException) for o in outs[0]), outs[0]
    assert torch.equal(held[0]["w"], full) and receiver.version == 1
    assert all(isinstance(o, sync.RoundAbortedError) for o in outs[1]), outs[1]
    assert "'w at [4, 0]' (rank 2 vs rank 3)" in str(outs[1][0]), outs[1][0]


def test_replicas_that_drift_apart_are_found_at_the_next_full_round() -> None:
    def state(rank: int, v: int) -> dict[str, torch.Tensor]:
        s = experts(0, v)  # every rank the same state...
        if v == 3 and rank == 1:
            s["norm"] = s["norm"] + 1e-3  # ...until rank 1's norm drifts
        return s

    with three() as groups:
        outs, held, receiver = rounds(groups, state, [1, 2, 3], full=lambda v: v == 3)
    assert all(not isinstance(o, BaseException) for o in outs[0] + outs[1]), outs
    assert all(isinstance(o, sync.RoundAbortedError) for o in outs[2]), outs[2]
    assert "'norm' (rank 0 vs rank 1)" in str(outs[2][0])
    assert receiver.version == 2 and torch.equal(held[2]["norm"], experts(0, 2)["norm"])


def test_trust_skips_the_check_and_sends_one_ranks_copy() -> None:
    with three() as groups:
        (out,), (held,), _ = rounds(groups, lambda r, v: experts(r), [1], replicas="trust")
    assert all(not isinstance(o, BaseException) for o in out), out
    assert torch.equal(held["experts.w"], experts(0)["experts.w"])  # one rank's, as told


def test_a_bad_replicas_value_is_refused() -> None:
    with three() as groups, pytest.raises(sync.PlanError, match="replicas='rank0'"):
        sync.WeightSender(groups[0], replicas="rank0")


def test_only_digests_of_one_kind_are_compared() -> None:
    a = vote_value(3, {"w": "x:" + "0" * 32, "v": "f:" + "1" * 32})
    b = vote_value(3, {"w": "x:" + "0" * 32, "v": "x:" + "2" * 32})  # v: another kind
    assert replicas_differ([0, 1], [a, b]) is None
    c = vote_value(3, {"w": "x:" + "9" * 32})
    assert "'w' (ranks 0,2 vs rank 1)" in str(replicas_differ([0, 1, 2], [a, c, b]))
    assert "rank 1's vote carries malformed" in str(replicas_differ([0, 1], [a, "3\nnot json"]))
    assert replicas_differ([0, 1], ["3", "3"]) is None  # delta rounds carry none


@pytest.mark.gpu
def test_cuda_replicas_are_digested_on_the_device() -> None:
    """Replicas on a GPU are compared by the device fingerprint, without a copy to the host:
    equal bytes agree, one changed element does not."""
    from deltackpt.sync.replicas import replica_digests

    w = torch.randn(1000, 300).to(torch.bfloat16).cuda()
    drifted = w.clone()
    drifted[999, 299] += 1
    a = replica_digests({"w": w}, {"w": "w"})
    assert a["w"].startswith("f:") and a == replica_digests({"w": w.clone()}, {"w": "w"})
    b = replica_digests({"w": drifted}, {"w": "w"})
    assert "'w' (rank 0 vs rank 1)" in str(
        replicas_differ([0, 1], [vote_value(1, a), vote_value(1, b)])
    )


@pytest.mark.gpu
def test_cuda_trainers_holding_their_own_experts_fail_the_round() -> None:
    """The whole path with the trainers' tensors on the GPU (the host mirror's rounds): the
    replicas are digested on the device, on the caller's stream, and the round fails."""

    def on_gpu(rank: int, v: int) -> dict[str, torch.Tensor]:
        return {n: t.cuda() for n, t in experts(rank).items()}

    with three() as groups:
        (out,), (held,), receiver = rounds(groups, on_gpu, [1])
    assert all(isinstance(o, sync.RoundAbortedError) for o in out), out
    assert "'experts.w' (rank 0 vs rank 1)" in str(out[0])
    assert receiver.version is None and held == {}

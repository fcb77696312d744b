"""The sync schedule alone (pure, no processes): minimum bytes per link, every receiver element
covered exactly once, deterministic buckets both ends agree on, validation errors, and a
simulated 256 trainer -> 128 inference rank plan (sizes only)."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from deltackpt.sync import PlanError, shard_box
from deltackpt.sync.schedule import build_schedule, split_box
from deltackpt.sync.schedule_decl import (
    Box,
    Decl,
    Held,
    LocalShard,
    Wanted,
    decl_from_json,
    decl_to_json,
    held_from,
)

SHAPES = {"a": (10, 6), "b": (7,), "c": (5, 9, 4), "s": ()}


def trainers(n: int, dim: int = 0, replicas: int = 1) -> list[Decl]:
    """``n`` trainers holding Shard(dim) of every tensor (``replicas`` copies of each shard)."""
    out = []
    for r in range(n * replicas):
        held = tuple(
            Held(
                k, "float32", s, shard_box(s, min(dim, len(s) - 1), r % n, n) if s else Box((), ())
            )
            for k, s in SHAPES.items()
        )
        out.append(Decl(r, True, held=held))
    return out


def receiver(
    rank: int, part: int | None, parts: int, dim: int = 1, dtype: str | None = "bfloat16"
) -> Decl:
    wanted = tuple(
        Wanted(
            "m." + k,
            k,
            dtype,
            None if part is None or not s else shard_box(s, min(dim, len(s) - 1), part, parts),
        )
        for k, s in SHAPES.items()
    )
    return Decl(rank, False, wanted=wanted)


def coverage(sched, rank: int) -> None:
    """Every element of every wanted box arrives exactly once, from a holder of it."""
    for w, ti, box in sched.wanted[rank]:
        hits = np.zeros(box.size, dtype=np.int64)
        for link in sched.links_of(rank):
            for b in link.buckets:
                for p in b.pieces:
                    if p.tensor == ti:
                        hits[p.box.within(box)] += 1
                        t = sched.tensors[ti]
                        held = [t.boxes[i] for i, hs in enumerate(t.holders) if link.sender in hs]
                        assert any(h.intersect(p.box) == p.box for h in held)
        assert (hits == 1).all(), w.name


@pytest.mark.parametrize(
    ("n_train", "replicas", "parts", "dim"),
    [(2, 1, 2, 1), (3, 2, 2, 0), (1, 1, 3, 1), (4, 1, 1, 0)],
)
def test_minimum_bytes_and_exact_coverage(
    n_train: int, replicas: int, parts: int, dim: int
) -> None:
    world = n_train * replicas
    decls = trainers(n_train, 0, replicas)
    decls += [receiver(world + j, j, parts, dim) for j in range(parts)]
    decls.append(receiver(world + parts, None, parts, dim, dtype=None))  # replicated, fp32
    sched = build_schedule(decls, bucket_bytes=64, align=16)  # tiny buckets: many splits
    matrix = sched.link_bytes()
    for ri, r in enumerate(sched.receivers):
        coverage(sched, r)
        got = {lk.sender: lk.nbytes for lk in sched.links_of(r)}
        for ti_, s in enumerate(sched.trainers):
            # the minimum: sum over tensors of |held box ∩ wanted box| x wire itemsize,
            # from the one holder the schedule picked for this receiver
            want = 0
            for w, ti, box in sched.wanted[r]:
                t = sched.tensors[ti]
                for bi, b in enumerate(t.boxes):
                    inter = b.intersect(box)
                    if inter is not None and sched.holder(ti, bi, r) == s:
                        want += inter.numel * (2 if w.dtype == "bfloat16" else 4)
            assert got.get(s, 0) == want == matrix[ti_, ri]
            from_sender = {lk.receiver: lk for lk in sched.links_of(s)}
            assert from_sender.get(r, sched.link(s, r)) == sched.link(s, r)
        assert sum(got.values()) == sched.wanted_bytes(r)
    # replicas share the load: receivers are spread over both copies of each shard
    senders = {lk.sender for r in sched.receivers for lk in sched.links_of(r)}
    assert (max(senders) >= n_train) == (replicas > 1)


def test_buckets_respect_size_and_both_ends_agree() -> None:
    decls = [*trainers(2), receiver(2, 0, 2), receiver(3, None, 2, dtype=None)]
    # fresh schedules per path: links are cached, so each side computes its own here
    for s in (0, 1):
        for r in (2, 3):
            by_sender = build_schedule(decls, bucket_bytes=128, align=16).links_of(s)
            rev = list(reversed(decls))  # the order of the declarations does not matter
            by_receiver = build_schedule(rev, bucket_bytes=128, align=16).links_of(r)
            from_sender = {lk.receiver: lk for lk in by_sender}[r]
            assert from_sender == {lk.sender: lk for lk in by_receiver}[s]
            for k, bk in enumerate(from_sender.buckets):
                assert bk.index == k and bk.capacity <= 128
                assert all(p.nbytes <= 128 for p in bk.pieces)


def test_split_box_bounds_every_piece() -> None:
    box = Box((1, 2, 0), (5, 7, 4))
    for limit in (4, 16, 40, 1000):
        parts = split_box(box, 4, limit)
        assert sum(p.numel for p in parts) == box.numel
        assert all(p.numel * 4 <= max(limit, 4) for p in parts)
        hits = np.zeros(box.size, dtype=np.int64)
        for p in parts:
            hits[p.within(box)] += 1
        assert (hits == 1).all()


def test_validation_errors_name_the_tensor() -> None:
    good = trainers(2)
    gap = [good[0], Decl(1, True, held=good[1].held[1:])]
    with pytest.raises(PlanError, match=r"'a'.*cover"):
        build_schedule([*gap, receiver(2, 0, 2)], bucket_bytes=64)
    overlap = Decl(
        1, True, held=(Held("a", "float32", (10, 6), Box((4, 0), (6, 6))), *good[1].held[1:])
    )
    with pytest.raises(PlanError, match="overlap"):
        build_schedule([good[0], overlap, receiver(2, 0, 2)], bucket_bytes=64)
    bad_src = Decl(2, False, wanted=(Wanted("x", "nope", None, None),))
    with pytest.raises(PlanError, match="'nope'"):
        build_schedule([*good, bad_src], bucket_bytes=64)
    dtypes = Decl(
        1, True, held=tuple(Held(h.name, "float16", h.shape, h.box) for h in good[1].held)
    )
    with pytest.raises(PlanError, match="same global dtype"):
        build_schedule([good[0], dtypes, receiver(2, 0, 2)], bucket_bytes=64)
    with pytest.raises(PlanError, match="malformed"):
        decl_from_json(
            b'{"format":2,"rank":0,"trainer":true,"held":[["a","float32",[-1],[0],[1]]],"wanted":[]}'
        )


def test_decl_json_round_trip_and_local_shards() -> None:
    t = torch.arange(12.0).reshape(4, 3)
    held, local = held_from({"w": LocalShard(t[2:], (2, 0), (4, 3)), "v": torch.ones(2)})
    assert held[0].box == Box((2, 0), (2, 3)) and held[0].shape == (4, 3)
    assert torch.equal(local["w"], t[2:]) and held[1].box == Box((0,), (2,))
    d = Decl(0, True, held=tuple(held))
    assert decl_from_json(decl_to_json(d)) == d
    r = receiver(1, 0, 2)
    assert decl_from_json(decl_to_json(r)) == r
    every = Decl(3, False, every=True)
    assert decl_from_json(decl_to_json(every)) == every
    with pytest.raises(PlanError, match="malformed"):  # a wildcard that also lists tensors
        decl_from_json(
            decl_to_json(every).replace(b'"wanted":[]', b'"wanted":[["x","x",null,null,null,true]]')
        )


def test_simulated_256_to_128_plan() -> None:
    """A Llama-70B-like tensor list (4 of its 80 layers, to keep the test short), 256 FSDP
    trainers -> 8-way TP x 16 replicas: every receiver gets its slice once, from the trainers
    that hold it; per link far less than a broadcast of the full model."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from _sync.sim import simulate

    res = simulate(trainers=256, tp=8, replicas=16, layers=4)
    assert res["links"] == 256 * 128
    assert res["per_receiver_bytes"] * 8 == pytest.approx(res["model_bf16_bytes"], rel=0.01)
    assert res["link_bytes_max"] * 256 < res["broadcast_per_receiver_bytes"]
    assert res["trainer0_links"] == 128 and res["receiver0_links"] == 256
    assert math.isfinite(res["build_s"])

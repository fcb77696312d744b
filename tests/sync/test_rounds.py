"""Weight sync end to end: 2 trainer ranks holding DTensor ``Shard(0)`` shards -> inference ranks
in their own layouts (tensor-parallel slices in bf16, or a replicated full copy), over gloo
point-to-point links and over shared-memory links, in the same processes. Bit-exact after every round, versions advance, bytes per link equal the
schedule's minimum (the sum of the intersections), delta rounds send only changed pieces.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from tests._dist import free_port, spawn
from tests.sync._common import BUCKET, TRAINERS, make_state, mismatches, wants_for

pytestmark = pytest.mark.multiproc

VERSIONS = (1, 2, 3, 4)


# links, change detection and zero-copy per run: gloo sends contiguous pieces from the tensors
# (zero_copy_min=0: every one), "gloo-packed" packs every piece into buckets; shm packs into the
# link windows and detects changes by version counter
KINDS = ("gloo", "shm", "gloo-packed")


def _trainer(rank: int, world: int, ports: list[int], port_mesh: int) -> dict[str, Any]:
    import torch.distributed as dist
    from torch.distributed.tensor import DeviceMesh, Shard, distribute_tensor

    from deltackpt import sync

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port_mesh}", rank=rank, world_size=TRAINERS
    )
    mesh = DeviceMesh("cpu", list(range(TRAINERS)))
    res = {}
    for kind, port in zip(KINDS, ports, strict=True):
        group = sync.SyncGroup(
            "127.0.0.1", port, rank, world, range(TRAINERS), timeout=60, links=kind.split("-")[0]
        )
        # shm: detect="version" on a state updated in place (only the tensors that changed)
        detect = "version" if kind == "shm" else "hash"
        zero_copy = None if kind == "gloo-packed" else 0
        sender = sync.WeightSender(
            group, bucket_bytes=BUCKET, detect=detect, zero_copy_min=zero_copy
        )
        out = []
        state: dict[str, Any] = {}
        for v in VERSIONS:
            new = {n: distribute_tensor(t, mesh, [Shard(0)]) for n, t in make_state(v).items()}
            if detect == "hash" or not state:
                state = new
            for n, t in new.items():
                if not torch.equal(state[n].to_local(), t.to_local()):
                    state[n].to_local().copy_(t.to_local())
            out.append(sender.push(state, version=v, full=v == 4))
        sched = sender.schedule
        links = {(s, r): sched.link(s, r).nbytes for s in sched.trainers for r in sched.receivers}
        group.pg.barrier().wait()  # every peer is done with the link files
        group.close()
        res[kind] = {"stats": out, "links": links}
    return res


def _receiver(rank: int, world: int, ports: list[int], layout: tuple[Any, ...]) -> dict[str, Any]:
    return {
        kind: _receive(rank, world, port, layout, kind)
        for kind, port in zip(KINDS, ports, strict=True)
    }


def _receive(
    rank: int, world: int, port: int, layout: tuple[Any, ...], kind: str
) -> dict[str, Any]:
    from deltackpt import sync

    group = sync.SyncGroup(
        "127.0.0.1", port, rank, world, range(TRAINERS), timeout=60, links=kind.split("-")[0]
    )
    wants = wants_for(layout)
    receiver = sync.WeightReceiver(group, wants, bucket_bytes=BUCKET)
    loaded: dict[str, torch.Tensor] = {}
    rounds = []
    for v in VERSIONS:
        names: list[str] = []

        def load(ws: list[tuple[str, torch.Tensor]], names: list[str] = names) -> None:
            for n, t in ws:
                names.append(n)
                loaded[n] = t.clone()

        st = receiver.pull(load)
        rounds.append(
            {"stats": st, "version": receiver.version, "bad": mismatches(wants, loaded, layout, v)}
        )
    group.pg.barrier().wait()
    group.close()
    return {"rounds": rounds}


def min_link_bytes(layout: tuple[Any, ...], trainer: int) -> int:
    """Sum over tensors of |trainer Shard(0) box ∩ receiver box| x wire itemsize."""
    from deltackpt import sync

    total = 0
    for _name, t in make_state(1).items():
        shape = tuple(t.shape)
        held = sync.shard_box(shape, 0, trainer, TRAINERS)
        if layout[0] == "tp":
            want = sync.shard_box(shape, 1 if len(shape) == 2 else 0, layout[1], layout[2])
            size = 2 if t.is_floating_point() else t.element_size()
        else:
            want, size = sync.Box((0,) * len(shape), shape), t.element_size()
        inter = held.intersect(want)
        total += 0 if inter is None else math.prod(inter.size) * size
    return total


def _run(layouts: list[tuple[Any, ...]]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    world = TRAINERS + len(layouts)
    ports, port_mesh = [free_port() for _ in KINDS], free_port()
    targets: list[Any] = [(_trainer, (r, world, ports, port_mesh)) for r in range(TRAINERS)]
    targets += [(_receiver, (TRAINERS + i, world, ports, lay)) for i, lay in enumerate(layouts)]
    outcomes = spawn(targets, timeout=120, fast_exit=True)
    values = [o.unwrap() for o in outcomes]
    return values[:TRAINERS], values[TRAINERS:]


def check(layouts: list[tuple[Any, ...]]) -> None:
    trainers_all, receivers_all = _run(layouts)
    for kind in KINDS:
        check_kind([t[kind] for t in trainers_all], [r[kind] for r in receivers_all], layouts, kind)


def check_kind(
    trainers: list[dict[str, Any]], receivers: list[dict[str, Any]], layouts: list[Any], kind: str
) -> None:
    for i, (lay, res) in enumerate(zip(layouts, receivers, strict=True)):
        r = TRAINERS + i
        rounds = res["rounds"]
        assert [x["version"] for x in rounds] == list(VERSIONS)
        for v, x in zip(VERSIONS, rounds, strict=True):
            assert x["bad"] == [], f"receiver {lay} v{v}: {x['bad']}"
        first = rounds[0]["stats"]
        assert first.full
        # bytes per link: the plan's minimum, computed here from the boxes alone
        for s in range(TRAINERS):
            want = min_link_bytes(lay, s)
            assert trainers[s]["links"][(s, r)] == want
            assert first.per_link.get(s, 0) == want, (lay, s)
            assert trainers[s]["stats"][0].per_link.get(r, 0) == want
            assert rounds[3]["stats"].per_link.get(s, 0) == want  # full=True round
        # zero-copy pieces: only on gloo, and all of a replicated receiver's (fp32, row blocks)
        zc = first.zero_copy_bytes
        if kind != "gloo":
            assert zc == 0
        elif lay[0] == "full":
            floats = sum(v.numel() * v.element_size() for v in make_state(1).values())
            assert zc == first.payload_bytes == floats, (zc, first.payload_bytes)
        # delta rounds move less than a full round, and something
        for k in (1, 2):
            st = rounds[k]["stats"]
            assert not st.full and 0 < st.payload_bytes < first.payload_bytes, (lay, k)
    for s in range(TRAINERS):
        st = trainers[s]["stats"]
        assert [x.version for x in st] == list(VERSIONS)
        assert (st[0].zero_copy_bytes > 0) == (kind == "gloo")
        assert st[0].full and st[3].full and not st[1].full


@pytest.mark.slow
def test_two_trainers_to_two_tp_ranks() -> None:
    check([("tp", 0, 2), ("tp", 1, 2)])


@pytest.mark.slow
def test_two_trainers_to_replicated_and_tp() -> None:
    check([("full",), ("tp", 1, 2)])

"""End-to-end weight sync between processes: gloo broadcast and shared memory.

Each test spawns at most 4 processes (tests/_dist.py) and runs several rounds inside them, since
starting a torch process costs seconds here.
"""

from __future__ import annotations

import os
import time
import uuid
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from tests._dist import free_port, spawn

pytestmark = pytest.mark.multiproc

BUCKET = 16 << 10  # small buckets: the big tensors below are split over several rows
TRAINERS, WORLD = 2, 4


def make_state(version: int) -> dict[str, torch.Tensor]:
    """The trainer's full (global) state at ``version``; deterministic on every process."""
    g = torch.Generator().manual_seed(0)
    s = {
        "embed.weight": torch.randn(300, 64, generator=g),  # 2 shards x 38 KiB: split rows
        "layers.0.attn.weight": torch.randn(48, 40, generator=g),  # Shard(1): strided boxes
        "layers.0.attn.bias": torch.randn(48, generator=g),  # Replicate
        "layers.1.mlp.weight": torch.randn(64, 32, generator=g),  # Shard(0)
        "layers.1.odd": torch.randn(5, 3, generator=g),  # Shard(0), uneven (3 + 2 rows)
        "lm_head.weight": torch.randn(100, 64, generator=g),  # plain, 25 KiB > bucket
        "norm.weight": torch.ones(64),
        "w_half": torch.randn(33, 17, generator=g).half(),
        "w_bf16": torch.randn(40, 8, generator=g).bfloat16(),
        "w_f64": torch.randn(9, generator=g).double(),
        "w_steps": torch.arange(7),
        "w_mask": torch.rand(5, 5, generator=g) > 0.5,
        "w_empty": torch.zeros(0, 4),
        "w_scalar": torch.tensor(2.5),
    }
    for i in range(150):
        s[f"tiny.{i}"] = torch.randn(i % 3 + 1, generator=g)
    if version >= 2:
        s["layers.1.mlp.weight"] += 1
    if version >= 4:
        s["embed.weight"][:3] *= 2
        s["tiny.7"] += 1
    return s


CHANGED = {2: {"layers.1.mlp.weight"}, 3: set(), 4: {"embed.weight", "tiny.7"}}


def shard_state(state: dict[str, torch.Tensor], mesh: Any) -> list[tuple[str, torch.Tensor]]:
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    placements = {
        "embed.weight": Shard(0),
        "layers.0.attn.weight": Shard(1),
        "layers.0.attn.bias": Replicate(),
        "layers.1.mlp.weight": Shard(0),
        "layers.1.odd": Shard(0),
    }
    return [
        (n, distribute_tensor(t, mesh, [placements[n]]) if n in placements else t)
        for n, t in state.items()
    ]


def build_module(state: dict[str, torch.Tensor], float_dtype: torch.dtype | None) -> Any:
    """An nn.Module whose parameters/buffers have ``state``'s names (zeros)."""
    root = torch.nn.Module()
    for name, t in state.items():
        *path, leaf = name.split(".")
        m = root
        for p in path:
            if not hasattr(m, p):
                m.add_module(p, torch.nn.Module())
            m = getattr(m, p)
        if t.dtype.is_floating_point:
            dt = float_dtype or t.dtype
            m.register_parameter(leaf, torch.nn.Parameter(torch.zeros(t.shape, dtype=dt)))
        else:
            m.register_buffer(leaf, torch.zeros_like(t))
    return root


def mismatches(
    module: Any, state: dict[str, torch.Tensor], prefix: str = "", cast: torch.dtype | None = None
) -> list[str]:
    sd = module.state_dict()
    bad = []
    for n, t in state.items():
        want = t.to(cast) if cast is not None and t.is_floating_point() else t
        if not torch.equal(sd[prefix + n], want):
            bad.append(n)
    return bad


def expected_delta(plan: Any, changed: set[str]) -> tuple[int, int]:
    """Buckets and bytes of a delta round that sends exactly the ``changed`` tensors."""
    layout = plan.layout(t.index for t in plan.tensors if t.name in changed)
    return len(layout), sum(b.nbytes for b in layout)


def make_transport(
    kind: str, rank: int, port: int, name: str, senders: list[int], world: int
) -> Any:
    from deltackpt import sync

    if kind == "gloo":
        return sync.DistTransport(group=None, senders=senders)
    return sync.ShmTransport(name, rank=rank, world_size=world, senders=senders, timeout=30)


# ---- 2 sharded trainers -> 2 inference processes ------------------------------------------


def _sharded_rank(rank: int, port: int, name: str) -> dict[str, Any]:
    """One process of the 2 -> 2 job: the same rounds over gloo, then over shared memory."""
    import torch.distributed as dist

    from deltackpt import sync

    sync.init_group("127.0.0.1", port, rank, WORLD, timeout=30)
    group = dist.new_group(list(range(TRAINERS)))  # every rank of the world must call it
    mesh = None
    if rank < TRAINERS:
        from torch.distributed.tensor import DeviceMesh

        mesh = DeviceMesh.from_group(group, "cpu")
    out = {}
    for kind in ("gloo", "shm"):
        transport = make_transport(kind, rank, port, name, list(range(TRAINERS)), WORLD)
        out[kind] = _rounds(rank, transport, mesh)
        transport.close()
        dist.barrier()
    return out


def _rounds(rank: int, transport: Any, mesh: Any) -> dict[str, Any]:
    from deltackpt import sync

    out: dict[str, Any] = {"rounds": []}
    if rank < TRAINERS:
        sender = sync.WeightSender(transport, bucket_bytes=BUCKET)
        for v in (1, 2, 3, 4):
            out["rounds"].append(sender.push(shard_state(make_state(v), mesh), version=v))
        return out
    template = make_state(1)
    if rank == TRAINERS:  # exact dtypes, transactional
        module = build_module(template, None)
        adapter = sync.ModuleAdapter(module)
        receiver = sync.WeightReceiver(transport)
        prefix, cast = "", None
    else:  # bf16 model under a prefix, per-bucket loading, receiver-side cast
        module = torch.nn.Module()
        module.add_module("model", build_module(template, torch.bfloat16))
        adapter = sync.ModuleAdapter(module, name_map=lambda n: "model." + n, strict=True)
        receiver = sync.WeightReceiver(transport, apply="per_bucket", dtype=torch.bfloat16)
        prefix, cast = "model.", torch.bfloat16
    for v in (1, 2, 3, 4):
        names: list[str] = []
        dtypes: set[torch.dtype] = set()

        def load(
            ws: list[tuple[str, torch.Tensor]],
            names: list[str] = names,
            dtypes: set[torch.dtype] = dtypes,
        ) -> None:
            names.extend(n for n, _ in ws)
            dtypes.update(t.dtype for _, t in ws)
            adapter(ws)

        adapter.reset()
        st = receiver.pull(load)
        cov = adapter.coverage()
        out["rounds"].append(
            {
                "stats": st,
                "version": receiver.version,
                "names": sorted(names),
                "dtypes": sorted(map(str, dtypes)),
                "bad": mismatches(module, make_state(v), prefix, cast),
                "expected": expected_delta(receiver.plan, CHANGED[v]) if v in CHANGED else None,
                "missing": cov.missing,
                "unexpected": cov.unexpected,
            }
        )
    return out


def test_sharded_trainers_to_two_receivers() -> None:
    """2 trainer ranks holding DTensor shards -> 2 receivers, over gloo and over shm."""
    name, port = f"t-{uuid.uuid4().hex[:10]}", free_port()
    try:
        outcomes = spawn(
            [(_sharded_rank, (r, port, name)) for r in range(WORLD)], timeout=150, fast_exit=True
        )
    finally:
        from deltackpt.sync import ShmTransport

        ShmTransport.unlink(name)
    values = [o.unwrap() for o in outcomes]
    for kind in ("gloo", "shm"):
        check_sharded_rounds(kind, [v[kind] for v in values])


def check_sharded_rounds(kind: str, res: list[dict[str, Any]]) -> None:
    s0 = res[0]["rounds"]
    assert [st.version for st in s0] == [1, 2, 3, 4], kind
    assert s0[0].full and s0[0].plan_sent and s0[0].bytes_sent == s0[0].bytes_total
    assert not s0[1].plan_sent and 0 < s0[1].bytes_sent < s0[1].bytes_total / 4
    assert s0[2].buckets_sent == 0 and s0[2].bytes_sent == 0
    # the other sender reports the same rounds, timing aside
    assert [replace(st, seconds=0) for st in res[1]["rounds"]] == [
        replace(st, seconds=0) for st in s0
    ]
    for rank in (2, 3):
        rounds = res[rank]["rounds"]
        for v, r in enumerate(rounds, start=1):
            assert r["version"] == v
            assert r["bad"] == [], f"{kind} rank {rank} v{v}: weights differ: {r['bad']}"
            assert r["unexpected"] == ()
            if v in CHANGED:  # delta round: exactly the changed tensors, re-packed
                st = r["stats"]
                assert r["names"] == sorted(CHANGED[v]), (kind, rank, v)
                assert (st.buckets_sent, st.bytes_sent) == r["expected"], (kind, rank, v)
                assert st.bytes_sent == s0[v - 1].bytes_sent
        assert rounds[0]["missing"] == ()
        assert rounds[0]["stats"].buckets_sent == rounds[0]["stats"].buckets_total
    # the per_bucket receiver asked for bf16: floating tensors reach load_weights as bf16
    assert res[3]["rounds"][0]["dtypes"] == ["torch.bfloat16", "torch.bool", "torch.int64"]
    assert "torch.float16" in res[2]["rounds"][0]["dtypes"]


# ---- a sender dies mid-round ---------------------------------------------------------------


KILL_WORLD = 3  # sender rank 0, receivers 1 and 2


def _die_mid_round(sender: Any) -> None:
    """Make the next round's eighth bucket kill the process, as a crash would."""
    from deltackpt.sync import packing

    pack = packing.Packer.pack
    count = [0]

    def dying_pack(self: Any, *args: Any) -> Any:
        count[0] += 1
        if count[0] == 8:
            sender._channel.flush()  # buckets 0-6 are delivered: the crash is mid-round for sure
            os._exit(17)
        return pack(self, *args)

    packing.Packer.pack = dying_pack  # type: ignore[method-assign]


def _kill_sender(kind: str, port: int, name: str) -> None:
    from deltackpt import sync

    if kind == "gloo":
        sync.init_group("127.0.0.1", port, 0, KILL_WORLD, timeout=30)
    transport = make_transport(kind, 0, port, name, [0], KILL_WORLD)
    sender = sync.WeightSender(transport, bucket_bytes=BUCKET)
    sender.push(make_state(1), version=1)
    _die_mid_round(sender)
    sender.push(make_state(2), version=2, full=True)
    raise AssertionError("unreachable: the sender should have died")


def _replacement_sender(kind: str, port2: int, name: str, marks: str) -> dict[str, Any]:
    from deltackpt import sync

    if kind == "gloo":
        sync.init_group("127.0.0.1", port2, 0, KILL_WORLD, timeout=60)
    else:  # one leader at a time: start once the receivers saw the old one die
        deadline = time.monotonic() + 60
        while len(list(Path(marks).glob("failed-*"))) < 2:
            if time.monotonic() > deadline:
                raise TimeoutError("receivers never reported the failure")
            time.sleep(0.05)
    transport = make_transport(kind, 0, port2, name, [0], KILL_WORLD)
    sender = sync.WeightSender(transport, bucket_bytes=BUCKET)
    st = sender.push(make_state(2), version=2)
    if kind == "gloo":
        import torch.distributed as dist

        dist.barrier()
    return {"stats": st}


def _kill_receiver(
    rank: int, kind: str, port: int, port2: int, name: str, marks: str
) -> dict[str, Any]:
    import torch.distributed as dist

    from deltackpt import sync

    if kind == "gloo":
        sync.init_group("127.0.0.1", port, rank, KILL_WORLD, timeout=30)
    transport = make_transport(kind, rank, port, name, [0], KILL_WORLD)
    module = build_module(make_state(1), None)
    adapter = sync.ModuleAdapter(module)
    apply = "on_commit" if rank == 1 else "per_bucket"
    receiver = sync.WeightReceiver(transport, apply=apply)
    receiver.pull(adapter)
    out: dict[str, Any] = {"v1_bad": mismatches(module, make_state(1))}
    t0 = time.monotonic()
    try:
        receiver.pull(adapter)
        out["error"] = None
    except sync.SyncError as e:
        out["error"] = type(e).__name__
        out["message"] = str(e)
    out["seconds_to_error"] = time.monotonic() - t0
    out["version_after_failure"] = receiver.version
    out["consistent_after_failure"] = receiver.consistent
    out["bad_after_failure"] = mismatches(module, make_state(1))
    Path(marks, f"failed-{rank}").touch()
    if kind == "gloo":
        sync.init_group("127.0.0.1", port2, rank, KILL_WORLD, timeout=60)
    transport.reset()
    st = receiver.pull(adapter)
    out["stats"] = st
    out["version"] = receiver.version
    out["consistent"] = receiver.consistent
    out["bad"] = mismatches(module, make_state(2))
    if kind == "gloo":
        dist.barrier()
    return out


@pytest.mark.parametrize("kind", ["gloo", "shm"])
def test_sender_killed_mid_round(kind: str, tmp_path: Path) -> None:
    name = f"k-{uuid.uuid4().hex[:10]}"
    port, port2 = free_port(), free_port()
    try:
        outcomes = spawn(
            [
                (_kill_sender, (kind, port, name)),
                (_kill_receiver, (1, kind, port, port2, name, str(tmp_path))),
                (_kill_receiver, (2, kind, port, port2, name, str(tmp_path))),
                (_replacement_sender, (kind, port2, name, str(tmp_path))),
            ],
            timeout=120,
            fast_exit=True,
        )
    finally:
        from deltackpt.sync import ShmTransport

        ShmTransport.unlink(name)
    assert outcomes[0].exitcode == 17 and not outcomes[0].reported
    new = outcomes[3].unwrap()
    assert new["stats"].full and new["stats"].plan_sent and new["stats"].version == 2
    for o in outcomes[1:3]:
        r = o.unwrap()
        assert r["v1_bad"] == []
        assert r["error"] == "PeerLostError", r.get("message")
        assert r["seconds_to_error"] < 10  # detection, not the 30 s transport timeout
        assert r["version_after_failure"] == 1
        if o.index == 1:  # on_commit: the model still holds version 1, untouched
            assert r["bad_after_failure"] == []
            assert r["consistent_after_failure"]
        assert r["stats"].full and r["version"] == 2 and r["consistent"]
        assert r["bad"] == []
    # per_bucket: buckets before the crash were applied, so the model was a mix until repaired
    r2 = outcomes[2].unwrap()
    assert not r2["consistent_after_failure"]

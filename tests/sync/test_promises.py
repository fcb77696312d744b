"""Promises of the deleted broadcast-engine tests (test_sync_local.py, test_sync_multiproc.py,
test_sync_tamper.py) that still apply to the one engine, checked between processes.

* 1 -> N broadcast of every dtype (half, bf16, double, int32, bool, empty, scalar, a
  non-contiguous source, many tiny tensors, a tensor split over buckets): bit-exact, delta rounds
  send and hand over exactly the changed tensors (a change inside a split tensor: all of it),
  an unchanged round calls no ``load_weights`` and still advances the version, casts on either
  side.
* DTensor trainers (Shard(0), Shard(1), Replicate, plain) -> receivers that want everything,
  through :class:`~deltackpt.sync.ModuleAdapter` (exact, or bf16 under a prefix, strict).
* Failures: bad sender input aborts every rank with a typed error and the next round works;
  senders that disagree on the version fail every rank; a corrupted bucket is rejected on every
  rank and the last version kept; a shm wait is bounded when no sender comes; a sender killed
  mid-round on shm links.
* Untrusted shared memory: a link window written after the vote, after a bucket was copied
  out, or while the sender packs, and a hostile process scribbling the windows during rounds,
  never make a receiver return normally with bytes the trainer never sent.

Children return plain data (numpy arrays are avoided: results are compared where they are).
"""

from __future__ import annotations

import mmap
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import torch

from tests._dist import Outcome, free_port, spawn

if TYPE_CHECKING:
    from deltackpt.sync import SyncGroup

pytestmark = pytest.mark.multiproc

TYPED = ("DigestMismatchError", "RoundAbortedError")


def _group(
    port: int, rank: int, world: int, trainers: Any, links: str, timeout: float = 30.0
) -> SyncGroup:
    from deltackpt import sync

    return sync.SyncGroup("127.0.0.1", port, rank, world, trainers, timeout=timeout, links=links)


def _err(e: BaseException) -> tuple[str, str]:
    return type(e).__name__, str(e)


class Sink:
    """``load_weights`` that keeps a copy of what it is handed, remembers each call's names, and
    (with ``want``) records every tensor whose bytes differ from what the trainer sent."""

    def __init__(self) -> None:
        self.state: dict[str, torch.Tensor] = {}
        self.calls: list[list[str]] = []
        self.want: dict[str, torch.Tensor] | None = None
        self.wrong: list[str] = []

    def __call__(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        self.calls.append([n for n, _ in weights])
        for n, t in weights:
            if self.want is not None and not same(t, self.want.get(n)):
                self.wrong.append(n)
            self.state[n] = t.clone()


def same(got: torch.Tensor | None, want: torch.Tensor | None) -> bool:
    return (
        got is not None
        and want is not None
        and got.dtype == want.dtype
        and got.shape == want.shape
        and torch.equal(got, want)
    )


def differ(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> list[str]:
    """Names whose tensors differ (dtype, shape or bytes); names missing from ``got`` are left
    to the caller."""
    return sorted(n for n in got if not same(got[n], want.get(n)))


def _wait_for(path: Path, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} never appeared")
        time.sleep(0.01)


def nbytes(state: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


# ---- 1 -> 2 broadcast of every dtype, delta rounds, casts (was test_sync_local.py) ---------

BC_BUCKET = 16 << 10
BC_ROUNDS = (1, 2, 3, 4, 5)  # 2: LoRA adapters change; 3: nothing; 4: a split tensor; 5: full


def bc_model() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    s = {
        "embed": torch.randn(300, 40, generator=g),  # 48 KB: split over 3 buckets of 16 KiB
        "base.w": torch.randn(32, 32, generator=g),
        "lora.a": torch.randn(4, 32, generator=g),
        "lora.b": torch.randn(32, 4, generator=g),
        "h": torch.randn(17, 3, generator=g).half(),
        "bf": torch.randn(11, generator=g).bfloat16(),
        "d": torch.randn(5, generator=g).double(),
        "i": torch.arange(9, dtype=torch.int32),
        "m": torch.tensor([True, False, True]),
        "e": torch.zeros(0, 2),
        "s": torch.tensor(1.5),
        "nc": torch.randn(8, 6, generator=g).t(),  # non-contiguous source
    }
    for i in range(64):
        s[f"tiny{i}"] = torch.full((1 + i % 2,), float(i))
    return s


def bc_mutate(s: dict[str, torch.Tensor], v: int) -> None:
    """In place, as an optimizer step: what round ``v`` changes."""
    if v == 2:  # LoRA-style: only the adapters
        s["lora.a"].add_(1)
        s["lora.b"].mul_(2)
    if v == 4:  # one row of a tensor split over several buckets
        s["embed"][-1].fill_(7)


def bc_state(v: int) -> dict[str, torch.Tensor]:
    s = bc_model()
    for k in range(1, v + 1):
        bc_mutate(s, k)
    return s


def fp16_except_d(name: str, dtype: torch.dtype) -> torch.dtype | None:
    return torch.float16 if dtype.is_floating_point and name != "d" else None


def cast(
    state: dict[str, torch.Tensor], spec: Any, declared: Any = None
) -> dict[str, torch.Tensor]:
    """``state`` as a receiver asking for ``spec`` gets it from a sender that declares its
    tensors as ``declared`` picks: one cast, from the source, to the dtype ``spec`` picks from
    the declared one."""
    from deltackpt.sync.dtypes import resolve_dtype

    return {
        n: t.to(resolve_dtype(spec, n, resolve_dtype(declared, n, t.dtype)))
        for n, t in state.items()
    }


def _bc_trainer(ports: list[int]) -> dict[str, Any]:
    from deltackpt import sync

    group = _group(ports[0], 0, 3, [0], "shm")
    sender = sync.WeightSender(group, bucket_bytes=BC_BUCKET)
    state = bc_model()
    rounds = []
    for v in BC_ROUNDS:
        bc_mutate(state, v)
        rounds.append(sender.push(state, version=v, full=v == 5))
    group.pg.barrier().wait()
    group.close()
    # the sender casts (a dtype: floating tensors only), over gloo
    group = _group(ports[1], 0, 3, [0], "gloo")
    cast_stats = sync.WeightSender(group, bucket_bytes=BC_BUCKET, dtype=torch.bfloat16).push(
        bc_model(), version=1
    )
    group.pg.barrier().wait()
    group.close()
    return {"rounds": rounds, "cast": cast_stats}


def _bc_receiver(rank: int, ports: list[int]) -> dict[str, Any]:
    from deltackpt import sync

    spec = None if rank == 1 else fp16_except_d  # rank 2 asks for fp16 (the sender casts)
    group = _group(ports[0], rank, 3, [0], "shm")
    receiver = sync.WeightReceiver(group, dtype=spec, bucket_bytes=BC_BUCKET)
    sink = Sink()
    rounds = []
    for v in BC_ROUNDS:
        sink.calls = []
        st = receiver.pull(sink)
        want = cast(bc_state(v), spec)
        rounds.append(
            {
                "stats": st,
                "version": receiver.version,
                "calls": sink.calls,
                "bad": differ(sink.state, want),
                "missing": sorted(set(want) - set(sink.state)),
            }
        )
    group.pg.barrier().wait()
    group.close()
    group = _group(ports[1], rank, 3, [0], "gloo")
    receiver = sync.WeightReceiver(group, dtype=spec, bucket_bytes=BC_BUCKET)
    sink = Sink()
    st = receiver.pull(sink)
    want = cast(bc_model(), spec, torch.bfloat16)  # the sender casts once, to what rank asks
    out = {
        "stats": st,
        "bad": differ(sink.state, want),
        "missing": sorted(set(want) - set(sink.state)),
        "wants": {w.name: str(w.dtype) for w in receiver.wants},
    }
    group.pg.barrier().wait()
    group.close()
    return {"rounds": rounds, "cast": out}


@pytest.fixture(scope="module")
def broadcast() -> list[Any]:
    ports = [free_port(), free_port()]
    outcomes = spawn(
        [(_bc_trainer, (ports,)), (_bc_receiver, (1, ports)), (_bc_receiver, (2, ports))],
        timeout=120,
        fast_exit=True,
    )
    return [o.unwrap() for o in outcomes]


def test_broadcast_every_dtype_round_trip_and_delta_rounds(broadcast: list[Any]) -> None:
    trainer, *receivers = broadcast
    st = trainer["rounds"]
    assert [x.version for x in st] == list(BC_ROUNDS)
    assert st[0].full and not any(x.full for x in st[1:4]) and st[4].full
    for rank, rec in enumerate(receivers, start=1):
        spec = None if rank == 1 else fp16_except_d
        rounds = rec["rounds"]
        assert [r["version"] for r in rounds] == list(BC_ROUNDS)
        for v, r in zip(BC_ROUNDS, rounds, strict=True):
            assert r["bad"] == [], (rank, v, r["bad"])
            # what this receiver received is what the trainer sent it
            assert r["stats"].payload_bytes == st[v - 1].per_link.get(rank, 0), (rank, v)
        # round 1: every tensor, whole ("e" has no bytes: see the test below)
        assert set(rounds[0]["missing"]) <= {"e"}
        full_bytes = nbytes(cast(bc_model(), spec))
        assert rounds[0]["stats"].full and rounds[0]["stats"].payload_bytes == full_bytes
        # round 2: only the adapters travel and reach load_weights
        lora = cast({n: bc_model()[n] for n in ("lora.a", "lora.b")}, spec)
        assert rounds[1]["calls"] == [["lora.a", "lora.b"]]
        assert rounds[1]["stats"].payload_bytes == nbytes(lora) == (1024 if rank == 1 else 512)
        # round 3: nothing changed: no bytes, no load_weights call, the version advances
        assert rounds[2]["calls"] == [] and rounds[2]["stats"].payload_bytes == 0
        # round 4: a change inside a split tensor resends all of it; handed over whole
        embed = cast({"embed": bc_model()["embed"]}, spec)
        assert rounds[3]["calls"] == [["embed"]]
        assert rounds[3]["stats"].payload_bytes == nbytes(embed)
        # round 5: full=True sends everything again
        assert rounds[4]["stats"].full and rounds[4]["stats"].payload_bytes == full_bytes
        assert sorted(rounds[4]["calls"][0]) == sorted(set(bc_model()) - set(rounds[0]["missing"]))


def test_broadcast_hands_every_tensor_to_load_weights_in_the_first_round(
    broadcast: list[Any],
) -> None:
    for rec in broadcast[1:]:
        assert rec["rounds"][0]["missing"] == []


def test_casts_on_either_side(broadcast: list[Any]) -> None:
    """The sender declares bf16 (``dtype=torch.bfloat16``: floating tensors only; half the
    bytes); rank 2 asks for fp16 except 'd', which the sender casts to from its own tensors
    (one cast, not bf16 then fp16)."""
    trainer, *receivers = broadcast
    model = bc_model()
    for rank, rec in enumerate(receivers, start=1):
        c = rec["cast"]
        assert c["bad"] == [] and set(c["missing"]) <= {"e"}
        assert trainer["cast"].per_link[rank] == c["stats"].payload_bytes
        wants = c["wants"]
        assert wants["i"] == "torch.int32" and wants["m"] == "torch.bool"
        assert wants["embed"] == ("torch.bfloat16" if rank == 1 else "torch.float16")
        assert wants["d"] == "torch.bfloat16"
    wire = cast(model, torch.bfloat16)
    assert receivers[0]["cast"]["stats"].payload_bytes == nbytes(wire) < nbytes(model)


# ---- 2 DTensor trainers -> 2 receivers that want everything (was test_sync_multiproc.py) ---

DT_TRAINERS, DT_WORLD = 2, 4
DT_CHANGED = {2: ["attn.weight"], 3: []}


def dt_state(v: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    s = {
        "embed.weight": torch.randn(30, 16, generator=g),  # Shard(0)
        "attn.weight": torch.randn(12, 10, generator=g),  # Shard(1): strided boxes
        "attn.bias": torch.randn(12, generator=g),  # Replicate
        "odd": torch.randn(5, 3, generator=g),  # Shard(0), uneven (3 + 2 rows)
        "head.weight": torch.randn(20, 16, generator=g),  # plain, on both trainers
        "w_half": torch.randn(9, 5, generator=g).half(),
        "w_steps": torch.arange(7),
        "w_mask": torch.rand(4, 4, generator=g) > 0.5,
    }
    if v >= 2:
        s["attn.weight"] = s["attn.weight"] + 1
    return s


def dt_module(float_dtype: torch.dtype | None) -> torch.nn.Module:
    """An nn.Module whose parameters/buffers have ``dt_state``'s names (zeros)."""
    root = torch.nn.Module()
    for name, t in dt_state(1).items():
        *path, leaf = name.split(".")
        m = root
        for p in path:
            if not hasattr(m, p):
                m.add_module(p, torch.nn.Module())
            m = getattr(m, p)
        if t.dtype.is_floating_point:
            z = torch.zeros(t.shape, dtype=float_dtype or t.dtype)
            m.register_parameter(leaf, torch.nn.Parameter(z))
        else:
            m.register_buffer(leaf, torch.zeros_like(t))
    return root


def _dt_trainer(rank: int, port: int, port_mesh: int) -> list[Any]:
    import torch.distributed as dist
    from torch.distributed.tensor import DeviceMesh, Replicate, Shard, distribute_tensor

    from deltackpt import sync

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port_mesh}", rank=rank, world_size=DT_TRAINERS
    )
    mesh = DeviceMesh("cpu", list(range(DT_TRAINERS)))
    placements = {
        "embed.weight": Shard(0),
        "attn.weight": Shard(1),
        "attn.bias": Replicate(),
        "odd": Shard(0),
    }
    group = _group(port, rank, DT_WORLD, range(DT_TRAINERS), "gloo")
    sender = sync.WeightSender(group, bucket_bytes=1 << 10)
    out = []
    for v in (1, 2, 3):
        state = [
            (n, distribute_tensor(t, mesh, [placements[n]]) if n in placements else t)
            for n, t in dt_state(v).items()
        ]
        out.append(sender.push(state, version=v))
    group.pg.barrier().wait()
    group.close()
    return out


def _dt_receiver(rank: int, port: int) -> list[dict[str, Any]]:
    from deltackpt import sync

    group = _group(port, rank, DT_WORLD, range(DT_TRAINERS), "gloo")
    if rank == DT_TRAINERS:  # the trainers' dtypes
        module = dt_module(None)
        adapter = sync.ModuleAdapter(module)
        receiver = sync.WeightReceiver(group, bucket_bytes=1 << 10)
        prefix, spec = "", None
    else:  # a bf16 model under a prefix, strict names, the receiver asks for bf16
        module = torch.nn.Module()
        module.add_module("model", dt_module(torch.bfloat16))
        adapter = sync.ModuleAdapter(module, name_map=lambda n: "model." + n, strict=True)
        receiver = sync.WeightReceiver(group, dtype=torch.bfloat16, bucket_bytes=1 << 10)
        prefix, spec = "model.", torch.bfloat16
    rounds = []
    for v in (1, 2, 3):
        names: list[str] = []

        def load(ws: list[tuple[str, torch.Tensor]], names: list[str] = names) -> None:
            names.extend(n for n, _ in ws)
            adapter(ws)

        adapter.reset()
        st = receiver.pull(load)
        sd = module.state_dict()
        want = cast(dt_state(v), spec)
        cov = adapter.coverage()
        rounds.append(
            {
                "stats": st,
                "version": receiver.version,
                "names": sorted(names),
                "bad": sorted(n for n, t in want.items() if not same(sd[prefix + n], t)),
                "missing": cov.missing,
                "unexpected": cov.unexpected,
                "bytes": nbytes(want),
            }
        )
    group.pg.barrier().wait()
    group.close()
    return rounds


def test_dtensor_trainers_to_receivers_that_want_everything() -> None:
    port, port_mesh = free_port(), free_port()
    targets: list[Any] = [(_dt_trainer, (r, port, port_mesh)) for r in range(DT_TRAINERS)]
    targets += [(_dt_receiver, (r, port)) for r in range(DT_TRAINERS, DT_WORLD)]
    values = [o.unwrap() for o in spawn(targets, timeout=120, fast_exit=True)]
    trainers, receivers = values[:DT_TRAINERS], values[DT_TRAINERS:]
    for t in trainers:
        assert [x.version for x in t] == [1, 2, 3] and t[0].full and not t[1].full
    for i, rounds in enumerate(receivers):
        r = DT_TRAINERS + i
        for v, x in enumerate(rounds, start=1):
            assert x["version"] == v and x["bad"] == [], (r, v, x["bad"])
            assert x["unexpected"] == ()
            sent = sum(t[v - 1].per_link.get(r, 0) for t in trainers)
            assert x["stats"].payload_bytes == sent, (r, v)
        first = rounds[0]
        assert first["missing"] == () and first["names"] == sorted(dt_state(1))
        # every element once, from one holder (replicas and plain tensors are not sent twice)
        assert first["stats"].full and first["stats"].payload_bytes == first["bytes"]
        for v, changed in DT_CHANGED.items():
            assert rounds[v - 1]["names"] == changed, (r, v)
        assert rounds[2]["stats"].payload_bytes == 0


# ---- bad sender input, disagreeing versions ------------------------------------------------


# phases of one pair of processes: a plain failed round over gloo; the same with the trainer
# slow to vote (the receiver's abort reason is written first); over shm with the receiver slow
# to copy the failed round's stub out of its window (the trainer starts the next round first)
BAD_PHASES = ("gloo", "gloo-slow-vote", "shm-slow-receiver")


def _phase_done(marks: str, phase: str, rank: int) -> None:
    """Both ranks leave a phase together (not a gloo barrier: the group may be broken)."""
    Path(marks, f"{phase}-{rank}").touch()
    _wait_for(Path(marks, f"{phase}-{1 - rank}"), 30)


def _bad_input_trainer(ports: list[int], marks: str) -> dict[str, Any]:
    from deltackpt import sync
    from deltackpt.sync.group import SyncGroup

    real_vote = SyncGroup.vote
    res = {}
    for phase, port in zip(BAD_PHASES, ports, strict=True):
        group = _group(port, 0, 2, [0], phase.split("-")[0], timeout=3)
        sender = sync.WeightSender(group, bucket_bytes=4096)
        if phase == "gloo-slow-vote":

            def slow_vote(self: SyncGroup, seq: int, *args: Any, **kw: Any) -> str | None:
                time.sleep(0.3)
                return real_vote(self, seq, *args, **kw)

            SyncGroup.vote = slow_vote  # type: ignore[method-assign]
        out: list[Any] = []
        # a tensor the sender cannot read (never materialized): the round fails while packing
        steps: list[tuple[dict[str, torch.Tensor], int]] = [
            ({"w": torch.empty(2, device="meta")}, 1),
            ({"w": torch.ones(2)}, 1),
            # different tensors than the schedule was built for: refused before any round
            ({"w": torch.ones(2), "x": torch.ones(1)}, 2),
            ({"w": torch.full((2,), 2.0)}, 2),
        ]
        for state, v in steps:
            try:
                out.append(("ok", sender.push(state, version=v).full))
            except sync.SyncError as e:
                out.append(_err(e))
            SyncGroup.vote = real_vote  # type: ignore[method-assign]
        _phase_done(marks, phase, 0)
        group.close()
        res[phase] = out
    return res


def _bad_input_receiver(ports: list[int], marks: str) -> dict[str, Any]:
    from deltackpt import sync
    from deltackpt.sync.shm_links import ShmLinks

    real_wait = ShmLinks._wait_copy
    res = {}
    for phase, port in zip(BAD_PHASES, ports, strict=True):
        group = _group(port, 1, 2, [0], phase.split("-")[0], timeout=3)
        receiver = sync.WeightReceiver(group, bucket_bytes=4096)
        if phase == "shm-slow-receiver":

            def slow_wait(self: ShmLinks, *args: Any) -> None:
                time.sleep(0.3)  # descheduled for a moment, as on a busy host
                ShmLinks._wait_copy = real_wait  # type: ignore[method-assign]
                real_wait(self, *args)

            ShmLinks._wait_copy = slow_wait  # type: ignore[method-assign]
        sink = Sink()
        out: list[Any] = []
        for v in (None, 1, 2):
            try:
                receiver.pull(sink)
                out.append(None)
            except sync.SyncError as e:
                out.append(_err(e))
            want = {} if v is None else {"w": torch.full((2,), float(v))}
            out.append((receiver.version, list(sink.calls), differ(sink.state, want)))
        _phase_done(marks, phase, 1)
        group.close()
        res[phase] = out
    return res


@pytest.fixture(scope="module")
def bad_input(tmp_path_factory: pytest.TempPathFactory) -> list[Any]:
    ports = [free_port() for _ in BAD_PHASES]
    marks = str(tmp_path_factory.mktemp("bad_input"))
    outs = spawn(
        [(_bad_input_trainer, (ports, marks)), (_bad_input_receiver, (ports, marks))],
        timeout=90,
        fast_exit=True,
    )
    return [o.unwrap() for o in outs]


def _check_bad_input(values: list[Any], phase: str) -> None:
    trainer, receiver = (v[phase] for v in values)
    name, message = trainer[0]
    assert name == "SyncError", (name, message)  # its own failure, not RoundAbortedError
    assert "receivers keep version None" in message
    name, message = receiver[0]
    assert name == "RoundAbortedError" and "version stays None" in message, (name, message)
    assert receiver[1] == (None, [], [])  # nothing applied, load_weights never called
    assert trainer[1] == ("ok", True) and receiver[2:4] == [None, (1, [["w"]], [])]
    name, message = trainer[2]
    assert name == "PlanError" and "different tensors" in message
    assert trainer[3] == ("ok", False) and receiver[4:6] == [None, (2, [["w"], ["w"]], [])]


def test_bad_sender_input_aborts_every_rank_and_the_next_round_works(
    bad_input: list[Any],
) -> None:
    _check_bad_input(bad_input, "gloo")


def test_failing_sender_names_its_own_error(bad_input: list[Any]) -> None:
    _check_bad_input(bad_input, "gloo-slow-vote")
    _, message = bad_input[0]["gloo-slow-vote"][0]
    assert "failed packing bucket 0" in message and "meta" in message, message


def test_failed_round_on_shm_does_not_strand_a_slower_receiver(bad_input: list[Any]) -> None:
    _check_bad_input(bad_input, "shm-slow-receiver")


def _non_tensor_trainer(port: int) -> list[Any]:
    from deltackpt import sync

    group = _group(port, 0, 2, [0], "shm", timeout=3)
    sender = sync.WeightSender(group, bucket_bytes=4096)
    out: list[Any] = []
    for state in ([("w", [1.0, 2.0])], {"w": torch.ones(2)}):
        try:
            sender.push(state, version=1)
            out.append(None)
        except Exception as e:  # the promise is a SyncError: whatever comes is reported
            out.append(_err(e))
    # the store lives in this rank: leave only once the receiver is done reading it (with
    # fast_exit an early exit reset the receiver's last store read: a PeerLostError, under load)
    group.pg.barrier().wait()
    return out


def _non_tensor_receiver(port: int) -> list[Any]:
    from deltackpt import sync

    group = _group(port, 1, 2, [0], "shm", timeout=3)
    receiver = sync.WeightReceiver(group, bucket_bytes=4096)
    out: list[Any] = []
    for _ in range(2):
        try:
            receiver.pull(Sink())
            out.append(None)
        except Exception as e:
            out.append(_err(e))
    out.append(receiver.version)
    group.pg.barrier().wait()
    return out


def test_non_tensor_sender_input_aborts_every_rank_with_a_typed_error() -> None:
    port = free_port()
    outs = spawn(
        [(_non_tensor_trainer, (port,)), (_non_tensor_receiver, (port,))],
        timeout=60,
        fast_exit=True,
    )
    trainer, receiver = (o.unwrap() for o in outs)
    assert trainer[0] is not None and trainer[0][0] in ("SyncError", "PlanError"), trainer[0]
    assert "(name: str, tensor)" in trainer[0][1] or "tensor" in trainer[0][1]
    assert receiver[0] is not None and receiver[0][0] == "RoundAbortedError", receiver[0]
    assert trainer[1] is None and receiver[1] is None and receiver[2] == 1


INTO_LINKS = ("gloo", "shm")
INTO_TIMEOUT = 20.0


def _into_trainer(ports: list[int]) -> dict[str, Any]:
    from deltackpt import sync

    res = {}
    for links, port in zip(INTO_LINKS, ports, strict=True):
        group = _group(port, 0, 3, [0], links, timeout=INTO_TIMEOUT)
        sender = sync.WeightSender(group, bucket_bytes=4096)
        out: list[Any] = []
        for _ in range(2):  # the first setup fails on rank 2; the retry commits
            t0 = time.monotonic()
            try:
                out.append(("ok", sender.push({"w": torch.arange(4.0)}, version=1).version))
            except sync.SyncError as e:
                out.append(_err(e))
            out.append(time.monotonic() - t0)
        group.pg.barrier().wait()
        group.close()
        res[links] = out
    return res


def _into_receiver(rank: int, ports: list[int]) -> dict[str, Any]:
    from deltackpt import sync

    res = {}
    for links, port in zip(INTO_LINKS, ports, strict=True):
        group = _group(port, rank, 3, [0], links, timeout=INTO_TIMEOUT)
        out: list[Any] = []
        for attempt in range(2):
            # rank 2 first passes a parameter of the wrong shape, then the right one
            into = torch.zeros(3 if rank == 2 and attempt == 0 else 4)
            receiver = sync.WeightReceiver(group, [sync.Want("w", into=into)], bucket_bytes=4096)
            t0 = time.monotonic()
            try:
                receiver.pull()
                out.append(None)
            except sync.SyncError as e:
                out.append(_err(e))
            out.append((time.monotonic() - t0, receiver.version, into.tolist()))
        group.pg.barrier().wait()
        group.close()
        res[links] = out
    return res


@pytest.fixture(scope="module")
def wrong_into() -> list[Any]:
    ports = [free_port() for _ in INTO_LINKS]
    targets: list[Any] = [(_into_trainer, (ports,))]
    targets += [(_into_receiver, (r, ports)) for r in (1, 2)]
    return [o.unwrap() for o in spawn(targets, timeout=90, fast_exit=True)]


@pytest.mark.parametrize("links", INTO_LINKS)
def test_receiver_with_a_wrong_into_shape_fails_every_rank_fast(
    wrong_into: list[Any], links: str
) -> None:
    """A receiver whose ``Want.into`` does not fit its box fails the setup with PlanError; the
    trainer and the other receiver, which had finished their part of the setup, get a typed
    error at once (not the group timeout), and the next attempt plans and commits."""
    trainer, good, bad = (o[links] for o in wrong_into)
    name, message = bad[0]
    assert name == "PlanError" and "into has shape [3]" in message, (name, message)
    for who, (name, message), seconds in (
        ("trainer", trainer[0], trainer[1]),
        ("receiver 1", good[0], good[1][0]),
    ):
        assert name == "RoundAbortedError", (who, name, message)
        assert "rank 2" in message and "into has shape [3]" in message, (who, message)
        assert seconds < INTO_TIMEOUT / 2, (who, seconds)  # not the timeout, even when busy
    assert good[1][1:] == (None, [0.0] * 4) and bad[1][1:] == (None, [0.0] * 3)
    assert trainer[2] == ("ok", 1)
    for rec in (good, bad):
        assert rec[2] is None and rec[3][1:] == (1, [0.0, 1.0, 2.0, 3.0])


def _halves(rank: int, state: dict[str, torch.Tensor]) -> dict[str, Any]:
    from deltackpt import sync

    out = {}
    for n, t in state.items():
        box = sync.shard_box(t.shape, 0, rank, 2)
        out[n] = sync.LocalShard(
            t[box.offset[0] : box.offset[0] + box.size[0]], box.offset, t.shape
        )
    return out


VERSION_KINDS = ("sharded", "replicated")


def _version_trainer(rank: int, ports: list[int]) -> dict[str, Any]:
    from deltackpt import sync

    res = {}
    for kind, port in zip(VERSION_KINDS, ports, strict=True):
        group = _group(port, rank, 3, [0, 1], "gloo", timeout=20)
        sender = sync.WeightSender(group, bucket_bytes=4096)
        state = {"w": torch.arange(8.0), "b": torch.ones(4)}
        local = _halves(rank, state) if kind == "sharded" else state
        out: list[Any] = []
        try:
            sender.push(local, version=5 if rank == 0 else 6)
            out.append(None)
        except sync.SyncError as e:
            out.append(_err(e))
        out.append(sender.push(local, version=6).version)
        group.pg.barrier().wait()
        group.close()
        res[kind] = out
    return res


def _version_receiver(ports: list[int]) -> dict[str, Any]:
    from deltackpt import sync

    res = {}
    for kind, port in zip(VERSION_KINDS, ports, strict=True):
        group = _group(port, 2, 3, [0, 1], "gloo", timeout=20)
        receiver = sync.WeightReceiver(group, bucket_bytes=4096)
        sink = Sink()
        out: list[Any] = []
        try:
            receiver.pull(sink)
            out.append(None)
        except sync.SyncError as e:
            out.append(_err(e))
        out.append(receiver.version)
        receiver.pull(sink)
        out.append(receiver.version)
        out.append(differ(sink.state, {"w": torch.arange(8.0), "b": torch.ones(4)}))
        group.pg.barrier().wait()
        group.close()
        res[kind] = out
    return res


@pytest.fixture(scope="module")
def versions() -> list[Any]:
    ports = [free_port() for _ in VERSION_KINDS]
    targets: list[Any] = [(_version_trainer, (r, ports)) for r in (0, 1)]
    targets.append((_version_receiver, (ports,)))
    return [o.unwrap() for o in spawn(targets, timeout=90, fast_exit=True)]


def _check_versions(values: list[Any], kind: str) -> None:
    t0, t1, rec = (v[kind] for v in values)
    for who, e in (("trainer 0", t0[0]), ("trainer 1", t1[0]), ("receiver", rec[0])):
        assert e is not None and "different versions" in e[1], (who, e)
    assert rec[1] is None  # nothing committed
    assert t0[1] == t1[1] == rec[2] == 6 and rec[3] == []  # the next round agrees and commits


def test_senders_must_agree_on_version_sharded(versions: list[Any]) -> None:
    _check_versions(versions, "sharded")


def test_senders_must_agree_on_version_replicated(versions: list[Any]) -> None:
    _check_versions(versions, "replicated")


# ---- a corrupted bucket is rejected on every rank (gloo) ------------------------------------


def _corrupt_trainer(port: int) -> list[Any]:
    from deltackpt import sync

    group = _group(port, 0, 3, [0], "gloo")
    sender = sync.WeightSender(group, bucket_bytes=4096, zero_copy_min=None)
    g = torch.Generator().manual_seed(3)
    v1 = {"w": torch.randn(2000, generator=g), "x": torch.randn(10, generator=g)}
    v2 = {n: t + 1 for n, t in v1.items()}
    out: list[Any] = [sender.push(v1, version=1).version]
    real_isend = group.isend
    flipped: list[int] = []

    def corrupt(buf: torch.Tensor, dst: int, tag: int) -> Any:
        # a bit flips on the way to rank 1 (after the sender hashed bucket 1)
        if dst == 1 and tag == 1 and not flipped:
            buf = buf.clone()
            buf[-1] ^= 0xFF  # the last byte of the message: payload of its last piece
            flipped.append(tag)
        return real_isend(buf, dst, tag)

    group.isend = corrupt  # type: ignore[method-assign]
    try:
        sender.push(v2, version=2, full=True)
        out.append(None)
    except sync.SyncError as e:
        out.append(_err(e))
    out.append((sender.version, len(flipped)))
    group.isend = real_isend  # type: ignore[method-assign]
    st = sender.push(v2, version=3)
    out.append((st.full, st.version))
    group.pg.barrier().wait()
    group.close()
    return out


def _corrupt_receiver(rank: int, port: int) -> list[Any]:
    from deltackpt import sync

    group = _group(port, rank, 3, [0], "gloo")
    receiver = sync.WeightReceiver(group, bucket_bytes=4096)
    sink = Sink()
    receiver.pull(sink)
    kept = {n: t.clone() for n, t in sink.state.items()}
    sink.calls = []
    out: list[Any] = []
    try:
        receiver.pull(sink)
        out.append(None)
    except sync.SyncError as e:
        out.append(_err(e))
    out.append((receiver.version, list(sink.calls), differ(sink.state, kept)))
    receiver.pull(sink)
    g = torch.Generator().manual_seed(3)
    v2 = {"w": torch.randn(2000, generator=g) + 1, "x": torch.randn(10, generator=g) + 1}
    out.append((receiver.version, differ(sink.state, v2), sorted(sink.state)))
    group.pg.barrier().wait()
    group.close()
    return out


def test_corrupted_bucket_is_rejected_on_every_rank_and_last_version_kept() -> None:
    port = free_port()
    targets: list[Any] = [(_corrupt_trainer, (port,))]
    targets += [(_corrupt_receiver, (r, port)) for r in (1, 2)]
    trainer, hit, other = (o.unwrap() for o in spawn(targets, timeout=90, fast_exit=True))
    name, message = hit[0]
    assert name == "DigestMismatchError", message
    assert "round 2" in message and "bucket 1 from rank 0" in message
    name, message = other[0]
    assert name == "RoundAbortedError" and "rank 1:" in message, message
    name, message = trainer[1]
    assert name == "RoundAbortedError" and "rank 1:" in message, message
    assert trainer[2] == (1, 1)  # the sender keeps version 1 too
    for rec in (hit, other):
        assert rec[1] == (1, [], [])  # version 1 kept; load_weights never saw round 2
        assert rec[2] == (3, [], ["w", "x"])
    assert trainer[3] == (True, 3)  # the round after a failure is full


# ---- untrusted shared memory: writes after the vote / after a bucket was copied out ---------

SHM_BUCKET = 8 << 10


def shm_state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"w{i}": torch.randn(3000 + 7 * i, generator=g) for i in range(4)}


class Window:
    """An independent read-write mapping of a receiver's link file (as a buggy or hostile
    process that opens ``/dev/shm/deltackpt-mxn-*`` would hold it): the bucket slots after the
    cells (``ShmLinks.open``)."""

    def __init__(self, path: str, buckets: int, slot: int) -> None:
        fd = os.open(path, os.O_RDWR)
        try:
            self.mm = mmap.mmap(fd, os.path.getsize(path))
        finally:
            os.close(fd)
        self.cells = -(-buckets * 16 // 4096) * 4096
        self.slot = slot
        self.data = memoryview(self.mm)[self.cells :]
        self.flips = 0

    def flip(self, lo: int = 0, hi: int | None = None) -> None:
        view = torch.frombuffer(self.data, dtype=torch.uint8)[lo:hi]
        view.bitwise_not_()
        self.flips += 1

    def flip_slot(self, tag: int) -> None:
        self.flip(tag * self.slot, (tag + 1) * self.slot)


def _window(group: Any, receiver: Any) -> Window:
    _, _, _, slot = group._shm._maps[(0, group.rank)]
    return Window(group._shm.path(0, group.rank), len(receiver._buckets), slot)


def _after_trainer(port: int) -> list[Any]:
    from deltackpt import sync

    group = _group(port, 0, 2, [0], "shm")
    sender = sync.WeightSender(group, bucket_bytes=SHM_BUCKET)
    out: list[Any] = []
    for v, full in ((1, False), (2, True), (3, True), (4, False)):
        try:
            sender.push(shm_state(v), version=v, full=full)
            out.append(None)
        except sync.SyncError as e:
            out.append(type(e).__name__)
        group.pg.barrier().wait()  # the next round starts after the receiver's writes
    group.close()
    return out


def _after_receiver(port: int) -> list[dict[str, Any]]:
    from deltackpt import sync
    from deltackpt.sync.group import SyncGroup
    from deltackpt.sync.shm_links import ShmLinks

    group = _group(port, 1, 2, [0], "shm")
    receiver = sync.WeightReceiver(group, bucket_bytes=SHM_BUCKET)
    sink = Sink()
    window: Window | None = None
    real_vote, real_wait = SyncGroup.vote, ShmLinks._wait_copy

    def vote_then_write(self: SyncGroup, seq: int, *args: Any, **kw: Any) -> str | None:
        out = real_vote(self, seq, *args, **kw)
        assert window is not None
        window.flip()  # every slot, after the round was verified and voted
        return out

    def copy_then_write(self: ShmLinks, src: int, tag: int, into: torch.Tensor, seq: int) -> None:
        real_wait(self, src, tag, into, seq)
        assert window is not None
        window.flip_slot(tag)  # this bucket, once the receiver has its header and bytes

    rounds = []
    for v in (1, 2, 3, 4):
        if v == 2:
            window = _window(group, receiver)
            SyncGroup.vote = vote_then_write  # type: ignore[method-assign]
        elif v == 3:
            SyncGroup.vote = real_vote  # type: ignore[method-assign]
            ShmLinks._wait_copy = copy_then_write  # type: ignore[method-assign]
        elif v == 4:
            ShmLinks._wait_copy = real_wait  # type: ignore[method-assign]
        kept = {n: t.clone() for n, t in sink.state.items()}
        sink.want, sink.wrong = shm_state(v), []
        flips = window.flips if window is not None else 0
        try:
            receiver.pull(sink)
            err = None
        except sync.SyncError as e:
            err = type(e).__name__
        rounds.append(
            {
                "error": err,
                "version": receiver.version,
                "wrong": sink.wrong,
                "bad": differ(sink.state, shm_state(v) if err is None else kept),
                "flips": (window.flips if window is not None else 0) - flips,
                "buckets": len(receiver._buckets),
            }
        )
        group.pg.barrier().wait()
    group.close()
    return rounds


def test_window_written_after_the_vote_or_after_a_bucket_never_reaches_load_weights() -> None:
    port = free_port()
    outs = spawn(
        [(_after_trainer, (port,)), (_after_receiver, (port,))], timeout=90, fast_exit=True
    )
    trainer, rounds = (o.unwrap() for o in outs)
    assert rounds[0]["buckets"] > 3
    assert rounds[1]["flips"] == 1 and rounds[2]["flips"] == rounds[0]["buckets"]
    kept = 1
    for v, r in enumerate(rounds, start=1):
        assert r["wrong"] == [], f"round {v}: load_weights got bytes never sent: {r['wrong']}"
        assert r["bad"] == [], (v, r)
        if r["error"] is None:
            assert r["version"] == v and trainer[v - 1] is None
            kept = v
        else:  # a typed failure is allowed; the last version is kept
            assert r["error"] in TYPED and r["version"] == kept, (v, r)
    assert rounds[3]["error"] is None and rounds[3]["version"] == 4  # the next round commits


# ---- untrusted shared memory: a write while the sender packs -------------------------------

PACK_KINDS = ("nocast", "cast")
FLIPS: dict[str, list[int]] = {}  # in the trainer process: writes into the window, per kind


def _pack_trainer(ports: list[int]) -> dict[str, Any]:
    from deltackpt import sync
    from deltackpt.sync import wire

    res = {}
    for kind, port in zip(PACK_KINDS, ports, strict=True):
        group = _group(port, 0, 2, [0], "shm")
        sender = sync.WeightSender(group, bucket_bytes=SHM_BUCKET)
        sender.push(shm_state(1), version=1)
        real_pack, real_copy = wire.pack, wire.copy_into
        flips = FLIPS[kind] = [0]

        def pack_then_write(
            src: Any, dst: torch.Tensor, *a: Any, real_pack: Any = real_pack, **kw: Any
        ) -> Any:
            d = real_pack(src, dst, *a, **kw)  # no cast: hashed from the source, then copied
            if dst.numel():
                dst[0] ^= 0xFF
                FLIPS["nocast"][0] += 1
            return d

        def copy_then_write(
            dst: torch.Tensor, src: torch.Tensor, real_copy: Any = real_copy
        ) -> None:
            real_copy(dst, src)  # cast path: a chunk copied into the window, not yet hashed
            raw = dst.view(-1).view(torch.uint8)
            if raw.numel():
                raw[0] ^= 0xFF
                FLIPS["cast"][0] += 1

        if kind == "nocast":
            wire.pack = pack_then_write  # type: ignore[assignment]
        else:
            wire.copy_into = copy_then_write  # type: ignore[assignment]
        out: list[Any] = []
        try:
            sender.push(shm_state(2), version=2, full=True)
            out.append(None)
        except sync.SyncError as e:
            out.append(type(e).__name__)
        wire.pack, wire.copy_into = real_pack, real_copy  # type: ignore[assignment]
        out.append((sender.version, flips[0]))
        out.append(sender.push(shm_state(3), version=3).version)
        group.pg.barrier().wait()
        group.close()
        res[kind] = out
    return res


def _pack_receiver(ports: list[int]) -> dict[str, Any]:
    from deltackpt import sync

    res = {}
    for kind, port in zip(PACK_KINDS, ports, strict=True):
        group = _group(port, 1, 2, [0], "shm")
        spec = None if kind == "nocast" else torch.bfloat16  # bf16: the sender casts
        receiver = sync.WeightReceiver(group, dtype=spec, bucket_bytes=SHM_BUCKET)
        sink = Sink()
        receiver.pull(sink)
        kept = {n: t.clone() for n, t in sink.state.items()}
        out: list[Any] = []
        sink.want = cast(shm_state(2), spec)
        try:
            receiver.pull(sink)
            out.append(None)
        except sync.SyncError as e:
            out.append(type(e).__name__)
        out.append((receiver.version, sink.wrong, differ(sink.state, kept)))
        sink.want, sink.wrong = cast(shm_state(3), spec), []
        receiver.pull(sink)
        out.append((receiver.version, sink.wrong, differ(sink.state, sink.want)))
        group.pg.barrier().wait()
        group.close()
        res[kind] = out
    return res


@pytest.fixture(scope="module")
def packing() -> list[Any]:
    ports = [free_port() for _ in PACK_KINDS]
    outs = spawn(
        [(_pack_trainer, (ports,)), (_pack_receiver, (ports,))], timeout=90, fast_exit=True
    )
    return [o.unwrap() for o in outs]


def _check_packing(values: list[Any], kind: str) -> None:
    trainer, rec = (v[kind] for v in values)
    assert trainer[1][1] > 0  # the window was written
    assert rec[1][1] == [], f"load_weights got bytes the trainer never sent: {rec[1][1]}"
    assert rec[0] == "DigestMismatchError", rec[0]  # flipped bytes always mismatch
    assert rec[1] == (1, [], [])  # version 1 kept, the model untouched
    assert trainer[0] == "RoundAbortedError" and trainer[1][0] == 1
    assert trainer[2] == 3 and rec[2] == (3, [], [])


def test_window_written_while_the_sender_packs_is_detected(packing: list[Any]) -> None:
    _check_packing(packing, "nocast")


def test_window_written_while_the_sender_casts_is_detected(packing: list[Any]) -> None:
    _check_packing(packing, "cast")


# ---- a shm wait is bounded when no sender comes ---------------------------------------------

WAIT_TIMEOUT = 2.0


def _silent_trainer(port: int, marks: str) -> None:
    from deltackpt import sync

    group = _group(port, 0, 2, [0], "shm", timeout=WAIT_TIMEOUT)
    sync.WeightSender(group, bucket_bytes=4096).push({"w": torch.ones(4)}, version=1)
    deadline = time.monotonic() + 30  # alive and beating, but never pushes round 2
    while not Path(marks, "done").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    group.close()


def _waiting_receiver(port: int, marks: str) -> dict[str, Any]:
    from deltackpt import sync

    group = _group(port, 1, 2, [0], "shm", timeout=WAIT_TIMEOUT)
    receiver = sync.WeightReceiver(group, bucket_bytes=4096)
    receiver.pull()
    t0 = time.monotonic()
    out: dict[str, Any] = {}
    try:
        receiver.pull()
        out["error"] = None
    except sync.SyncError as e:
        out["error"] = _err(e)
    out["seconds"] = time.monotonic() - t0
    out["broken"] = group.broken
    out["version"] = receiver.version
    Path(marks, "done").touch()
    group.close()
    return out


def test_shm_wait_is_bounded_without_a_sender(tmp_path: Path) -> None:
    port = free_port()
    outs = spawn(
        [(_silent_trainer, (port, str(tmp_path))), (_waiting_receiver, (port, str(tmp_path)))],
        timeout=60,
        fast_exit=True,
    )
    outs[0].unwrap()
    r = outs[1].unwrap()
    assert r["error"] is not None and r["error"][0] in ("SyncTimeoutError", "PeerLostError"), r
    assert "not published within 2 s" in r["error"][1], r["error"]
    # bounded by its timeout: not before it, and not much after (a busy machine adds seconds)
    assert WAIT_TIMEOUT <= r["seconds"] < WAIT_TIMEOUT + 15, r["seconds"]
    assert r["broken"] and r["version"] == 1


# ---- a sender killed mid-round on shm links (test_fail covers gloo) ------------------------

KILL_WORLD = 3  # trainer 0 (it hosts the store), receivers 1 and 2


def kill_state(v: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(v)
    return {f"layer{i}.weight": torch.randn(24, 32, generator=g) for i in range(4)}


def _kill_trainer(port: int) -> None:
    from deltackpt import sync
    from deltackpt.sync import packer as packer_mod

    group = _group(port, 0, KILL_WORLD, [0], "shm")
    sender = sync.WeightSender(group, bucket_bytes=2048)
    sender.push(kill_state(1), version=1)
    # every receiver has finished round 1 (its vote read back from this process's store) before
    # this process dies in round 2: else a receiver still polling round 1's vote loses the store
    # there, fails round 1 with PeerLostError and never gets to round 2 (seen under load)
    group.pg.barrier().wait()
    pack = packer_mod.Packer.message
    count = [0]

    def dying(*args: Any, **kw: Any) -> Any:
        count[0] += 1
        if count[0] == 5:  # several buckets are published: the crash is mid-round
            os._exit(17)
        return pack(*args, **kw)

    packer_mod.Packer.message = dying  # type: ignore[method-assign]
    sender.push(kill_state(2), version=2, full=True)
    raise AssertionError("unreachable: the sender should have died")


def _kill_receiver(rank: int, port: int, port2: int, marks: str) -> dict[str, Any]:
    from deltackpt import sync

    group = _group(port, rank, KILL_WORLD, [0], "shm")
    module = torch.nn.Module()
    for i in range(4):
        module.add_module(f"layer{i}", torch.nn.Linear(32, 24, bias=False))
    adapter = sync.ModuleAdapter(module)
    receiver = sync.WeightReceiver(group, bucket_bytes=2048)

    def bad(v: int) -> list[str]:
        sd = module.state_dict()
        return sorted(n for n, t in kill_state(v).items() if not torch.equal(sd[n], t))

    receiver.pull(adapter)
    group.pg.barrier().wait()  # round 1 is over on every rank (see _kill_trainer)
    out: dict[str, Any] = {"v1_bad": bad(1)}
    t0 = time.monotonic()
    try:
        receiver.pull(adapter)
        out["error"] = None
    except sync.SyncError as e:
        out["error"] = _err(e)
    out["seconds_to_error"] = time.monotonic() - t0
    out["version_after_failure"] = receiver.version
    out["bad_after_failure"] = bad(1)  # nothing applied
    Path(marks, f"reconnect-{rank}").touch()  # the replacement joins now, not before
    group.reconnect(port2)
    adapter.reset()
    out["stats"] = receiver.pull(adapter)
    out["version"] = receiver.version
    out["bad"] = bad(2)
    out["complete"] = adapter.coverage().complete
    group.pg.barrier().wait()
    group.close()
    return out


def _kill_replacement(port2: int, marks: str) -> dict[str, Any]:
    from deltackpt import sync

    # a replacement started as the survivors reconnect (its store waits the group timeout for
    # them: on a busy machine the first rounds and the failure can take longer than that)
    for rank in (1, 2):
        _wait_for(Path(marks, f"reconnect-{rank}"), 90)
    group = _group(port2, 0, KILL_WORLD, [0], "shm")
    st = sync.WeightSender(group, bucket_bytes=2048).push(kill_state(2), version=2)
    group.pg.barrier().wait()
    group.close()
    return {"stats": st}


@pytest.mark.slow
def test_sender_killed_mid_round_on_shm_links(tmp_path: Path) -> None:
    port, port2 = free_port(), free_port()
    marks = str(tmp_path)
    outcomes: list[Outcome] = spawn(
        [
            (_kill_trainer, (port,)),
            (_kill_receiver, (1, port, port2, marks)),
            (_kill_receiver, (2, port, port2, marks)),
            (_kill_replacement, (port2, marks)),
        ],
        timeout=120,
        fast_exit=True,
    )
    assert outcomes[0].exitcode == 17 and not outcomes[0].reported
    for o in outcomes[1:3]:  # a receiver's own failure first: the replacement waits for them
        o.unwrap()
    new = outcomes[3].unwrap()["stats"]
    assert new.full and new.version == 2
    for o in outcomes[1:3]:
        r = o.unwrap()
        assert r["v1_bad"] == []
        assert r["error"] is not None and r["error"][0] == "PeerLostError", r["error"]
        assert r["seconds_to_error"] < 10  # detected, not the 30 s group timeout
        assert r["version_after_failure"] == 1 and r["bad_after_failure"] == []
        assert r["stats"].full and r["version"] == 2 and r["bad"] == [] and r["complete"]


# ---- a hostile process scribbles the link windows while rounds run -------------------------

SCRIBBLE_WORLD = 3  # trainer 0, receivers 1 and 2
SCRIBBLE_ROUNDS = 12


def _scribble_state(v: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(v)
    return {f"w{i}": torch.randn(3000 + 7 * i, generator=g) for i in range(6)}


def _scribbler(marks: str, seconds: float) -> int:
    """Map every receiver's link file as soon as it is announced, flip random bytes in their
    bucket slots until ``stop`` appears (not in the cells: a flipped cell only stalls a round
    into the timeout or fails it as a lost peer; the slots are what could become weights)."""
    import numpy as np

    deadline = time.monotonic() + seconds
    views = []
    for r in range(1, SCRIBBLE_WORLD):
        mark = Path(marks, f"link-{r}")
        _wait_for(mark, seconds)
        path, cells = mark.read_text().split()
        fd = os.open(path, os.O_RDWR)
        mm = mmap.mmap(fd, os.path.getsize(path))
        os.close(fd)
        views.append(np.frombuffer(mm, np.uint8)[int(cells) :])
    rng = np.random.default_rng(0)
    flips = 0
    Path(marks, "scribbling").touch()
    while not Path(marks, "stop").exists() and time.monotonic() < deadline:
        data = views[flips % len(views)]
        pos = rng.integers(0, data.size, 2)
        data[pos] ^= 0xFF
        flips += 1
        time.sleep(rng.uniform(0, 0.002))
    Path(marks, "stopped").touch()  # no flip after this: the last round must commit
    return flips


def _scribble_rank(rank: int, port: int, marks: str) -> dict[str, Any]:
    from deltackpt import sync

    group = _group(port, rank, SCRIBBLE_WORLD, [0], "shm")
    if rank == 0:
        sender = sync.WeightSender(group, bucket_bytes=SHM_BUCKET)
        versions: list[Any] = []
        for v in range(1, SCRIBBLE_ROUNDS + 2):
            if v == 2:  # the link files exist since round 1: wait until someone scribbles
                _wait_for(Path(marks, "scribbling"), 60)
            if v == SCRIBBLE_ROUNDS + 1:  # last round: once the scribbler has stopped (a
                Path(marks, "stop").touch()  # fixed wait let a busy machine's scribbler on)
                _wait_for(Path(marks, "stopped"), 60)
            try:
                versions.append(sender.push(_scribble_state(v), version=v, full=True).version)
            except sync.SyncError as e:
                versions.append(type(e).__name__)
            # rounds in lockstep: a failed round ends for the trainer before every receiver
            # copied its slots (test_failed_round_on_shm_does_not_strand_a_slower_receiver)
            group.pg.barrier().wait()
        group.pg.barrier().wait()
        group.close()
        return {"versions": versions}
    receiver = sync.WeightReceiver(group, bucket_bytes=SHM_BUCKET)
    sink = Sink()
    rounds = []
    for v in range(1, SCRIBBLE_ROUNDS + 2):
        sink.want, sink.wrong, sink.calls = _scribble_state(v), [], []
        try:
            receiver.pull(sink)
            err = None
        except sync.SyncError as e:
            err = type(e).__name__
        if v == 1:
            cells = -(-len(receiver._buckets) * 16 // 4096) * 4096
            # whole or absent: the scribbler polls for the name and reads it at once (a plain
            # write_text let it read an empty file on a busy machine, and it died)
            tmp = Path(marks, f".link-{rank}")
            tmp.write_text(f"{group._shm.path(0, rank)} {cells}")
            os.replace(tmp, Path(marks, f"link-{rank}"))
        rounds.append(
            {
                "error": err,
                "wrong": sink.wrong,
                "version": receiver.version,
                "complete": err is not None
                or sorted(n for c in sink.calls for n in c) == sorted(sink.want),
            }
        )
        group.pg.barrier().wait()
    group.pg.barrier().wait()
    group.close()
    return {"rounds": rounds}


@pytest.mark.slow
def test_hostile_process_scribbling_the_link_windows(tmp_path: Path) -> None:
    port = free_port()
    outcomes = spawn(
        [(_scribble_rank, (r, port, str(tmp_path))) for r in range(SCRIBBLE_WORLD)]
        + [(_scribbler, (str(tmp_path), 60.0))],
        timeout=120,
        fast_exit=True,
    )
    assert outcomes[3].unwrap() > 0  # first: a dead scribbler is why the trainer waited
    versions = outcomes[0].unwrap()["versions"]
    for o in outcomes[1:3]:
        rounds = o.unwrap()["rounds"]
        last = None
        for v, r in enumerate(rounds, start=1):
            assert r["wrong"] == [], f"rank {o.index} round {v}: wrong bytes {r['wrong']}"
            if r["error"] is None:
                assert r["version"] == v and r["complete"] and versions[v - 1] == v
                last = v
            else:
                assert r["error"] in TYPED, r
                assert r["version"] == last and versions[v - 1] == "RoundAbortedError"
        assert rounds[-1]["error"] is None  # once the writer stopped, rounds commit again

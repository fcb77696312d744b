"""Weight sync in one process: what the deleted broadcast-engine tests (test_sync_local.py,
test_sync_plan.py) promised that still applies to the one engine.

ModuleAdapter copies in place and reports coverage; roles are checked (a trainer rank cannot
build a :class:`~deltackpt.sync.WeightReceiver`, an inference rank no
:class:`~deltackpt.sync.WeightSender`); bad arguments and bad plans raise typed errors that name
the problem. The two-rank cases run both ranks of a real :class:`~deltackpt.sync.SyncGroup` as
threads of this process (gloo and the store on 127.0.0.1).
"""

from __future__ import annotations

import json
import math
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

from deltackpt import sync
from deltackpt.errors import InvalidArgumentError
from deltackpt.sync.dtypes import wire_dtype
from deltackpt.sync.schedule import build_schedule
from deltackpt.sync.schedule_decl import Decl, Held, expand_every, held_from
from tests._dist import free_port
from tests.sync._common import local_pair, run_threads

TIMEOUT = 10.0


@pytest.fixture
def pair() -> Iterator[tuple[sync.SyncGroup, sync.SyncGroup]]:
    """A trainer (rank 0) and an inference rank (rank 1) of one group, in this process."""
    with local_pair(TIMEOUT) as groups:
        yield groups


# ---- roles and constructor arguments -------------------------------------------------------


def test_a_pid_is_looked_up_only_where_it_means_that_process(
    pair: tuple[sync.SyncGroup, sync.SyncGroup],
) -> None:
    """A peer is taken for dead by its pid only where the pid means that process: the same
    kernel and pid namespace. Two containers run with ``--network host`` share the host name
    but number their processes each their own way."""
    from deltackpt.sync.peers import pid_space

    trainer, _ = pair
    here = pid_space()
    assert here.count("/pid:[") == 1 and here == trainer._space
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)  # fmt: skip
    dead, host = int(gone.stdout), socket.gethostname()
    mine = trainer.store.get("pid/1")

    def posted(value: object) -> bool:
        trainer.store.set("pid/1", value if isinstance(value, bytes) else json.dumps(value))
        trainer._pids.clear()
        return trainer.alive(1)

    try:
        assert not posted([host, dead, here])  # here, and gone
        assert posted([host, dead, "another-boot/pid:[4026531836]"])  # same name, not here
        assert posted(["elsewhere", dead, ""])  # no pid space posted: the host name decides
        assert not posted([host, dead, ""])
        with pytest.raises(sync.SyncError, match=r"not \[host, pid, pid space\]"):
            posted(f"{host}:{dead}".encode())  # a rank of another deltackpt
    finally:
        trainer.store.set("pid/1", mine)
        trainer._pids.clear()
    assert trainer.alive(1) and trainer.pid_of(1) == (host, json.loads(mine)[1])


def test_roles_are_checked(pair: tuple[sync.SyncGroup, sync.SyncGroup]) -> None:
    trainer, inference = pair
    with pytest.raises(sync.SyncError, match="not a trainer"):
        sync.WeightSender(inference)
    with pytest.raises(sync.SyncError, match="is a trainer"):
        sync.WeightReceiver(trainer)
    with pytest.raises(sync.SyncError, match="is a trainer"):
        sync.WeightReceiver(trainer, [sync.Want("w")])
    # the right roles construct, with the link's bucket size where given none (the same on
    # both ends, as the plan's check wants): 64 MiB on gloo and shm, 256 MiB on ipc links
    assert sync.WeightSender(trainer).bucket_bytes == 64 << 20
    assert sync.WeightReceiver(inference).bucket_bytes == 64 << 20
    assert sync.WeightReceiver(inference, bucket_bytes=1 << 20).bucket_bytes == 1 << 20
    from deltackpt.sync.group import default_bucket_bytes

    assert [default_bucket_bytes(k) for k in ("gloo", "shm", "ipc")] == [64 << 20] * 2 + [256 << 20]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"links": "nccl"}, "choose 'auto'"),
        ({"trainers": []}, "need at least one trainer"),
        ({"trainers": [0, 1]}, "need at least one trainer and one inference rank"),
        ({"trainers": [2]}, "all in range"),
        ({"rank": 2}, r"SyncGroup\(rank=2\): expected an int in 0..1 \(world_size=2\)"),
        ({"rank": -1}, r"rank=-1\): expected an int in 0..1"),
        ({"rank": True}, r"rank=True\): expected an int"),
        ({"world_size": 1}, r"world_size=1\): expected an int >= 2"),
        ({"master_port": 0}, r"master_port=0\): expected a port in 1..65535"),
        ({"master_port": "29500"}, r"master_port='29500'\): expected an int"),
        ({"master_addr": ""}, r"master_addr=''\): expected a host name"),
        ({"timeout": 0}, r"timeout=0\): expected a number of seconds > 0"),
        ({"timeout": float("nan")}, r"timeout=nan\)"),
        ({"join_timeout": -1}, r"join_timeout=-1\): expected None or a number"),
        ({"beat": 1.0, "dead_after": 0.5}, r"dead_after=0.5\): expected more than beat=1.0"),
        ({"ipc_buckets": 1}, r"ipc_buckets=1: expected None"),
    ],
)
def test_bad_group_arguments_raise_before_connecting(kwargs: dict[str, Any], match: str) -> None:
    """Named, typed (a PlanError: also an InvalidArgumentError, as every bad argument of
    deltackpt) and at once: a rank out of range used to wait out join_timeout (60 s) on a
    group it could never join, then say it could not join."""
    args: dict[str, Any] = {"master_addr": "127.0.0.1", "master_port": free_port(), "rank": 0,
                            "world_size": 2, "trainers": [0], "timeout": 1.0, **kwargs}  # fmt: skip
    t0 = time.monotonic()
    with pytest.raises(sync.PlanError, match=match) as e:
        # a port nobody listens on: the arguments are checked before any connection
        sync.SyncGroup(**args)
    assert isinstance(e.value, InvalidArgumentError) and isinstance(e.value, ValueError)
    assert time.monotonic() - t0 < 10  # not a join that timed out


def test_a_bad_reconnect_port_leaves_the_group_as_it_is(
    pair: tuple[sync.SyncGroup, sync.SyncGroup],
) -> None:
    trainer, inference = pair
    for bad in (0, "29500", 70000, None):
        with pytest.raises(sync.PlanError, match=r"reconnect\(master_port=.*the group was left"):
            trainer.reconnect(bad)  # type: ignore[arg-type]
    assert trainer.epoch == 0
    s, r = sync.WeightSender(trainer), sync.WeightReceiver(inference)  # still one group
    out = run_threads(lambda: s.push({"w": torch.ones(4)}, version=1), r.pull)
    assert not any(isinstance(o, BaseException) for o in out), out
    assert r.version == 1


def test_a_numpy_rank_and_port_are_integers() -> None:
    from deltackpt.sync.group import check_group_args

    check_group_args("127.0.0.1", np.int64(29500), np.int32(1), np.int64(2), 60.0, None, 0.2, 3.0)


def test_bad_sender_arguments(pair: tuple[sync.SyncGroup, sync.SyncGroup]) -> None:
    trainer, _ = pair
    with pytest.raises(sync.SyncError, match="choose 'hash' or 'version'"):
        sync.WeightSender(trainer, detect="sometimes")


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"bucket_bytes": "64M"}, r"\(bucket_bytes='64M'\): expected None .* an int of bytes"),
        ({"bucket_bytes": 32}, r"\(bucket_bytes=32\): expected .* >= align=64"),
        ({"bucket_bytes": 1.5e6}, r"\(bucket_bytes=1500000.0\)"),
        ({"align": 100}, r"\(align=100\): expected a power of two >= 16"),
        ({"align": 8}, r"\(align=8\)"),
    ],
)
def test_sizes_are_checked_where_they_are_given(
    pair: tuple[sync.SyncGroup, sync.SyncGroup], kwargs: dict[str, Any], match: str
) -> None:
    """Not only at the first round (where every rank's must also agree)."""
    trainer, inference = pair
    with pytest.raises(sync.PlanError, match="WeightSender" + match):
        sync.WeightSender(trainer, **kwargs)
    with pytest.raises(sync.PlanError, match="WeightReceiver" + match):
        sync.WeightReceiver(inference, **kwargs)
    with pytest.raises(sync.PlanError, match=r"zero_copy_min='big'\): expected None"):
        sync.WeightSender(trainer, zero_copy_min="big")
    with pytest.raises(sync.PlanError, match=r"apply_threads=0\): expected None"):
        sync.WeightReceiver(inference, apply_threads=0)


def test_a_dtype_is_checked_where_it_is_given_and_may_be_named(
    pair: tuple[sync.SyncGroup, sync.SyncGroup],
) -> None:
    """dtype="bfloat16" (vLLM's spelling) used to fail the first round's setup on that rank with
    "'str' object is not callable", the other rank told only that the setup failed there."""
    trainer, inference = pair
    for name in ("bfloat16", "torch.bfloat16", "bf16", " bf16 "):
        assert sync.WeightSender(trainer, dtype=name).dtype is torch.bfloat16
    assert sync.WeightReceiver(inference, dtype="half").dtype is torch.float16
    assert sync.WeightReceiver(inference, dtype=torch.float32).dtype is torch.float32
    keep = sync.WeightSender(trainer, dtype=lambda n, d: None).dtype
    assert callable(keep) and sync.WeightSender(trainer).dtype is None
    for bad in ("bfloat", "int8", torch.int8, 16):
        with pytest.raises(
            sync.PlanError, match=r"WeightSender\(dtype=.*expected None, a floating"
        ):
            sync.WeightSender(trainer, dtype=bad)
        with pytest.raises(InvalidArgumentError, match=r"WeightReceiver\(dtype="):
            sync.WeightReceiver(inference, dtype=bad)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"name": ""}, r"Want\(name=''\): expected the tensor's name"),
        ({"into": [1, 2]}, r"Want\('w', into=\[1, 2\]\): expected None or the tensor .*got list"),
        ({"box": (0, 4)}, r"box=\(0, 4\)\): expected None \(the whole tensor\) or a Box"),
        ({"dtype": "bfloat"}, r"dtype='bfloat'\): expected None, a torch dtype or its name"),
        ({"source": 3}, r"source=3\): expected None or a trainer tensor's name"),
    ],
)
def test_a_bad_want_is_refused_where_it_is_made(kwargs: dict[str, Any], match: str) -> None:
    """Not at the first round: Want("w", into=[1, 2]) failed there with an AttributeError."""
    with pytest.raises(sync.PlanError, match=match):
        sync.Want(**{"name": "w", **kwargs})
    assert sync.Want("w", dtype="int8").dtype is torch.int8  # a name is its dtype


def test_bucket_bytes_must_agree_on_every_rank(
    pair: tuple[sync.SyncGroup, sync.SyncGroup],
) -> None:
    trainer, inference = pair
    sender = sync.WeightSender(trainer, bucket_bytes=4096)
    receiver = sync.WeightReceiver(inference, bucket_bytes=8192)
    errs = run_threads(
        lambda: sender.push({"w": torch.ones(4)}, version=1), lambda: receiver.pull()
    )
    for e in errs:
        assert isinstance(e, sync.PlanError), repr(e)
        assert "bucket_bytes/align" in str(e) and "pass the same values" in str(e)


def test_shard_box_rejects_bad_arguments() -> None:
    with pytest.raises(sync.PlanError, match="shard_box"):
        sync.shard_box((4, 4), 2, 0, 2)  # no dim 2
    with pytest.raises(sync.PlanError, match="shard_box"):
        sync.shard_box((4, 4), 0, 2, 2)  # index out of range


# ---- plan errors name the tensor and the fix (was test_sync_plan.py) ----------------------


def _decl(rank: int, held: list[Held]) -> Decl:
    return Decl(rank, True, held=tuple(held))


def _everything(trainers: list[Decl], rank: int) -> Decl:
    return expand_every(Decl(rank, False, every=True), trainers, None)


def test_plan_errors_name_the_tensor_and_the_fix() -> None:
    with pytest.raises(sync.PlanError, match="'w' appears twice"):
        held_from([("w", torch.ones(2)), ("w", torch.ones(2))])
    with pytest.raises(sync.PlanError, match="unknown dtype 'float99'"):
        wire_dtype("float99")
    t = _decl(0, [Held("w", "float32", (8,), sync.Box((6,), (4,)))])
    with pytest.raises(sync.PlanError, match=r"'w'.*does not fit in shape \[8\]"):
        build_schedule([t, _everything([t], 1)], bucket_bytes=4096, align=64)
    ok = _decl(0, [Held("w", "float32", (8,), sync.Box((0,), (8,)))])
    with pytest.raises(sync.PlanError, match="power of two"):
        build_schedule([ok, _everything([ok], 1)], bucket_bytes=4096, align=100)
    twice = _decl(0, [*ok.held, *ok.held])
    with pytest.raises(sync.PlanError, match="declares 'w' twice"):
        build_schedule([twice, _everything([ok], 1)], bucket_bytes=4096, align=64)


def _coverage(sched: Any, rank: int) -> None:
    """Every element of every wanted box arrives exactly once."""
    pieces: dict[int, list[Any]] = {}
    for link in sched.links_of(rank):
        for b in link.buckets:
            for p in b.pieces:
                pieces.setdefault(p.tensor, []).append(p)
    for w, ti, box in sched.wanted[rank]:
        hits = np.zeros(box.size, dtype=np.int64)
        for p in pieces.get(ti, []):
            hits[p.box.within(box)] += 1
        assert (hits == 1).all(), w.name


def test_uneven_empty_and_scalar_tensors_are_planned() -> None:
    """Uneven shards (3 + 2 rows), a shard that is empty on one trainer, an empty tensor and a
    scalar: every element planned exactly once, for a receiver that wants everything."""
    shapes = {"odd": (5, 3), "z": (1, 4), "e": (0, 2), "s": ()}
    decls = []
    for r in (0, 1):
        held = []
        for name, shape in shapes.items():
            box = sync.shard_box(shape, 0, r, 2) if shape else sync.Box((), ())
            held.append(Held(name, "float32", shape, box))
        decls.append(_decl(r, held))
    assert decls[1].held[1].box.numel == 0  # rank 1's shard of z is empty
    sched = build_schedule([*decls, _everything(decls, 2)], bucket_bytes=4096, align=64)
    _coverage(sched, 2)
    assert sched.wanted_bytes(2) == 4 * (15 + 4 + 0 + 1)


def test_many_tiny_tensors_share_buckets() -> None:
    held, _ = held_from({f"t{i}": torch.ones(1) for i in range(1000)})
    t = _decl(0, held)
    sched = build_schedule([t, _everything([t], 1)], bucket_bytes=4096, align=64)
    _coverage(sched, 1)
    (link,) = sched.links_of(1)
    assert len(link.buckets) <= math.ceil(1000 * 64 / 4096) + 1  # not one bucket per tensor
    assert all(b.capacity <= 4096 for b in link.buckets)


# ---- ModuleAdapter -------------------------------------------------------------------------


class Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(5, 4)
        self.proj = torch.nn.Linear(4, 4).to(torch.bfloat16)
        self.head = torch.nn.Linear(4, 5, bias=False)
        self.head.weight = self.embed.weight  # tied
        self.register_buffer("steps", torch.zeros(2, dtype=torch.int64))


def test_module_adapter_copies_in_place_and_reports_coverage() -> None:
    m = Tiny()
    params_before = dict(m.named_parameters())
    adapter = sync.ModuleAdapter(
        m, name_map={"model.embed_tokens.weight": "embed.weight", "rotary.inv_freq": None}
    )
    w = torch.randn(5, 4)
    adapter(
        [
            ("model.embed_tokens.weight", w),
            ("proj.weight", torch.ones(4, 4)),
            ("rotary.inv_freq", torch.ones(2)),
            ("extra", torch.ones(1)),
        ]
    )
    assert torch.equal(m.embed.weight, w) and m.head.weight is m.embed.weight
    assert m.proj.weight.dtype == torch.bfloat16
    assert torch.equal(m.proj.weight, torch.ones(4, 4).bfloat16())  # cast by copy_
    assert all(p is params_before[n] for n, p in m.named_parameters())  # in place
    assert m.embed.weight.grad is None  # under no_grad: no autograd history
    cov = adapter.coverage()
    assert set(cov.loaded) == {"embed.weight", "head.weight", "proj.weight"}  # tied: both names
    assert set(cov.missing) == {"proj.bias", "steps"}
    assert cov.unexpected == ("extra",) and cov.skipped == ("rotary.inv_freq",)
    assert not cov.complete
    adapter.reset()
    assert adapter.coverage().loaded == ()
    assert adapter.load_weights == adapter.__call__


def test_module_adapter_errors() -> None:
    m = Tiny()
    with pytest.raises(sync.SyncError, match=r"shape \[3\].*'proj.bias' has shape \[4\]"):
        sync.ModuleAdapter(m)([("proj.bias", torch.ones(3))])
    with pytest.raises(sync.SyncError, match="no such parameter"):
        sync.ModuleAdapter(m, strict=True)([("nope", torch.ones(1))])
    adapter = sync.ModuleAdapter(m, name_map=lambda n: n.removeprefix("model."))
    adapter([("model.steps", torch.tensor([3, 4]))])
    assert m.steps.tolist() == [3, 4]
    no_buffers = sync.ModuleAdapter(m, buffers=False)
    no_buffers([("steps", torch.tensor([5, 6]))])
    assert m.steps.tolist() == [3, 4] and no_buffers.coverage().unexpected == ("steps",)


def test_the_same_tensors_again_skip_the_check_but_a_moved_one_is_seen(
    pair: tuple[sync.SyncGroup, sync.SyncGroup],
) -> None:
    """A push of the very tensors of the last one skips their check (the per-tensor host work
    of a round); written in place, their new bytes go; a tensor whose storage was swapped
    (``param.data = ...``) is read where it is now; one of another shape is refused."""
    g0, g1 = pair
    sender = sync.WeightSender(g0, bucket_bytes=4096)
    receiver = sync.WeightReceiver(g1, bucket_bytes=4096)
    w = torch.nn.Parameter(torch.zeros(64), requires_grad=False)
    state = {"w": w, "b": torch.ones(8)}

    def round_(v: int) -> dict[str, torch.Tensor]:
        got: dict[str, torch.Tensor] = {}
        out = run_threads(
            lambda: sender.push(state, version=v),
            lambda: receiver.pull(lambda ws: got.update((n, t.clone()) for n, t in ws)),
        )
        for o in out:
            if isinstance(o, BaseException):
                raise o
        return got

    round_(1)
    w.data[3] = 5.0  # in place: the same storage
    assert round_(2)["w"][3] == 5.0
    assert sender._same_tensors(state)
    w.data = torch.full((64,), 7.0)  # swapped: the same Parameter, another storage
    assert not sender._same_tensors(state)
    assert torch.equal(round_(3)["w"], torch.full((64,), 7.0))
    assert sender._same_tensors(state)  # remembered again after the check
    w.data = torch.zeros(32)
    with pytest.raises(sync.PlanError, match="different tensors"):
        sender.push(state, version=4)


def test_a_parameter_moved_between_rounds_is_written_where_it_is_now(
    pair: tuple[sync.SyncGroup, sync.SyncGroup],
) -> None:
    """The receiver keeps each piece's view of its ``into`` parameter from round to round; a
    parameter whose storage was swapped (``param.data = ...``) gets the next round's bytes in
    its new storage, the old one left alone. A box of a larger tensor too."""
    g0, g1 = pair
    sender = sync.WeightSender(g0, bucket_bytes=4096)
    p = torch.nn.Parameter(torch.zeros(64), requires_grad=False)
    rows = torch.nn.Parameter(torch.zeros(4, 8), requires_grad=False)
    wants = [
        sync.Want("w", into=p),
        sync.Want("m", box=sync.Box((2, 0), (2, 8)), into=rows[2:]),
    ]
    receiver = sync.WeightReceiver(g1, wants, bucket_bytes=4096)
    state = {"w": torch.zeros(64), "m": torch.zeros(4, 8)}

    def round_(v: int, full: bool = False) -> None:
        state["w"].fill_(float(v))
        state["m"].fill_(float(v))
        out = run_threads(lambda: sender.push(state, version=v, full=full), lambda: receiver.pull())
        for o in out:
            if isinstance(o, BaseException):
                raise o

    round_(1)
    assert torch.equal(p, torch.full((64,), 1.0)) and torch.equal(rows[2:], torch.full((2, 8), 1.0))
    old = p.data
    p.data = torch.zeros(64)  # swapped
    round_(2, full=True)
    assert torch.equal(p, torch.full((64,), 2.0))
    assert torch.equal(old, torch.full((64,), 1.0))  # the old storage left alone
    assert torch.equal(rows[:2], torch.zeros(2, 8)) and torch.equal(
        rows[2:], torch.full((2, 8), 2.0)
    )
    round_(3)
    assert torch.equal(p, torch.full((64,), 3.0)) and torch.equal(old, torch.full((64,), 1.0))


def test_a_bucket_that_fails_packing_while_others_pack_ahead_fails_the_round_cleanly(
    pair: tuple[sync.SyncGroup, sync.SyncGroup], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Host rounds pack two buckets at once (``DELTACKPT_PACK_THREADS``): when one in the
    middle fails, the buckets packed beside it are waited for and not sent, the sender names
    the bucket, the receiver applies nothing and keeps its version, and the next round works."""
    from deltackpt import options
    from deltackpt.sync import packer

    g0, g1 = pair
    with options.overrides(DELTACKPT_PACK_THREADS="2"):  # the default, whatever the environment
        send = sync.WeightSender(g0, bucket_bytes=4096, zero_copy_min=None)
    assert send.pack_threads == 2
    recv = sync.WeightReceiver(g1, bucket_bytes=4096)
    state = {f"w{i}": torch.full((900,), float(i)) for i in range(8)}  # one bucket each
    got: dict[str, torch.Tensor] = {}

    def round_(v: int) -> list[Any]:
        return run_threads(
            lambda: send.push(state, version=v),
            lambda: recv.pull(lambda ws: got.update((n, t.clone()) for n, t in ws)),
        )

    assert not any(isinstance(o, BaseException) for o in round_(1))
    real = packer.Packer.message

    def flaky(self: Any, sched: Any, bk: Any, *args: Any) -> Any:
        if bk.index == 3:
            raise OSError("simulated read failure")
        return real(self, sched, bk, *args)

    monkeypatch.setattr(packer.Packer, "message", flaky)
    for t in state.values():
        t += 1
    got.clear()
    out = round_(2)
    assert isinstance(out[0], sync.SyncError) and "failed packing bucket 3" in str(out[0])
    assert isinstance(out[1], sync.RoundAbortedError)
    assert got == {} and recv.version == 1
    monkeypatch.setattr(packer.Packer, "message", real)
    assert not any(isinstance(o, BaseException) for o in round_(3))
    assert recv.version == 3 and all(torch.equal(got[n], t) for n, t in state.items())

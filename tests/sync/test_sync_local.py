"""Weight sync in one process: ranks are threads sharing a ShmTransport segment.

The protocol and the failure paths behave the same as between processes (tests in
test_sync_multiproc.py), and these run in a fraction of a second each.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

import pytest
import torch

from deltackpt import sync

TIMEOUT = 10.0


@pytest.fixture
def shm_name() -> Iterator[str]:
    name = f"local-{uuid.uuid4().hex[:12]}"
    yield name
    sync.ShmTransport.unlink(name)


def run_threads(*fns: Callable[[], Any], timeout: float = 30.0) -> list[Any]:
    """Run each function in a thread; return values or the exceptions they raised."""
    out: list[Any] = [None] * len(fns)

    def wrap(i: int, fn: Callable[[], Any]) -> None:
        try:
            out[i] = fn()
        except BaseException as e:  # returned to the test, which asserts on it
            out[i] = e

    threads = [threading.Thread(target=wrap, args=(i, f), daemon=True) for i, f in enumerate(fns)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    if any(t.is_alive() for t in threads):
        raise AssertionError(f"threads still running after {timeout} s: {out}")
    return out


def transports(
    name: str, world: int, senders: tuple[int, ...] = (0,), timeout: float = TIMEOUT
) -> list[sync.ShmTransport]:
    return [
        sync.ShmTransport(name, rank=r, world_size=world, senders=senders, timeout=timeout)
        for r in range(world)
    ]


def model(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
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


class Collect:
    """load_weights that copies what it is given, and remembers each call."""

    def __init__(self) -> None:
        self.state: dict[str, torch.Tensor] = {}
        self.calls: list[list[str]] = []

    def __call__(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        self.calls.append([n for n, _ in weights])
        for n, t in weights:
            self.state[n] = t.clone()

    def names(self) -> set[str]:
        return {n for c in self.calls for n in c}


def assert_same(
    got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], cast: torch.dtype | None = None
) -> None:
    assert set(got) == set(want)
    for n, t in want.items():
        w = t.to(cast) if cast is not None and t.is_floating_point() else t
        assert got[n].dtype == w.dtype and torch.equal(got[n], w), n


def test_round_trip_delta_rounds_and_versions(shm_name: str) -> None:
    t0, t1, t2 = transports(shm_name, 3)
    sender = sync.WeightSender(t0, bucket_bytes=16 << 10)
    receivers = [sync.WeightReceiver(t1), sync.WeightReceiver(t2, apply="per_bucket")]
    sinks = [Collect(), Collect()]
    state = model()
    results: list[list[Any]] = []

    def round_(mutate: Callable[[], None] | None = None, **kw: Any) -> list[Any]:
        if mutate:
            mutate()
        for s in sinks:
            s.calls.clear()
        res = run_threads(
            lambda: sender.push(state, version=len(results) + 1, **kw),
            *[lambda r=r, s=s: r.pull(s) for r, s in zip(receivers, sinks, strict=True)],
        )
        for r in res:
            if isinstance(r, BaseException):
                raise r
        results.append(res)
        return res

    st, r1, _ = round_()
    assert st.full and st.plan_sent and st.bytes_sent == st.bytes_total
    assert replace(r1, seconds=0) == replace(st, seconds=0)
    for s in sinks:
        assert_same(s.state, state)
    assert [r.version for r in receivers] == [1, 1] and sender.version == 1
    # on_commit hands the split "embed" over as one view of the staged round, not assembled
    assert receivers[0]._asm is not None and not receivers[0]._asm.full
    assert receivers[1]._asm is not None and receivers[1]._asm.full  # per_bucket assembles

    # LoRA-style: only the adapters change -> only they travel, packed together
    st, r1, r2 = round_(lambda: (state["lora.a"].add_(1), state["lora.b"].mul_(2)))
    assert not st.full and not st.plan_sent
    assert st.buckets_sent == 1 and st.bytes_sent == 2 * 4 * 32 * 4  # lora.a, lora.b
    assert r1.bytes_sent == r2.bytes_sent == st.bytes_sent
    for s in sinks:
        assert s.names() == {"lora.a", "lora.b"}
        assert_same(s.state, state)

    st, *_ = round_()  # nothing changed
    assert st.buckets_sent == 0 and [r.version for r in receivers] == [3, 3]
    assert all(s.calls == [] for s in sinks)

    # a change inside a split tensor resends all of it; receivers get it whole
    st, *_ = round_(lambda: state["embed"][-1].fill_(7))
    assert st.buckets_sent == 3 and st.bytes_sent == 300 * 40 * 4
    for s in sinks:
        assert s.names() == {"embed"}
        assert_same(s.state, state)

    st, *_ = round_(full=True)
    assert st.full and st.bytes_sent == st.bytes_total and not st.plan_sent


def test_plan_changes_when_tensors_change(shm_name: str) -> None:
    t0, t1 = transports(shm_name, 2)
    sender, receiver, sink = (
        sync.WeightSender(t0, bucket_bytes=4096),
        sync.WeightReceiver(t1),
        Collect(),
    )
    state = {"a": torch.ones(10)}
    run_threads(lambda: sender.push(state, 1), lambda: receiver.pull(sink))
    state = {"a": torch.ones(10), "b": torch.zeros(3, dtype=torch.int8)}
    st, rst = run_threads(lambda: sender.push(state, 2), lambda: receiver.pull(sink))
    assert st.plan_sent and st.full and rst.plan_sent
    assert [t.name for t in receiver.plan.tensors] == ["a", "b"]
    assert_same(sink.state, state)


def test_casts_on_either_side(shm_name: str) -> None:
    t0, t1, t2 = transports(shm_name, 3)
    # the sender casts fp32 -> bf16 on the wire (half the bytes); receiver 2 asks for fp16
    sender = sync.WeightSender(t0, bucket_bytes=16 << 10, dtype=torch.bfloat16)
    r_bf16 = sync.WeightReceiver(t1)
    r_fp16 = sync.WeightReceiver(
        t2,
        apply="per_bucket",
        dtype=lambda name, dt: torch.float16 if dt.is_floating_point and name != "d" else None,
    )
    a, b = Collect(), Collect()
    state = model()
    run_threads(lambda: sender.push(state, 1), lambda: r_bf16.pull(a), lambda: r_fp16.pull(b))
    wire = {n: t.to(torch.bfloat16) if t.is_floating_point() else t for n, t in state.items()}
    assert_same(a.state, wire)
    want = {
        n: t.to(torch.float16) if t.is_floating_point() and n != "d" else t for n, t in wire.items()
    }
    assert_same(b.state, want)
    planned = {t.name: t.dtype for t in r_bf16.plan.tensors}
    assert planned["embed"] == "bfloat16" and planned["i"] == "int32"  # half the wire bytes


def test_corrupted_bucket_is_rejected_and_last_version_kept(shm_name: str) -> None:
    t0, t1 = transports(shm_name, 2)
    sender, receiver = sync.WeightSender(t0, bucket_bytes=4096), sync.WeightReceiver(t1)
    sink = Collect()
    v1 = {"w": torch.randn(2000), "x": torch.randn(10)}
    run_threads(lambda: sender.push(v1, 1), lambda: receiver.pull(sink))
    kept = {n: t.clone() for n, t in sink.state.items()}

    ch = sender._channel
    real_progress = ch.progress  # the shm window streams: receivers read behind the packer

    flipped: list[int] = []

    def corrupt_then_report(bucket: Any, upto: int) -> None:  # a bit flips after the sender
        if bucket.index == 1 and upto > 5 and not flipped:  # hashed it, before receivers read
            ch.buffer(bucket)[5] ^= 0xFF
            flipped.append(1)
        real_progress(bucket, upto)

    ch.progress = corrupt_then_report
    v2 = {"w": v1["w"] + 1, "x": v1["x"] + 1}
    s_err, r_err = run_threads(lambda: sender.push(v2, 2, full=True), lambda: receiver.pull(sink))
    assert isinstance(r_err, sync.DigestMismatchError) and "round 2" in str(r_err)
    assert "bucket 1" in str(r_err)
    assert isinstance(s_err, sync.RoundAbortedError) and "rank 1 rejected" in str(s_err)
    assert receiver.version == 1 and sender.version == 1
    assert_same(sink.state, kept)  # load_weights never saw round 2

    ch.progress = real_progress
    st, _ = run_threads(lambda: sender.push(v2, 3), lambda: receiver.pull(sink))
    assert st.full and receiver.version == 3  # the round after a failure is full
    assert_same(sink.state, v2)


def test_bad_sender_input_aborts_every_rank(shm_name: str) -> None:
    t0, t1 = transports(shm_name, 2)
    sender, receiver, sink = sync.WeightSender(t0), sync.WeightReceiver(t1), Collect()
    s_err, r_err = run_threads(
        lambda: sender.push([("w", [1.0, 2.0])], 1), lambda: receiver.pull(sink)
    )
    assert isinstance(s_err, sync.SyncError) and "(name: str, tensor)" in str(s_err)
    assert isinstance(r_err, sync.RoundAbortedError) and "sender rank 0" in str(r_err)
    st, _ = run_threads(lambda: sender.push({"w": torch.ones(2)}, 1), lambda: receiver.pull(sink))
    assert receiver.version == 1 and st.full


def test_senders_must_agree_on_version(shm_name: str) -> None:
    t0, t1, t2 = transports(shm_name, 3, senders=(0, 1))
    s0, s1, rec = sync.WeightSender(t0), sync.WeightSender(t1), sync.WeightReceiver(t2)
    state = {"w": torch.ones(4)}
    errs = run_threads(
        lambda: s0.push(state, 5), lambda: s1.push(state, 6), lambda: rec.pull(Collect())
    )
    assert all(isinstance(e, sync.SyncError) and "different versions" in str(e) for e in errs)
    sink = Collect()
    run_threads(lambda: s0.push(state, 6), lambda: s1.push(state, 6), lambda: rec.pull(sink))
    assert rec.version == 6
    assert_same(sink.state, state)


def test_load_weights_error_in_per_bucket_mode_rejects_the_round(shm_name: str) -> None:
    t0, t1 = transports(shm_name, 2)
    sender = sync.WeightSender(t0, bucket_bytes=4096)
    receiver = sync.WeightReceiver(t1, apply="per_bucket")
    state = {"a": torch.ones(1000), "b": torch.ones(1000)}

    def flaky(weights: list[tuple[str, torch.Tensor]]) -> None:
        if any(n == "b" for n, _ in weights):
            raise ValueError("model rejects b")

    s_err, r_err = run_threads(lambda: sender.push(state, 1), lambda: receiver.pull(flaky))
    assert isinstance(r_err, sync.SyncError) and "model rejects b" in str(r_err)
    assert isinstance(s_err, sync.RoundAbortedError)
    assert receiver.version is None and not receiver.consistent  # "a" was already loaded
    sink = Collect()
    run_threads(lambda: sender.push(state, 2), lambda: receiver.pull(sink))
    assert receiver.version == 2 and receiver.consistent
    assert_same(sink.state, state)


def test_shm_wait_is_bounded_without_a_sender(shm_name: str) -> None:
    (t1,) = [sync.ShmTransport(shm_name, rank=1, world_size=2, timeout=0.5)]
    receiver = sync.WeightReceiver(t1)
    start = time.monotonic()
    with pytest.raises(sync.SyncTimeoutError, match="sender rank 0"):
        receiver.pull(Collect())
    assert time.monotonic() - start < 3
    assert t1.broken


def test_install_hook_then_full_round(shm_name: str) -> None:
    t0, t1 = transports(shm_name, 2)
    sender, receiver = sync.WeightSender(t0), sync.WeightReceiver(t1)
    sink = Collect()
    state = {"w": torch.arange(6.0)}
    run_threads(lambda: sender.push(state, 1), lambda: receiver.pull(sink))
    run_threads(lambda: sender.push(state, 2), lambda: receiver.pull(sink))
    receiver.install([("w", torch.zeros(6))], 7, sink)  # e.g. a snapshot from the store
    assert receiver.version == 7 and torch.equal(sink.state["w"], torch.zeros(6))
    st, rst = run_threads(lambda: sender.push(state, 8), lambda: receiver.pull(sink))
    assert st.full and rst.full  # the receiver asked for everything
    assert_same(sink.state, state)


def test_roles_are_checked(shm_name: str) -> None:
    t0, t1 = transports(shm_name, 2)
    with pytest.raises(sync.SyncError, match="not a sender"):
        sync.WeightSender(t1)
    with pytest.raises(sync.SyncError, match="is a sender"):
        sync.WeightReceiver(t0)
    with pytest.raises(sync.SyncError, match="on_commit"):
        sync.WeightReceiver(t1, apply="later")  # type: ignore[arg-type]


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
    params_before = {n: p for n, p in m.named_parameters()}
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
    assert m.proj.weight.dtype == torch.bfloat16 and torch.equal(
        m.proj.weight, torch.ones(4, 4).bfloat16()
    )
    assert all(p is params_before[n] for n, p in m.named_parameters())  # in place
    assert not m.embed.weight.requires_grad or m.embed.weight.grad is None
    cov = adapter.coverage()
    assert set(cov.loaded) == {"embed.weight", "head.weight", "proj.weight"}
    assert set(cov.missing) == {"proj.bias", "steps"}
    assert cov.unexpected == ("extra",) and cov.skipped == ("rotary.inv_freq",)
    assert not cov.complete
    adapter.reset()
    assert adapter.coverage().loaded == ()


def test_module_adapter_errors() -> None:
    m = Tiny()
    with pytest.raises(sync.SyncError, match=r"shape \[3\].*'proj.bias' has shape \[4\]"):
        sync.ModuleAdapter(m)([("proj.bias", torch.ones(3))])
    with pytest.raises(sync.SyncError, match="no such parameter"):
        sync.ModuleAdapter(m, strict=True)([("nope", torch.ones(1))])
    adapter = sync.ModuleAdapter(m, name_map=lambda n: n.removeprefix("model."))
    adapter([("model.steps", torch.tensor([3, 4]))])
    assert m.steps.tolist() == [3, 4]

"""A ring of ipc buckets (``SyncGroup(..., links="ipc", ipc_buckets=N)``, deltackpt/sync/
ipc_links.py): a trainer holds N shared buckets per link instead of one per bucket of a round
(on a GPU, N buckets of device memory instead of a copy of the round), reusing each within the
round once the receiver acknowledged its copy of the message before. Real processes on CPU
shared storage, as a GPU runs them on CUDA IPC handles, host and device rounds:

* full and delta rounds bit-exact on two links of several buckets each, into round and ring
  staging, through a re-plan; the trainer made N buckets per link (its /dev/shm files), posted N
  handles, and each receiver mapped N (a bucket reusing memory maps nothing new);
* the trainer really waits: a receiver that holds its copy of a bucket back holds back the
  trainer's pack of the bucket N later (and not of the one before); host rounds pack N buckets
  at once (never more), device rounds one;
* a receiver killed mid-round while the trainer waits for its acknowledgement: the trainer
  raises ``PeerLostError`` naming the wait, not a hang;
* a tampered message still fails the round on every rank, nothing applied, the next round exact;
* a bad ``ipc_buckets`` is refused before connecting.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import time
from typing import Any

import pytest
import torch

from tests._dist import free_port, spawn
from tests.sync._common import make_state, mismatches, wants_for
from tests.sync.test_ipc_links import LAYOUTS, ROUNDS, _files, _tamper_receiver, _tamper_trainer

pytestmark = pytest.mark.multiproc

RING = 2
BUCKET = 4 << 10  # many buckets per link: more than the ring


def _trainer(port: int) -> dict[str, Any]:
    from deltackpt import sync

    group = sync.SyncGroup("127.0.0.1", port, 0, 3, [0], timeout=60, links="ipc", ipc_buckets=RING)
    links = group._ipc
    assert links is not None
    out: dict[str, Any] = {"rounds": []}
    sender = sync.WeightSender(group, bucket_bytes=BUCKET)
    for v in (1, 2, 3, 4):
        out["rounds"].append(sender.push(make_state(v), version=v, full=v == 4))
    out["device_rounds"] = sender._device
    out["per_link"] = {r: len(o.buckets) for r, o in links._out.items()}
    out["distinct"] = {r: len({id(b) for b in o.buckets}) for r, o in links._out.items()}
    out["sent"] = links.handles_sent
    out["files"] = len(_files(os.getpid()))
    sender = sync.WeightSender(group, bucket_bytes=2 * BUCKET)  # a re-plan: other slot sizes
    out["replan"] = sender.push(make_state(5), version=5)
    out["replan_distinct"] = {r: len({id(b) for b in o.buckets}) for r, o in links._out.items()}
    group.pg.barrier().wait()
    group.close()
    return out


def _receiver(rank: int, port: int, staging: str) -> dict[str, Any]:
    from deltackpt import sync

    layout = LAYOUTS[rank]
    group = sync.SyncGroup("127.0.0.1", port, rank, 3, [0], timeout=60, links="ipc")
    links = group._ipc
    assert links is not None
    wants = wants_for(layout)
    if staging == "ring":  # written into the receiver's own tensors before the vote
        wants = [dataclasses.replace(w, into=None) for w in wants]
    loaded: dict[str, torch.Tensor] = {}
    out: dict[str, Any] = {"versions": [], "bad": []}

    def pull(receiver: Any) -> None:
        receiver.pull(lambda ws: loaded.update((n, t.clone()) for n, t in ws))
        out["versions"].append(receiver.version)
        out["bad"].append(mismatches(wants, loaded, layout, receiver.version))

    receiver = sync.WeightReceiver(group, wants, bucket_bytes=BUCKET, staging=staging)
    for _ in range(4):
        pull(receiver)
    out["opened"] = links.handles_opened
    out["ring"] = receiver._ring
    pull(sync.WeightReceiver(group, wants, bucket_bytes=2 * BUCKET, staging=staging))
    group.pg.barrier().wait()
    group.close()
    return out


@pytest.fixture(scope="module", params=[(r, s) for r in sorted(ROUNDS) for s in ("round", "ring")])
def ring_rounds(request: pytest.FixtureRequest) -> tuple[str, str, list[Any]]:
    mode, staging = request.param
    port = free_port()
    targets = [
        (_trainer, (port,)),
        (_receiver, (1, port, staging)),
        (_receiver, (2, port, staging)),
    ]
    with pytest.MonkeyPatch.context() as mp:  # the spawned ranks inherit it
        mp.setenv("DELTACKPT_DEVICE_ROUNDS", ROUNDS[mode])
        got = [o.unwrap() for o in spawn(targets, timeout=120, fast_exit=True)]
    assert got[0]["device_rounds"] == (mode == "device")
    return mode, staging, got


def test_a_ring_of_buckets_carries_full_and_delta_rounds_bit_exact(ring_rounds: Any) -> None:
    _, staging, (trainer, *receivers) = ring_rounds
    st = trainer["rounds"]
    assert [s.full for s in st] == [True, False, False, True]
    assert 0 < st[1].payload_bytes < st[0].payload_bytes
    assert trainer["replan"].version == 5
    for rec in receivers:
        assert rec["versions"] == [1, 2, 3, 4, 5]
        assert rec["bad"] == [[]] * 5
    assert receivers[0]["ring"] == (staging == "ring")  # the link of many buckets: 2 slots


def test_the_trainer_holds_only_its_ring_of_buckets_per_link(ring_rounds: Any) -> None:
    _, _, (trainer, *receivers) = ring_rounds
    per_link = trainer["per_link"]
    assert per_link[1] > 2 * RING, per_link  # the whole model's link: more buckets than the ring
    held = {r: min(n, RING) for r, n in per_link.items()}
    assert trainer["distinct"] == held
    assert trainer["sent"] == sum(held.values())  # a handle per shared bucket, not per bucket
    assert trainer["files"] == sum(held.values()) + len(per_link)  # + each link's cells
    assert all(v <= RING for v in trainer["replan_distinct"].values())
    for rank, rec in enumerate(receivers, start=1):
        assert rec["opened"] == held[rank] + 1  # its ring's buckets and its cells, mapped once


# ---- the trainer waits for the receiver's copy ---------------------------------------------


def _slow_trainer(port: int) -> dict[str, Any]:
    from deltackpt import sync
    from deltackpt.sync import ipc_links

    group = sync.SyncGroup("127.0.0.1", port, 0, 2, [0], timeout=60, links="ipc", ipc_buckets=RING)
    sender = sync.WeightSender(group, bucket_bytes=BUCKET)
    sender.push(make_state(1), version=1)
    waits: dict[int, float] = {}  # a bucket whose memory's last message was waited for -> when
    orig = ipc_links.wait_published

    def timed(g: Any, src: int, tag: int, seq: int, *args: Any, **kw: Any) -> None:
        orig(g, src, tag, seq, *args, **kw)
        if kw.get("acked"):
            waits.setdefault(tag + RING, time.monotonic())

    ipc_links.wait_published = timed  # type: ignore[assignment]
    sender.push(make_state(2), version=2, full=True)
    group.pg.barrier().wait()
    group.close()
    return {"waits": waits, "buckets": len(sender._buckets)}


def _whole_receiver(port: int) -> tuple[Any, list[Any], Any, dict[str, torch.Tensor]]:
    """Rank 1 of a 1x1 ipc group, receiving every tensor whole: group, wants, receiver and
    what it loaded."""
    from deltackpt import sync

    group = sync.SyncGroup("127.0.0.1", port, 1, 2, [0], timeout=60, links="ipc")
    wants = wants_for(("full",))
    return group, wants, sync.WeightReceiver(group, wants, bucket_bytes=BUCKET), {}


def _slow_receiver(port: int) -> dict[str, Any]:
    from deltackpt.sync.ipc_links import IpcLinks

    layout = ("full",)
    group, wants, receiver, loaded = _whole_receiver(port)
    receiver.pull(lambda ws: loaded.update((n, t.clone()) for n, t in ws))
    orig = IpcLinks._wait_copy
    released: dict[int, float] = {}

    def slow(self: IpcLinks, src: int, tag: int, into: torch.Tensor, seq: int) -> None:
        if tag == 0:  # bucket 0 is copied (and acknowledged) only after a second
            time.sleep(1.0)
        released.setdefault(tag, time.monotonic())
        orig(self, src, tag, into, seq)

    IpcLinks._wait_copy = slow  # type: ignore[method-assign]
    receiver.pull(lambda ws: loaded.update((n, t.clone()) for n, t in ws))
    out = {"released": released, "bad": mismatches(wants, loaded, layout, 2)}
    group.pg.barrier().wait()
    group.close()
    return out


@pytest.mark.parametrize("mode", sorted(ROUNDS))
def test_the_trainer_packs_a_ring_bucket_again_only_after_the_receivers_copy(
    mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The receiver sleeps 1 s before it copies bucket 0 out: the trainer got bucket 2's memory
    (bucket 0's) only after that; buckets 0 and 1 (memory of their own) wait for nothing."""
    monkeypatch.setenv("DELTACKPT_DEVICE_ROUNDS", ROUNDS[mode])
    port = free_port()
    trainer, rec = (
        o.unwrap()
        for o in spawn(
            [(_slow_trainer, (port,)), (_slow_receiver, (port,))], timeout=90, fast_exit=True
        )
    )
    assert trainer["buckets"] > RING and rec["bad"] == []
    waits, released = trainer["waits"], rec["released"]
    assert min(waits) == RING  # buckets 0 and 1 did not wait
    assert waits[RING] >= released[0]  # bucket 2 reuses bucket 0's: after the receiver's copy


def _busy_trainer(port: int) -> dict[str, Any]:
    import threading

    from deltackpt import sync
    from deltackpt.sync.packer import Packer

    group = sync.SyncGroup("127.0.0.1", port, 0, 2, [0], timeout=60, links="ipc", ipc_buckets=RING)
    sender = sync.WeightSender(group, bucket_bytes=BUCKET)
    sender.push(make_state(1), version=1)
    lock, now, most = threading.Lock(), [0], [0]

    def counted(orig: Any) -> Any:
        def pack(*args: Any, **kw: Any) -> Any:
            with lock:
                now[0] += 1
                most[0] = max(most[0], now[0])
            try:
                time.sleep(0.05)  # long enough that the next bucket's pack could overlap it
                return orig(*args, **kw)
            finally:
                with lock:
                    now[0] -= 1

        return pack

    Packer.message = counted(Packer.message)  # type: ignore[method-assign]
    Packer.device_message = counted(Packer.device_message)  # type: ignore[method-assign]
    sender.push(make_state(2), version=2, full=True)
    sender.push(make_state(3), version=3)
    group.pg.barrier().wait()
    group.close()
    return {"most": most[0], "buckets": len(sender._buckets), "threads": sender.pack_threads}


def _plain_receiver(port: int) -> dict[str, Any]:
    layout = ("full",)
    group, wants, receiver, loaded = _whole_receiver(port)
    bad = []
    for v in (1, 2, 3):
        receiver.pull(lambda ws: loaded.update((n, t.clone()) for n, t in ws))
        bad += mismatches(wants, loaded, layout, v)
    group.pg.barrier().wait()
    group.close()
    return {"bad": bad}


@pytest.mark.parametrize("threads", [2, 3])
@pytest.mark.parametrize("mode", sorted(ROUNDS))
def test_a_ring_packs_as_many_buckets_at_once_as_it_has(
    mode: str, threads: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Host rounds on a ring of two ipc buckets pack two buckets at once (each into the memory
    its receiver copied out), never more, whatever DELTACKPT_PACK_THREADS allows: a third
    would need the copy of a bucket not sent yet. Device rounds pack one at a time. Bit-exact
    either way."""
    monkeypatch.setenv("DELTACKPT_DEVICE_ROUNDS", ROUNDS[mode])
    monkeypatch.setenv("DELTACKPT_PACK_THREADS", str(threads))
    port = free_port()
    trainer, rec = (
        o.unwrap()
        for o in spawn(
            [(_busy_trainer, (port,)), (_plain_receiver, (port,))], timeout=90, fast_exit=True
        )
    )
    assert trainer["buckets"] > RING and trainer["threads"] == threads
    assert rec["bad"] == []
    assert trainer["most"] == (1 if mode == "device" else RING)


# ---- a receiver killed while the trainer waits ---------------------------------------------


def _waiting_trainer(port: int) -> dict[str, Any]:
    from deltackpt import sync

    # rank 1: the store lives on the receiver... which dies; so the trainer hosts it (rank 0)
    group = sync.SyncGroup("127.0.0.1", port, 0, 2, [0], timeout=60, links="ipc", ipc_buckets=RING)
    sender = sync.WeightSender(group, bucket_bytes=BUCKET)
    sender.push(make_state(1), version=1)
    out: dict[str, Any] = {}
    t0 = time.monotonic()
    try:
        sender.push(make_state(2), version=2, full=True)
        out["error"] = None
    except sync.SyncError as e:
        out["error"] = (type(e).__name__, str(e))
    out["seconds"] = time.monotonic() - t0
    group.close()
    return out


def _dying_receiver(port: int) -> None:
    from deltackpt import sync
    from deltackpt.sync.ipc_links import IpcLinks

    group = sync.SyncGroup("127.0.0.1", port, 1, 2, [0], timeout=60, links="ipc")
    receiver = sync.WeightReceiver(group, wants_for(("full",)), bucket_bytes=BUCKET)
    receiver.pull(lambda ws: None)
    orig = IpcLinks._wait_copy

    def dying(self: IpcLinks, src: int, tag: int, into: torch.Tensor, seq: int) -> None:
        if tag == 1:  # bucket 0 received, never acknowledged: the trainer waits for it
            os.kill(os.getpid(), signal.SIGKILL)
        orig(self, src, tag, into, seq)

    IpcLinks._wait_copy = dying  # type: ignore[method-assign]
    receiver.pull(lambda ws: None)
    raise AssertionError("unreachable: the receiver should have died")


@pytest.mark.parametrize("mode", sorted(ROUNDS))
def test_a_receiver_killed_while_the_trainer_waits_for_its_copy_is_a_lost_peer(
    mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DELTACKPT_DEVICE_ROUNDS", ROUNDS[mode])
    port = free_port()
    trainer, rec = spawn(
        [(_waiting_trainer, (port,)), (_dying_receiver, (port,))], timeout=90, fast_exit=True
    )
    assert rec.exitcode == -signal.SIGKILL and not rec.reported, (rec, trainer)
    t = trainer.unwrap()
    assert t["error"] is not None and t["error"][0] == "PeerLostError", t["error"]
    assert "rank 1" in t["error"][1], t["error"]
    assert t["seconds"] < 30  # the liveness check, not the 60 s timeout


# ---- a tampered message ---------------------------------------------------------------------


@pytest.mark.parametrize("mode", sorted(ROUNDS))
def test_a_tampered_ring_bucket_fails_the_round_and_the_next_is_exact(
    mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A byte of a message in reused memory flipped after its publish: the round fails on
    both ranks (its digest), nothing applied; the next (full) round is exact."""
    monkeypatch.setenv("DELTACKPT_DEVICE_ROUNDS", ROUNDS[mode])
    port = free_port()
    from deltackpt.options import default_ipc_buckets

    assert default_ipc_buckets() == RING  # the trainer of test_ipc_links runs the default ring
    trainer, rec = (
        o.unwrap()
        for o in spawn(
            [(_tamper_trainer, (port,)), (_tamper_receiver, (port, RING))],
            timeout=90,
            fast_exit=True,
        )
    )
    assert rec["hit"] == [RING]
    assert trainer == [None, "RoundAbortedError", None]
    assert [e and e[0] for e in rec["errors"]] == [None, "DigestMismatchError", None]
    assert rec["versions"] == [1, 1, 3]
    assert rec["bad"] == [[], [], []]


@pytest.mark.parametrize("bad", [1, 0, True, 2.0, "2"])
def test_a_bad_ipc_buckets_is_refused_before_connecting(bad: Any) -> None:
    from deltackpt import sync

    with pytest.raises(sync.SyncError, match=r"ipc_buckets=.*int >= 2"):
        sync.SyncGroup("127.0.0.1", 1, 0, 2, [0], links="ipc", ipc_buckets=bad)


@pytest.mark.parametrize(("env", "want"), [(None, 2), ("3", 3), ("none", None), (" None ", None)])
def test_the_default_ring_comes_from_the_environment(
    env: str | None, want: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``ipc_buckets="auto"`` (the default): ``DELTACKPT_IPC_BUCKETS`` (2 unless set), read when
    the group is built; an explicit ``ipc_buckets`` wins; a bad value names the variable."""
    from deltackpt import sync
    from deltackpt.errors import InvalidArgumentError

    if env is None:
        monkeypatch.delenv("DELTACKPT_IPC_BUCKETS", raising=False)
    else:
        monkeypatch.setenv("DELTACKPT_IPC_BUCKETS", env)
    # the options as the constructor resolves them, before it connects (not done here)
    monkeypatch.setattr(sync.SyncGroup, "_connect", lambda self, port: None)
    assert sync.SyncGroup("127.0.0.1", 1, 0, 2, [0], links="ipc").ipc_buckets == want
    explicit = sync.SyncGroup("127.0.0.1", 1, 0, 2, [0], links="ipc", ipc_buckets=4)
    assert explicit.ipc_buckets == 4
    monkeypatch.setenv("DELTACKPT_IPC_BUCKETS", "1")
    with pytest.raises(InvalidArgumentError, match="DELTACKPT_IPC_BUCKETS"):
        sync.SyncGroup("127.0.0.1", 1, 0, 2, [0], links="ipc")

"""Tensor-handle links (``SyncGroup(..., links="ipc")``, deltackpt/sync/ipc_links.py) between
real processes, on CPU shared storage (PyTorch's file_system sharing), as a GPU runs them on
CUDA IPC handles:

* full and delta rounds bit-exact on two links; each bucket's handle is posted once and reused
  every round; a re-plan with another layout posts new handles, one with the same layout none;
  ``reconnect`` and ``close`` release the buckets: no ``/dev/shm`` file of the trainer is left;
* a shared bucket written after the publish fails the round on every rank, the receiver's
  weights untouched, and the next round (full) is exact;
* a trainer killed mid-round: the receiver raises ``PeerLostError`` (the pid check), nothing
  applied;
* on a GPU: CUDA tensors through CUDA buckets, bit-exact: host rounds and device rounds (packed
  in the bucket, device digests), into host or device staging.
* every test above runs host rounds and device rounds (the CPU stand-in of a CUDA bucket).
"""

from __future__ import annotations

import glob
import os
import signal
from typing import Any

import pytest
import torch

from tests._dist import free_port, spawn
from tests.sync._common import make_state, mismatches, wants_for

pytestmark = pytest.mark.multiproc

BUCKET = 8 << 10
LAYOUTS = {1: ("full",), 2: ("tp", 0, 2)}  # receiver rank -> layout


def _files(pid: int) -> list[str]:
    """The /dev/shm files PyTorch's file_system sharing made for process ``pid``."""
    return sorted(glob.glob(f"/dev/shm/torch_{pid}_*"))


def _buckets(sender: Any) -> int:
    return len(sender._buckets)


def _layout(sender: Any) -> dict[int, tuple[int, int]]:
    """Receiver -> (buckets, slot bytes) of the trainer's links: what its buckets are made of."""
    from deltackpt.sync.rounds import link_slots

    slots = link_slots(sender.schedule.links_of(0), sender.align)
    return {r: v for (_, r), v in slots.items()}


def new_handles(old: dict[int, tuple[int, int]], new: dict[int, tuple[int, int]]) -> int:
    """Buckets a re-plan from layout ``old`` to ``new`` makes: all of a link whose slot size
    changed, else those past the old count."""
    return sum(
        n if r not in old or old[r][1] != slot else max(0, n - old[r][0])
        for r, (n, slot) in new.items()
    )


# ---- rounds, handles, re-plans, reconnect, close ------------------------------------------


def _trainer(ports: list[int]) -> dict[str, Any]:
    from deltackpt import sync

    # a bucket of its own per bucket of a round (not the default ring: test_ipc_ring.py)
    group = sync.SyncGroup(
        "127.0.0.1", ports[0], 0, 3, [0], timeout=60, links="ipc", ipc_buckets=None
    )
    links = group._ipc
    assert links is not None
    out: dict[str, Any] = {"rounds": [], "sent": []}
    sender = sync.WeightSender(group, bucket_bytes=BUCKET)
    for v in (1, 2, 3, 4):
        out["rounds"].append(sender.push(make_state(v), version=v, full=v == 4))
        out["sent"].append(links.handles_sent)
    out["buckets"] = _buckets(sender)
    out["device_rounds"] = sender._device
    out["layout"] = _layout(sender)
    out["files_planned"] = len(_files(os.getpid()))
    # a re-plan with another layout (bucket size): new buckets, new handles
    sender = sync.WeightSender(group, bucket_bytes=2 * BUCKET)
    out["replan"] = sender.push(make_state(5), version=5)
    out["replan_sent"] = links.handles_sent
    out["replan_buckets"] = _buckets(sender)
    out["replan_layout"] = _layout(sender)
    out["retired"] = links.retired  # the replaced buckets, acknowledged: dropped
    # a re-plan with the same layout: the buckets and their handles are reused
    sender = sync.WeightSender(group, bucket_bytes=2 * BUCKET)
    out["same"] = sender.push(make_state(6), version=6)
    out["same_sent"] = links.handles_sent
    out["files_before_reconnect"] = len(_files(os.getpid()))
    group.reconnect(ports[1])
    sender = sync.WeightSender(group, bucket_bytes=BUCKET)
    out["after_reconnect"] = sender.push(make_state(7), version=7)
    assert group._ipc is not None
    out["reconnect_sent"] = group._ipc.handles_sent
    out["files_after_reconnect"] = len(_files(os.getpid()))
    group.pg.barrier().wait()
    group.close()
    group.pg.barrier().wait()  # every receiver closed too
    out["files_after_close"] = _files(os.getpid())
    return out


def _receiver(rank: int, ports: list[int]) -> dict[str, Any]:
    from deltackpt import sync

    layout = LAYOUTS[rank]
    group = sync.SyncGroup("127.0.0.1", ports[0], rank, 3, [0], timeout=60, links="ipc")
    links = group._ipc
    assert links is not None
    out: dict[str, Any] = {"rounds": [], "opened": []}
    wants = wants_for(layout)
    loaded: dict[str, torch.Tensor] = {}

    def load(ws: list[tuple[str, torch.Tensor]]) -> None:
        loaded.update((n, t.clone()) for n, t in ws)

    def pull(receiver: Any) -> dict[str, Any]:
        st = receiver.pull(load)
        v = receiver.version
        return {"stats": st, "version": v, "bad": mismatches(wants, loaded, layout, v)}

    receiver = sync.WeightReceiver(group, wants, bucket_bytes=BUCKET)
    for _ in (1, 2, 3, 4):
        out["rounds"].append(pull(receiver))
        out["opened"].append(links.handles_opened)
    out["buckets"] = len(receiver._buckets)
    for key, bucket in (("replan", 2 * BUCKET), ("same", 2 * BUCKET)):
        receiver = sync.WeightReceiver(group, wants, bucket_bytes=bucket)
        out[key] = pull(receiver)
        out[key + "_opened"] = links.handles_opened
    group.reconnect(ports[1])
    receiver = sync.WeightReceiver(group, wants, bucket_bytes=BUCKET)
    out["after_reconnect"] = pull(receiver)
    group.pg.barrier().wait()
    group.close()
    out["mapped_after_close"] = len(links._in)
    group.pg.barrier().wait()
    return out


# "host": packed on the host, xxh3 digests (as on every other link); "device": a device round
# (DELTACKPT_DEVICE_ROUNDS=always: the CPU stand-in of a CUDA bucket), packed from the tensors
# into the bucket itself, device digests (sync/device_digest.py)
ROUNDS = {"host": "off", "device": "always"}


@pytest.fixture(scope="module", params=sorted(ROUNDS))
def rounds(request: pytest.FixtureRequest) -> list[Any]:
    ports = [free_port(), free_port()]
    targets = [(_trainer, (ports,)), (_receiver, (1, ports)), (_receiver, (2, ports))]
    with pytest.MonkeyPatch.context() as mp:  # the spawned ranks inherit it
        mp.setenv("DELTACKPT_DEVICE_ROUNDS", ROUNDS[request.param])
        got = [o.unwrap() for o in spawn(targets, timeout=120, fast_exit=True)]
    assert got[0]["device_rounds"] == (request.param == "device")
    return got


def test_full_and_delta_rounds_are_bit_exact(rounds: list[Any]) -> None:
    trainer, *receivers = rounds
    st = trainer["rounds"]
    assert [s.version for s in st] == [1, 2, 3, 4]
    assert [s.full for s in st] == [True, False, False, True]
    # a delta round sends the one tensor that changed, not everything
    assert 0 < st[1].payload_bytes < st[0].payload_bytes
    assert st[3].payload_bytes == st[0].payload_bytes
    for rec in receivers:
        assert [r["version"] for r in rec["rounds"]] == [1, 2, 3, 4]
        assert [r["bad"] for r in rec["rounds"]] == [[], [], [], []]
        assert [r["stats"].full for r in rec["rounds"]] == [True, False, False, True]
        for key in ("replan", "same", "after_reconnect"):
            assert rec[key]["bad"] == [] and rec[key]["stats"].full, (key, rec[key])
        assert [rec[k]["version"] for k in ("replan", "same", "after_reconnect")] == [5, 6, 7]


def test_handles_are_sent_once_per_bucket_and_resent_on_a_layout_change(
    rounds: list[Any],
) -> None:
    trainer, *receivers = rounds
    n = trainer["buckets"]
    assert n > len(receivers)  # several buckets per link
    # posted in the first round's setup, reused by every later round
    assert trainer["sent"] == [n, n, n, n]
    # another bucket size: the buckets of the links whose slot size changed are new (a link
    # whose largest message fits both sizes keeps its buckets); the replaced ones were
    # acknowledged and dropped
    old, new = trainer["layout"], trainer["replan_layout"]
    assert any(old[r][1] != new[r][1] for r in new)
    assert trainer["replan_sent"] == n + new_handles(old, new) > n
    assert trainer["retired"] == 0
    # the same layout again: no handle posted
    assert trainer["same_sent"] == trainer["replan_sent"]
    for rank, rec in enumerate(receivers, start=1):
        m = rec["buckets"]
        # every bucket of its link once, plus the link's cells (one handle per setup)
        assert rec["opened"] == [m + 1] * 4
        # the re-plan: the new setup's cells, and the buckets its trainer made anew
        made = new_handles({rank: old[rank]}, {rank: new[rank]})
        assert rec["replan_opened"] == rec["opened"][-1] + 1 + made
        assert rec["same_opened"] == rec["replan_opened"] + 1  # only the new setup's cells


def test_reconnect_and_close_release_every_shared_bucket(rounds: list[Any]) -> None:
    trainer, *receivers = rounds
    links = len(receivers)
    # one file per bucket and one cell table per link, while planned
    assert trainer["files_planned"] == trainer["buckets"] + links
    assert trainer["files_before_reconnect"] == trainer["replan_buckets"] + links
    # after reconnect only the new group's buckets exist: the old ones were released
    assert trainer["reconnect_sent"] == trainer["buckets"]
    assert trainer["files_after_reconnect"] == trainer["buckets"] + links
    assert trainer["files_after_close"] == []
    assert all(rec["mapped_after_close"] == 0 for rec in receivers)


# ---- a shared bucket written after the publish ---------------------------------------------


def _tamper_trainer(port: int) -> list[str | None]:
    from deltackpt import sync

    group = sync.SyncGroup("127.0.0.1", port, 0, 2, [0], timeout=60, links="ipc")
    sender = sync.WeightSender(group, bucket_bytes=BUCKET)
    errors: list[str | None] = []
    for v in (1, 2, 3):
        try:
            sender.push(make_state(v), version=v, full=True)
            errors.append(None)
        except sync.SyncError as e:
            errors.append(type(e).__name__)
    group.pg.barrier().wait()
    group.close()
    return errors


def _tamper_receiver(port: int, at: int = 0) -> dict[str, Any]:
    """``at``: the bucket of round 2 whose payload is flipped (in a ring's reused memory when
    at least ``ipc_buckets``: test_ipc_ring.py)."""
    from deltackpt import sync
    from deltackpt.sync import rounds
    from deltackpt.sync.ipc_links import GEN, SEQ, IpcLinks

    layout = ("full",)
    group = sync.SyncGroup("127.0.0.1", port, 1, 2, [0], timeout=60, links="ipc")
    wants = wants_for(layout)
    receiver = sync.WeightReceiver(group, wants, bucket_bytes=BUCKET)
    orig = IpcLinks._wait_copy
    hit: list[int] = []

    def hostile(self: IpcLinks, src: int, tag: int, into: torch.Tensor, seq: int) -> None:
        if seq == 2 and tag == at:  # round 2, bucket `at`: wait for the publish, then write
            lk = self._in[src]
            cellv = self._cells(src, lk, seq)
            while cellv[tag, SEQ] != seq:
                pass
            bucket = self._bucket(src, lk, tag, int(cellv[tag, GEN]))
            bucket[rounds.payload_start(receiver._buckets[tag], receiver.align) + 3] ^= 0x40
            hit.append(tag)
        orig(self, src, tag, into, seq)

    IpcLinks._wait_copy = hostile  # type: ignore[method-assign]
    loaded: dict[str, torch.Tensor] = {}

    def load(ws: list[tuple[str, torch.Tensor]]) -> None:
        loaded.update((n, t.clone()) for n, t in ws)

    out: dict[str, Any] = {"errors": [], "bad": [], "versions": []}
    for _ in range(3):
        try:
            receiver.pull(load)
            out["errors"].append(None)
        except sync.SyncError as e:
            out["errors"].append((type(e).__name__, str(e)))
        out["versions"].append(receiver.version)
        out["bad"].append(mismatches(wants, loaded, layout, receiver.version or 0))
    out["hit"] = hit
    group.pg.barrier().wait()
    group.close()
    return out


@pytest.mark.parametrize("mode", sorted(ROUNDS))
def test_a_tampered_shared_bucket_is_refused_and_nothing_is_applied(
    mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    port = free_port()
    monkeypatch.setenv("DELTACKPT_DEVICE_ROUNDS", ROUNDS[mode])
    trainer, rec = (
        o.unwrap()
        for o in spawn(
            [(_tamper_trainer, (port,)), (_tamper_receiver, (port,))], timeout=90, fast_exit=True
        )
    )
    assert rec["hit"] == [0]
    assert rec["errors"][0] is None and rec["errors"][2] is None
    name, message = rec["errors"][1]
    assert name == "DigestMismatchError" and "has digest" in message, message
    assert "nothing was applied" in message
    assert trainer == [None, "RoundAbortedError", None]
    # round 2 left the weights at version 1, bit for bit; round 3 (full) is exact
    assert rec["versions"] == [1, 1, 3]
    assert rec["bad"] == [[], [], []]


# ---- a header-only message in the cell (device rounds) -------------------------------------


def _inline_trainer(port: int) -> dict[str, Any]:
    from deltackpt import sync
    from deltackpt.sync.ipc_links import NBYTES

    group = sync.SyncGroup("127.0.0.1", port, 0, 2, [0], timeout=60, links="ipc")
    sender = sync.WeightSender(group, bucket_bytes=BUCKET)
    out: dict[str, Any] = {"errors": [], "inline": []}
    # v2: the state of v1 again, a delta round: no bucket has a piece to send
    for v, state, full in ((1, make_state(1), True), (2, make_state(1), False)):
        try:
            sender.push(state, version=v, full=full)
            out["errors"].append(None)
        except sync.SyncError as e:
            out["errors"].append(type(e).__name__)
        assert group._ipc is not None
        out["inline"].append(int((group._ipc._out[1].cellv[:, NBYTES] < 0).sum()))
    out["buckets"] = len(sender._buckets)
    sender.push(make_state(3), version=3, full=True)
    group.pg.barrier().wait()
    group.close()
    return out


def _inline_receiver(port: int, tamper: str) -> dict[str, Any]:
    from deltackpt import sync
    from deltackpt.sync import wire
    from deltackpt.sync.ipc_links import HEAD, NBYTES, SEQ, IpcLinks

    layout = ("full",)
    group = sync.SyncGroup("127.0.0.1", port, 1, 2, [0], timeout=60, links="ipc")
    wants = wants_for(layout)
    receiver = sync.WeightReceiver(group, wants, bucket_bytes=BUCKET)
    orig = IpcLinks._wait_copy
    seen: list[int] = []

    def hostile(self: IpcLinks, src: int, tag: int, into: torch.Tensor, seq: int) -> None:
        if seq == 2 and tag == 0:  # round 2, bucket 0: its header is in the cell
            lk = self._in[src]
            cellv = self._cells(src, lk, seq)
            while cellv[tag, SEQ] != seq:
                pass
            seen.append(int(cellv[tag, NBYTES]))
            if tamper == "payload":  # a scribbler claims payload the bucket would hold
                cellv[tag, HEAD + wire.HEAD - 2] = 64
            elif tamper == "short":  # ... or a header two words shorter than its pieces'
                cellv[tag, NBYTES] += 16
        orig(self, src, tag, into, seq)

    IpcLinks._wait_copy = hostile  # type: ignore[method-assign]
    loaded: dict[str, torch.Tensor] = {}
    out: dict[str, Any] = {"errors": [], "bad": [], "versions": []}
    for _ in range(3):
        try:
            receiver.pull(lambda ws: loaded.update((n, t.clone()) for n, t in ws))
            out["errors"].append(None)
        except sync.SyncError as e:
            out["errors"].append((type(e).__name__, str(e)))
        out["versions"].append(receiver.version)
        v = receiver.version or 0
        out["bad"].append(mismatches(wants, loaded, layout, 1 if v == 2 else v))
    out["seen"] = seen
    group.pg.barrier().wait()
    group.close()
    return out


@pytest.mark.parametrize("tamper", ["clean", "payload", "short"])
def test_an_unchanged_bucket_sends_its_header_in_the_cell(
    tamper: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A device round's bucket with nothing to send: the header in the link's cell, the bucket
    untouched (no work on the device on either side); a header there that claims payload, or
    is shorter than its bucket's pieces need (a process scribbling the cell), fails the round
    (a typed error on every rank, not a crash of the receiver) and nothing is applied."""
    port = free_port()
    monkeypatch.setenv("DELTACKPT_DEVICE_ROUNDS", "always")
    trainer, rec = (
        o.unwrap()
        for o in spawn(
            [(_inline_trainer, (port,)), (_inline_receiver, (port, tamper))],
            timeout=90,
            fast_exit=True,
        )
    )
    assert trainer["inline"] == [0, trainer["buckets"]]  # the full round: every header in a bucket
    assert len(rec["seen"]) == 1 and rec["seen"][0] < 0  # minus the header's bytes
    if tamper == "clean":
        assert trainer["errors"] == [None, None] and rec["errors"] == [None, None, None]
        assert rec["versions"] == [1, 2, 3]
    else:
        name, message = rec["errors"][1]
        assert name == "RoundAbortedError", name  # this rank's finding fails the round
        assert {
            "payload": "a header-only message in the link's cell names 64 payload bytes",
            "short": "the header in the link's cell holds",
        }[tamper] in message, message
        assert trainer["errors"] == [None, "RoundAbortedError"]
        assert rec["versions"] == [1, 1, 3]
    assert rec["bad"] == [[], [], []]


# ---- a trainer killed mid-round ------------------------------------------------------------


def _kill_trainer(port: int) -> None:
    from deltackpt import sync
    from deltackpt.sync.ipc_links import IpcLinks

    # rank 1: the store lives on the receiver (rank 0) and outlives the trainer, so the link's
    # own pid check finds the death, not a failed store call
    group = sync.SyncGroup("127.0.0.1", port, 1, 2, [1], timeout=60, links="ipc")
    sender = sync.WeightSender(group, bucket_bytes=BUCKET)
    sender.push(make_state(1), version=1)
    publish = IpcLinks.publish

    def dying(self: IpcLinks, dst: int, tag: int, n: int, *args: Any, **kw: Any) -> Any:
        if tag == 2:  # buckets 0 and 1 are published: the crash is mid-round
            os.kill(os.getpid(), signal.SIGKILL)
        return publish(self, dst, tag, n, *args, **kw)

    IpcLinks.publish = dying  # type: ignore[method-assign]
    sender.push(make_state(2), version=2, full=True)
    raise AssertionError("unreachable: the trainer should have died")


def _kill_receiver(port: int) -> dict[str, Any]:
    from deltackpt import sync

    layout = ("full",)
    group = sync.SyncGroup("127.0.0.1", port, 0, 2, [1], timeout=60, links="ipc")
    wants = wants_for(layout)
    receiver = sync.WeightReceiver(group, wants, bucket_bytes=BUCKET)
    loaded: dict[str, torch.Tensor] = {}

    def load(ws: list[tuple[str, torch.Tensor]]) -> None:
        loaded.update((n, t.clone()) for n, t in ws)

    receiver.pull(load)
    out: dict[str, Any] = {"v1_bad": mismatches(wants, loaded, layout, 1)}
    try:
        receiver.pull(load)
        out["error"] = None
    except sync.SyncError as e:
        out["error"] = (type(e).__name__, str(e))
    out["version"] = receiver.version
    out["bad"] = mismatches(wants, loaded, layout, 1)  # nothing of round 2 applied
    out["broken"] = group.broken
    group.close()
    return out


@pytest.mark.parametrize("mode", sorted(ROUNDS))
def test_a_trainer_killed_mid_round_fails_the_receiver_with_peer_lost(
    mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DELTACKPT_DEVICE_ROUNDS", ROUNDS[mode])
    port = free_port()
    trainer, rec = spawn(
        [(_kill_trainer, (port,)), (_kill_receiver, (port,))], timeout=90, fast_exit=True
    )
    assert trainer.exitcode == -signal.SIGKILL and not trainer.reported
    r = rec.unwrap()
    assert r["v1_bad"] == []
    assert r["error"] is not None and r["error"][0] == "PeerLostError", r["error"]
    assert "rank 1" in r["error"][1] and "reconnect" in r["error"][1]
    assert r["version"] == 1 and r["bad"] == [] and r["broken"]


# ---- on a GPU: CUDA buckets ---------------------------------------------------------------


def _cuda_trainer(
    port: int,
    mode: str,
    buckets_on: str = "cuda:0",
    side_stream: bool = False,
    ring: int | None = None,
    tensors_on: str = "cuda:0",
) -> dict[str, Any]:
    import contextlib

    from deltackpt import sync
    from deltackpt.options import overrides

    group = sync.SyncGroup(
        "127.0.0.1",
        port,
        0,
        2,
        [0],
        timeout=60,
        links="ipc",
        ipc_device=buckets_on,
        ipc_buckets=ring,
    )
    sender = sync.WeightSender(group, bucket_bytes=BUCKET)
    stats = []
    # side_stream: the trainer writes its tensors and pushes on a stream of its own (the sender
    # must queue its device work after those writes, not on the default stream)
    ctx = torch.cuda.stream(torch.cuda.Stream()) if side_stream else contextlib.nullcontext()
    with overrides(DELTACKPT_DEVICE_ROUNDS=mode), ctx:
        for v in (1, 2, 3):
            state = {n: t.to(tensors_on) for n, t in make_state(v).items()}
            if side_stream:  # a long kernel queued last on this stream: a race would show
                for t in state.values():
                    if t.is_floating_point():  # (integer tensors cannot take a float product)
                        t.mul_(2.0).mul_(0.5)
            stats.append(sender.push(state, version=v, full=v == 3))
    assert group._ipc is not None
    buckets = [b for o in group._ipc._out.values() for b in o.buckets]
    out = {
        "buckets": len(buckets),
        "distinct": len({id(b) for b in buckets}),
        "full": [s.full for s in stats],
        "payload": [s.payload_bytes for s in stats],
        "device_rounds": sender._device,
        "on_device": all(b.shared.is_cuda for b in buckets),
        "locked": [b.locked and b.shared.is_pinned() for b in buckets],
        # a host round packs into a pinned buffer; a device round makes none
        "pinned": [
            b.host is not None and b.host is not b.shared and b.host.is_pinned() for b in buckets
        ],
    }
    group.pg.barrier().wait()
    group.close()
    return out


def _cuda_receiver(port: int, staging: str, side_stream: bool, pin: bool | str) -> dict[str, Any]:
    import dataclasses

    from deltackpt import sync

    layout = ("full",)
    group = sync.SyncGroup("127.0.0.1", port, 1, 2, [0], timeout=60, links="ipc")
    wants = wants_for(layout)
    if staging == "cuda:0":  # the parameters on the device: staged there too (by default)
        wants = [
            dataclasses.replace(w, into=None if w.into is None else w.into.to("cuda:0"))
            for w in wants
        ]
        wants = [w for w in wants if w.into is not None]
    # host staging pinned (pin=True), or page-locked where it lies once CUDA is in use (the
    # default, "auto"): the bucket's copies to and from the GPU at the link's speed
    receiver = sync.WeightReceiver(group, wants, bucket_bytes=BUCKET, pin=pin)
    loaded: dict[str, torch.Tensor] = {}

    def load(ws: list[tuple[str, torch.Tensor]]) -> None:  # into device tensors, then back
        loaded.update((n, t.to("cuda:0").cpu()) for n, t in ws)

    bad = []
    # side_stream: the engine pulls under a stream of its own (the commit's copies, on the
    # receiver's threads too, must queue there, not on the default stream)
    side = torch.cuda.Stream() if side_stream else None
    for _ in range(3):
        with torch.cuda.stream(side):  # None: the current stream
            receiver.pull(load)
        held = [
            dataclasses.replace(w, into=None if w.into is None else w.into.cpu()) for w in wants
        ]
        bad.append(mismatches(held, loaded, layout, receiver.version or 0))
    assert group._ipc is not None
    mapped_cuda = all(t.is_cuda for lk in group._ipc._in.values() for _, t in lk.mapped.values())
    locked = [t.is_pinned() for lk in group._ipc._in.values() for _, t in lk.mapped.values()]
    staged = {str(s.device) for s in receiver._slots}
    if staging == "cpu":
        assert receiver.staging_locked and all(s.is_pinned() for s in receiver._slots)
    group.pg.barrier().wait()
    group.close()
    return {
        "bad": bad,
        "version": receiver.version,
        "mapped_cuda": mapped_cuda,
        "staged": staged,
        "locked": locked,
    }


@pytest.mark.gpu
@pytest.mark.parametrize(
    "mode, staging, kernel, buckets_on, side_stream, ring",
    [
        ("off", "cpu", "off", "cuda:0", False, None),
        ("auto", "cpu", "off", "cuda:0", False, None),
        ("auto", "cuda:0", "off", "cuda:0", False, None),
        ("auto", "cuda:0", "triton", "cuda:0", False, None),
        ("auto", "cpu", "triton", "cuda:0", False, None),
        ("auto", "cuda:0", "triton", "cuda:0", True, None),
        # device rounds through host shared memory: the GPU's tensors copied into page-locked
        # host buckets, digests taken on the trainer's GPU, checked on the receiver's
        ("always", "cuda:0", "triton", "cpu", False, None),
        ("always", "cpu", "off", "cpu", True, None),
        ("auto", "cuda:0", "off", "cpu", False, None),  # auto's choice for CUDA tensors
        # a ring of two shared buckets per link (ipc_buckets=2), reused within each round
        ("auto", "cuda:0", "triton", "cuda:0", False, 2),
        ("off", "cpu", "off", "cuda:0", False, 2),
        ("always", "cuda:0", "triton", "cpu", False, 2),
    ],
)
def test_cuda_buckets_carry_full_and_delta_rounds_bit_exact(
    mode: str,
    staging: str,
    kernel: str,
    buckets_on: str,
    side_stream: bool,
    ring: int | None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Host rounds (pinned buffer, xxh3) and device rounds (packed into the CUDA bucket,
    device digests), into host staging or device staging (``into`` on the device); the
    device rounds' fingerprints by the torch operations or the Triton kernel (both sides);
    device rounds through host buckets; ``side_stream``: the trainer pushes and the receiver
    pulls on streams of their own; ``ring``: a ring of that many buckets per link."""
    monkeypatch.setenv("DELTACKPT_FINGERPRINT_COMPILE", kernel)  # the spawned ranks inherit it
    port = free_port()
    trainer, rec = (
        o.unwrap()
        for o in spawn(
            [
                (_cuda_trainer, (port, mode, buckets_on, side_stream, ring)),
                # host rounds: staging pinned by torch's allocator; device rounds: "auto"
                (_cuda_receiver, (port, staging, side_stream, mode == "off" or "auto")),
            ],
            timeout=120,
            fast_exit=True,
        )
    )
    host_buckets = buckets_on == "cpu"
    assert trainer["full"] == [True, False, True] and trainer["on_device"] == (not host_buckets)
    if ring is not None:  # more buckets than the ring, in its memory
        assert trainer["buckets"] > ring and trainer["distinct"] == ring, trainer
    assert trainer["device_rounds"] == (mode != "off")
    assert all(trainer["pinned"]) == (mode == "off") and any(trainer["pinned"]) == (mode == "off")
    assert all(trainer["locked"]) == host_buckets and any(trainer["locked"]) == host_buckets
    assert 0 < trainer["payload"][1] < trainer["payload"][0]  # only the changed tensor
    assert rec["bad"] == [[], [], []] and rec["version"] == 3
    assert rec["mapped_cuda"] == (not host_buckets) and rec["staged"] == {staging}
    # the receiver page-locks the host buckets it copies to its GPU from
    assert all(rec["locked"]) == (host_buckets and staging != "cpu")


@pytest.mark.gpu
def test_host_tensors_into_cuda_buckets_pushed_under_a_side_stream() -> None:
    """A trainer whose tensors are on the host and whose ipc buckets are on the GPU, pushing
    under a stream of its own: the packing thread queues its copies into the buckets (and their
    headers and digests) on that stream, the one the publish waits on (it was the default
    stream, which a side stream does not wait for)."""
    port = free_port()
    trainer, rec = (
        o.unwrap()
        for o in spawn(
            [
                (_cuda_trainer, (port, "auto", "cuda:0", True, None, "cpu")),
                (_cuda_receiver, (port, "cuda:0", True, "auto")),
            ],
            timeout=120,
            fast_exit=True,
        )
    )
    assert trainer["device_rounds"] and trainer["on_device"]
    assert trainer["full"] == [True, False, True]
    assert rec["bad"] == [[], [], []] and rec["version"] == 3


LONG_BUCKET = 16 << 10  # room for more pieces than a link's cell has header room for


def _many_state(v: int, dev: str) -> dict[str, torch.Tensor]:
    """One tensor over several 16 KiB buckets, then 300 of 16 elements (over 128 pieces to a
    bucket: headers too long for the link's cell); round ``v`` changes only the first."""
    g = torch.Generator().manual_seed(0)
    out = {"big": torch.randn(32768, generator=g).to(torch.bfloat16) + v}
    out.update((f"s{i:03d}", torch.randn(16, generator=g).to(torch.bfloat16)) for i in range(300))
    return {n: t.to(dev) for n, t in out.items()}


def _many_trainer(port: int, dev: str) -> dict[str, Any]:
    from deltackpt import sync
    from deltackpt.options import overrides

    group = sync.SyncGroup("127.0.0.1", port, 0, 2, [0], timeout=60, links="ipc", ipc_device="cpu")
    sender = sync.WeightSender(group, bucket_bytes=LONG_BUCKET)
    with overrides(DELTACKPT_DEVICE_ROUNDS="always"):
        stats = [sender.push(_many_state(v, dev), version=v) for v in (1, 2)]
    sched = sender.schedule
    names = [{sched.tensors[p.tensor].name for p in bk.pieces} for bk in sender._buckets]
    group.pg.barrier().wait()
    group.close()
    return {
        "payload": [s.payload_bytes for s in stats],
        # a bucket of small tensors only, with a header too long for its cell
        "unchanged_long": sum("big" not in n and len(n) > 128 for n in names),
    }


def _many_receiver(port: int, dev: str) -> dict[str, Any]:
    from deltackpt import sync

    group = sync.SyncGroup("127.0.0.1", port, 1, 2, [0], timeout=60, links="ipc", ipc_device="cpu")
    receiver = sync.WeightReceiver(group, bucket_bytes=LONG_BUCKET, device=torch.device(dev))
    held: dict[str, torch.Tensor] = {}
    bad = []
    for v in (1, 2):
        receiver.pull(lambda ws: held.update((n, t.clone()) for n, t in ws))
        want = _many_state(v, dev)
        bad.append(sorted(n for n, t in want.items() if not torch.equal(held[n], t)))
    group.pg.barrier().wait()
    group.close()
    return {"bad": bad, "version": receiver.version}


@pytest.mark.parametrize("dev", ["cpu", pytest.param("cuda:0", marks=pytest.mark.gpu)])
def test_host_buckets_with_long_headers_carry_a_delta_round(
    dev: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Device rounds through host buckets: a bucket whose header is too long for its cell
    (over 128 pieces) with nothing changed goes whole, with a header in it; on CUDA its (no)
    digests lie on the host, the changed bucket's on the GPU, and the round reads each where it
    lies (a concatenation across the two devices failed the trainer's push)."""
    monkeypatch.setenv("DELTACKPT_DEVICE_SCAN", "always")  # the CPU stand-in of a GPU's scan
    port = free_port()
    trainer, rec = (
        o.unwrap()
        for o in spawn(
            [(_many_trainer, (port, dev)), (_many_receiver, (port, dev))],
            timeout=120,
            fast_exit=True,
        )
    )
    assert trainer["unchanged_long"] >= 1
    assert 0 < trainer["payload"][1] < trainer["payload"][0]
    assert rec["bad"] == [[], []] and rec["version"] == 2


# ---- the receiver's host staging, page-locked once its process uses a GPU -----------------


def _lock_trainer(ports: list[int]) -> dict[str, Any]:
    from deltackpt import sync

    group = sync.SyncGroup("127.0.0.1", ports[0], 0, 2, [0], timeout=60, links="ipc")
    sender = sync.WeightSender(group, bucket_bytes=BUCKET)
    for v in (1, 2):
        sender.push(make_state(v), version=v)
    sender = sync.WeightSender(group, bucket_bytes=2 * BUCKET)  # a re-plan: new staging
    sender.push(make_state(3), version=3)
    group.reconnect(ports[1])  # a new epoch: the same receiver plans its staging anew
    sender.push(make_state(4), version=4)
    sender = sync.WeightSender(group, bucket_bytes=2 * BUCKET)
    sender.push(make_state(5), version=5)
    group.pg.barrier().wait()
    group.close()
    return {}


def _lock_receiver(ports: list[int]) -> dict[str, Any]:
    """A receiver whose process uses a GPU (CUDA faked: the page-lock calls recorded), host
    rounds: when its host staging is locked and unlocked."""
    import gc

    from deltackpt import cuda, sync

    calls: list[tuple[str, int]] = []

    def register(t: torch.Tensor) -> bool:
        cuda._REGISTERED[t.data_ptr()] = t.numel()
        calls.append(("lock", t.data_ptr()))
        return True

    def unregister(t: torch.Tensor, wait: bool = True) -> None:
        if cuda._REGISTERED.pop(t.data_ptr(), None) is not None:
            calls.append(("unlock", t.data_ptr()))

    real = (torch.cuda.is_available, torch.cuda.is_initialized, cuda.register_host)
    real_unregister = cuda.unregister_host
    torch.cuda.is_available = torch.cuda.is_initialized = lambda: True  # type: ignore[assignment]
    cuda.register_host, cuda.unregister_host = register, unregister  # type: ignore[assignment]
    layout = ("full",)
    wants = wants_for(layout)
    loaded: dict[str, torch.Tensor] = {}
    out: dict[str, Any] = {"bad": []}

    def pull(receiver: Any) -> None:
        receiver.pull(lambda ws: loaded.update((n, t.clone()) for n, t in ws))
        v = receiver.version
        out["bad"].append(mismatches(wants, loaded, layout, v))

    def arena(receiver: Any) -> int:
        return receiver._arena.data_ptr()

    try:
        group = sync.SyncGroup("127.0.0.1", ports[0], 1, 2, [0], timeout=60, links="ipc")
        r1 = sync.WeightReceiver(group, wants, bucket_bytes=BUCKET)
        pull(r1)
        pull(r1)
        out["r1"] = (arena(r1), r1.staging_locked, list(calls))
        r2 = sync.WeightReceiver(group, wants, bucket_bytes=2 * BUCKET)
        pull(r2)
        a2 = arena(r2)
        del r1
        gc.collect()  # a receiver collected: its lock released
        out["r1_gone"] = list(calls)
        group.reconnect(ports[1])
        pull(r2)
        out["r2"] = (a2, arena(r2), r2.staging_locked, list(calls))
        r3 = sync.WeightReceiver(group, wants, bucket_bytes=2 * BUCKET, pin=False)
        pull(r3)
        out["r3"] = (r3.staging_locked, list(calls))
        del r2
        gc.collect()
        out["end"] = list(calls)
    finally:
        torch.cuda.is_available, torch.cuda.is_initialized, cuda.register_host = real
        cuda.unregister_host = real_unregister
    group.pg.barrier().wait()
    group.close()
    return out


def test_host_staging_is_page_locked_once_cuda_is_in_use_and_unlocked_when_replaced() -> None:
    """``WeightReceiver(pin="auto")`` (the default) on an ipc link: its host staging is
    page-locked once (where it lies, its exact bytes) in a process that uses a GPU, the lock
    released before a re-plan's new staging replaces it and when the receiver is collected;
    ``pin=False`` locks nothing; every round bit-exact."""
    ports = [free_port(), free_port()]
    _, rec = (
        o.unwrap()
        for o in spawn(
            [(_lock_trainer, (ports,)), (_lock_receiver, (ports,))], timeout=120, fast_exit=True
        )
    )
    assert rec["bad"] == [[]] * 5
    a1, locked, calls = rec["r1"]
    assert locked and calls == [("lock", a1)]  # once for both rounds
    a2 = rec["r1_gone"][1][1]
    assert rec["r1_gone"] == [("lock", a1), ("lock", a2), ("unlock", a1)]
    was, a3, locked, calls = rec["r2"]
    assert was == a2 and locked
    # the reconnect's re-plan: the old staging unlocked, the new one locked
    assert calls[3:] == [("unlock", a2), ("lock", a3)]
    locked, calls = rec["r3"]
    assert not locked and len(calls) == 5  # pin=False: nothing locked
    assert rec["end"][5:] == [("unlock", a3)]


@pytest.mark.parametrize("pin", ["yes", 1, None])
def test_a_bad_pin_is_a_plan_error(pin: Any) -> None:
    from deltackpt import sync
    from deltackpt.sync.errors import PlanError

    class _Group:  # checked before anything else of the group is looked at
        rank, trainers, links = 1, [0], "ipc"

    with pytest.raises(PlanError, match=r"pin=.*expected True, False or 'auto'"):
        sync.WeightReceiver(_Group(), pin=pin)  # type: ignore[arg-type]


# ---- handles, in one process ---------------------------------------------------------------


@pytest.mark.parametrize("bad", ["foo", "meta", "cuda:0"])
def test_a_bad_ipc_device_is_refused_before_connecting(bad: str) -> None:
    from deltackpt import sync

    if bad == "cuda:0" and torch.cuda.is_available():
        pytest.skip("CUDA is present: cuda:0 is a valid ipc_device")
    with pytest.raises(sync.SyncError, match="ipc_device="):
        sync.SyncGroup("127.0.0.1", free_port(), 0, 2, [0], links="ipc", ipc_device=bad)


def test_a_handle_maps_the_same_bytes_and_a_wrong_one_is_refused() -> None:
    import json

    from deltackpt.sync import PeerLostError
    from deltackpt.sync.ipc_links import open_handle, share, tensor_handle

    t = share(4096, torch.device("cpu"))
    assert t.is_shared() and len(_files(os.getpid())) >= 1
    raw = tensor_handle(t)
    mapped = open_handle(raw, 4096, "ipc link 0->1 bucket 0")
    t[:4] = torch.tensor([1, 2, 3, 4], dtype=torch.uint8)
    assert mapped[:4].tolist() == [1, 2, 3, 4]  # one storage, two mappings
    assert mapped.data_ptr() != t.data_ptr()
    with pytest.raises(PeerLostError, match=r"4096 bytes, this rank's schedule expects 8192"):
        open_handle(raw, 8192, "ipc link 0->1 bucket 0")
    doc = json.loads(raw)
    with pytest.raises(PeerLostError, match="not a bucket of this link"):
        open_handle(json.dumps({**doc, "name": "/etc/passwd"}).encode(), 4096, "ipc link 0->1")
    with pytest.raises(PeerLostError, match="unreadable handle"):
        open_handle(b"\x80not json", 4096, "ipc link 0->1")
    before = _files(os.getpid())
    del t, mapped
    assert len(_files(os.getpid())) == len(before) - 1  # the last mapping removed its file


def test_a_host_bucket_is_page_locked_only_where_cuda_is() -> None:
    """``cuda.register_host`` page-locks a shared host bucket for a GPU's copies where CUDA
    is present (and unlocks it); without CUDA it says no and the bucket stays as it is."""
    from deltackpt import cuda
    from deltackpt.sync.ipc_links import share

    t = share(1 << 20, torch.device("cpu"))
    if not torch.cuda.is_available():
        assert cuda.register_host(t) is False and not t.is_pinned()
        cuda.unregister_host(t)  # nothing to undo
        return
    assert cuda.register_host(t) and t.is_pinned() and cuda.register_host(t)  # once
    back = torch.empty(1 << 20, dtype=torch.uint8, device="cuda")
    t.fill_(7)
    back.copy_(t, non_blocking=True)
    torch.cuda.synchronize()
    assert int(back.sum()) == 7 << 20
    cuda.unregister_host(t)
    assert not t.is_pinned() and cuda.register_host(torch.empty(0, dtype=torch.uint8)) is False


def test_a_host_lock_collected_during_a_graph_capture_is_undone_after_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A receiver's staging lock (``cuda.HostLock``) collected while this thread captures a
    CUDA graph (vLLM captures them) makes no runtime call there (``cudaHostUnregister`` would
    end the capture): the memory stays locked and alive until the next lock or release, which
    unlocks it. The driver's calls stood in for (no CUDA here; the gpu test below: a real
    capture)."""
    import gc

    from deltackpt import cuda

    locked: dict[int, torch.Tensor] = {}
    undone: list[int] = []

    def register(t: torch.Tensor) -> bool:
        locked[t.data_ptr()] = t
        cuda._REGISTERED[t.data_ptr()] = t.numel()
        return True

    def unregister(t: torch.Tensor, wait: bool = True) -> None:
        cuda._REGISTERED.pop(t.data_ptr(), None)
        undone.append(t.data_ptr())

    monkeypatch.setattr(cuda, "register_host", register)
    monkeypatch.setattr(cuda, "unregister_host", unregister)
    capturing = [True]
    monkeypatch.setattr(cuda, "_capturing", lambda: capturing[0])
    t = torch.empty(4096, dtype=torch.uint8)
    lock = cuda.HostLock(t)
    assert lock.locked
    del lock
    gc.collect()
    assert undone == [] and [id(d) for d in cuda._DEFERRED] == [id(t)]  # nothing called
    capturing[0] = False
    other = cuda.HostLock(torch.empty(64, dtype=torch.uint8))  # the next lock undoes it
    assert undone == [t.data_ptr()] and cuda._DEFERRED == []
    other.release()
    assert len(undone) == 2
    lock = cuda.HostLock(t)
    lock.release()  # outside a capture: unlocked at once, as before
    assert undone[-1] == t.data_ptr() and cuda._DEFERRED == []
    # the very tensor locked again after its lock was deferred: the new lock owns it
    capturing[0] = True
    lock = cuda.HostLock(t)
    del lock
    gc.collect()
    capturing[0] = False
    lock = cuda.HostLock(t)
    assert lock._owned and cuda._DEFERRED == []
    lock.release()
    assert undone[-2:] == [t.data_ptr(), t.data_ptr()] and t.data_ptr() not in cuda._REGISTERED


@pytest.mark.gpu
def test_a_host_lock_collected_inside_a_real_graph_capture_keeps_the_capture() -> None:
    import gc

    from deltackpt import cuda

    t = torch.empty(1 << 20, dtype=torch.uint8)
    lock = cuda.HostLock(t)
    assert lock.locked and t.is_pinned()
    x = torch.zeros(4, device="cuda")
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        x.add_(1)
        del lock
        gc.collect()  # the collector may run anywhere: here, inside the capture
    graph.replay()
    torch.cuda.synchronize()
    assert x.tolist() == [1.0] * 4 and t.is_pinned()  # still locked, the capture intact
    cuda.HostLock(torch.empty(4096, dtype=torch.uint8)).release()
    assert not t.is_pinned() and cuda._DEFERRED == []


def test_a_shared_memory_manager_that_answers_late_is_asked_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """PyTorch's manager is given 1 s to answer each registration (libshm's socket); on a busy
    host it missed that once in the suite ("Shared memory manager connection has timed out"
    from a trainer's first bucket), failing the round. A bucket and a mapping are tried again,
    a few times; another error is not."""
    from deltackpt.sync import ipc_links
    from deltackpt.sync.ipc_links import open_handle, share, tensor_handle

    late = RuntimeError("Shared memory manager connection has timed out")
    real_share = torch.UntypedStorage._share_filename_cpu_
    real_open = torch.UntypedStorage._new_shared_filename_cpu
    calls = {"share": 0, "open": 0}

    def share_late(self: Any) -> Any:
        calls["share"] += 1
        if calls["share"] <= 2:
            raise late
        return real_share(self)

    def open_late(*args: Any) -> Any:
        calls["open"] += 1
        if calls["open"] == 1:
            raise late
        return real_open(*args)

    monkeypatch.setattr(torch.UntypedStorage, "_share_filename_cpu_", share_late)
    monkeypatch.setattr(torch.UntypedStorage, "_new_shared_filename_cpu", open_late)
    t = share(4096, torch.device("cpu"))
    assert t.is_shared() and calls["share"] == 3
    monkeypatch.setattr(torch.UntypedStorage, "_share_filename_cpu_", real_share)
    mapped = open_handle(tensor_handle(t), 4096, "ipc link 0->1 bucket 0")
    t[:3] = torch.tensor([7, 8, 9], dtype=torch.uint8)
    assert mapped[:3].tolist() == [7, 8, 9] and calls["open"] == 2

    def never(self: Any) -> Any:
        raise late

    monkeypatch.setattr(torch.UntypedStorage, "_share_filename_cpu_", never)
    monkeypatch.setattr(ipc_links.time, "sleep", lambda s: None)
    with pytest.raises(RuntimeError, match="timed out"):
        share(4096, torch.device("cpu"))  # given up after MANAGER_TRIES


def test_shared_memory_without_room_is_a_plan_error_that_says_what_to_change(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A CPU bucket /dev/shm has no room for (PyTorch reserves it up front and raises; a
    container's default /dev/shm is 64 MB): a typed error naming the bytes and the fixes, not
    PyTorch's RuntimeError; another RuntimeError passes through. (Checked for real in a mount
    namespace with a 6 MB /dev/shm: the trainer raises this, the receiver the round's abort.)"""
    from deltackpt import sync
    from deltackpt.sync.ipc_links import share

    def full(self: Any) -> Any:
        raise RuntimeError(
            "unable to allocate shared memory(shm) for file </torch_1_2_3>: No space left on "
            "device (28)"
        )

    monkeypatch.setattr(torch.UntypedStorage, "_share_filename_cpu_", full)
    with pytest.raises(sync.PlanError) as got:
        share(4096, torch.device("cpu"))
    for part in ("needs 4096 bytes", "/dev/shm", "--shm-size", "bucket_bytes", "ipc_buckets"):
        assert part in str(got.value), (part, str(got.value))

    def broken(self: Any) -> Any:
        raise RuntimeError("something else")

    monkeypatch.setattr(torch.UntypedStorage, "_share_filename_cpu_", broken)
    with pytest.raises(RuntimeError, match="something else") as other:
        share(4096, torch.device("cpu"))
    assert not isinstance(other.value, sync.SyncError)


def test_a_cuda_bucket_without_room_is_a_plan_error_that_says_what_to_change(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The device out of memory for a CUDA bucket (the ring's two per link): a typed error
    naming the bytes, the device and the fixes (the allocation stood in for on CPU)."""
    from deltackpt import sync
    from deltackpt.sync.ipc_links import share

    empty = torch.empty

    def oom(*args: Any, **kw: Any) -> torch.Tensor:
        if str(kw.get("device", "")).startswith("cuda"):
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 256 MiB")
        return empty(*args, **kw)

    monkeypatch.setattr(torch, "empty", oom)
    with pytest.raises(sync.PlanError) as got:
        share(1 << 28, torch.device("cuda", 0))
    for part in ("needs 268435456 bytes on cuda:0", "bucket_bytes", "ipc_buckets", "ipc_device"):
        assert part in str(got.value), (part, str(got.value))

"""Delta rounds whose changed elements are found on the device (deltackpt/sync/device_patches.py),
run here through the host mirror's CPU stand-in (``DELTACKPT_DEVICE_SCAN=always``,
``DELTACKPT_DEVICE_PATCH=always``): the same device bases, comparisons and scatters a GPU runs,
on CPU tensors.

The parts: the mirror with device bases (only the changed elements cross; a round that fails
leaves the base at the committed version; a tensor with too many changes goes by chunks); the
encoder fed a device list builds the host encoder's payload, byte for byte. End to end (one
trainer, bf16 weights and one fp32 master cast to bf16 -> one receiver over gloo): RL-like
steps (~2% of the elements) are bit-exact on the receiver, send the same payload bytes as the
host path and bring less to the mirror; a round the receiver rejects, a round whose packing
fails on the trainer and a round whose receiver dies (then ``reconnect`` and a replacement)
leave the device bases committed, and the next rounds are exact; a tensor with half its
elements changed falls back and stays exact. The ``gpu`` test runs it on CUDA.
"""

from __future__ import annotations

import os
import time
from typing import Any

import numpy as np
import pytest
import torch

from deltackpt.format.device_changes import changed_elements_on
from deltackpt.options import overrides
from deltackpt.sync import delta_codec
from deltackpt.sync.device_patches import DeviceBases
from deltackpt.sync.host_mirror import HostMirror
from deltackpt.sync.patches import Bases
from tests._dist import free_port, spawn

STANDIN = {"DELTACKPT_DEVICE_SCAN": "always", "DELTACKPT_DEVICE_PATCH": "always"}
VERSIONS = tuple(range(1, 11))
REJECTED = 4  # the receiver votes no
PACK_FAILS = 6  # the trainer's packing raises (after the device found its changes)
DENSE_AT = 8  # half the elements of "wide" change: over the cap, by chunks
BUCKET = 256 << 10  # "big" (2 MiB) goes in pieces over several buckets


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def _as_sent(s: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``s`` as the trainers declare it: floating tensors in bf16."""
    return {n: t.bfloat16() if t.is_floating_point() else t for n, t in s.items()}


def _rl(t: torch.Tensor, share: float, seed: int) -> torch.Tensor:
    """``t`` with about ``share`` of its elements moved by a small step (seeded)."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(t.shape, generator=g) < share
    step = (torch.randn(t.shape, generator=g) * 0.05).to(t.dtype)
    return torch.where(mask, t + step, t)


def state(version: int, device: str = "cpu") -> dict[str, torch.Tensor]:
    """bf16 weights (one of 2 MiB: two fingerprint chunks, several buckets), an fp32 master
    sent as bf16, an int tensor that never changes; each version an RL-like step of ~2% of
    every floating tensor's elements, and at ``DENSE_AT`` half of "wide"'s."""
    g = torch.Generator().manual_seed(0)
    s = {
        "big": torch.randn(1024, 1024, generator=g).bfloat16(),
        "wide": torch.randn(128, 512, generator=g).bfloat16(),
        "norm": torch.randn(512, generator=g).bfloat16(),
        "master": torch.randn(64, 96, generator=g),
        "steps": torch.arange(16),
    }
    for v in range(2, version + 1):
        for i, n in enumerate(("big", "wide", "norm")):
            share = 0.5 if (v == DENSE_AT and n == "wide") else 0.02
            s[n] = _rl(s[n], share, 1000 * v + i)
        # an optimizer step on the master: every fp32 element moves, ~2% of their bf16 casts
        g = torch.Generator().manual_seed(1000 * v + 3)
        s["master"] = s["master"] * (1 + torch.randn(s["master"].shape, generator=g) * 1e-4)
    return {n: t.to(device) for n, t in s.items()}


# ---- the mirror with device bases -------------------------------------------------------------


def test_only_the_changed_elements_cross_and_a_failed_round_keeps_the_base() -> None:
    v1, v2 = state(1), state(2)
    local = {n: v1[n].clone() for n in ("big", "wide")}
    m = HostMirror()
    with overrides(**STANDIN):
        m.stage(local, full=True)
        assert m.last.patched == [] and m.device.bases == {}  # allocated at the commit
        m.commit()
        assert sorted(m.device.bases) == ["big", "wide"]
        assert all(torch.equal(m.device.bases[n], _flat(local[n])) for n in local)
        for n in local:
            local[n].copy_(v2[n])
        k = sum(int((_flat(v1[n]).view(torch.int16) != _flat(v2[n]).view(torch.int16)).sum())
                for n in local)  # fmt: skip
        out, unchanged = m.stage(local, full=False)
        assert sorted(m.last.patched) == ["big", "wide"] and m.last.copied == []
        assert m.last.patched_bytes == k * (4 + 2) and not unchanged
        assert all(torch.equal(out[n], local[n]) for n in local)  # the mirror is the new bytes
        assert m.device.last.elements == k
        m.abandon()  # the round failed: the bases stay at the committed version
        assert all(torch.equal(m.device.bases[n], _flat(v1[n])) for n in local)
        m.stage(local, full=False)  # the next round finds the same changes
        assert m.last.patched_bytes == k * (4 + 2)
        m.commit()
        assert all(torch.equal(m.device.bases[n], _flat(v2[n])) for n in local)
        # too many changes: "wide"'s changed chunks are copied, its base copied at the commit
        local["wide"].copy_(_rl(local["wide"], 0.5, 7))
        out, _ = m.stage(local, full=False)
        assert m.last.copied == ["wide"] and m.last.patched == []
        assert torch.equal(out["wide"], local["wide"])
        m.commit()
        assert torch.equal(m.device.bases["wide"], _flat(local["wide"]))
    with overrides(DELTACKPT_DEVICE_SCAN="always", DELTACKPT_DEVICE_PATCH="off"):
        m.stage(local, full=False)  # "off" drops the bases
        assert m.device.bases == {} and m.device.nbytes == 0


def test_device_patches_are_off_by_default_and_auto_is_cuda_only() -> None:
    local = {"w": torch.randn(300, 7).bfloat16()}
    for knobs in (
        {"DELTACKPT_DEVICE_SCAN": "always"},
        {**STANDIN, "DELTACKPT_DEVICE_PATCH": "auto"},
    ):
        m = HostMirror()
        with overrides(**knobs):
            m.stage(local, full=True)
            m.commit()
            local["w"][3, 3] += 1
            m.stage(local, full=False)
        assert m.device.bases == {} and m.last.copied == ["w"] and m.last.patched == []


# ---- the encoder fed a device list ------------------------------------------------------------


@pytest.mark.parametrize(
    ("dtype", "n", "share", "policy"),
    [
        (torch.bfloat16, 300_001, 0.02, "auto"),  # PACKED
        (torch.bfloat16, 300_001, 0.05, "patch"),
        (torch.bfloat16, 40, 0.05, "auto"),  # a tiny piece: SPARSE
        (torch.float32, 5_000, 0.2, "patch"),
        (torch.float32, 5_000, 0.2, "auto"),  # over 1/16: the host path decides (whole)
        (torch.float32, 5_000, 0.001, "patch"),
    ],
)
def test_a_device_list_encodes_to_the_host_payload(
    dtype: torch.dtype, n: int, share: float, policy: str
) -> None:
    g = torch.Generator().manual_seed(3)
    old = torch.randn(n, generator=g).to(dtype)
    new = _rl(old, share, 4)
    itemsize = old.element_size()
    allow, below = {
        "auto": (frozenset({delta_codec.PACKED, delta_codec.SPARSE}), 1 / 16),
        "patch": (delta_codec.ALL, delta_codec.PACKED_BELOW),
    }[policy]
    key = (0, (0,), (n,), str(dtype).removeprefix("torch."))
    found = changed_elements_on(_flat(new), _flat(old), itemsize, n)  # the whole list
    out = []
    for bases in (Bases(), DeviceBases()):
        bases.allow, bases.packed_below = allow, below
        bases.sent(key, old, dtype)
        bases.commit()
        if isinstance(bases, DeviceBases):
            assert found is not None
            bases.finder = lambda k: found if k == key else None
        got = bases.encode(key, _flat(new), itemsize)
        base = bases._base.get(key)
        out.append((got, None if base is None else base.clone()))
    (host, host_base), (dev, dev_base) = out
    assert (host is None) == (dev is None)
    if host is not None and dev is not None:
        assert host[0] == dev[0] and np.array_equal(host[1], dev[1])
    if host_base is None or dev_base is None:
        assert host_base is None and dev_base is None
    else:
        assert torch.equal(host_base, dev_base) and torch.equal(dev_base, _flat(new))


# ---- end to end -------------------------------------------------------------------------------


def _trainer(port: int, patch: str, device: str) -> list[dict[str, Any]]:
    from deltackpt import sync
    from deltackpt.sync import packer

    knobs = {"DELTACKPT_DEVICE_PATCH": patch}
    if device == "cpu":
        knobs["DELTACKPT_DEVICE_SCAN"] = "always"
    group = sync.SyncGroup("127.0.0.1", port, 0, 2, [0], timeout=60, links="gloo")
    sender = sync.WeightSender(group, bucket_bytes=BUCKET, dtype=torch.bfloat16)
    orig = packer.Packer.message
    out: list[dict[str, Any]] = []
    with overrides(**knobs):
        for v in VERSIONS:
            if v == PACK_FAILS:

                def failing(self: Any, *a: Any, **kw: Any) -> Any:
                    raise RuntimeError("packing failed on purpose")

                packer.Packer.message = failing  # type: ignore[method-assign]
            rec: dict[str, Any] = {"error": None}
            try:
                st = sender.push(state(v, device), version=v)
                rec.update(full=st.full, payload=st.payload_bytes, mirrored=st.mirrored_bytes)
            except sync.SyncError as e:
                rec["error"] = type(e).__name__
            packer.Packer.message = orig  # type: ignore[method-assign]
            # as sent (the fp32 master is mirrored, and based, in its wire dtype)
            committed = _as_sent(state(sender.version or 0, device))
            bases = sender.mirror.device.bases
            rec.update(
                patched=sorted(sender.mirror.last.patched),
                copied=sorted(sender.mirror.last.copied),
                found_pieces=sender._bases.found_pieces,  # type: ignore[attr-defined]
                based=sorted(bases),
                # every device base holds the last committed version, also after a failure
                stale=sorted(
                    n for n, b in bases.items() if not torch.equal(b, _flat(committed[n]))
                ),
            )
            out.append(rec)
    group.pg.barrier().wait()
    group.close()
    return out


def _receiver(port: int) -> list[dict[str, Any]]:
    from deltackpt import sync
    from deltackpt.sync.receiver import WeightReceiver

    group = sync.SyncGroup("127.0.0.1", port, 1, 2, [0], timeout=60, links="gloo")
    receiver = sync.WeightReceiver(group, bucket_bytes=BUCKET)
    pulls = [0]
    orig = WeightReceiver._verify

    def rejecting(self: Any, *a: Any, **kw: Any) -> str | None:
        if pulls[0] == REJECTED:
            return "rejected by the test"
        return orig(self, *a, **kw)

    WeightReceiver._verify = rejecting  # type: ignore[method-assign]
    held: dict[str, torch.Tensor] = {}
    out = []
    for _ in VERSIONS:
        pulls[0] += 1

        def load(ws: list[tuple[str, torch.Tensor]]) -> None:
            for n, t in ws:
                held[n] = t.clone()

        rec: dict[str, Any] = {"error": None}
        try:
            receiver.pull(load)
        except sync.SyncError as e:
            rec["error"] = type(e).__name__
        want = {
            n: t.bfloat16() if t.is_floating_point() else t
            for n, t in state(receiver.version or 0).items()
        }
        bad = sorted(n for n, t in want.items() if n not in held or not torch.equal(held[n], t))
        rec.update(version=receiver.version, bad=bad)
        out.append(rec)
    group.pg.barrier().wait()
    group.close()
    return out


def _run(patch: str, device: str = "cpu") -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    port = free_port()
    outcomes = spawn(
        [(_trainer, (port, patch, device)), (_receiver, (port,))], timeout=120, fast_exit=True
    )
    trainer, receiver = (o.unwrap() for o in outcomes)
    return trainer, receiver


def _check(trainer: list[dict[str, Any]], rec: list[dict[str, Any]]) -> None:
    """What both the CPU stand-in and CUDA must show with device patches on."""
    errors = [r["error"] for r in trainer]
    assert errors[REJECTED - 1] == "RoundAbortedError" and errors[PACK_FAILS - 1] == "SyncError"
    assert [e for i, e in enumerate(errors) if i + 1 not in (REJECTED, PACK_FAILS)] == [None] * 8
    full = [r.get("full") for r in trainer]
    assert full == [True, False, False, None, True, None, True, False, False, False]
    # the receiver: bit-exact after every round; a failed round keeps the last commit
    assert [r["version"] for r in rec] == [1, 2, 3, 3, 5, 5, 7, 8, 9, 10]
    assert all(r["bad"] == [] for r in rec), rec
    # the device bases: allocated by the first commit, at the committed version after every
    # round (the failed ones included); "steps" (int64) and "master" (fp32) have theirs too
    assert all(r["based"] == ["big", "master", "norm", "steps", "wide"] for r in trainer)
    assert all(r["stale"] == [] for r in trainer), trainer
    # RL steps: the bf16 tensors came by their changed elements, and their pieces were encoded
    # from the device's list; so did the fp32 master, cast to its wire dtype (bf16) on the
    # device first: ~2% of its bf16 elements changed
    for v in (2, 3, 8, 9, 10):
        r = trainer[v - 1]
        assert {"big", "norm", "master"} <= set(r["patched"]), (v, r)
        assert r["found_pieces"] > trainer[v - 2]["found_pieces"]
    # half of "wide" changed: over the cap, its chunks copied
    assert "wide" in trainer[DENSE_AT - 1]["copied"]
    assert "wide" not in trainer[DENSE_AT - 1]["patched"]
    assert "wide" in trainer[DENSE_AT]["patched"]  # and by elements again next round


@pytest.mark.multiproc
def test_rl_rounds_are_exact_and_send_the_host_paths_bytes() -> None:
    on, rec_on = _run("always")
    off, rec_off = _run("off")
    _check(on, rec_on)
    assert all(r["bad"] == [] for r in rec_off)
    assert all(r["patched"] == [] and r["found_pieces"] == 0 for r in off)
    # the same payload bytes on the wire, round by round; less brought to the mirror
    assert [r.get("payload") for r in on] == [r.get("payload") for r in off]
    for v in (2, 3, 9, 10):
        assert on[v - 1]["mirrored"] < off[v - 1]["mirrored"] / 2, (v, on[v - 1], off[v - 1])


def _losing_trainer(port: int, port2: int) -> dict[str, Any]:
    """Rounds 1-2 commit; the receiver dies in round 3; after ``reconnect`` a replacement
    gets round 4 (full) and round 5 (by changed elements)."""
    from deltackpt import sync

    group = sync.SyncGroup("127.0.0.1", port, 0, 2, [0], timeout=60, links="gloo")
    sender = sync.WeightSender(group, bucket_bytes=BUCKET, dtype=torch.bfloat16)
    out: dict[str, Any] = {}
    with overrides(**STANDIN):
        for v in (1, 2):
            sender.push(state(v), version=v)
        try:
            sender.push(state(3), version=3)
        except sync.SyncError as e:
            out["error"] = type(e).__name__
        out["patched_3"] = sorted(sender.mirror.last.patched)
        bases, committed = sender.mirror.device.bases, _as_sent(state(2))
        out["stale"] = sorted(
            n for n, b in bases.items() if not torch.equal(b, _flat(committed[n]))
        )
        out["based"] = sorted(bases)
        group.reconnect(port2)
        out["full_4"] = sender.push(state(4), version=4).full
        out["full_5"] = sender.push(state(5), version=5).full
        out["patched_5"] = sorted(sender.mirror.last.patched)
    group.pg.barrier().wait()
    group.close()
    return out


def _dying_receiver(port: int) -> None:
    from deltackpt import sync
    from deltackpt.sync.receiver import WeightReceiver

    group = sync.SyncGroup("127.0.0.1", port, 1, 2, [0], timeout=60, links="gloo")
    receiver = sync.WeightReceiver(group, bucket_bytes=BUCKET)
    receiver.pull(lambda ws: None)
    receiver.pull(lambda ws: None)

    def dying(self: Any, *a: Any, **kw: Any) -> Any:
        os._exit(17)  # mid-round 3, while verifying what arrived

    WeightReceiver._verify = dying  # type: ignore[method-assign]
    receiver.pull(lambda ws: None)


def _replacement_receiver(port2: int) -> list[bool]:
    from deltackpt import sync

    time.sleep(1.0)  # after the first receiver died
    group = sync.SyncGroup("127.0.0.1", port2, 1, 2, [0], timeout=60, links="gloo")
    receiver = sync.WeightReceiver(group, bucket_bytes=BUCKET)
    held: dict[str, torch.Tensor] = {}
    exact = []
    for v in (4, 5):
        receiver.pull(lambda ws: held.update((n, t.clone()) for n, t in ws))
        want = {n: t.bfloat16() if t.is_floating_point() else t for n, t in state(v).items()}
        exact.append(receiver.version == v and all(torch.equal(held[n], want[n]) for n in want))
    group.pg.barrier().wait()
    group.close()
    return exact


@pytest.mark.multiproc
def test_a_lost_receiver_leaves_the_device_bases_committed() -> None:
    port, port2 = free_port(), free_port()
    outs = spawn(
        [
            (_losing_trainer, (port, port2)),
            (_dying_receiver, (port,)),
            (_replacement_receiver, (port2,)),
        ],
        timeout=120,
        fast_exit=True,
    )
    assert outs[1].exitcode == 17
    t = outs[0].unwrap()
    assert t["error"] == "PeerLostError", t
    assert "big" in t["patched_3"]  # the lost round had found its changes on the device
    assert t["based"] and t["stale"] == []  # ... and left the bases at version 2
    assert t["full_4"] and not t["full_5"] and "big" in t["patched_5"]
    assert outs[2].unwrap() == [True, True]


@pytest.mark.gpu
@pytest.mark.multiproc
def test_cuda_rl_rounds_by_changed_elements() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    trainer, rec = _run("auto", "cuda")
    _check(trainer, rec)

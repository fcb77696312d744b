"""Patched delta rounds fail closed: a receiver whose weights are not the round's base version
(edited by hand, or holding another version) fails the round on every rank with a typed error,
nothing is applied anywhere, and the next round (full) is bit-exact; a patch payload written in
a shared-memory window after the publish never reaches the model; a trainer killed while it
encodes patches fails every peer fast, and a replacement catches up with a full round.

World: trainer 0 (whole tensors, bf16) -> receivers 1 and 2. Receiver 1 holds its tensors in
``into`` parameters (which a user can edit), receiver 2 wants everything through
``load_weights``. States from ``test_patches.state`` (a few percent of elements per version).
"""

from __future__ import annotations

import os
import time
from typing import Any

import pytest
import torch

from tests._dist import free_port, spawn
from tests.sync.test_patches import state

pytestmark = pytest.mark.multiproc

WORLD = 3
BUCKET = 4 << 10


def _bf16(v: int) -> dict[str, torch.Tensor]:
    return {n: t.bfloat16() if t.is_floating_point() else t for n, t in state(v).items()}


def _trainer(port: int, links: str, rounds: int, port2: int | None = None) -> list[Any]:
    from deltackpt import sync

    group = sync.SyncGroup("127.0.0.1", port, 0, WORLD, [0], timeout=60, links=links)
    sender = sync.WeightSender(group, bucket_bytes=BUCKET, encode="patch")
    out: list[Any] = []
    for v in range(1, rounds + 1):
        try:
            st = sender.push(_bf16(v), version=v)
            out.append(("ok", st.full))
        except sync.SyncError as e:
            out.append((type(e).__name__, str(e)))
    group.pg.barrier().wait()
    group.close()
    return out


def _receiver(rank: int, port: int, links: str, rounds: int, edit_before: int) -> dict[str, Any]:
    """Pulls ``rounds`` rounds; before round ``edit_before`` the into-receiver (rank 1) edits
    one element of a tensor the round patches, or (rank 1, edit_before < 0) claims to hold
    version ``-edit_before``."""
    from deltackpt import sync

    group = sync.SyncGroup("127.0.0.1", port, rank, WORLD, [0], timeout=60, links=links)
    if rank == 1:
        wants = [sync.Want(n, into=torch.zeros_like(t)) for n, t in _bf16(1).items()]
        receiver = sync.WeightReceiver(group, wants, bucket_bytes=BUCKET)
    else:
        receiver = sync.WeightReceiver(group, bucket_bytes=BUCKET)
    held: dict[str, torch.Tensor] = {}
    out: dict[str, Any] = {"errors": [], "versions": [], "exact": [], "patched": []}
    for v in range(1, rounds + 1):
        if rank == 1 and v == edit_before:
            receiver.wants[0].into[3, 5] += 1  # type: ignore[index]
        if rank == 1 and v == -edit_before:
            receiver.version = 1  # as if it had installed version 1 by hand
        before = {
            w.name: (w.into if w.into is not None else held.get(w.name)) for w in receiver.wants
        }
        before = {n: None if t is None else t.clone() for n, t in before.items()}
        try:
            st = receiver.pull(lambda ws: held.update((n, t.clone()) for n, t in ws))
            out["errors"].append(None)
            out["patched"].append(st.patched)
        except sync.SyncError as e:
            out["errors"].append((type(e).__name__, str(e)))
            out["patched"].append(None)
            now = {
                w.name: (w.into if w.into is not None else held.get(w.name)) for w in receiver.wants
            }
            out["untouched"] = all(
                (a is None and b is None) or torch.equal(a, b)  # type: ignore[arg-type]
                for a, b in zip(before.values(), now.values(), strict=True)
            )
        got = {w.name: (w.into if w.into is not None else held[w.name]) for w in receiver.wants}
        exp = _bf16(receiver.version or 0)
        out["versions"].append(receiver.version)
        out["exact"].append(all(torch.equal(got[n], exp[n]) for n in exp))
    group.pg.barrier().wait()
    group.close()
    return out


@pytest.mark.parametrize("links", ["gloo", "shm"])
@pytest.mark.parametrize("case", ["edited", "other-version"])
def test_receiver_not_at_the_base_fails_the_round_everywhere(links: str, case: str) -> None:
    port = free_port()
    edit = 3 if case == "edited" else -3
    trainer, r1, r2 = (
        o.unwrap()
        for o in spawn(
            [
                (_trainer, (port, links, 4)),
                (_receiver, (1, port, links, 4, edit)),
                (_receiver, (2, port, links, 4, edit)),
            ],
            timeout=90,
        )
    )
    assert trainer[0] == ("ok", True) and trainer[1] == ("ok", False)
    assert trainer[2][0] == "RoundAbortedError", trainer[2]
    assert trainer[3] == ("ok", True)  # the next round is full
    assert r1["patched"][1] > 0 and r2["patched"][1] > 0  # round 2 went as patches
    name, msg = r1["errors"][2]
    assert name == "DigestMismatchError", msg
    assert (
        "has digest" if case == "edited" else "patches version 2 but this rank holds version 1"
    ) in msg
    assert r2["errors"][2][0] == "RoundAbortedError"
    assert r1["untouched"] and r2["untouched"]  # nothing applied on any receiver
    assert r2["versions"] == [1, 2, 2, 4] and r2["exact"] == [True] * 4
    assert r1["versions"][3] == 4 and r1["exact"][3]  # healed by the full round


def _window_attacker(port: int) -> dict[str, Any]:
    """Receiver 2 over shm, with another process's write landing in the patch payload of
    round 2's first bucket after the trainer published it."""
    from deltackpt.sync import rounds
    from deltackpt.sync.shm_links import ShmLinks

    orig = ShmLinks._wait_copy
    hit: list[int] = []

    def hostile(self: ShmLinks, src: int, tag: int, into: torch.Tensor, seq: int) -> None:
        _, cell, data, slot = self._maps[(src, self.g.rank)]
        if seq == 2 and tag == 0:
            while cell[tag, 0] != seq:
                pass
            bk = self.g._receiver._buckets[tag]  # type: ignore[attr-defined]
            data[tag * slot + rounds.payload_start(bk, 64) + 20] ^= 0x10  # a patch byte
            hit.append(seq)
        orig(self, src, tag, into, seq)

    ShmLinks._wait_copy = hostile  # type: ignore[method-assign]
    from deltackpt import sync

    real = sync.WeightReceiver.__init__

    def remember(self: Any, group: Any, *a: Any, **kw: Any) -> None:
        real(self, group, *a, **kw)
        group._receiver = self

    sync.WeightReceiver.__init__ = remember  # type: ignore[method-assign]
    out = _receiver(2, port, "shm", 3, 0)
    out["hit"] = hit
    return out


def test_patch_written_in_the_window_after_publish_never_reaches_the_model() -> None:
    port = free_port()
    trainer, r1, r2 = (
        o.unwrap()
        for o in spawn(
            [
                (_trainer, (port, "shm", 3)),
                (_receiver, (1, port, "shm", 3, 0)),
                (_window_attacker, (port,)),
            ],
            timeout=90,
        )
    )
    assert r2["hit"] == [2]
    assert r2["errors"][1] is not None and r2["errors"][1][0] in (
        "DigestMismatchError",
        "RoundAbortedError",
    ), r2["errors"][1]
    assert r2["untouched"] and r1["untouched"]
    assert trainer[1][0] == "RoundAbortedError" and trainer[2] == ("ok", True)
    assert r1["versions"] == r2["versions"] == [1, 1, 3]
    assert r1["exact"] == r2["exact"] == [True] * 3


def _dying_trainer(port: int, port2: int) -> None:
    from deltackpt import sync
    from deltackpt.sync.patches import Bases

    group = sync.SyncGroup("127.0.0.1", port, 0, WORLD, [0], timeout=60, links="gloo")
    sender = sync.WeightSender(group, bucket_bytes=BUCKET, encode="patch")
    sender.push(_bf16(1), version=1)
    # every receiver has finished round 1 (its vote read back from this process's store) before
    # this process dies in round 2: else a receiver still polling round 1 loses the store there
    group.pg.barrier().wait()
    orig = Bases.encode
    count = [0]

    def dying(*a: Any, **kw: Any) -> Any:
        count[0] += 1
        if count[0] == 2:
            os._exit(17)  # mid-round, while encoding the second patch
        return orig(*a, **kw)

    Bases.encode = dying  # type: ignore[method-assign]
    sender.push(_bf16(2), version=2)


def _replacement_trainer(port2: int) -> list[Any]:
    from deltackpt import sync

    time.sleep(1.0)  # after the first trainer died
    group = sync.SyncGroup("127.0.0.1", port2, 0, WORLD, [0], timeout=60, links="gloo")
    st = sync.WeightSender(group, bucket_bytes=BUCKET, encode="patch").push(_bf16(3), version=3)
    group.pg.barrier().wait()
    return [st.full]


def _surviving_receiver(rank: int, port: int, port2: int) -> dict[str, Any]:
    from deltackpt import sync

    group = sync.SyncGroup("127.0.0.1", port, rank, WORLD, [0], timeout=60, links="gloo")
    # rank 2 stages through two slots, writing verified buckets before the vote: the lost
    # round must be taken back from its own tensors too
    staging = "ring" if rank == 2 else "round"
    receiver = sync.WeightReceiver(group, bucket_bytes=BUCKET, staging=staging)
    held: dict[str, torch.Tensor] = {}

    def load(ws: list[tuple[str, torch.Tensor]]) -> None:
        held.update((n, t.clone()) for n, t in ws)

    def own_exact(v: int) -> bool:
        want = _bf16(v)
        return all(
            torch.equal(t, want[w.name])
            for w, t in zip(receiver.wants, receiver._targets, strict=True)
        )

    receiver.pull(load)
    group.pg.barrier().wait()  # round 1 done everywhere; the trainer dies in round 2
    t0 = time.monotonic()
    out: dict[str, Any] = {}
    try:
        receiver.pull(load)
    except sync.SyncError as e:
        out["error"] = type(e).__name__
    out["seconds"] = time.monotonic() - t0
    out["v1_exact"] = all(torch.equal(held[n], t) for n, t in _bf16(1).items())
    out["own_v1_exact"] = own_exact(1)
    out["ring"] = receiver._ring
    out["version_after"] = receiver.version
    group.reconnect(port2)
    st = receiver.pull(load)
    out["full"], out["version"] = st.full, receiver.version
    out["exact"] = all(torch.equal(held[n], t) for n, t in _bf16(3).items())
    group.pg.barrier().wait()
    return out


def test_trainer_killed_while_encoding_patches() -> None:
    port, port2 = free_port(), free_port()
    outs = spawn(
        [
            (_dying_trainer, (port, port2)),
            (_surviving_receiver, (1, port, port2)),
            (_surviving_receiver, (2, port, port2)),
            (_replacement_trainer, (port2,)),
        ],
        timeout=120,
        fast_exit=True,
    )
    assert outs[0].exitcode == 17
    for o in outs[1:3]:
        r = o.unwrap()
        assert r["error"] == "PeerLostError" and r["seconds"] < 30, r
        assert r["v1_exact"] and r["own_v1_exact"] and r["version_after"] == 1
        assert r["full"] and r["version"] == 3 and r["exact"]
    assert outs[3].unwrap() == [True]
    assert [o.unwrap()["ring"] for o in outs[1:3]] == [False, True]

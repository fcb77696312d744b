"""A receiver's kept pieces edited by hand (issue 37): a delta round does not send a piece that
did not change, so the receiver keeps its copy. With ``WeightReceiver(verify="all")`` every
kept piece is re-hashed before the vote: an edit fails the round on every rank (nothing
applied, version unchanged) and the next round, full, heals it. With the default
``verify="sent"`` the edit is kept until a full round (what docs/sync.md says is checked).

World: one trainer (rank 0, whole tensors) -> one receiver (rank 1, ``into=`` targets).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests._dist import free_port, spawn
from tests.sync._common import make_state, wants_for

pytestmark = pytest.mark.multiproc
ROUNDS = (1, 2, 3, 4)  # make_state changes q (v4), norm (v2), odd (v3); "o" never changes


def _trainer(port: int, links: str) -> list[Any]:
    from deltackpt import sync

    group = sync.SyncGroup("127.0.0.1", port, 0, 2, [0], timeout=60, links=links)
    sender = sync.WeightSender(group, bucket_bytes=8 << 10)
    out: list[Any] = []
    for v in ROUNDS:
        try:
            stats = sender.push(make_state(v), version=v)
            out.append(("ok", stats.full))
        except sync.SyncError as e:
            out.append((type(e).__name__, None))
    group.pg.barrier().wait()
    group.close()
    return out


def _receiver(port: int, links: str, verify: str) -> dict[str, Any]:
    from deltackpt import sync

    group = sync.SyncGroup("127.0.0.1", port, 1, 2, [0], timeout=60, links=links)
    wants = wants_for(("full",))
    into = {w.name: w.into for w in wants if w.into is not None}
    receiver = sync.WeightReceiver(group, wants, bucket_bytes=8 << 10, verify=verify)
    out: dict[str, Any] = {"rounds": [], "o_exact": []}
    for v in ROUNDS:
        if v == 3:  # after round 2 committed: flip one bit of a tensor the trainer never changes
            into["o"].view(-1).view(torch.int32)[5] ^= 1
        try:
            stats = receiver.pull(lambda ws: None)
            out["rounds"].append(("ok", stats.full, receiver.version))
        except sync.SyncError as e:
            out["rounds"].append((type(e).__name__, str(e)[:300], receiver.version))
        out["o_exact"].append(torch.equal(into["o"], make_state(v)["o"]))
    group.pg.barrier().wait()
    group.close()
    return out


@pytest.mark.parametrize(("links", "verify"), [("gloo", "all"), ("shm", "all"), ("gloo", "sent")])
def test_an_edited_kept_piece(links, verify):
    port = free_port()
    outs = spawn(
        [(_trainer, (port, links)), (_receiver, (port, links, verify))], timeout=90, fast_exit=True
    )
    trainer, rec = outs[0].unwrap(), outs[1].unwrap()
    r1, r2, r3, r4 = rec["rounds"]
    assert r1[0] == r2[0] == "ok" and r2[2] == 2 and not r2[1]  # round 2: a delta round
    if verify == "all":
        assert r3[0] == "DigestMismatchError" and "kept piece o" in r3[1], r3
        assert r3[2] == 2  # nothing applied: still version 2
        assert trainer[2][0] == "RoundAbortedError", trainer
        assert r4[0] == "ok" and r4[1] and r4[2] == 4  # the next round is full and heals
        assert rec["o_exact"] == [True, True, False, True]
    else:  # what docs/sync.md says: kept pieces are not re-checked
        assert r3[0] == "ok" and r3[2] == 3
        assert rec["o_exact"] == [True, True, False, False]


def test_verify_is_validated():
    from deltackpt import sync

    class _Group:
        rank, trainers = 1, [0]

    with pytest.raises(sync.PlanError, match="verify"):
        sync.WeightReceiver(_Group(), verify="some")  # type: ignore[arg-type]

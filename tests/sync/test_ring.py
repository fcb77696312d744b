"""``WeightReceiver(staging="ring")``: two message slots reused, each verified bucket written
into the receiver's own tensors before the vote and taken back when the round fails.

1 trainer -> 2 receivers (every tensor whole; a tensor-parallel half through ``boxes``, in
bf16), many small buckets, gloo, shared memory and tensor handles (the trainer's ring of
buckets): full and patched rounds bit-exact as with
``staging="round"``; a round one receiver refuses (its copy changed behind its back: a patch
whose result does not check out, after earlier buckets were written) leaves both receivers
bit-exact on the previous version; ``pull(undo=True)`` then ``revert()``; the arena is two
messages, not a round; ``into`` wants are refused.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests._dist import free_port, spawn
from tests.sync.test_patches import _all, _box, state

pytestmark = pytest.mark.multiproc

BUCKET = 2 << 10
# version -> what happens: "ok", "tamper" (receiver 1 edits a copy first: the round fails),
# "revert" (committed, then taken back); the trainer sends whole after a failed round
PLAN = {1: "ok", 2: "ok", 3: "tamper", 4: "revert", 5: "ok", 6: "revert", 7: "ok", 8: "ok"}
FULL = {4, 5, 7}
TAMPERED = 1  # "q": its buckets come after those of "embed", written by then


def _trainer(rank: int, world: int, port: int, links: str) -> list[Any]:
    from deltackpt import sync

    group = sync.SyncGroup("127.0.0.1", port, rank, world, [0], links=links)
    sender = sync.WeightSender(group, bucket_bytes=BUCKET, encode="patch", zero_copy_min=0)
    out = []
    for v in PLAN:
        try:
            out.append(sender.push(state(v), version=v, full=v in FULL).full)
        except sync.SyncError as e:
            out.append(type(e).__name__)
    group.pg.barrier().wait()
    group.close()
    return out


def _receiver(rank: int, world: int, port: int, links: str, spill_dir: str) -> list[Any]:
    from deltackpt import sync

    group = sync.SyncGroup("127.0.0.1", port, rank, world, [0], links=links)
    half = rank == 2
    boxes = (lambda n, shape: _box(shape, 0, 2)) if half else None
    dtype = torch.bfloat16 if half else None
    # receiver 2 keeps what whole pieces overwrite in a file, receiver 1 in memory
    undo_dir = spill_dir if half else None
    receiver = sync.WeightReceiver(
        group, bucket_bytes=BUCKET, staging="ring", boxes=boxes, dtype=dtype, undo_dir=undo_dir
    )
    model: dict[str, torch.Tensor] = {}

    def expected(v: int, name: str) -> torch.Tensor:
        exp = state(v)[name]
        if half:
            exp = exp[_box(tuple(exp.shape), 0, 2).within(_all(exp))]
            exp = exp.to(torch.bfloat16) if exp.is_floating_point() else exp
        return exp

    def bad(v: int) -> list[str]:
        held = dict(zip([w.name for w in receiver.wants], receiver._targets, strict=True))
        return [n for n, t in held.items() if not torch.equal(t, expected(v, n))]

    out: list[Any] = []
    serving = 0
    for v, what in PLAN.items():
        if what == "tamper" and rank == 1:
            saved = receiver._targets[TAMPERED].view(-1)[:3].clone()
            receiver._targets[TAMPERED].view(-1)[:3] += 1  # a stray write: its patch fails
        try:
            st = receiver.pull(lambda ws: model.update((n, t.clone()) for n, t in ws), undo=True)
        except sync.SyncError as e:
            if what == "tamper" and rank == 1:  # put the stray write back: not the round's
                receiver._targets[TAMPERED].view(-1)[:3] = saved
            out.append((v, type(e).__name__, receiver.version, bad(serving)))
            continue
        if what == "revert":
            kept = (receiver.undo_bytes, receiver.spilled_bytes)
            model.update(receiver.revert())
            out.append((v, "reverted", receiver.version, bad(serving), st.patched > 0, kept))
            continue
        serving = v
        out.append((v, "ok", receiver.version, bad(v), st.patched > 0, st.full))
    out.append(("arena", receiver.staging_bytes, len(receiver._buckets)))
    group.pg.barrier().wait()
    group.close()
    return out


# ipc: the trainer's ring of shared buckets (ipc_buckets=2) against the receivers' ring slots
@pytest.mark.parametrize("links", ["gloo", "shm", "ipc"])
def test_ring_staging_is_bit_exact_and_takes_failed_rounds_back(links: str, tmp_path) -> None:
    port = free_port()
    spill = str(tmp_path)
    jobs = [(_trainer, (0, 3, port, links))]
    jobs += [(_receiver, (r, 3, port, links, spill)) for r in (1, 2)]
    trainer, *receivers = [o.unwrap() for o in spawn(jobs, timeout=120)]
    assert list(tmp_path.iterdir()) == []  # the spill files were unlinked from the start
    assert trainer[2] == "RoundAbortedError"  # the tampered round, refused everywhere
    for rec in receivers:
        *rows, arena = rec
        by_v = {r[0]: r for r in rows}
        # bit-exact on what it serves after every round: the failed round's buckets written
        # before the failing one ("embed") were taken back
        assert all(r[3] == [] for r in rows), rows
        assert by_v[3][1] in ("DigestMismatchError", "RoundAbortedError") and by_v[3][2] == 2
        assert by_v[4][1:3] == ("reverted", 2) and by_v[6][1:3] == ("reverted", 5)
        assert [by_v[v][2] for v in (1, 2, 5, 7, 8)] == [1, 2, 5, 7, 8]
        # the full round taken back: its old bytes in memory (1) or in the spill file (2)
        undo, spilled = by_v[4][5]
        assert (undo == 0 and spilled > 0) if rec is receivers[1] else (undo > 0 == spilled)
        assert by_v[6][5][0] > 0  # a patch's old values stay in memory either way
        assert by_v[2][4] and by_v[8][4]  # patched rounds
        _, nbytes, nbuckets = arena
        assert nbuckets >= 3 and nbytes <= 2 * (BUCKET + 512), arena  # two messages, not a round


def test_ring_staging_refuses_into_wants() -> None:
    from deltackpt import sync

    class G:
        rank, trainers = 1, [0]

    with pytest.raises(sync.PlanError, match="without into"):
        sync.WeightReceiver(
            G(),  # type: ignore[arg-type]
            [sync.Want("w", into=torch.zeros(3))],
            staging="ring",
        )

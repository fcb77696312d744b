"""Rounds a receiver can take back: ``pull(undo=True)`` keeps what a round overwrote (for a
patch only the changed elements), so a ``load_weights`` that raises leaves the targets and the
version as they were, and :meth:`WeightReceiver.revert` puts the previous version back after a
committed round (what an inference engine needs when the commit into its model fails partway).

1 trainer -> 2 receivers (one whole, one tensor-parallel half in bf16, ``into`` targets and
``load_weights`` ones), gloo and shared memory, rounds with patches and whole pieces.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests._dist import free_port, spawn
from tests.sync.test_patches import BUCKET, _all, _box, state

pytestmark = pytest.mark.multiproc

# version -> what the receivers do: "ok", "fail" (load_weights raises), "revert" (commit, then
# revert); the trainer sends whole after a round the receivers took back
PLAN = {1: "ok", 2: "ok", 3: "fail", 4: "ok", 5: "revert", 6: "ok", 7: "ok"}
FULL_AFTER = {4, 6}


class Refused(Exception):
    pass


def _trainer(rank: int, world: int, port: int, links: str) -> list[bool]:
    from deltackpt import sync

    group = sync.SyncGroup("127.0.0.1", port, rank, world, [0], links=links)
    sender = sync.WeightSender(group, bucket_bytes=BUCKET, encode="patch", zero_copy_min=0)
    out = []
    for v in PLAN:
        out.append(sender.push(state(v), version=v, full=v in FULL_AFTER).full)
    group.pg.barrier().wait()
    group.close()
    return out


def _expected(v: int, name: str, part: int | None) -> torch.Tensor:
    exp = state(v)[name]
    if part is None:
        return exp
    exp = exp[_box(tuple(exp.shape), part, 2).within(_all(exp))]
    return exp.to(torch.bfloat16) if exp.is_floating_point() else exp


def _receiver(rank: int, world: int, port: int, links: str) -> list[Any]:
    from deltackpt import sync

    group = sync.SyncGroup("127.0.0.1", port, rank, world, [0], links=links)
    part = None if rank == 1 else 0
    if part is None:
        receiver = sync.WeightReceiver(group, bucket_bytes=BUCKET)
    else:  # TP half in bf16: "embed" through load_weights, the others in place
        wants = []
        for n, t in state(1).items():
            dt = torch.bfloat16 if t.is_floating_point() else t.dtype
            box = _box(tuple(t.shape), part, 2)
            into = None if n == "embed" else torch.zeros(box.size, dtype=dt)
            wants.append(sync.Want(n, box=box, dtype=dt, into=into))
        receiver = sync.WeightReceiver(group, wants, bucket_bytes=BUCKET)
    model: dict[str, torch.Tensor] = {}  # what load_weights got: the "model"
    sparse, missed = [0], []  # changed_elements: tensors told by index, elements it missed

    def bits(t: torch.Tensor) -> torch.Tensor:
        ints = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
        return t.reshape(-1).view(ints[t.element_size()])

    def load(ws: list[tuple[str, torch.Tensor]], fail: bool = False) -> None:
        elements = receiver.changed_elements()
        for n, t in ws:  # every element that moved is among the indices the receiver names
            idx, old = elements.get(n), model.get(n)
            if idx is None or old is None:
                continue
            sparse[0] += 1
            moved = torch.nonzero(bits(old) != bits(t)).reshape(-1)
            if not bool(torch.isin(moved, idx).all()):
                missed.append(n)
        if fail:
            raise Refused("the model refused the weights")
        model.update((n, t.clone()) for n, t in ws)

    def bad(v: int) -> list[str]:
        return [
            w.name
            for w in receiver.wants
            if not torch.equal(
                w.into if w.into is not None else model[w.name], _expected(v, w.name, part)
            )
        ]

    out = []
    serving = 0
    for v, what in PLAN.items():
        try:
            st = receiver.pull(lambda ws, f=what == "fail": load(ws, f), undo=True)
        except Refused:
            out.append((v, "refused", receiver.version, bad(serving)))
            continue
        if what == "revert":
            load(receiver.revert())
            out.append((v, "reverted", receiver.version, bad(serving), st.patched > 0))
            continue
        serving = v
        out.append((v, "ok", receiver.version, bad(v), st.patched > 0))
    try:
        receiver.revert()
        receiver.revert()
    except sync.SyncError as e:
        out.append(str(e))
    out.append(("elements", sparse[0], missed))
    group.pg.barrier().wait()
    group.close()
    return out


@pytest.mark.parametrize("links", ["gloo", "shm", "ipc"])  # ipc: the trainer's ring of buckets
def test_a_round_taken_back_leaves_the_previous_version_bit_exact(links: str) -> None:
    port = free_port()
    jobs = [(_trainer, (0, 3, port, links))]
    jobs += [(_receiver, (r, 3, port, links)) for r in (1, 2)]
    trainer, *receivers = [o.unwrap() for o in spawn(jobs, timeout=120)]
    assert trainer == [v == 1 or v in FULL_AFTER for v in PLAN]
    for rec in receivers:
        *rec, elements = rec
        by_v = {r[0]: r for r in rec[:-1]}
        # every round leaves every target bit-exact on the version the receiver serves
        assert all(r[3] == [] for r in rec[:-1]), rec
        # the changed elements a patch round names cover every element that moved
        assert elements[1] > 0 and elements[2] == [], elements
        assert by_v[3][1:3] == ("refused", 2)  # load_weights raised: version 2 stands
        assert by_v[5][1:3] == ("reverted", 4)  # committed, then taken back
        assert [by_v[v][2] for v in (1, 2, 4, 6, 7)] == [1, 2, 4, 6, 7]
        assert by_v[2][4] and by_v[7][4]  # delta rounds with patches were taken back too
        assert "nothing to revert" in rec[-1]  # one revert per round

"""Change detection of delta rounds: one trainer -> one receiver holding a column slice
(every piece strided in the trainer's tensor), one push per state below; after every round the
receiver's tensors equal the trainer's and the payload is exactly the changed tensors' pieces.

The sender compares one in-place digest per whole local tensor with the one committed last
(after a full round it has none yet and hashes each piece once). The traps: a tensor that goes
back to an earlier value (A -> B -> A must be sent again), and switching ``detect`` between
rounds ("version" sends moved tensors unhashed, so no stale digest may survive it).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests._dist import free_port, spawn

pytestmark = pytest.mark.multiproc

SHAPES = {"a": (32, 16), "b": (16, 64), "c": (48,)}
# (tensor -> multiplier applied to its base value, detect mode, full round)
STEPS: list[tuple[dict[str, float], str, bool]] = [
    ({}, "hash", True),  # full
    ({"a": 2.0}, "hash", False),  # first delta after a full round: piece hashes
    ({"a": 2.0, "b": 3.0}, "hash", False),  # tensor digests from here on
    ({"b": 3.0}, "hash", False),  # a back to its first value: must be sent
    ({"b": 3.0}, "hash", False),  # nothing changed
    ({"b": 3.0}, "version", False),  # version counters recorded from here on
    ({"b": 3.0, "c": 5.0}, "version", False),  # c moved: sent unhashed
    ({"b": 3.0}, "hash", False),  # back to hash: c went back, must be sent
]


def base(name: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(len(name) * 7 + ord(name))
    return torch.randn(SHAPES[name], generator=g)


def value(step: int, name: str) -> torch.Tensor:
    return base(name) * STEPS[step][0].get(name, 1.0)


def col_box(shape: tuple[int, ...]) -> Any:
    from deltackpt import sync

    return sync.shard_box(shape, 1 if len(shape) == 2 else 0, 1, 2)


def _trainer(port: int) -> list[int]:
    from deltackpt import sync

    group = sync.SyncGroup("127.0.0.1", port, 0, 2, [0], timeout=60, links="gloo")
    sender = sync.WeightSender(group, bucket_bytes=4 << 10, encode="dense")  # whole pieces
    state = {n: value(0, n) for n in SHAPES}  # updated in place, as an optimizer does
    payloads = []
    for i, (_, detect, full) in enumerate(STEPS):
        sender.detect = detect
        for n in SHAPES:
            new = value(i, n)
            if not torch.equal(state[n], new):
                state[n].copy_(new)
        payloads.append(sender.push(state, version=i + 1, full=full).payload_bytes)
    group.pg.barrier().wait()
    group.close()
    return payloads


def _receiver(port: int) -> list[list[str]]:
    from deltackpt import sync

    group = sync.SyncGroup("127.0.0.1", port, 1, 2, [0], timeout=60, links="gloo")
    wants = [
        sync.Want(n, box=col_box(s), into=torch.zeros(col_box(s).size)) for n, s in SHAPES.items()
    ]
    receiver = sync.WeightReceiver(group, wants, bucket_bytes=4 << 10)
    bad = []
    for i in range(len(STEPS)):
        receiver.pull()
        bad.append(
            [
                w.name
                for w in wants
                if not torch.equal(w.into, value(i, w.name)[w.box.within(full_box(w.name))])
            ]
        )
    group.pg.barrier().wait()
    group.close()
    return bad


def full_box(name: str) -> Any:
    from deltackpt import sync

    return sync.Box((0,) * len(SHAPES[name]), SHAPES[name])


def piece_bytes(names: list[str]) -> int:
    return sum(col_box(SHAPES[n]).numel * 4 for n in names)


def test_delta_rounds_send_exactly_the_changed_tensors() -> None:
    port = free_port()
    outcomes = spawn([(_trainer, (port,)), (_receiver, (port,))], timeout=90, fast_exit=True)
    payloads, bad = (o.unwrap() for o in outcomes)
    assert bad == [[] for _ in STEPS]  # bit-exact after every round
    changed = [list(SHAPES), ["a"], ["b"], ["a"], [], [], ["c"], ["c"]]
    assert payloads == [piece_bytes(c) for c in changed]

"""Shared pieces of the sync tests: the trainer state, its shards and the receiver layouts.

World layouts (<= 4 processes): ranks 0 and 1 are trainers holding ``Shard(0)`` of every tensor
(fp32); the other ranks are inference ranks: ``("tp", i, n)`` holds part ``i`` of ``n`` of each
tensor as tensor-parallel slices (``TP_DIM``: Shard(1) for matrices, Shard(0) for vectors) in
bf16 for floating tensors, ``("full",)`` holds every tensor whole in the trainer's dtype.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from deltackpt import sync
from tests._dist import free_port

TRAINERS = 2
BUCKET = 8 << 10  # small: big pieces split, many buckets per link


def make_state(version: int) -> dict[str, torch.Tensor]:
    """The trainers' global state at ``version``, deterministic on every process."""
    g = torch.Generator().manual_seed(0)
    s = {
        "embed": torch.randn(64, 48, generator=g),  # 12 KiB fp32: split into several pieces
        "q": torch.randn(40, 24, generator=g),
        "o": torch.randn(24, 40, generator=g),
        "odd": torch.randn(7, 5, generator=g),  # uneven shards on both sides
        "norm": torch.randn(24, generator=g),
        "steps": torch.arange(10),  # int: never cast
        "half": torch.randn(6, 8, generator=g).half(),
    }
    for v in range(2, version + 1):  # each round changes ~one tensor (a delta round)
        name = ["q", "norm", "odd", "embed"][v % 4]
        s[name] = s[name] + v
    return s


def tp_dim(shape: tuple[int, ...]) -> int:
    return 1 if len(shape) == 2 else 0


def wants_for(layout: tuple[Any, ...], version_template: int = 1) -> list[Any]:
    from deltackpt import sync

    out = []
    for name, t in make_state(version_template).items():
        dt = torch.bfloat16 if t.is_floating_point() and layout[0] == "tp" else t.dtype
        if layout[0] == "tp":
            box = sync.shard_box(t.shape, tp_dim(tuple(t.shape)), layout[1], layout[2])
        else:
            box = None
        size = box.size if box is not None else tuple(t.shape)
        into = torch.zeros(size, dtype=dt) if name != "norm" else None  # norm: load_weights
        out.append(sync.Want(name, box=box, dtype=dt, into=into))
    return out


def expected_local(layout: tuple[Any, ...], version: int) -> dict[str, torch.Tensor]:
    from deltackpt import sync

    out = {}
    for name, t in make_state(version).items():
        if layout[0] == "tp":
            box = sync.shard_box(t.shape, tp_dim(tuple(t.shape)), layout[1], layout[2])
            t = t[box.within(sync.Box((0,) * t.dim(), tuple(t.shape)))]
            if t.is_floating_point():
                t = t.to(torch.bfloat16)
        out[name] = t
    return out


def mismatches(wants: list[Any], loaded: dict[str, torch.Tensor], layout: Any, v: int) -> list[str]:
    exp = expected_local(layout, v)
    bad = []
    for w in wants:
        got = w.into if w.into is not None else loaded.get(w.name)
        if got is None or not torch.equal(got, exp[w.name]):
            bad.append(w.name)
    return bad


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


@contextmanager
def local_pair(
    timeout: float = 10.0, links: str = "gloo"
) -> Iterator[tuple[sync.SyncGroup, sync.SyncGroup]]:
    """A trainer (rank 0) and an inference rank (rank 1) of one group, in this process; closed
    on exit."""
    port = free_port()
    groups = run_threads(
        *[
            lambda r=r: sync.SyncGroup("127.0.0.1", port, r, 2, [0], timeout=timeout, links=links)
            for r in (0, 1)
        ]
    )
    for g in groups:
        if isinstance(g, BaseException):
            raise g
    try:
        yield groups[0], groups[1]
    finally:
        for g in groups:
            g.close()

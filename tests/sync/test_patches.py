"""Element-sparse delta rounds end to end: trainers send patches against the version the
receivers hold, receivers rebuild the new bytes, verify them and apply at commit.

Layouts: 1 -> 1, 1 -> 2 (receivers that want everything), and 2 x 2 (``Shard(0)`` trainer
shards -> ``Shard(1)`` tensor-parallel receivers in bf16); links gloo, shared memory and tensor
handles (all with ``encode="patch"``). Rounds mix few changed elements (sparse patches), many (byte planes or
whole pieces), nothing, and full anchors (``full_every``). After every round each receiver holds
the trainers' state bit for bit; delta rounds carry a fraction of a full round's bytes.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests._dist import free_port, spawn

pytestmark = pytest.mark.multiproc

SHAPES = {"embed": (64, 48), "q": (40, 24), "odd": (7, 5), "norm": (24,), "half": (6, 8)}
# fraction of elements changed per version (version 1: the first full round)
CHANGE = {2: 0.02, 3: 0.03, 4: 0.6, 5: 0.0, 6: 0.02, 7: 0.05, 8: 0.01}
VERSIONS = tuple(range(1, 9))
FULL_EVERY = 5  # version 6 is a full anchor
BUCKET = 4 << 10


def _bucket(links: str) -> int:
    """ipc: small buckets, so that every link has more of them than the trainers' ring."""
    return BUCKET // 8 if links == "ipc" else BUCKET


def state(version: int) -> dict[str, torch.Tensor]:
    """The trainers' global state at ``version``: each version changes a random fraction of
    the elements of every floating tensor (as an RL step with a small learning rate does)."""
    g = torch.Generator().manual_seed(0)
    s = {n: torch.randn(shape, generator=g) for n, shape in SHAPES.items()}
    s["half"] = s["half"].half()
    for v in range(2, version + 1):
        for n, t in s.items():
            mask = torch.rand(t.shape, generator=g) < CHANGE[v]
            s[n] = torch.where(mask, t + torch.randn(t.shape, generator=g).to(t.dtype), t)
    s["steps"] = torch.arange(10) + min(version, 4)  # an int tensor, unchanged from 4 on
    return s


def _box(shape: tuple[int, ...], i: int, n: int) -> Any:
    from deltackpt import sync

    return sync.shard_box(shape, 1 if len(shape) == 2 else 0, i, n)


def _trainer(rank: int, world: int, trainers: int, port: int, links: str) -> list[Any]:
    from deltackpt import sync

    group = sync.SyncGroup("127.0.0.1", port, rank, world, range(trainers), links=links)
    sender = sync.WeightSender(
        group, bucket_bytes=_bucket(links), encode="patch", full_every=FULL_EVERY, zero_copy_min=0
    )
    out = []
    for v in VERSIONS:
        s = state(v)
        if trainers > 1:  # Shard(0) row blocks
            s = {
                n: sync.LocalShard(
                    t[_box(tuple(t.shape), rank, trainers).within(_all(t))], o, t.shape
                )
                for n, t in s.items()
                for o in [_box(tuple(t.shape), rank, trainers).offset]
            }
        st = sender.push(s, version=v)
        out.append((st.full, st.payload_bytes, group.reuses_buckets()))
    group.pg.barrier().wait()
    group.close()
    return out


def _all(t: torch.Tensor) -> Any:
    from deltackpt import sync

    return sync.Box((0,) * t.dim(), tuple(t.shape))


def _receiver(rank: int, world: int, trainers: int, port: int, links: str) -> list[Any]:
    from deltackpt import sync

    group = sync.SyncGroup("127.0.0.1", port, rank, world, range(trainers), links=links)
    tp = world - trainers
    j = rank - trainers
    if trainers > 1:  # TP slices in bf16, written in place (norm through load_weights)
        wants = []
        for n, t in state(1).items():
            dt = torch.bfloat16 if t.is_floating_point() else t.dtype
            box = _box(tuple(t.shape), j, tp)
            into = None if n == "norm" else torch.zeros(box.size, dtype=dt)
            wants.append(sync.Want(n, box=box, dtype=dt, into=into))
        receiver = sync.WeightReceiver(group, wants, bucket_bytes=_bucket(links))
    else:
        receiver = sync.WeightReceiver(group, bucket_bytes=_bucket(links))
    held: dict[str, torch.Tensor] = {}
    out = []
    for v in VERSIONS:
        st = receiver.pull(lambda ws: held.update((n, t.clone()) for n, t in ws))
        bad = []
        for w in receiver.wants:
            exp = state(v)[w.name]
            if trainers > 1:
                exp = exp[_box(tuple(exp.shape), j, tp).within(_all(exp))]
                exp = exp.to(torch.bfloat16) if exp.is_floating_point() else exp
            got = w.into if w.into is not None else held[w.name]
            if not torch.equal(got, exp):
                bad.append(w.name)
        out.append((st.full, st.payload_bytes, st.patched, receiver.version, bad))
    group.pg.barrier().wait()
    group.close()
    return out


# ipc: tensor handles, the trainers' default ring of two buckets per link reused within each
# round (several trainers and receivers waiting on each other's copies: no deadlock); "ipc
# device": device rounds on it (the CPU stand-in; changed pieces sent whole, no host patches)
@pytest.mark.parametrize("links", ["gloo", "shm", "ipc", "ipc device"])
@pytest.mark.parametrize("shape", [(1, 1), (1, 2), (2, 2)])
def test_patched_rounds_are_bit_exact(
    shape: tuple[int, int], links: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    m, n = shape
    port = free_port()
    device = links == "ipc device"
    if device:  # the spawned ranks inherit it
        monkeypatch.setenv("DELTACKPT_DEVICE_ROUNDS", "always")
        links = "ipc"
    jobs = [(_trainer, (r, m + n, m, port, links)) for r in range(m)]
    jobs += [(_receiver, (m + j, m + n, m, port, links)) for j in range(n)]
    outs = [o.unwrap() for o in spawn(jobs, timeout=120)]
    for rec in outs[m:]:
        assert [r[4] for r in rec] == [[] for _ in VERSIONS]  # bit-exact after every round
        assert [r[3] for r in rec] == list(VERSIONS)
        fulls = [r[0] for r in rec]
        assert fulls[0] and fulls[5]  # the first round and the anchor
        full_bytes = rec[0][1]
        by_v = dict(zip(VERSIONS, rec, strict=True))
        for v in (2, 3, 7, 8):  # few elements changed: patches, a fraction of the bytes
            assert device or by_v[v][2] > 0, (v, by_v[v])
            assert device or by_v[v][1] < full_bytes * 0.5, (v, by_v[v][1], full_bytes)
        assert by_v[5][1] == 0  # nothing changed: nothing sent
    for tr in outs[:m]:
        assert [f for f, _, _ in tr] == [v in (1, 6) for v in VERSIONS]
        assert all(r for _, _, r in tr) == (links == "ipc")  # the ring reused within rounds

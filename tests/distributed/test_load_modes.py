"""``load(process_group=pg, mode=...)``: all_ranks, broadcast and auto on 2 and 4 gloo ranks,
resharding (saved on 2 ranks, loaded on 4 with other placements), ``keys=`` filters, bytes read
from storage per rank, and failures (a corrupt chunk, a dead reader, a dead receiver)."""

from __future__ import annotations

import os
import time

import pytest
import torch

import deltackpt
from tests._dist import free_port, init_gloo, run_ranks, spawn

pytestmark = [pytest.mark.multiproc, pytest.mark.slow]


def _init(rank: int, world: int, port: int, timeout: float = 30.0) -> object:
    return init_gloo(rank, world, port, timeout)


def full_state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return {
        "a": torch.randn(37, 24, generator=g),  # uneven over 2 and 4 ranks
        "b": torch.randn(12, 50, generator=g).to(torch.bfloat16),
        "r": torch.randn(300, 40, generator=g),  # replicated, several chunks
        "plain": torch.arange(11, dtype=torch.int64),
        "s": torch.tensor(3.5),
    }


def _save(rank: int, world: int, port: int, store: str) -> bool:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    _init(rank, world, port)
    if rank == 0:
        deltackpt.open_store(store, chunk_bytes=4096, small_bytes=256)
    dist.barrier()
    mesh = init_device_mesh("cpu", (world,))
    full = full_state()
    state = {
        "a": distribute_tensor(full["a"], mesh, [Shard(0)]),
        "b": distribute_tensor(full["b"], mesh, [Shard(1)]),
        "r": distribute_tensor(full["r"], mesh, [Replicate()]),
        "plain": full["plain"],
        "s": full["s"],
        "meta": {"step": 5, "lr": 0.25},
    }
    deltackpt.save(state, store, "s0", process_group=dist.group.WORLD)
    dist.destroy_process_group()
    return True


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> str:
    store = str(tmp_path_factory.mktemp("modes") / "s")
    assert run_ranks(_save, 2, free_port(), store, timeout=120) == [True, True]
    return store


def _target(world: int, placements: dict[str, object]) -> dict[str, object]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    zeros = {k: torch.zeros_like(v) for k, v in full_state().items()}
    out: dict[str, object] = {
        k: distribute_tensor(zeros[k], mesh, [p]) for k, p in placements.items()
    }
    out.update({k: v for k, v in zeros.items() if k not in placements})
    out["meta"] = {"step": -1, "lr": 0.0}
    return out


def _check(target: dict[str, object], keys: set[str]) -> dict[str, bool]:
    """Per key: loaded bit-exact if in ``keys``, still zero otherwise."""
    exp = full_state()
    ok = {}
    for k, v in exp.items():
        t = target[k]
        got = t.full_tensor() if hasattr(t, "full_tensor") else t  # type: ignore[union-attr]
        ok[k] = bool(torch.equal(got, v)) if k in keys else not bool(got.any())
    return ok


def _load_modes(rank: int, world: int, port: int, store: str) -> dict:
    import torch.distributed as dist
    from torch.distributed.tensor import Replicate, Shard

    from tests.loading.test_keys import count_reads

    _init(rank, world, port)
    pg = dist.group.WORLD
    sharded = {"a": Shard(1), "b": Shard(0), "r": Shard(0)}
    out: dict = {}
    everything = set(full_state())
    for mode in ("all_ranks", "broadcast"):
        t = _target(world, sharded)
        with count_reads() as n:
            deltackpt.load(store, "s0", into=t, process_group=pg, mode=mode, bucket_bytes=16384)
        out[f"{mode}/sharded"] = (_check(t, everything), t["meta"], n[0])
    # keys=: only "a" and meta/step, in both modes
    for mode in ("all_ranks", "broadcast"):
        t = _target(world, sharded)
        with count_reads() as n:
            deltackpt.load(store, into=t, process_group=pg, mode=mode, keys=["a", "meta/step"])
        out[f"{mode}/keys"] = (_check(t, {"a"}), t["meta"], n[0])
    # replicated DTensors and plain tensors: auto picks broadcast (only rank 0 reads)
    t = _target(world, {"a": Replicate(), "r": Replicate()})
    with count_reads() as n:
        deltackpt.load(store, "s0", into=t, process_group=pg, mode="auto", bucket_bytes=8192)
    out["auto/replicated"] = (_check(t, everything), n[0])
    # sharded targets: auto picks all_ranks (every rank reads its own rows)
    t = _target(world, sharded)
    with count_reads() as n:
        deltackpt.load(store, "s0", into=t, process_group=pg, mode="auto")
    out["auto/sharded"] = (_check(t, everything), n[0])
    # no into: new tensors on every rank, with a filter
    with count_reads() as n:
        got = deltackpt.load(store, process_group=pg, mode="broadcast", keys=lambda p: p != "r")
    exp = full_state()
    out["broadcast/new"] = (
        sorted(got),
        all(torch.equal(got[k], exp[k]) for k in exp if k != "r"),
        got["meta"],
        n[0],
    )
    dist.destroy_process_group()
    return out


@pytest.mark.parametrize("world", [4, 2])
def test_modes_reshard_bit_exact_and_only_the_reader_reads(saved: str, world: int) -> None:
    from tests.loading.test_keys import count_reads

    with count_reads() as one:  # what one process loading everything reads
        deltackpt.load(saved, "s0")
    results = run_ranks(_load_modes, world, free_port(), saved, timeout=150)
    for rank, out in enumerate(results):
        for mode in ("all_ranks", "broadcast"):
            ok, meta, _ = out[f"{mode}/sharded"]
            assert all(ok.values()) and meta == {"step": 5, "lr": 0.25}, (rank, mode, ok)
            ok, meta, _ = out[f"{mode}/keys"]
            assert all(ok.values()) and meta == {"step": 5, "lr": 0.0}, (rank, mode, ok)
        ok, _ = out["auto/replicated"]
        assert all(ok.values()), (rank, ok)
        ok, n = out["auto/sharded"]
        assert all(ok.values()) and n > 0, (rank, ok)
        keys, same, meta, _ = out["broadcast/new"]
        assert keys == ["a", "b", "meta", "plain", "s"] and same and meta["lr"] == 0.25
    reads = {k: [out[k][-1] for out in results] for k in results[0]}
    # broadcast: the reading rank reads every chunk once (a chunk cut by a bucket's end too),
    # and no other rank reads at all
    chunk_bytes = sum(c.length for c in deltackpt.open_store(saved).manifest("s0").chunks.values())
    for k in ("broadcast/sharded", "auto/replicated"):
        # every chunk once; at most the alignment padding a single process reads on top
        assert chunk_bytes <= reads[k][0] <= one[0], (k, reads[k], chunk_bytes, one[0])
        assert reads[k][1:] == [0] * (world - 1), (k, reads[k])
    assert reads["broadcast/keys"] == [37 * 24 * 4] + [0] * (world - 1)  # only "a"'s bytes
    # all_ranks with sharded targets: every rank reads, and less than everything
    assert all(0 < n < one[0] for n in reads["all_ranks/sharded"]), reads
    assert reads["all_ranks/keys"] == [37 * 24 * 4] * world, reads  # a Shard(1) target: all rows


def _broken(rank: int, world: int, port: int, store: str, how: str) -> dict:
    import torch.distributed as dist

    from deltackpt.distributed import load as dl

    # the default rendezvous and collective timeout (30 s): a shorter one made the rendezvous of 3
    # freshly spawned ranks fail on a busy machine; failures are seen in ~0.1-1.3 s anyway
    _init(rank, world, port)
    pg = dist.group.WORLD
    read_bucket, copy_out = dl.BroadcastLoad._read_bucket, dl.BroadcastLoad._copy_out
    calls = [0]

    def dying_reader(self, *a):  # type: ignore[no-untyped-def]
        calls[0] += 1
        if calls[0] == 3:
            os._exit(3)
        return read_bucket(self, *a)

    def dying_receiver(self, *a):  # type: ignore[no-untyped-def]
        calls[0] += 1
        if calls[0] == 2:
            os._exit(4)
        return copy_out(self, *a)

    if how == "reader" and rank == 0:
        dl.BroadcastLoad._read_bucket = dying_reader  # type: ignore[method-assign]
    if how == "receiver" and rank == 1:
        dl.BroadcastLoad._copy_out = dying_receiver  # type: ignore[method-assign]
    t0 = time.monotonic()
    try:
        deltackpt.load(store, "s0", process_group=pg, mode="broadcast", bucket_bytes=4096)
    except deltackpt.errors.DistributedError as e:
        return {
            "error": type(e).__name__,
            "failures": [(f.rank, f.step, f.error) for f in e.failures],
            "seconds": time.monotonic() - t0,
        }
    return {"error": None}


def _corrupt(store: str) -> None:
    st = deltackpt.open_store(store)
    m = st.manifest("s0")
    e = next(e for e in m.tensors if e.path == "r")
    rec = m.chunks[e.all_slices()[-1][0]]
    p = st.pack_path(rec.pack)
    p.chmod(0o644)
    with open(p, "r+b") as f:
        f.seek(rec.offset)
        b = f.read(1)
        f.seek(rec.offset)
        f.write(bytes([b[0] ^ 1]))


def test_failures_raise_typed_errors_on_every_live_rank(saved: str, tmp_path) -> None:
    import shutil

    # a dead reading rank: every receiver raises, within the group timeout (30 s)
    port = free_port()
    outcomes = spawn([(_broken, (r, 3, port, saved, "reader")) for r in range(3)], timeout=90)
    assert outcomes[0].exitcode == 3
    for o in outcomes[1:]:
        v = o.unwrap()
        assert v["error"] == "DistributedError" and v["seconds"] < 30, v
    # a dead receiver: the reader and the other receiver raise
    port = free_port()
    outcomes = spawn([(_broken, (r, 3, port, saved, "receiver")) for r in range(3)], timeout=90)
    assert outcomes[1].exitcode == 4
    for o in (outcomes[0], outcomes[2]):
        v = o.unwrap()
        assert v["error"] == "DistributedError" and v["seconds"] < 30, v
    # a corrupt chunk on the reader: the same error on every rank, naming the read step
    store = str(tmp_path / "c")
    shutil.copytree(saved, store)
    _corrupt(store)
    results = run_ranks(_broken, 2, free_port(), store, "none", timeout=90)
    for v in results:
        assert v["error"] == "DistributedError"
        assert v["failures"] == [(0, "read", "CorruptChunkError")], v

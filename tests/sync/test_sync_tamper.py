"""Weight sync treats the shared-memory window as untrusted: a writer that changes it after the
receiver verified a bucket cannot make ``load_weights`` see bytes the sender never sent.

Every test asserts the same contract: ``load_weights`` is handed exactly the sender's bytes, or
the round fails with a typed ``deltackpt.sync`` error and the receiver keeps its last version
(and, with ``apply="on_commit"``, its model) — never wrong bytes with a normal return.

The writer is a second, independent mapping of the window file (as a buggy or hostile process
that maps ``/dev/shm/deltackpt-sync-*`` would hold it), driven at well-defined points of a round
through the protocol functions the receiver calls (``_protocol.header``, ``_protocol.vote``).
"""

from __future__ import annotations

import glob
import mmap
import os
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from deltackpt import sync
from deltackpt.sync import _protocol as proto
from deltackpt.sync import packing as packing_mod
from deltackpt.sync.transport import Channel
from tests._dist import spawn
from tests.sync.test_sync_local import Collect, assert_same, model, run_threads, transports

TYPED = (sync.DigestMismatchError, sync.RoundAbortedError)


@pytest.fixture
def shm_name() -> Iterator[str]:
    name = f"tamper-{uuid.uuid4().hex[:12]}"
    yield name
    sync.ShmTransport.unlink(name)


class Window:
    """An independent read-write mapping of a receiver's shm window: its arena, where every
    round lays out its buckets (``plan.arena_offsets``)."""

    def __init__(self, receiver: sync.WeightReceiver) -> None:
        ch: Any = receiver._channel
        size = os.path.getsize(ch.path)
        fd = os.open(ch.path, os.O_RDWR)
        try:
            self.mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self.arena = np.frombuffer(self.mm, np.uint8)[ch.data.storage_offset() :]
        self.offsets: list[int] = ch.offsets  # this round's layout, as the receiver sees it
        self.flips = 0

    def flip(self, lo: int = 0, hi: int | None = None) -> None:
        self.arena[lo:hi] ^= 0xFF
        self.flips += 1

    def flip_bucket(self, plan: sync.Plan, index: int) -> None:
        off = self.offsets[index]
        self.flip(off, off + plan.buckets[index].nbytes)  # full rounds: plan.buckets is the layout

    def close(self) -> None:
        del self.arena
        self.mm.close()


class Strict(Collect):
    """load_weights that checks every tensor it is handed against what the sender sent."""

    def __init__(self, want: dict[str, torch.Tensor]) -> None:
        super().__init__()
        self.want = want
        self.wrong: list[str] = []

    def __call__(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        for n, t in weights:
            w = self.want[n]
            if t.dtype != w.dtype or t.shape != w.shape or not torch.equal(t, w):
                self.wrong.append(n)
        super().__call__(weights)


def assert_verified_or_failed(
    result: Any,
    receiver: sync.WeightReceiver,
    sink: Strict,
    *,
    version: int,
    kept_version: int | None,
    kept: dict[str, torch.Tensor],
) -> None:
    assert sink.wrong == [], f"load_weights got bytes the sender never sent: {sink.wrong}"
    if isinstance(result, BaseException):
        assert isinstance(result, TYPED), repr(result)
        assert receiver.version == kept_version
        if receiver.apply == "on_commit":
            assert_same(sink.state, kept)  # the model never saw the round
    else:
        assert receiver.version == version
        assert_same(sink.state, sink.want)


def first_round(
    sender: sync.WeightSender, receiver: sync.WeightReceiver, state: dict[str, torch.Tensor]
) -> Strict:
    sink = Strict(state)
    _, res = run_threads(lambda: sender.push(state, 1), lambda: receiver.pull(sink))
    if isinstance(res, BaseException):
        raise res
    assert sink.wrong == [] and receiver.version == 1
    return sink


def synced_pair(
    shm_name: str, apply: str = "on_commit"
) -> tuple[Any, sync.WeightSender, sync.WeightReceiver, Strict, dict[str, torch.Tensor]]:
    """A sender and a receiver over shm after one clean round: (the receiver's transport,
    sender, receiver, its sink, a copy of the weights it committed)."""
    t0, t1 = transports(shm_name, 2)
    sender = sync.WeightSender(t0, bucket_bytes=16 << 10)
    receiver = sync.WeightReceiver(t1, apply=apply)  # type: ignore[arg-type]
    sink = first_round(sender, receiver, model(0))
    return t1, sender, receiver, sink, {n: t.clone() for n, t in sink.state.items()}


def test_window_changed_after_the_vote_never_reaches_load_weights(
    shm_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """on_commit: the round is verified and voted; then every byte of the window flips before
    the receiver hands the staged buckets over (a sender starting the next round early, or any
    other process writing the window)."""
    t1, sender, receiver, sink, kept = synced_pair(shm_name)
    window = Window(receiver)
    real_vote = proto.vote

    def vote_then_tamper(t: Any, reject: bool) -> int:
        out = real_vote(t, reject)
        if t is t1:
            window.flip()
        return out

    monkeypatch.setattr(proto, "vote", vote_then_tamper)
    sink.want = v2 = model(1)
    _, res = run_threads(lambda: sender.push(v2, 2, full=True), lambda: receiver.pull(sink))
    assert window.flips == 1
    assert_verified_or_failed(res, receiver, sink, version=2, kept_version=1, kept=kept)
    window.close()


@pytest.mark.parametrize("apply", ["on_commit", "per_bucket"])
def test_bucket_changed_after_its_header_never_reaches_load_weights(
    shm_name: str, monkeypatch: pytest.MonkeyPatch, apply: str
) -> None:
    """Each bucket flips in the window right after its header (with the digest the receiver
    already checked the bucket against) reached the receiver."""
    t1, sender, receiver, sink, kept = synced_pair(shm_name, apply)
    window = Window(receiver)
    real_header = proto.header

    def header_then_tamper(t: Any, src: int, index: int, *args: Any) -> tuple[int, str]:
        out = real_header(t, src, index, *args)
        if t is t1 and out[0] == proto.OK:
            window.flip_bucket(receiver.plan, index)
        return out

    monkeypatch.setattr(proto, "header", header_then_tamper)
    sink.want = v2 = model(1)
    _, res = run_threads(lambda: sender.push(v2, 2, full=True), lambda: receiver.pull(sink))
    assert window.flips == len(receiver.plan.buckets) > 3
    assert_verified_or_failed(res, receiver, sink, version=2, kept_version=1, kept=kept)

    monkeypatch.setattr(proto, "header", real_header)  # the next clean round commits
    sink.want = v3 = model(2)
    _, res = run_threads(lambda: sender.push(v3, 3), lambda: receiver.pull(sink))
    assert not isinstance(res, BaseException), res
    assert receiver.version == 3 and sink.wrong == []
    assert_same(sink.state, v3)
    window.close()


class _FlipAfterCopy:
    """Stands in for numpy in the sender's packing module: every ``copyto`` into the shared window is
    followed by a write of another process into the bytes just copied, before the sender hashes
    them."""

    def __init__(self) -> None:
        self.flips = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(np, name)

    def copyto(self, dst: np.ndarray, src: np.ndarray, **kw: Any) -> None:
        np.copyto(dst, src, **kw)
        if dst.size:
            dst[0] ^= 0xFF
            self.flips += 1


def test_window_changed_while_the_sender_packs_is_detected(
    shm_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The sender's digest names the bytes it meant to send (its tensors), not whatever the window
    holds after its copy: a write that lands between the copy and the hash is caught."""
    _, sender, receiver, sink, kept = synced_pair(shm_name)
    fake = _FlipAfterCopy()
    monkeypatch.setattr(packing_mod, "np", fake)
    sink.want = v2 = model(1)
    s_res, res = run_threads(lambda: sender.push(v2, 2, full=True), lambda: receiver.pull(sink))
    assert fake.flips > 0
    assert_verified_or_failed(res, receiver, sink, version=2, kept_version=1, kept=kept)
    assert isinstance(res, sync.DigestMismatchError), res  # flipped bytes always mismatch
    assert isinstance(s_res, sync.RoundAbortedError) and sender.version == 1


class _OwnRing(Channel):
    """A receiver-side channel that ignores ``into`` and returns buckets in a ring of two buffers
    of its own, reused every second bucket — as the Channel contract allows for a channel that is
    not ``stable`` (e.g. NCCL buckets on a device when the staging is in host memory)."""

    relays = False
    stable = False

    def __init__(self, inner: Channel) -> None:
        self.inner = inner
        self.ring: list[torch.Tensor] = []
        self.n = 0
        self.slot: dict[int, torch.Tensor] = {}

    def begin_round(self, buckets: Any) -> None:
        self.inner.begin_round(buckets)
        need = max((b.nbytes for b in buckets), default=0)
        if not self.ring or self.ring[0].numel() < need:
            self.ring = [torch.empty(need, dtype=torch.uint8) for _ in range(2)]

    def buffer(self, bucket: Any) -> torch.Tensor:
        raise AssertionError("receiver-side channel")

    def send(self, bucket: Any, extents: Any = None) -> None:
        raise AssertionError("receiver-side channel")

    def expect(self, bucket: Any, into: torch.Tensor | None) -> None:
        self.slot[bucket.index] = self.ring[self.n % 2][: bucket.nbytes]
        self.n += 1

    def wait(self, bucket: Any) -> torch.Tensor:
        out = self.slot.pop(bucket.index)
        out.copy_(self.inner.wait(bucket))
        return out

    def close(self) -> None:
        self.inner.close()


def test_on_commit_stages_buckets_a_channel_returns_in_its_own_ring(shm_name: str) -> None:
    """The receiver must stage what it verified even when the channel hands back buffers it will
    reuse for later buckets (the bytes of bucket i would otherwise be those of bucket i+2)."""
    t0, t1 = transports(shm_name, 2)
    real_open = t1.open_channel
    t1.open_channel = lambda plan: _OwnRing(real_open(plan))  # type: ignore[method-assign]
    sender = sync.WeightSender(t0, bucket_bytes=16 << 10)
    receiver = sync.WeightReceiver(t1)
    state = model(0)
    sink = Strict(state)
    _, res = run_threads(lambda: sender.push(state, 1), lambda: receiver.pull(sink))
    assert len(receiver.plan.buckets) > 3
    assert_verified_or_failed(res, receiver, sink, version=1, kept_version=None, kept={})
    assert not isinstance(res, BaseException), res


# ---- a hostile process scribbles over the window while rounds run -------------------------


WORLD = 3  # sender 0, receivers 1 (on_commit) and 2 (per_bucket)
ROUNDS = 12


def _state(v: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(v)
    return {f"w{i}": torch.randn(3000 + 7 * i, generator=g) for i in range(6)}


def _scribbler(name: str, marks: str, seconds: float) -> int:
    """Map the window as soon as it exists and flip random bytes in it until ``stop`` appears."""
    deadline = time.monotonic() + seconds
    paths: list[str] = []
    while not paths:
        paths = glob.glob(f"/dev/shm/deltackpt-sync-{glob.escape(name)}.w*")
        if time.monotonic() > deadline:
            raise TimeoutError("the window never appeared")
        time.sleep(0.01)
    fd = os.open(paths[0], os.O_RDWR)
    mm = mmap.mmap(fd, os.path.getsize(paths[0]))
    os.close(fd)
    # past the first page, the per-bucket cells (publish/progress; this plan has < 170 pieces):
    # flipping those would only stall the round into a timeout, the arena is what matters here
    data = np.frombuffer(mm, np.uint8)[4096:]
    rng = np.random.default_rng(0)
    flips = 0
    Path(marks, "scribbling").touch()
    while not Path(marks, "stop").exists() and time.monotonic() < deadline:
        pos = rng.integers(0, data.size, 2)
        data[pos] ^= 0xFF
        flips += 1
        time.sleep(rng.uniform(0, 0.002))
    return flips


def _wait_for(path: Path, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} never appeared")
        time.sleep(0.01)


def _tamper_rank(rank: int, name: str, marks: str) -> dict[str, Any]:
    from deltackpt import sync

    t = sync.ShmTransport(name, rank=rank, world_size=WORLD, senders=[0], timeout=30)
    if rank == 0:
        sender = sync.WeightSender(t, bucket_bytes=8 << 10)
        out = []
        for v in range(1, ROUNDS + 2):
            if v == 2:  # the window exists since round 1: wait until someone scribbles on it
                _wait_for(Path(marks, "scribbling"), 60)
            if v == ROUNDS + 1:  # last round: the scribbler has stopped
                Path(marks, "stop").touch()
                time.sleep(0.1)
            try:
                out.append(sender.push(_state(v), v, full=True).version)
            except sync.RoundAbortedError:
                out.append(None)
        return {"versions": out}
    receiver = sync.WeightReceiver(t, apply="on_commit" if rank == 1 else "per_bucket")
    rounds = []
    for v in range(1, ROUNDS + 2):
        want = _state(v)
        wrong: list[str] = []
        seen: dict[str, torch.Tensor] = {}

        def load(
            ws: list[tuple[str, torch.Tensor]],
            want: dict[str, torch.Tensor] = want,
            wrong: list[str] = wrong,
            seen: dict[str, torch.Tensor] = seen,
        ) -> None:
            for n, x in ws:
                if not torch.equal(x, want[n]):
                    wrong.append(n)
                seen[n] = x.clone()

        try:
            receiver.pull(load)
            err = None
        except sync.SyncError as e:
            err = type(e).__name__
        rounds.append(
            {
                "error": err,
                "wrong": wrong,
                "version": receiver.version,
                "complete": sorted(seen) == sorted(want),
            }
        )
    return {"rounds": rounds}


@pytest.mark.multiproc
def test_hostile_process_scribbling_the_window(tmp_path: Path) -> None:
    name = f"scribble-{uuid.uuid4().hex[:10]}"
    try:
        outcomes = spawn(
            [(_tamper_rank, (r, name, str(tmp_path))) for r in range(WORLD)]
            + [(_scribbler, (name, str(tmp_path), 90.0))],
            timeout=120,
            fast_exit=True,
        )
    finally:
        sync.ShmTransport.unlink(name)
    versions = outcomes[0].unwrap()["versions"]
    assert outcomes[3].unwrap() > 0
    for o in outcomes[1:3]:
        rounds = o.unwrap()["rounds"]
        last = None
        for v, r in enumerate(rounds, start=1):
            assert r["wrong"] == [], f"rank {o.index} round {v}: wrong bytes {r['wrong']}"
            if r["error"] is None:
                assert r["version"] == v and r["complete"] and versions[v - 1] == v
                last = v
            else:
                assert r["error"] in ("DigestMismatchError", "RoundAbortedError"), r
                assert r["version"] == last and versions[v - 1] is None
        assert rounds[-1]["error"] is None  # once the writer stopped, rounds commit again

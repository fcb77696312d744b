"""deltackpt.Follower on a local store: incremental catch-up, load_weights, fallbacks, leases,
and a trainer process publishing while the follower polls."""

from __future__ import annotations

import multiprocessing as mp
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import deltackpt
from deltackpt import LoadStats
from deltackpt.errors import (
    FollowerBehindError,
    HeldVersionMismatchError,
    InvalidArgumentError,
    SnapshotNotFoundError,
)
from tests.loading._history import is_mid_chain, new_store, publish, same, state_at


def _empty_like(k: int) -> dict[str, Any]:
    s = state_at(k)
    return {"model": {n: torch.zeros_like(t) for n, t in s["model"].items()}, "step": -1}


def test_follow_into_first_full_then_incremental(tmp_path: Path) -> None:
    st = new_store(tmp_path / "s")
    into = _empty_like(0)
    f = deltackpt.Follower(st, into=into, lease_ttl=None)
    assert f.poll() is None and f.version is None  # nothing published yet
    publish(st, 0)
    s0 = f.poll()
    assert s0 is not None and (s0.version, s0.mode, s0.previous) == ("s0", "full", None)
    assert same(into, state_at(0)) and into["step"] == 0
    assert f.poll() is None  # nothing newer
    full = s0.load.bytes_read
    for k in range(1, 4):
        publish(st, k)
        s = f.poll()
        assert s is not None and (s.version, s.previous, s.mode) == (
            f"s{k}",
            f"s{k - 1}",
            "incremental",
        )
        assert same(into, state_at(k)) and into["step"] == k and f.version == f"s{k}"
        assert "model/w0" in s.changed and "model/w3" not in s.changed
        assert 0 < s.load.bytes_read < full / 4  # three of 5 big tensors never change
        assert s.load.chunks_unchanged > 0


@pytest.mark.parametrize("held", [0, 1, 2])
def test_follow_catches_up_k_versions_from_keyframe_or_mid_chain(tmp_path: Path, held: int) -> None:
    st = new_store(tmp_path / "s")
    for k in range(held + 1):
        publish(st, k)
    into = state_at(held)
    f = deltackpt.Follower(st, into=into, since=f"s{held}", lease_ttl=None)
    for k in range(held + 1, held + 4):
        publish(st, k)
    assert not is_mid_chain(st, "s0") and is_mid_chain(st, "s1")  # held 0: keyframe; 1: mid
    s = f.poll()
    assert s is not None and s.mode == "incremental" and s.version == f"s{held + 3}"
    assert same(into, state_at(held + 3))
    assert s.load.chunks_unchanged > 0
    if held < 3 and is_mid_chain(st, f"s{held + 3}"):
        assert s.load.chunks_patched >= 1  # the chain above the held chunk, applied in place


def test_follow_load_weights_gets_changed_tensors_only(tmp_path: Path) -> None:
    st = new_store(tmp_path / "s")
    publish(st, 0)
    calls: list[dict[str, torch.Tensor]] = []

    def load_weights(weights: Any) -> None:
        calls.append({n: t.clone() for n, t in weights})

    f = deltackpt.Follower(st, load_weights=load_weights, keys=["model"],
                           rename=lambda k: k.removeprefix("model/"), lease_ttl=None)  # fmt: skip
    assert f.poll() is not None
    assert set(calls[0]) == set(state_at(0)["model"])  # first: everything
    publish(st, 1)
    publish(st, 2)
    s = f.poll()
    assert s is not None and s.mode == "incremental" and s.version == "s2"
    assert {"w0", "w1", "w5", "bias"} <= set(calls[1]) and not {"w2", "w3", "w4"} & set(calls[1])
    want = state_at(2)["model"]
    for n, t in calls[1].items():
        assert torch.equal(t, want[n])
    assert same({"model": f.state["model"]}, state_at(2))  # the follower's own copy


def test_follow_load_weights_failure_resends_everything(tmp_path: Path) -> None:
    st = new_store(tmp_path / "s")
    publish(st, 0)
    fail = [True]
    got: list[set[str]] = []

    def load_weights(weights: Any) -> None:
        names = {n for n, _ in weights}
        if fail[0]:
            fail[0] = False
            raise RuntimeError("engine busy")
        got.append(names)

    f = deltackpt.Follower(st, load_weights=load_weights, lease_ttl=None)
    with pytest.raises(RuntimeError, match="engine busy"):
        f.poll()
    s = f.poll()  # no new version: the failed hand-over is repeated, whole
    assert s is not None and s.mode == "resend" and s.version == "s0"
    assert got == [{f"model/{n}" for n in state_at(0)["model"]}]
    assert f.poll() is None


# w0: patched or read (checked by default where it changes); w3: skipped as unchanged (only
# verify="full" hashes it)
@pytest.mark.parametrize("key,verify", [("w0", True), ("w3", "full")])
def test_follow_held_mismatch_reloads_whole_or_raises(
    tmp_path: Path, key: str, verify: bool | str
) -> None:
    st = new_store(tmp_path / "s")
    publish(st, 0)
    into = state_at(0)
    f = deltackpt.Follower(st, into=into, since="s0", lease_ttl=None, verify=verify)
    publish(st, 1)
    into["model"][key].view(-1)[7] += 1  # someone changed the weights behind its back
    s = f.poll()
    assert s is not None and s.mode == "full" and f"'model/{key}'" in s.reason
    assert same(into, state_at(1))

    strict = state_at(1)
    g = deltackpt.Follower(
        st, into=strict, since="s1", fallback="raise", lease_ttl=None, verify=verify
    )
    publish(st, 2)
    strict["model"][key].view(-1)[7] += 1
    before = {n: t.clone() for n, t in strict["model"].items()}
    with pytest.raises(HeldVersionMismatchError) as ei:
        g.poll()
    assert ei.value.key == f"model/{key}" and g.version == "s1"
    assert all(torch.equal(before[n], strict["model"][n]) for n in before)  # nothing written


def test_follower_fallen_behind_retention(tmp_path: Path) -> None:
    st = new_store(tmp_path / "s")
    publish(st, 0)
    a, b = state_at(0), state_at(0)
    fa = deltackpt.Follower(st, into=a, since="s0", lease_ttl=None)
    fb = deltackpt.Follower(st, into=b, since="s0", lease_ttl=None, fallback="raise")
    for k in range(1, 4):
        publish(st, k)
    report = deltackpt.gc(st, keep_last=1)
    assert "s0" in report.deleted and deltackpt.snapshots(st)[-1].name == "s3"
    s = fa.poll()  # default: a full load, saying why
    assert s is not None and s.mode == "full" and "'s0' was deleted" in s.reason
    assert same(a, state_at(3))
    with pytest.raises(FollowerBehindError) as ei:
        fb.poll()
    assert (ei.value.held, ei.value.latest) == ("s0", "s3") and "reload()" in str(ei.value)
    assert isinstance(ei.value, SnapshotNotFoundError)
    assert fb.version == "s0" and same(b, state_at(0))  # untouched
    r = fb.reload()
    assert r.mode == "full" and fb.version == "s3" and same(b, state_at(3))


def test_lease_keeps_held_snapshot_through_gc_and_checkpointer(tmp_path: Path) -> None:
    st = new_store(tmp_path / "s")
    publish(st, 0)
    publish(st, 1)
    into = state_at(1)
    f = deltackpt.Follower(st, into=into, since="s1", holder="eval-0", lease_ttl=600)
    assert f.poll() is None  # holds the newest: only the lease is written
    assert (tmp_path / "s" / "leases" / "eval-0.json").is_file()
    for k in range(2, 5):
        publish(st, k)
    report = deltackpt.gc(st, keep_last=1)
    assert report.deleted == ["s0", "s2", "s3"] and report.leased == ["s1"]
    got = deltackpt.load(st, "s1")  # its chain's chunks were kept with it
    assert same(got, state_at(1))
    s = f.poll()
    assert s is not None and s.mode == "incremental" and same(into, state_at(4))
    f.close()
    assert not (tmp_path / "s" / "leases" / "eval-0.json").exists()
    publish(st, 5)
    assert deltackpt.gc(st, keep_last=1).deleted == ["s1", "s4"]


def test_wait_and_bad_arguments(tmp_path: Path) -> None:
    st = new_store(tmp_path / "s")
    with pytest.raises(InvalidArgumentError, match=r"exactly one of into= .* and load_weights="):
        deltackpt.Follower(st)
    with pytest.raises(InvalidArgumentError, match="exactly one"):
        deltackpt.Follower(st, into={}, load_weights=print)
    with pytest.raises(InvalidArgumentError, match="fallback='later'"):
        deltackpt.Follower(st, into={}, fallback="later")
    with pytest.raises(InvalidArgumentError, match="lease_ttl=-1"):
        deltackpt.Follower(st, into={}, lease_ttl=-1)
    with pytest.raises(InvalidArgumentError, match=r"lease_ttl=1000000000000\.0"):
        deltackpt.Follower(st, into={}, lease_ttl=1e12)
    with pytest.raises(InvalidArgumentError, match="holder"):
        deltackpt.Follower(st, into={}, holder="../x")
    with pytest.raises(InvalidArgumentError, match="since="):
        deltackpt.Follower(st, load_weights=print, since="s0")
    f = deltackpt.Follower(st, into=_empty_like(0), lease_ttl=None)
    assert f.wait(timeout=0.05, interval=0.01) is None
    with pytest.raises(SnapshotNotFoundError, match="no committed snapshot"):
        f.reload()
    publish(st, 0)
    s = f.wait(timeout=5, interval=0.01)
    assert s is not None and s.version == "s0"


# ------------------------------------------------------------ a trainer publishing meanwhile
def _trainer(root: str, versions: int) -> None:
    st = new_store(root)
    for k in range(versions):
        publish(st, k)
        time.sleep(0.02)


def test_concurrent_publish_and_follow(tmp_path: Path) -> None:
    root = str(tmp_path / "s")
    new_store(root)
    versions = 8
    proc = mp.get_context("spawn").Process(target=_trainer, args=(root, versions))
    proc.start()
    try:
        into = _empty_like(0)
        f = deltackpt.Follower(root, into=into, lease_ttl=30)
        seen: list[str] = []
        deadline = time.monotonic() + 120
        while f.version != f"s{versions - 1}":
            assert time.monotonic() < deadline, f"follower stuck at {f.version}"
            s = f.poll()
            if s is None:
                time.sleep(0.005)
                continue
            k = int(s.version[1:])
            assert same(into, state_at(k)) and into["step"] == k  # never a half-written version
            seen.append(s.mode)
        proc.join(60)
        assert proc.exitcode == 0
    finally:
        if proc.is_alive():
            proc.kill()
    assert seen[0] == "full" and set(seen[1:]) <= {"incremental"}
    assert same(into, state_at(versions - 1))
    stats = LoadStats()
    deltackpt.load(root, "s0", stats=stats)  # every version stays loadable
    assert stats.bytes_read > 0


def test_follow_a_snapshot_saved_again_under_the_same_name(tmp_path: Path) -> None:
    st = new_store(tmp_path / "s")
    publish(st, 0)
    into = _empty_like(0)
    f = deltackpt.Follower(st, into=into, lease_ttl=None)
    assert f.poll() is not None and f.poll() is None
    time.sleep(0.01)  # a later commit time
    deltackpt.save(state_at(2), st, "s0", overwrite=True)
    s = f.poll()
    assert s is not None and s.version == "s0" and s.mode == "full" and "saved again" in s.reason
    assert same(into, state_at(2)) and f.poll() is None


def _retaining_trainer(root: str, versions: int) -> None:
    with deltackpt.Checkpointer(root, every=1, keep_last=2, async_=False, rng=False,
                                encoding="smallest", name_format="s{step}") as ckpt:  # fmt: skip
        for k in range(versions):
            ckpt.maybe_save(k, state_at(k))


@pytest.mark.parametrize("lease_ttl", [None, 30.0])
def test_follow_while_checkpointer_retention_deletes(
    tmp_path: Path, lease_ttl: float | None
) -> None:
    """The trainer keeps 2 versions and collects garbage after every save while the follower
    polls: whatever retention deletes under it, the follower only ever holds whole versions,
    falls back to full loads when its version went (no lease), and ends on the last one."""
    root = str(tmp_path / "s")
    new_store(root)
    versions = 10
    proc = mp.get_context("spawn").Process(target=_retaining_trainer, args=(root, versions))
    proc.start()
    try:
        into = _empty_like(0)
        f = deltackpt.Follower(root, into=into, lease_ttl=lease_ttl)
        deadline = time.monotonic() + 120
        while f.version != f"s{versions - 1}":
            assert time.monotonic() < deadline, f"follower stuck at {f.version}"
            s = f.poll()
            if s is not None:
                assert same(into, state_at(int(s.version[1:]))), s
            else:
                time.sleep(0.002)
        proc.join(60)
        assert proc.exitcode == 0
    finally:
        if proc.is_alive():
            proc.kill()
    assert same(into, state_at(versions - 1))
    f.close()


def test_poll_a_named_target_not_the_newest(tmp_path: Path) -> None:
    # followers that must hold one version together poll the name one of them chose: a save
    # committed after it does not move them
    st = new_store(tmp_path / "s")
    for k in range(3):
        publish(st, k)
    into = _empty_like(0)
    f = deltackpt.Follower(st, into=into, lease_ttl=None)
    s = f.poll(target="s1")
    assert s is not None and (s.version, s.mode) == ("s1", "full")
    assert same(into, state_at(1)) and f.poll(target="s1") is None  # held already
    # and back to an older one (a rollback to a published version), incrementally
    assert f.poll() is not None and f.version == "s2" and same(into, state_at(2))
    back = f.poll(target="s0")
    assert back is not None and (back.version, back.mode) == ("s0", "incremental")
    assert same(into, state_at(0))
    with pytest.raises(SnapshotNotFoundError, match=r"no committed snapshot 's9' to poll"):
        f.poll(target="s9")
    with pytest.raises(InvalidArgumentError, match=r"poll\(target=3\): expected a snapshot"):
        f.poll(target=3)  # type: ignore[arg-type]
    assert f.version == "s0" and same(into, state_at(0))  # the refusals changed nothing


def test_adopt_a_state_loaded_elsewhere_then_catch_up_from_it(tmp_path: Path) -> None:
    # an engine's start loaded s0 from the store itself: its follower adopts that copy, and
    # its first poll is a catch-up, not a full load
    st = new_store(tmp_path / "s")
    publish(st, 0)
    publish(st, 1)
    got: dict[str, torch.Tensor] = {}
    f = deltackpt.Follower(st, load_weights=lambda w: got.update(w), lease_ttl=None)
    f.adopt("s0", deltackpt.load(st, "s0"))
    s = f.poll()
    assert s is not None and (s.version, s.previous, s.mode) == ("s1", "s0", "incremental")
    assert "model/w0" in got and "model/w3" not in got  # only what changed was handed over
    assert same(f.state, state_at(1))
    with pytest.raises(InvalidArgumentError, match=r"adopt\('s0'\): only a load_weights"):
        f.adopt("s0", deltackpt.load(st, "s0"))  # it holds a version now

"""Crash safety: SIGKILL a saving process at random moments; inject I/O failures in-process.

Invariants checked after every crash: every listed snapshot loads bit-exactly (verified against
content recomputed from its name), no partial snapshot is listed, ``verify`` passes, a crashed
name can be saved again, and gc removes every leftover of the crashed saves.
"""

from __future__ import annotations

import errno
import functools
import os
import random
import shutil
import statistics
import time
from collections import deque
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import deltackpt
from deltackpt.errors import SnapshotNotFoundError
from deltackpt.store.durable import publish
from deltackpt.store.local import DurableOps
from deltackpt.store.store import PACK_ALIGN, Store
from tests._faults import close_store, faulty_store
from tests._workers import Child, assert_same_state, crash_base, crash_name, crash_state

# A trial takes ~2-3 s on an idle 2-core machine (the children start ahead), 3x that when other
# jobs load it: the number of trials adapts so the test stays within about 20-30 s (the
# suite's 10-minute budget; each trial is a fresh random kill point, so more runs add coverage).
CRASH_TRIALS = 16  # at most this many SIGKILLs ...
CRASH_MIN_TRIALS = 6  # ... and at least this many, even when the machine is slow ...
CRASH_BUDGET_S = 18.0  # ... and no new trial after this many seconds once the minimum is done


# ---------------------------------------------------------------------------- store inspection


def pack_sizes(store: Path) -> dict[str, int]:
    return {p.stem: p.stat().st_size for p in (store / "packs").glob("*.pack")}


def referenced(store: Path) -> tuple[set[str], int, int]:
    """(packs referenced by a committed manifest, their distinct chunk bytes, chunk count)."""
    st = deltackpt.open_store(store, create=False)
    locs: dict[tuple[str, int], int] = {}
    for m in st.manifests():
        for rec in m.chunks.values():
            locs[(rec.pack, rec.offset)] = rec.length
    return {p for p, _ in locs}, sum(locs.values()), len(locs)


def leftovers(store: Path) -> list[Path]:
    """tmp/ entries and snapshot dirs without a manifest."""
    out = list((store / "tmp").iterdir())
    out += [d for d in (store / "snapshots").iterdir() if not (d / "MANIFEST.json").exists()]
    return out


def assert_store_clean(store: Path) -> None:
    """What gc must leave: no leftovers, no unreferenced pack, packs no bigger than their data."""
    assert leftovers(store) == []
    sizes = pack_sizes(store)
    packs, live_bytes, n_chunks = referenced(store)
    assert set(sizes) == packs, f"unreferenced packs survive gc: {set(sizes) - packs}"
    slack = PACK_ALIGN * (len(packs) + n_chunks)  # pack headers + per-chunk alignment padding
    assert live_bytes <= sum(sizes.values()) <= live_bytes + slack


# ---------------------------------------------------------------------------- SIGKILL loop


def _idx(name: str) -> int:
    assert name.startswith("s-"), name
    return int(name[2:])


@pytest.mark.slow
def test_sigkill_at_random_moments_never_exposes_a_partial_snapshot(tmp_path: Path) -> None:
    store = tmp_path / "store"
    deltackpt.open_store(store)
    rng = random.Random(0xDC)
    committed: set[int] = set()  # save indexes known to have committed (ever)
    live: set[int] = set()  # committed and not deleted since
    checked: set[str] = set()  # snapshots already loaded and compared
    durations: list[float] = []  # begin -> commit of every save a child reported
    outcomes = {"before_commit": 0, "committed_unreported": 0, "between_saves": 0}
    retried = gcs = 0
    t_start = time.monotonic()
    children: list[Child] = []
    spares: deque[Child] = deque()  # started ahead: importing torch takes seconds

    trial_seconds: list[float] = []

    def warm_up(trial: int) -> None:
        """Start children for the next trials; two ahead unless the budget is about to end."""
        per_trial = statistics.mean(trial_seconds) if trial_seconds else 5.0
        soon_over = time.monotonic() - t_start + 2 * per_trial > CRASH_BUDGET_S
        depth = 1 if soon_over and trial + 2 >= CRASH_MIN_TRIALS else 2
        while len(spares) < min(depth, CRASH_TRIALS - trial):
            spares.append(Child("crash_saver", str(store)))
            children.append(spares[-1])

    try:
        warm_up(0)
        base = crash_base()  # what the children build too: expected content = base + index
        for trial in range(CRASH_TRIALS):
            child = spares.popleft()
            t0 = time.monotonic()
            child.expect("ready", 120)
            t1 = time.monotonic()
            start = max(committed) + 1 if committed else 0
            if start in crash_attempts(children):
                retried += 1  # this name was being saved when an earlier child died
            k = rng.choice([0, 0, 1])  # saves allowed to commit before the aimed one
            phase = rng.choice(["write", "write", "commit", "any"])
            encoding = rng.choice(["raw", "raw", "default"])  # default: xor chains, less I/O
            child.send(f"go {start} {k + 2} {encoding}")
            last = trial + 1 >= CRASH_TRIALS or (
                trial + 1 >= CRASH_MIN_TRIALS and time.monotonic() - t_start > CRASH_BUDGET_S
            )
            if not last:  # the next children warm up while this one saves
                warm_up(trial + 1)
            est = statistics.median(durations) if durations else 0.8
            target = start + k
            if phase == "commit":  # between "manifest about to be published" and return
                child.expect(f"publish {target}", 120)
                time.sleep(rng.uniform(0.0, 0.004))
            else:  # anywhere in planning, hashing, pack writes, fsyncs and commit
                child.expect(f"begin {target}", 120)
                time.sleep(rng.uniform(0.0, (0.9 if phase == "write" else 1.2) * est))
            child.kill()
            t2 = time.monotonic()

            events = [line.split() for _, line in child.log]
            begun = [int(e[1]) for e in events if e[0] == "begin"]
            reported = {int(e[1]) for e in events if e[0] == "commit"}
            times = {(e[0], int(e[1])): t for t, line in child.log if (e := line.split())[1:]}
            durations += [times[("commit", i)] - times[("begin", i)] for i in reported]
            committed |= reported
            live |= reported
            in_flight = begun[-1] if begun and begun[-1] not in reported else None

            # exactly the committed snapshots are listed, plus at most the one being saved
            listed = [s.name for s in deltackpt.snapshots(store)]
            assert len(listed) == len(set(listed))
            want = {crash_name(i) for i in live}
            assert want <= set(listed), f"trial {trial}: committed saves missing"
            extra = set(listed) - want
            allowed = {crash_name(in_flight)} if in_flight is not None else set()
            assert extra <= allowed, f"trial {trial}: unexpected snapshots {extra}"
            if in_flight is None:
                outcome = "between_saves"
            elif extra:  # committed right before the kill, not yet reported
                outcome = "committed_unreported"
                committed.add(in_flight)
                live.add(in_flight)
            else:
                outcome = "before_commit"
                assert not (store / "snapshots" / crash_name(in_flight) / "MANIFEST.json").exists()
            outcomes[outcome] += 1

            # every listed snapshot loads bit-exactly, and the whole store verifies
            for name in listed:
                if name not in checked:
                    got = deltackpt.load(store, name, verify=True)
                    assert_same_state(got, crash_state(base, _idx(name)), name)
                    checked.add(name)
            if live:  # "latest" is the newest committed save
                assert deltackpt.open_store(store).resolve("latest") == crash_name(max(live))
            report = deltackpt.verify(store)
            assert report.ok, report.problems[:3]
            assert sorted(report.snapshots) == sorted(listed)

            print(  # shown with -s or on failure
                f"trial {trial}: {phase} after {k} {encoding} saves, {outcome}; waited "
                f"{t1 - t0:.1f}s for the child, ran {t2 - t1:.1f}s, "
                f"checked {time.monotonic() - t2:.1f}s"
            )

            # bound the work of later trials: keep the 2 newest snapshots, gc now and then
            for i in sorted(live)[:-2]:
                deltackpt.delete(store, crash_name(i))
                live.discard(i)
            if trial % 4 == 3:  # the next child is only warming up: it holds no lock
                deltackpt.gc(store, lock_timeout=30)
                assert_store_clean(store)
                for i in live:  # compaction may have rewritten their manifests
                    got = deltackpt.load(store, crash_name(i), verify=True)
                    assert_same_state(got, crash_state(base, i), crash_name(i))
                gcs += 1
            trial_seconds.append(time.monotonic() - t0)
            if last:
                break
    finally:
        for c in children:
            c.kill()

    assert outcomes["before_commit"] >= 1, outcomes  # some kills really hit a save in flight
    assert committed, "no save ever committed"

    # gc removes exactly the debris of the crashed saves (and the deleted snapshots' packs)
    packs_before = pack_sizes(store)
    live_packs, _, _ = referenced(store)
    dead = set(packs_before) - live_packs
    debris = leftovers(store)
    report = deltackpt.gc(store)
    assert report.deleted == []
    assert report.packs_removed == len(dead)
    assert report.leftovers_removed == len(debris)
    assert report.bytes_freed >= sum(packs_before[p] for p in dead)  # + compaction, if any
    assert_store_clean(store)
    assert sorted(s.name for s in deltackpt.snapshots(store)) == sorted(map(crash_name, live))
    assert deltackpt.verify(store).ok
    newest = crash_name(max(live))
    assert_same_state(deltackpt.load(store, newest), crash_state(base, max(live)), newest)
    print(
        f"\ncrash trials {trial + 1} in {time.monotonic() - t_start:.0f}s: {outcomes}, "
        f"crashed names saved again {retried}, snapshots checked {len(checked)}, gcs {gcs}, "
        f"median save {statistics.median(durations) if durations else 0:.2f}s"
    )
    shutil.rmtree(store, ignore_errors=True)  # GBs: do not leave them in pytest's tmp dirs


def crash_attempts(children: list[Child]) -> set[int]:
    """Save indexes that a (dead) child began but did not report committed."""
    out: set[int] = set()
    for c in children:
        ev = [line.split() for _, line in c.log]
        begun = {int(e[1]) for e in ev if e[0] == "begin"}
        out |= begun - {int(e[1]) for e in ev if e[0] == "commit"}
    return out


# ---------------------------------------------------------------------------- injected failures


def small_state(i: int) -> dict[str, object]:
    g = torch.Generator().manual_seed(i)
    return {
        "w": torch.randn(600_000, generator=g),  # 2.4 MB: several chunks
        "b": torch.randn(100, generator=g),
        "step": i,
    }


@pytest.fixture
def small_store(tmp_path: Path) -> Iterator[Path]:
    path = tmp_path / "store"
    deltackpt.open_store(path, chunk_bytes=256 << 10, small_bytes=64 << 10)
    deltackpt.save(small_state(0), path, "s-0")
    deltackpt.save(small_state(1), path, "s-1")
    yield path


def _eio(*args: object, **kwargs: object) -> None:
    raise OSError(errno.EIO, "injected I/O error")


def _enospc(*args: object, **kwargs: object) -> None:
    raise OSError(errno.ENOSPC, "injected: no space left")


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def open_files(under: Path) -> set[str]:
    """The files under ``under`` this process holds open (a count of every descriptor would
    also see an earlier test's sockets closed by the garbage collector meanwhile)."""
    root, out = str(under.resolve()), set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # closed since the listing
            continue
        if target.startswith(root + os.sep):
            out.add(target)
    return out


def settle(store: Path, quiet: float = 0.3, timeout: float = 10.0) -> None:
    """Wait until packs/ and our open files stop changing for ``quiet`` seconds."""
    deadline = time.monotonic() + timeout
    last, since = None, time.monotonic()
    while time.monotonic() < deadline:
        now = (sorted(pack_sizes(store).items()), open_fds())
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= quiet:
            return
        time.sleep(0.02)


def _faulty(store: Path, where: str) -> Store:
    """``store`` opened through a storage that fails at ``where`` (tests/_faults.py)."""
    if where == "pack_create":  # ENOSPC writing a new pack's header
        return faulty_store(store, on_write=lambda key, n: _enospc() if n == 0 else None)
    if where == "pack_append":  # ENOSPC after a few payloads were written
        calls = [0]

        def on_write(key: str, n: int) -> None:
            if n == 0:
                return  # a pack's header
            calls[0] += 1
            if calls[0] > 3:
                raise OSError(errno.ENOSPC, "injected: no space left")

        return faulty_store(store, on_write=on_write)
    if where == "pack_fsync":
        return faulty_store(store, on_finish=_eio)
    if where == "manifest_write":  # the temp manifest cannot be made durable
        return faulty_store(store, ops=DurableOps(write_durable=_eio))
    if where == "publish":
        return faulty_store(store, ops=DurableOps(publish=_eio))
    if where == "link":  # the real publish, whose link() fails
        return faulty_store(store, ops=DurableOps(publish=functools.partial(publish, link=_eio)))
    raise AssertionError(where)


@pytest.mark.parametrize(
    "where", ["pack_create", "pack_append", "pack_fsync", "manifest_write", "publish", "link"]
)
def test_failed_save_is_invisible_and_can_be_retried(small_store: Path, where: str) -> None:
    store = small_store
    packs_before = set(pack_sizes(store))
    files_before = open_files(store)
    faulty = _faulty(store, where)
    try:
        with pytest.raises(OSError, match="injected"):
            deltackpt.save(small_state(2), faulty, "s-2")
        settle(store)  # see test_failed_save_stops_writing: its chunk jobs may still run
    finally:
        close_store(faulty)
    if where == "pack_create":  # no writer ever existed: nothing may stay open or on disk
        assert open_files(store) == files_before
        assert set(pack_sizes(store)) == packs_before

    # the failed name does not exist, the earlier snapshots are intact
    assert [s.name for s in deltackpt.snapshots(store)] == ["s-0", "s-1"]
    assert not deltackpt.open_store(store).has("s-2")
    with pytest.raises(SnapshotNotFoundError):
        deltackpt.load(store, "s-2")
    assert deltackpt.load(store)["step"] == 1
    for i in (0, 1):
        assert_same_state(deltackpt.load(store, f"s-{i}", verify=True), small_state(i))
    assert deltackpt.verify(store).ok

    # a retry with the same name succeeds and loads bit-exactly
    info = deltackpt.save(small_state(2), store, "s-2")
    assert info.name == "s-2" and info.chunks_new > 0
    assert_same_state(deltackpt.load(store, "s-2", verify=True), small_state(2))
    assert [s.name for s in deltackpt.snapshots(store)] == ["s-0", "s-1", "s-2"]

    # gc sweeps what the failed attempt left behind; everything still loads
    deltackpt.gc(store)
    assert_store_clean(store)
    for i in (0, 1, 2):
        assert_same_state(deltackpt.load(store, f"s-{i}", verify=True), small_state(i))


def test_failed_save_stops_writing_before_it_raises(tmp_path: Path) -> None:
    store = tmp_path / "store"
    deltackpt.open_store(store, chunk_bytes=64 << 10, small_bytes=16 << 10)
    calls = [0]

    def on_write(key: str, n: int) -> None:
        if n == 0:
            return  # a pack's header
        calls[0] += 1
        if calls[0] == 1:
            raise OSError(errno.ENOSPC, "injected: no space left")
        time.sleep(0.002)

    faulty = faulty_store(store, on_write=on_write)
    files_before = open_files(store)
    try:
        with pytest.raises(OSError, match="injected"):
            deltackpt.save({"w": torch.randn(4 << 20)}, faulty, "s", threads=4)  # 256 chunks
        at_raise = calls[0]
        settle(store)
        assert calls[0] == at_raise, f"{calls[0] - at_raise} payloads written after save() raised"
        assert pack_sizes(store) == {}
        assert open_files(store) == files_before
    finally:
        close_store(faulty)

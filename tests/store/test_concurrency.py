"""Concurrent saves into one store: from two processes and from two threads of one process."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import deltackpt
from deltackpt.errors import SnapshotExistsError
from tests._workers import Child, assert_same_state, pair_state

SHARED_SEED = 7


@pytest.fixture(scope="module")
def savers() -> Iterator[list[Child]]:
    """Two saver processes, reused by the tests of this module (python + torch start once)."""
    children = [Child("saver"), Child("saver")]
    try:
        for c in children:
            c.expect("ready", 120)
        yield children
    finally:
        for c in children:
            c.close(timeout=30)


def run_round(savers: list[Child], requests: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Send one request to each saver at once; return their answers in the same order."""
    for c, req in zip(savers, requests, strict=True):
        c.send(json.dumps(req))
    answers = []
    for c, req in zip(savers, requests, strict=True):
        _, line = c.expect(lambda s: s.startswith("{"), 120)
        answer = json.loads(line)
        assert answer["name"] == req["name"], answer
        answers.append(answer)
    return answers


def names(store: Path) -> list[str]:
    return [s.name for s in deltackpt.snapshots(store)]


def assert_clean_after_gc(store: Path) -> None:
    deltackpt.gc(store)
    assert list((store / "tmp").iterdir()) == []
    st = deltackpt.open_store(store, create=False)
    used = {r.pack for m in st.manifests() for r in m.chunks.values()}
    assert {p.stem for p in (store / "packs").glob("*.pack")} == used


@pytest.mark.slow
def test_two_processes_save_different_names_at_once(savers: list[Child], tmp_path: Path) -> None:
    store = tmp_path / "store"
    deltackpt.open_store(store)
    rdv = str(tmp_path / "rdv")
    reqs = [
        {"store": str(store), "name": f"p{i}", "shared": SHARED_SEED, "own": i}
        | {"rdv": "diff", "rdv_dir": rdv}  # both inside the store lock before either writes
        for i in range(2)
    ]
    answers = run_round(savers, reqs)
    assert [a["result"] for a in answers] == ["ok", "ok"], answers
    assert sorted(names(store)) == ["p0", "p1"]
    for i in range(2):
        want = pair_state(SHARED_SEED, i)
        assert_same_state(deltackpt.load(store, f"p{i}", verify=True), want, f"p{i}")
    assert deltackpt.verify(store).ok

    # a later save finds the shared tensor committed and writes only its own bytes
    info = deltackpt.save(pair_state(SHARED_SEED, 2), store, "p2")
    assert info.chunks_reused >= 1
    assert info.bytes_written < 16_000_000  # "own" is 8 MB, "shared" 16 MB
    assert_clean_after_gc(store)
    for i in range(3):
        want = pair_state(SHARED_SEED, i)
        assert_same_state(deltackpt.load(store, f"p{i}", verify=True), want, f"p{i}")


@pytest.mark.slow
def test_two_processes_race_for_the_same_name(savers: list[Child], tmp_path: Path) -> None:
    store = tmp_path / "store"
    deltackpt.open_store(store)
    rdv = str(tmp_path / "rdv")
    winners: dict[str, int] = {}  # name -> own seed of the saver that won it
    # rounds with a rendezvous: both passed the existence check, the commit (link) decides;
    # rounds without: a free race, decided by the check or by the link
    for r, lined_up in enumerate([True, True, False, False]):
        name = f"race-{r}"
        reqs = [
            {"store": str(store), "name": name, "shared": SHARED_SEED, "own": 10 * r + i}
            | ({"rdv": name, "rdv_dir": rdv} if lined_up else {})
            for i in range(2)
        ]
        answers = run_round(savers, reqs)
        results = sorted(a["result"] for a in answers)
        assert results == ["exists", "ok"], answers
        (won,) = [i for i, a in enumerate(answers) if a["result"] == "ok"]
        winners[name] = 10 * r + won
        info = {s.name: s for s in deltackpt.snapshots(store)}[name]
        assert info.metadata["pid"] == answers[won]["pid"]  # the winner's manifest, whole

    assert names(store) == list(winners)
    for name, own in winners.items():
        want = pair_state(SHARED_SEED, own)
        assert_same_state(deltackpt.load(store, name, verify=True), want, name)
    assert deltackpt.verify(store).ok
    assert_clean_after_gc(store)  # the losers' packs are garbage
    for name, own in winners.items():
        assert_same_state(deltackpt.load(store, name), pair_state(SHARED_SEED, own), name)


def _in_threads(fns: list[Any]) -> list[Any]:
    results: list[Any] = [None] * len(fns)

    def run(i: int) -> None:
        try:
            results[i] = fns[i]()
        except BaseException as e:
            results[i] = e

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(fns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads), "a save thread hangs"
    return results


# Saves from two threads of one process share the store's Saver (deltackpt/_async.py) and its
# reused staging arenas; the Saver's save slot serialises them. Both the staged path and saving
# straight from the live tensors (a memory budget too small to stage) are covered.
THREAD_OPTIONS = [
    pytest.param({"memory_budget": 1}, id="unstaged"),
    pytest.param({}, id="default"),
]


@pytest.mark.parametrize("options", THREAD_OPTIONS)
def test_two_threads_save_different_names_at_once(tmp_path: Path, options: dict[str, Any]) -> None:
    store = tmp_path / "store"
    deltackpt.open_store(store)
    states = [pair_state(SHARED_SEED, i) for i in range(2)]
    # started together; the save slot serialises them inside deltackpt
    results = _in_threads(
        [lambda i=i: deltackpt.save(states[i], store, f"t{i}", **options) for i in range(2)]
    )
    assert all(isinstance(r, deltackpt.SnapshotInfo) for r in results), results
    assert sorted(names(store)) == ["t0", "t1"]
    for i in range(2):
        assert_same_state(deltackpt.load(store, f"t{i}", verify=True), states[i], f"t{i}")
    assert deltackpt.verify(store).ok
    assert_clean_after_gc(store)


@pytest.mark.parametrize("options", THREAD_OPTIONS)
def test_two_threads_race_for_the_same_name(tmp_path: Path, options: dict[str, Any]) -> None:
    store = tmp_path / "store"
    deltackpt.open_store(store)
    states = [pair_state(SHARED_SEED, 20 + i) for i in range(2)]
    results = _in_threads(  # whichever comes second finds the name taken
        [
            lambda i=i: deltackpt.save(states[i], store, "same", metadata={"i": i}, **options)
            for i in (0, 1)
        ]
    )
    errors = [r for r in results if isinstance(r, BaseException)]
    assert len(errors) == 1 and isinstance(errors[0], SnapshotExistsError), results
    (won,) = [i for i, r in enumerate(results) if isinstance(r, deltackpt.SnapshotInfo)]
    assert names(store) == ["same"]
    assert deltackpt.snapshots(store)[0].metadata == {"i": won}
    assert_same_state(deltackpt.load(store, "same", verify=True), states[won], "same")
    assert deltackpt.verify(store).ok
    assert_clean_after_gc(store)

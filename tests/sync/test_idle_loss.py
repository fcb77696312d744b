"""A rank idle between rounds sees a peer's death (``SyncGroup.lost``): what a vLLM worker uses
to release its side of the link when its trainer dies while the engine serves (nothing else
would tell it until the next trainer's init).

World: trainers 0 (it hosts the store) and 1, receiver 2; no round runs, the receiver only
watches. Rank 1 dies first (on this host: its pid is gone; "on another host": its heartbeat
stops), then rank 0 and its store.
"""

from __future__ import annotations

import os
import time
from typing import Any

import pytest

from tests._dist import free_port, spawn

pytestmark = pytest.mark.multiproc

WORLD = 3
DEAD_AFTER = 1.0
SILENT = 2 * DEAD_AFTER  # no beat for this long: gone (a busy machine may stall a beat a second)


def _group(rank: int, port: int) -> Any:
    from deltackpt import sync

    return sync.SyncGroup(
        "127.0.0.1",
        port,
        rank,
        WORLD,
        [0, 1],
        timeout=60.0,
        beat=0.2,
        dead_after=DEAD_AFTER,
        links="gloo",
    )


def _trainer(rank: int, port: int, elsewhere: bool) -> None:
    if elsewhere and rank == 1:  # its pid is then not one this host can look up
        import socket

        socket.gethostname = lambda: "another-host"  # type: ignore[assignment]
    g = _group(rank, port)
    g.store.wait(["go0" if rank == 0 else "go1"])  # the receiver says when
    os._exit(17)  # dies, as a crash would: no close, no goodbye


def _until_lost(
    g: Any, ranks: list[int], silent: float | None = None, limit: float = 20.0
) -> tuple[str | None, float]:
    t0 = time.monotonic()
    while time.monotonic() - t0 < limit:
        why = g.lost(ranks, silent)
        if why is not None:
            return why, time.monotonic() - t0
        time.sleep(0.1)
    return None, limit


def _receiver(port: int) -> dict[str, Any]:
    g = _group(2, port)
    out: dict[str, Any] = {}
    quiet = []
    t0 = time.monotonic()
    while time.monotonic() - t0 < 3 * DEAD_AFTER:  # beats compared across SILENT
        quiet.append(g.lost([0, 1], SILENT))
        time.sleep(0.1)
    out["quiet"] = quiet
    g.store.set("go1", "")
    out["rank1"], out["rank1_s"] = _until_lost(g, [0, 1], SILENT)
    out["rank0_alone"] = g.lost([0], SILENT)  # the other trainer is still there
    out["broken_after_rank1"] = g.broken  # seeing a loss is not a failed round
    g.store.set("go0", "")
    out["store"], out["store_s"] = _until_lost(g, [0], SILENT)
    g.close()
    return out


@pytest.mark.parametrize("elsewhere", [False, True], ids=["same-host", "another-host"])
def test_an_idle_rank_sees_a_trainer_die_then_the_store_host(elsewhere: bool) -> None:
    port = free_port()
    targets: list[Any] = [(_trainer, (r, port, elsewhere)) for r in (0, 1)]
    targets.append((_receiver, (port,)))
    outcomes = spawn(targets, timeout=90, fast_exit=True)
    assert outcomes[0].exitcode == 17 and outcomes[1].exitcode == 17
    r = outcomes[2].unwrap()
    assert r["quiet"] and all(q is None for q in r["quiet"]), r["quiet"]
    assert r["rank1"] is not None and "rank 1 " in r["rank1"], r
    assert r["rank1_s"] < 15.0, r  # seen, not waited for: the group timeout is 60 s
    if elsewhere:
        assert "another-host" in r["rank1"] and "stopped beating for 2 s" in r["rank1"]
    assert r["rank0_alone"] is None and r["broken_after_rank1"] is False
    assert r["store"] is not None and "store" in r["store"], r
    assert r["store_s"] < 15.0, r

"""Run one benchmark job of ``bench_sync.py``: M trainer + N inference processes, each calling
``run(rank, m, n, cfg, port)`` (a module-level function: processes are spawned), and collect
every rank's result dict."""

from __future__ import annotations

import multiprocessing as mp
import os
from collections.abc import Callable
from typing import Any

import _common as C

Run = Callable[[int, int, int, dict[str, Any], int], dict[str, Any]]


def tp_wants(shapes: list[tuple[str, tuple[int, ...]]], j: int, n: int) -> list[Any]:
    """Inference rank ``j`` of ``n``: ``Shard(1)`` column blocks of every matrix and ``Shard(0)``
    of every vector, in bf16, written into preallocated parameters."""
    import torch

    from deltackpt import sync

    out = []
    for name, s in shapes:
        box = sync.shard_box(s, 1 if len(s) == 2 else 0, j, n)
        out.append(sync.Want(name, box=box, into=torch.zeros(box.size, dtype=torch.bfloat16)))
    return out


def _worker(run: Run, rank: int, m: int, n: int, cfg: dict[str, Any], port: int, q: Any) -> None:
    try:
        q.put((rank, run(rank, m, n, cfg, port)))
    except BaseException as e:
        import traceback

        q.put((rank, {"error": f"{e!r}\n{traceback.format_exc()}"}))
    q.close()
    q.join_thread()  # the result is in the pipe
    os._exit(0)  # skip teardown: gloo's threads may still be waiting on peers that left


def run_job(run: Run, m: int, n: int, cfg: dict[str, Any], what: str) -> dict[int, dict[str, Any]]:
    """Every rank's result; SystemExit naming ``what`` when a rank failed or timed out."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = C.free_port()
    procs = [ctx.Process(target=_worker, args=(run, r, m, n, cfg, port, q)) for r in range(m + n)]
    for p in procs:
        p.start()
    results = C.collect(procs, q, cfg["timeout"])
    errors = [res["error"] for res in results.values() if "error" in res]
    if errors or len(results) < m + n:
        raise SystemExit(f"{what} benchmark failed: {errors or 'timeout / crashed process'}")
    return results

"""Collecting the results of benchmark rank processes."""

from __future__ import annotations

import queue
import time
from typing import Any


def collect(procs: list[Any], q: Any, timeout: float) -> dict[int, Any]:
    """``(rank, result)`` pairs the started ``procs`` put on ``q``, by rank; stops early when a
    process exits with an error or after ``timeout`` seconds, then joins every process (and
    kills those still running). The caller checks that every rank answered."""
    results: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    while len(results) < len(procs) and time.monotonic() < deadline:
        try:
            r, res = q.get(timeout=1)
            results[r] = res
        except queue.Empty:
            if any(p.exitcode not in (None, 0) for p in procs):
                break
    for p in procs:
        p.join(10)
        if p.is_alive():
            p.kill()
    return results

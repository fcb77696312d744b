"""Start the real run's ranks (spawned processes, gloo on 127.0.0.1) and collect rank 0's
results, under a hard deadline and a floor of free memory (other jobs share the machine)."""

from __future__ import annotations

import multiprocessing as mp
import queue
import time
import traceback
from typing import Any

import _common as C

from _dist import log
from _dist.dcp_runs import DcpRuns
from _dist.dk_runs import DeltackptRuns


class Rank(DeltackptRuns, DcpRuns):
    """One rank of the real run: both systems, in the configured order."""

    def main(self) -> dict[str, Any]:
        self.build()
        order = ("dcp", "dk") if self.cfg["dcp_first"] else ("dk", "dcp")
        for which in order:
            self.run_deltackpt() if which == "dk" else self.run_dcp()
            self.barrier()
        keys = [None] * self.world
        self.dist.all_gather_object(keys, self.checks, group=self.pg)
        self.dist.destroy_process_group()
        return {
            "rows": self.rows,
            "checks": keys,
            "unique_global_bytes": self.unique_global_bytes,
            "keys": len(self.state),
            "steps": self.steps,
        }


def _child(rank: int, world: int, port: int, cfg: dict[str, Any], q: Any) -> None:
    try:
        q.put((rank, True, Rank(rank, world, port, cfg).main()))
    except BaseException:
        q.put((rank, False, traceback.format_exc()))


def run_real(cfg: dict[str, Any], timeout: float) -> dict[str, Any]:
    """Spawn the ranks, wait at most ``timeout`` s, kill them (by pid) if they overrun or if the
    machine runs out of memory (other jobs share it)."""
    world = cfg["world"]
    need = cfg["mem_need"]
    t_wait = time.monotonic() + cfg["mem_wait"]
    while C.mem_available() < need:
        if time.monotonic() > t_wait:
            raise RuntimeError(
                f"MemAvailable {C.mem_available() / 1e9:.1f} GB < {need / 1e9:.1f} GB "
                "needed by the ranks; not starting (other jobs use the memory)"
            )
        log(
            f"waiting for memory: {C.mem_available() / 1e9:.1f} GB available, {need / 1e9:.1f} needed"
        )
        time.sleep(10)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = C.free_port()
    procs = [
        ctx.Process(target=_child, args=(r, world, port, cfg, q), daemon=True) for r in range(world)
    ]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    results: dict[int, Any] = {}
    errors: dict[int, str] = {}
    try:
        while len(results) + len(errors) < world:
            if time.monotonic() > deadline:
                raise TimeoutError(f"real run exceeded {timeout:g}s; errors so far: {errors}")
            if C.mem_available() < cfg["mem_floor"]:
                raise MemoryError(
                    f"MemAvailable fell to {C.mem_available() / 1e9:.2f} GB; stopped the "
                    "ranks to protect the other jobs on this machine"
                )
            try:
                r, ok, payload = q.get(timeout=0.5)
            except queue.Empty:
                if (
                    any(not p.is_alive() and p.exitcode not in (0, None) for p in procs)
                    and not q.qsize()
                ):
                    dead = [(i, p.exitcode) for i, p in enumerate(procs) if not p.is_alive()]
                    time.sleep(2)
                    if q.empty():
                        raise RuntimeError(
                            f"rank(s) died without reporting: {dead}; {errors}"
                        ) from None
                continue
            (results if ok else errors)[r] = payload
            if not ok:
                log(f"rank {r} failed:\n{payload}")
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join(5)
    if errors:
        raise RuntimeError(f"ranks failed: {list(errors)}")
    return results[0]

"""Run a training function in a forked child and SIGKILL it from here when it reports a point.

Forking (instead of a fresh interpreter) spares the child the import of Lightning/transformers
(tens of seconds on a loaded machine). The child uses one intra-op thread, as the parent's test
does, so both compute the very same floats.

Where CUDA devices exist the child is a fresh interpreter instead (``spawn``, the target sent
with cloudpickle, closures by value): once the parent has run a backward pass there, PyTorch's
autograd refuses to run in a forked child ("Unable to handle autograd's threading in
combination with fork-based multiprocessing": its per-device threads). ``DELTACKPT_TEST_SPAWN=1``
takes that path on any machine (tests/integrations/test_fork_harness.py).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import traceback
from collections.abc import Callable
from typing import Any


def _child(target: Callable[[Callable[[], None]], None], conn: Any) -> None:
    import time

    import torch

    torch.set_num_threads(1)

    def at_kill_point() -> None:
        conn.send("kill me")
        time.sleep(600)  # the parent SIGKILLs us here

    try:
        target(at_kill_point)
        conn.send("finished without reaching the kill point")
    except BaseException:
        conn.send("error: " + traceback.format_exc())
    os._exit(0)


def _spawned(payload: bytes, conn: Any) -> None:
    import cloudpickle

    _child(cloudpickle.loads(payload), conn)


def spawns() -> bool:
    """Whether :func:`run_and_kill` starts a fresh interpreter instead of forking."""
    import torch

    return bool(os.environ.get("DELTACKPT_TEST_SPAWN")) or torch.cuda.is_available()


def run_and_kill(target: Callable[[Callable[[], None]], None], timeout: float = 120.0) -> None:
    """Fork (or spawn: module doc); the child runs ``target(at_kill_point)``; SIGKILL it when it
    calls ``at_kill_point``. Raises AssertionError if it never gets there (with the child's
    traceback)."""
    if spawns():
        import cloudpickle

        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_spawned, args=(cloudpickle.dumps(target), child), daemon=True)
        timeout += 60  # the fresh interpreter imports torch and the framework again
    else:
        ctx = mp.get_context("fork")
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_child, args=(target, child), daemon=True)
    proc.start()
    try:
        if not parent.poll(timeout):
            raise AssertionError(f"child did not reach the kill point within {timeout}s")
        msg = parent.recv()
        assert msg == "kill me", msg
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(30)
        assert proc.exitcode == -signal.SIGKILL, proc.exitcode
    finally:
        if proc.is_alive():
            os.kill(proc.pid, signal.SIGKILL)
            proc.join(30)

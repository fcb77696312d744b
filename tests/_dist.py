"""Run test bodies in several processes (gloo on 127.0.0.1), with a hard overall timeout.

    outcomes = spawn([(fn, (0, 3, port)), (fn, (1, 3, port)), (fn, (2, 3, port))], timeout=60)
    values = [o.unwrap() for o in outcomes]        # re-raises a child's exception

or, for the usual "same function on every rank" case::

    values = run_ranks(fn, 3, port, timeout=60)    # calls fn(rank, 3, port) in 3 processes

Children are started with the ``spawn`` method (fresh interpreters, nothing inherited from
pytest), run with one torch thread each (the machines have few cores and several ranks share
them), and send back ``fn``'s return value or their traceback. If the deadline passes, every child
still running is killed and :class:`TimeoutError` is raised with what each rank reported — a test
never hangs. A child that dies without reporting (killed, ``os._exit``) gives an outcome with
``exitcode`` set and no value.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import random
import socket
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["Outcome", "free_port", "init_gloo", "run_ranks", "spawn"]


def init_gloo(rank: int, world: int, port: int, timeout: float = 30.0) -> Any:
    """Join the default gloo process group of ``world`` ranks on 127.0.0.1:``port`` (in a
    child); returns it. ``timeout`` bounds every collective."""
    import datetime

    import torch.distributed as dist

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
        timeout=datetime.timedelta(seconds=timeout),
    )  # fmt: skip
    return dist.group.WORLD


# ports below Linux's ephemeral range (32768-60999): the kernel never hands them to a client
# socket, so between this check and the store's bind only another test can take one (the
# kernel's own pick, bind(0), lies inside the range: seen taken by a connection's local end
# before the store bound it, EADDRINUSE)
_PORTS = (20000, 32767)
_RNG = random.SystemRandom()  # not the random module's: a test that seeds it must not steer this


def free_port() -> int:
    """A TCP port free a moment ago on every address, below the ephemeral range, at random."""
    for _ in range(200):
        port = _RNG.randint(*_PORTS)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:  # no SO_REUSEADDR: a port in TIME_WAIT counts as taken
                s.bind(("", port))
            except OSError:
                continue
        return port
    raise RuntimeError(f"no free port in {_PORTS} after 200 tries")


@dataclass
class Outcome:
    index: int
    exitcode: int | None = None
    reported: bool = False
    value: Any = None
    error: str | None = None  # the child's traceback

    def unwrap(self) -> Any:
        if self.error is not None:
            raise AssertionError(f"process {self.index} failed:\n{self.error}")
        if not self.reported:
            raise AssertionError(
                f"process {self.index} exited with code {self.exitcode} without reporting a result"
            )
        return self.value


def _child(
    index: int,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    q: Any,
    fast_exit: bool,
    env: dict[str, str] | None = None,
) -> None:
    import torch

    if env is not None:  # the parent's environment now, not the fork server's at its start
        os.environ.clear()
        os.environ.update(env)
    torch.set_num_threads(1)
    try:
        q.put((index, True, fn(*args)))
    except BaseException:  # report everything, including SystemExit from the body
        q.put((index, False, traceback.format_exc()))
    if fast_exit:  # skip interpreter teardown (seconds with torch and process groups loaded)
        q.close()
        q.join_thread()  # the result is in the pipe
        os._exit(0)


# what rank bodies import, once in the server instead of in every child: DTensor and its first
# distribute_tensor (dynamo, sympy) and deltackpt cost ~2-6 s of CPU a child (tests/distributed/
# test_tiers.py alone: 75 -> 39 s; the suite 643 -> 417 s). Safe to share: deltackpt reads its
# environment when called, never at import (deltackpt/options.py)
PRELOAD = (
    "torch",
    "torch.distributed",
    "torch.distributed.tensor",
    "torch._dynamo",
    "torch.distributed.checkpoint",
    "numpy",
    "deltackpt",
    "deltackpt.dcp",
    "deltackpt.sync",
    "deltackpt.tiers",
)


def _context() -> Any:
    """Children forked from a server that imported torch once (``forkserver``, preloaded): a
    spawned child imports it again, ~1.7 s of CPU each, hundreds of times a suite run. Each
    child gets the parent's environment as it is when it starts (``_child``); what torch reads
    at import comes from the server's (started at a worker's first ``spawn``).
    ``DELTACKPT_TEST_SPAWN=spawn``: a fresh interpreter per child, as before."""
    if os.environ.get("DELTACKPT_TEST_SPAWN", "forkserver") == "spawn":
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOAD))
    return ctx


def spawn(
    targets: Sequence[tuple[Callable[..., Any], tuple[Any, ...]]],
    *,
    timeout: float = 60.0,
    fast_exit: bool = False,
) -> list[Outcome]:
    """Run ``fn(*args)`` for each target in its own process; wait at most ``timeout`` seconds.

    ``fast_exit``: children leave with ``os._exit`` once their result is sent, skipping
    interpreter teardown (atexit handlers, unflushed files) — seconds saved per process."""
    ctx = _context()
    q = ctx.Queue()
    env = dict(os.environ)
    procs = [
        ctx.Process(target=_child, args=(i, fn, args, q, fast_exit, env), daemon=True)
        for i, (fn, args) in enumerate(targets)
    ]
    outcomes = [Outcome(i) for i in range(len(procs))]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout

    def drain(block: float) -> None:
        try:
            i, ok, payload = q.get(timeout=block)
        except queue.Empty:
            return
        o = outcomes[i]
        o.reported = True
        if ok:
            o.value = payload
        else:
            o.error = payload

    try:
        while any(p.is_alive() for p in procs):
            if time.monotonic() > deadline:
                for p in procs:
                    if p.is_alive():
                        p.kill()
                for p in procs:
                    p.join(5)
                report = "\n".join(
                    f"process {o.index}: "
                    + (
                        "still running (killed)"
                        if not o.reported
                        else "failed:\n" + o.error
                        if o.error
                        else "finished"
                    )
                    for o in outcomes
                )
                raise TimeoutError(f"multi-process test exceeded {timeout:g} s\n{report}")
            drain(0.1)
        end = time.monotonic() + 2.0  # results put just before exit may still be in the pipe
        while not all(o.reported for o in outcomes) and time.monotonic() < end:
            drain(0.05)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(5)
            outcomes[procs.index(p)].exitcode = p.exitcode
        q.close()
    return outcomes


def run_ranks(fn: Callable[..., Any], nprocs: int, *args: Any, timeout: float = 60.0) -> list[Any]:
    """Call ``fn(rank, nprocs, *args)`` in ``nprocs`` processes; return the values by rank."""
    outcomes = spawn([(fn, (r, nprocs, *args)) for r in range(nprocs)], timeout=timeout)
    return [o.unwrap() for o in outcomes]

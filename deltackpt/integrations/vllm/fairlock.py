"""A lock granted in turn, for sharing an in-process ``vllm.LLM`` between a serving thread and
the trainer engine's calls (:class:`~deltackpt.integrations.vllm.trainer.LocalLLMClient`).
Imports nothing of vLLM."""

from __future__ import annotations

import threading

__all__ = ["FairLock"]


class FairLock:
    """A lock granted in the order it was asked for: a serving loop that takes it again as soon
    as it lets go cannot starve the trainer engine's calls (``threading.Lock`` has no order: the
    thread that releases usually wins it back)."""

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._next = 0  # the next ticket handed out
        self._turn = 0  # the ticket that holds the lock

    def acquire(self) -> None:
        with self._cond:
            ticket = self._next
            self._next += 1
            while self._turn != ticket:
                self._cond.wait()

    def release(self) -> None:
        with self._cond:
            self._turn += 1
            self._cond.notify_all()

    def __enter__(self) -> FairLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

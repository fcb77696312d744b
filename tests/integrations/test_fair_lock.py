"""``FairLock`` (deltackpt/integrations/vllm/fairlock.py): the lock ``LocalLLMClient`` holds
around an in-process ``vllm.LLM``, granted in the order asked, so a serving loop that takes it
again at once cannot starve the trainer engine's calls."""

from __future__ import annotations

import threading
import time

from deltackpt.integrations.vllm.fairlock import FairLock


def test_a_thread_that_takes_it_again_at_once_waits_its_turn():
    lock, order = FairLock(), []
    lock.acquire()  # the serving loop, mid-generate
    waiter = threading.Thread(
        target=lambda: (lock.acquire(), order.append("trainer"), lock.release())
    )
    waiter.start()
    deadline = time.monotonic() + 10
    while lock._next < 2 and time.monotonic() < deadline:  # the trainer's call is queued
        time.sleep(0.001)
    lock.release()
    with lock:  # the serving loop asks again at once: after the trainer
        order.append("serving")
    waiter.join(10)
    assert order == ["trainer", "serving"]


def test_many_threads_all_get_in_and_exclude_each_other():
    lock, inside, most, count = FairLock(), [0], [0], [0]

    def work() -> None:
        for _ in range(200):
            with lock:
                inside[0] += 1
                most[0] = max(most[0], inside[0])
                count[0] += 1
                inside[0] -= 1

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert count[0] == 800 and most[0] == 1

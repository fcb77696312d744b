"""What the one-host links (``shm_links``, ``ipc_links``) share: a bucket's cell is polled until
it names the round, with the liveness checks of docs/sync.md (Failures), and the two work
objects their ``send``/``recv`` return."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

import torch

from deltackpt.sync.errors import PeerLostError, SyncTimeoutError

if TYPE_CHECKING:
    from deltackpt.sync.group import SyncGroup

CHECK_S = 0.02  # how often a waiting receiver checks for an abort and the sender's process
# the longest sleep between two looks at a cell in the first FAST_S of a wait (a bucket of a
# streaming round is published within it: a round of 60 buckets could lose up to 60 sleeps),
# then the longest after (a long wait costs little CPU: ~1000 looks a second)
MAX_SLEEP_S = 2e-4
FAST_S = 0.02
SLOW_SLEEP_S = 1e-3


class _Copies(Protocol):
    def _wait_copy(self, src: int, tag: int, into: torch.Tensor, seq: int) -> None: ...


class Done:
    """A send that completed when it was issued (the bytes are in the shared memory)."""

    def wait(self) -> bool:
        return True


class Recv:
    def __init__(self, links: _Copies, src: int, tag: int, into: torch.Tensor, seq: int) -> None:
        self.links, self.src, self.tag, self.into, self.seq = links, src, tag, into, seq

    def wait(self) -> bool:
        self.links._wait_copy(self.src, self.tag, self.into, self.seq)
        return True


def wait_published(
    g: SyncGroup,
    src: int,
    tag: int,
    seq: int,
    cell_round: Callable[[], int],
    what: str,
    acked: bool = False,
) -> None:
    """Poll until ``cell_round()`` (the round bucket ``tag``'s cell names) is ``seq``. Every
    ``CHECK_S``: a round aborted because a peer was lost, or ``src``'s process gone, is a
    :class:`PeerLostError` (a soft abort is waited out: the sender publishes a stub); past the
    group's timeout, :class:`SyncTimeoutError`. ``acked``: a sender waiting for receiver
    ``src`` to acknowledge its copy of bucket ``tag`` (the errors say so)."""
    done, peer = ("acknowledging", "receiver") if acked else ("publishing", "sender")
    start = time.monotonic()
    next_check = start + CHECK_S
    delay = 1e-5
    while cell_round() != seq:
        now = time.monotonic()
        if now >= next_check:
            next_check = now + CHECK_S
            why = g.aborted(seq)
            if why is not None and why.startswith("lost: "):
                raise PeerLostError(why[6:])
            if not g.alive(src):
                raise PeerLostError(
                    f"{what}: rank {src} (pid {g.pid_of(src)[1]}) died before {done} "
                    f"bucket {tag} of round {seq}"
                )
        if now - start > g.timeout:
            raise SyncTimeoutError(
                f"{what}: bucket {tag} of round {seq} not {done.replace('ing', 'ed')} within "
                f"{g.timeout:g} s (its cell says round {cell_round()}); the {peer} is hung: "
                "reconnect the group"
            )
        time.sleep(delay)
        delay = min(2 * delay, MAX_SLEEP_S if now - start < FAST_S else SLOW_SLEEP_S)

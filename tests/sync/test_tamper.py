"""Shared-memory links are writable by any process that can open their files: a window
changed after the trainer published a bucket (its payload; a header flag claiming a
zero-copy piece, which shm links never carry; the payload length) fails the round on every rank, nothing reaches
the model, and the next round (full) is bit-exact.

World: one trainer (the whole tensors) -> one receiver (the whole tensors, trainer dtypes),
``links="shm"``. The hostile write happens in the receiver process, between the trainer's
publish and the receiver's copy out of the window, as another process's write would.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from deltackpt.sync import PlanError
from tests._dist import free_port, spawn
from tests.sync._common import make_state, mismatches, wants_for

pytestmark = pytest.mark.multiproc

LAYOUT = ("full",)
BUCKET = 8 << 10


def _trainer(port: int) -> list[str | None]:
    from deltackpt import sync

    group = sync.SyncGroup("127.0.0.1", port, 0, 2, [0], timeout=60, links="shm")
    sender = sync.WeightSender(group, bucket_bytes=BUCKET)
    errors: list[str | None] = []
    for v in (1, 2, 3):
        try:
            sender.push(make_state(v), version=v, full=True)  # every bucket carries pieces
            errors.append(None)
        except sync.SyncError as e:
            errors.append(type(e).__name__)
    group.pg.barrier().wait()
    group.close()
    return errors


def _receiver(port: int, attack: str) -> dict[str, Any]:
    from deltackpt import sync
    from deltackpt.sync import rounds, wire
    from deltackpt.sync.shm_links import ShmLinks

    group = sync.SyncGroup("127.0.0.1", port, 1, 2, [0], timeout=60, links="shm")
    wants = wants_for(LAYOUT)
    receiver = sync.WeightReceiver(group, wants, bucket_bytes=BUCKET)
    orig = ShmLinks._wait_copy
    hit: list[int] = []

    def hostile(self: ShmLinks, src: int, tag: int, into: torch.Tensor, seq: int) -> None:
        _, cell, data, slot = self._maps[(src, self.g.rank)]
        if seq == 2 and tag == 0:  # round 2, bucket 0: wait for the publish, then write
            while cell[tag, 0] != seq:
                pass
            bk = receiver._buckets[tag]
            win = data[tag * slot : (tag + 1) * slot]
            if attack == "payload":
                win[rounds.payload_start(bk, receiver.align) + 3] ^= 0x40
            elif attack == "flag":  # the first piece's flag: "sent on its own" (never on shm)
                words = win.numpy().view("int64")
                words[wire.HEAD] = words[wire.HEAD] & ~3 | wire.DIRECT
            else:  # the payload length: one aligned slot less than the pieces take
                win.numpy().view("int64")[6] -= receiver.align
            hit.append(seq)
        orig(self, src, tag, into, seq)

    ShmLinks._wait_copy = hostile  # type: ignore[method-assign]
    loaded: dict[str, torch.Tensor] = {}

    def load(ws: list[tuple[str, torch.Tensor]]) -> None:
        loaded.update((n, t.clone()) for n, t in ws)

    out: dict[str, Any] = {"errors": [], "bad": [], "versions": []}
    for _ in range(3):
        try:
            receiver.pull(load)
            out["errors"].append(None)
        except sync.SyncError as e:
            out["errors"].append((type(e).__name__, str(e)))
        out["versions"].append(receiver.version)
        out["bad"].append(mismatches(wants, loaded, LAYOUT, receiver.version or 0))
    out["hit"] = hit
    group.pg.barrier().wait()
    group.close()
    return out


@pytest.mark.parametrize(
    ("attack", "error", "says"),
    [
        ("payload", "DigestMismatchError", "has digest"),
        ("flag", "RoundAbortedError", "zero-copy pieces on a shm link"),
        ("length", "RoundAbortedError", "payload bytes, its pieces take"),
    ],
)
def test_window_written_after_publish_fails_the_round_everywhere(
    attack: str, error: str, says: str
) -> None:
    port = free_port()
    trainer, rec = (
        o.unwrap()
        for o in spawn(
            [(_trainer, (port,)), (_receiver, (port, attack))], timeout=90, fast_exit=True
        )
    )
    assert rec["hit"] == [2]
    assert rec["errors"][0] is None and rec["errors"][2] is None
    name, message = rec["errors"][1]
    assert name == error and says in message, message
    assert "nothing was applied" in message or "version stays 1" in message
    assert trainer == [None, "RoundAbortedError", None]
    # round 2 left the model at version 1, bit for bit; round 3 (full) is exact
    assert rec["versions"] == [1, 1, 3]
    assert rec["bad"] == [[], [], []]


def test_a_full_ram_disk_fails_the_link_setup_with_a_typed_error(monkeypatch):
    """A window that does not fit in /dev/shm (Docker's default is 64 MB) is refused when the
    links open, not by a SIGBUS at the first write into a sparse mapping."""
    import errno
    import os

    from deltackpt.sync import shm_links

    def full(fd: int, offset: int, size: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(shm_links.os, "posix_fallocate", full)
    links = shm_links.ShmLinks(None, f"full-{os.getpid()}")  # type: ignore[arg-type]
    with pytest.raises(PlanError, match="shm-size") as e:
        links.open({(0, 1): (2, 1 << 20)})
    assert "needs 2101248 bytes" in str(e.value) and "links='gloo'" in str(e.value)
    assert not os.path.exists(links.path(0, 1))


def test_link_files_are_removed_when_the_process_exits_without_close():
    """A job that ends by an exception never calls group.close(): the interpreter's exit removes
    its link files (only SIGKILL leaves them, as documented in sync/shm_links.py)."""
    import os
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent(
        f"""
        from deltackpt.sync.shm_links import ShmLinks
        links = ShmLinks(None, "exit-{os.getpid()}")
        links.open({{(0, 1): (2, 4096)}})
        print(links.path(0, 1), flush=True)
        raise RuntimeError("the job failed")
        """
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    path = p.stdout.strip()
    assert p.returncode == 1 and path.startswith(("/dev/shm/", "/tmp/")), p.stderr
    assert not os.path.exists(path)

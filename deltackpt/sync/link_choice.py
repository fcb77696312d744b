"""``SyncGroup(links="auto")``: tensor-handle links where every rank can map the others' shared
memory, gloo where one cannot.

What decides is not the host name (two containers of one host have their own ``/dev/shm``,
and a pod's may be 64 MB) but whether the memory an ipc link hands out can be mapped, and
whether there is room for it. So, once every rank joined the group's store:

1. rank 0 writes a random token into a new file of ``/dev/shm`` (``deltackpt-probe-<hex>``,
   mode 0600, as PyTorch's shared buckets are) and posts the file's name and the token;
2. every rank opens that file (the name checked against the pattern: the store is a control
   channel, not a path to trust) and posts whether it read the same token;
3. rank 0 chooses and posts its choice, with the reason; every rank takes it; rank 0 removes
   the file.

``"ipc"`` when every rank read the token and ``/dev/shm`` has twice the room the trainers'
shared buckets take at most (every trainer linked to every inference rank, a ring of
``ipc_buckets`` per link, two for ``None``, of :data:`~deltackpt.sync.group.BUCKET_BYTES`'s ipc
size; the half left over is for everything else that lives there, vLLM's and NCCL's own
buffers among them); CUDA buckets (``ipc_device="cuda:N"``) need only the links' small cell
tables there. Otherwise ``"gloo"``, which works between any hosts.

Measured (BENCHMARKS.md, "links='auto'"): on one host ipc links move a round sent whole 1.2-1.4x
faster than gloo over loopback into a vLLM engine, and at least as fast for patched rounds; on
an H100 a CUDA trainer's round through host shared memory took 0.99x a pinned D2H + H2D copy.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
from collections.abc import Callable
from dataclasses import dataclass

from deltackpt.sync.errors import SyncError

__all__ = ["LinkChoice", "choose_links", "shm_need"]

SHM_DIR = "/dev/shm"
_PREFIX = "deltackpt-probe-"
_PROBE = re.compile(_PREFIX + r"[0-9a-f]{32}")
_CELLS_BYTES = 1 << 20  # a link's cell table, rounded up (ipc_links.CELL_WORDS x 8 per bucket)


@dataclass(frozen=True)
class LinkChoice:
    """The links a group of ``links="auto"`` took, and why (``SyncGroup.links_reason``)."""

    links: str
    reason: str


def shm_need(
    trainers: int, receivers: int, ipc_buckets: int | None, bucket_bytes: int, on_cuda: bool
) -> int:
    """Bytes of ``/dev/shm`` the trainers' ipc buckets take at most: a ring per link, every
    trainer linked to every inference rank (the plan may link fewer)."""
    per_link = _CELLS_BYTES + (0 if on_cuda else (ipc_buckets or 2) * bucket_bytes)
    return trainers * receivers * per_link


def choose_links(
    store_set: Callable[[str, str], None],
    store_get: Callable[[str], bytes],
    wait: Callable[[list[str], str], None],
    rank: int,
    world_size: int,
    need: int,
    shm_dir: str = SHM_DIR,
) -> LinkChoice:
    """Every rank calls it with the group's store calls (``wait(keys, what)`` returns once
    every key is set, raising on a lost peer or the timeout); returns the same choice on every
    rank. Keys live under ``links/`` of the group's store (a new store per connection)."""
    probe = None
    try:
        if rank == 0:
            probe = _make_probe(shm_dir)
            store_set("links/probe", json.dumps(probe or {}))
        wait(["links/probe"], "waiting for rank 0's shared-memory probe")
        posted = _loads(store_get("links/probe"))
        store_set(f"links/seen/{rank}", "1" if _read_probe(shm_dir, posted) else "0")
        if rank == 0:
            keys = [f"links/seen/{r}" for r in range(world_size)]
            wait(keys, "waiting for every rank to look for the shared-memory probe")
            blind = [r for r, k in enumerate(keys) if store_get(k) != b"1"]
            choice = _decide(probe is not None, blind, _free(shm_dir), need, shm_dir)
            store_set("links/chosen", json.dumps([choice.links, choice.reason]))
        wait(["links/chosen"], "waiting for rank 0's choice of links")
        got = _loads(store_get("links/chosen"))
        if (
            not isinstance(got, list)
            or len(got) != 2
            or got[0] not in ("gloo", "ipc")
            or not isinstance(got[1], str)
        ):
            raise SyncError(
                f"rank {rank}: the group's store holds {got!r} as rank 0's choice of links; "
                "every rank must run the same deltackpt"
            )
        return LinkChoice(got[0], got[1])
    finally:
        if probe is not None:
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(shm_dir, probe["name"]))


def _make_probe(shm_dir: str) -> dict[str, str] | None:
    """A new file under ``shm_dir`` holding a random token; None where none can be made."""
    name, token = _PREFIX + secrets.token_hex(16), secrets.token_hex(16)
    try:
        fd = os.open(os.path.join(shm_dir, name), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError:
        return None
    try:
        os.write(fd, token.encode())
    finally:
        os.close(fd)
    return {"name": name, "token": token}


def _read_probe(shm_dir: str, posted: object) -> bool:
    """Whether this process reads rank 0's token in the file rank 0 named."""
    if not isinstance(posted, dict):
        return False
    name, token = posted.get("name"), posted.get("token")
    if not isinstance(name, str) or not isinstance(token, str) or not _PROBE.fullmatch(name):
        return False
    try:
        fd = os.open(os.path.join(shm_dir, name), os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return False
    try:
        return os.read(fd, 64) == token.encode()
    finally:
        os.close(fd)


def _free(shm_dir: str) -> int:
    try:
        return shutil.disk_usage(shm_dir).free
    except OSError:
        return 0


def _decide(made: bool, blind: list[int], free: int, need: int, shm_dir: str) -> LinkChoice:
    if not made:
        return LinkChoice("gloo", f"links='auto': rank 0 cannot write to {shm_dir}")
    if blind:
        ranks = ", ".join(str(r) for r in blind)
        return LinkChoice(
            "gloo",
            f"links='auto': rank(s) {ranks} cannot map rank 0's shared memory ({shm_dir}): "
            "another host or container",
        )
    if 2 * need > free:
        return LinkChoice(
            "gloo",
            f"links='auto': every rank shares {shm_dir}, but it has {free / 1e6:.0f} MB free "
            f"and the trainers' ipc buckets would take up to {need / 1e6:.0f} MB (ipc wants "
            "twice that free; give it room, e.g. docker run --shm-size, or pass links='ipc' "
            "with a smaller bucket_bytes)",
        )
    return LinkChoice(
        "ipc",
        f"links='auto': every rank shares {shm_dir} ({free / 1e6:.0f} MB free, the trainers' "
        f"ipc buckets take up to {need / 1e6:.0f} MB)",
    )


def _loads(raw: bytes) -> object:
    try:
        return json.loads(raw)
    except ValueError:
        return None

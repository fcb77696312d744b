"""``SyncGroup(links="auto")``: tensor-handle links where every rank can map the others' shared
memory, gloo where one cannot.

What decides is not the host name (two containers of one host have their own ``/dev/shm``, or
their own ``/tmp``, where PyTorch's shared-memory manager listens; a pod's ``/dev/shm`` may be
64 MB) but whether a bucket an ipc link hands out can be mapped, and whether there is room for
it. So, once every rank joined the group's store:

1. rank 0 makes a small shared tensor the way an ipc link makes its buckets
   (:func:`~deltackpt.sync.ipc_links.share`: PyTorch's file_system sharing), writes a random
   token into it and posts its handle and the token;
2. every rank maps that handle (:func:`~deltackpt.sync.ipc_links.open_handle`, which checks it
   as it checks a bucket's: the store is a control channel, not a path to trust) and posts
   whether it read the token;
3. rank 0 chooses and posts its choice, with the reason; every rank takes it; rank 0 lets the
   tensor go (PyTorch removes its file with the last mapping).

``"ipc"`` when every rank read the token and ``/dev/shm`` has twice the room the trainers'
shared buckets take at most (every trainer linked to every inference rank, a ring of
``ipc_buckets`` per link, two for ``None``, of :data:`~deltackpt.sync.group.BUCKET_BYTES`'s ipc
size; the half left over is for everything else that lives there, vLLM's and NCCL's own
buffers among them); CUDA buckets (``ipc_device="cuda:N"``) need only the links' small cell
tables there. Otherwise ``"gloo"``, which works between any hosts.

Measured (BENCHMARKS.md, "links='auto'"): on one host ipc links move a round sent whole into a
vLLM engine faster than gloo over loopback (a pre-training step's round 1.06-1.7x in three
pairs of runs), and a patched round as fast within noise; on an H100 a CUDA trainer's round
through host shared memory took 0.99x a pinned D2H + H2D copy.
"""

from __future__ import annotations

import json
import re
import secrets
import shutil
from collections.abc import Callable
from dataclasses import dataclass

import torch

from deltackpt.sync.errors import SyncError
from deltackpt.sync.ipc_links import open_handle, share, tensor_handle

__all__ = ["LinkChoice", "choose_links", "read_probe", "shm_need"]

SHM_DIR = "/dev/shm"  # where PyTorch's file_system sharing puts its files (shm_open)
_TOKEN = re.compile(r"[0-9a-f]{32}")
_PROBE_BYTES = 16
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
    *,
    can_map: Callable[[object], bool] | None = None,
    shm_dir: str = SHM_DIR,
) -> LinkChoice:
    """Every rank calls it with the group's store calls (``wait(keys, what)`` returns once
    every key is set, raising on a lost peer or the timeout); returns the same choice on every
    rank. Keys live under ``links/`` of the group's store (a new store per connection).
    ``can_map``: whether this rank reads rank 0's posted probe (default :func:`read_probe`);
    ``shm_dir``: where rank 0 looks for free room."""
    # rank 0 holds the probe until it returns: its file goes with the last mapping
    probe: torch.Tensor | None = None
    if rank == 0:
        probe, posted = _make_probe()
        store_set("links/probe", json.dumps(posted))
    wait(["links/probe"], "waiting for rank 0's shared-memory probe")
    seen = (can_map or read_probe)(_loads(store_get("links/probe")))
    store_set(f"links/seen/{rank}", "1" if seen else "0")
    if rank == 0:
        keys = [f"links/seen/{r}" for r in range(world_size)]
        wait(keys, "waiting for every rank to map the shared-memory probe")
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


def _make_probe() -> tuple[torch.Tensor | None, dict[str, str]]:
    """A shared tensor holding a random token, and what to post of it (nothing where no
    shared memory can be made)."""
    token = secrets.token_bytes(_PROBE_BYTES)
    try:
        t = share(_PROBE_BYTES, torch.device("cpu"))
        t.copy_(torch.frombuffer(bytearray(token), dtype=torch.uint8))
        handle = tensor_handle(t).decode()
    except (SyncError, RuntimeError, OSError):
        return None, {}
    return t, {"handle": handle, "token": token.hex()}


def read_probe(posted: object) -> bool:
    """Whether this process maps the tensor rank 0 posted and reads the token in it (the
    handle checked as a bucket's is; any failure to map it is a no)."""
    if not isinstance(posted, dict):
        return False
    handle, token = posted.get("handle"), posted.get("token")
    if not isinstance(handle, str) or not isinstance(token, str) or not _TOKEN.fullmatch(token):
        return False
    try:
        t = open_handle(handle.encode(), _PROBE_BYTES, "the links probe")
        got = bytes(t.numpy())
    except (SyncError, RuntimeError, OSError, ValueError, TypeError):
        return False
    del t
    return got == bytes.fromhex(token)


def _free(shm_dir: str) -> int:
    try:
        return shutil.disk_usage(shm_dir).free
    except OSError:
        return 0


def _decide(made: bool, blind: list[int], free: int, need: int, shm_dir: str) -> LinkChoice:
    if not made:
        return LinkChoice(
            "gloo", f"links='auto': rank 0 cannot make shared memory (PyTorch's, in {shm_dir})"
        )
    if blind:
        ranks = ", ".join(str(r) for r in blind)
        return LinkChoice(
            "gloo",
            f"links='auto': rank(s) {ranks} cannot map rank 0's shared memory: another host, "
            "or a container with its own /dev/shm or /tmp (PyTorch's shared-memory manager)",
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

"""Tensor-handle links of weight sync on one host (``SyncGroup(..., links="ipc")``).

The sender owns a ring of shared tensors per link (``SyncGroup(ipc_buckets=)``, two by default,
``DELTACKPT_IPC_BUCKETS``; ``None``: one per bucket of the round) and hands the receiver a *handle* of each, built by PyTorch's own sharing (``torch.multiprocessing.reductions``:
``reduce_tensor`` and the rebuild function it returns): on CPU the bucket's storage is shared
memory under PyTorch's file_system strategy (a name in ``/dev/shm``, ``torch_<pid>_...``; the
file-descriptor strategy needs a Unix socket between related processes, and ranks started by
torchrun are not), on CUDA (``SyncGroup(ipc_device="cuda:N")``) the bucket is device memory and
the handle a CUDA IPC handle. Handles are posted once per shared tensor to the group's TCP
store (``ipc/h/<sender>-<receiver>/<generation>``, JSON, never pickle: the store is a control
channel, not code) and reused every round while the link's layout (buckets, slot size) is
unchanged; a re-plan that changes it makes new buckets under new generations. Bucket ``i`` of a
round is ring tensor ``i % ipc_buckets``: the sender packs it once the receiver acknowledged its
copy of bucket ``i - ipc_buckets`` in that round (``_wait_free``, with the liveness checks of a
receive), the receiver acknowledges each copy as soon as it has landed (it sees the ring in the
cells: generations repeat) and maps each ring tensor once.

Per link, a small shared int64 table of cells (one row per bucket: round, message bytes,
handle generation, acknowledged round), also owned by the sender; its handle is posted once per
setup (``ipc/c/<setup>/<sender>-<receiver>``). A round mirrors the shm links (``shm_links.py``):
the sender packs into the bucket (CPU: straight into the shared tensor; CUDA: into a private
pinned buffer, then one host-to-device copy that has landed before the cell is written), then
writes the cell (bytes, then round). The receiver polls the cell, checking every 20 ms whether
the round was aborted or the sender's process died, opens the bucket's handle when the cell
names a generation it has not mapped, copies the message out into its private staging, where it
is verified and from where it is applied (the bucket is writable by other processes: docs/
sync.md, Untrusted shared memory), and acknowledges the round in the cell.

A device round's header travels in the cell (after the columns, ``HDR`` its bytes) whenever it
fits, written with its digests once the bucket has landed, so the receiver reads it without
waiting for its device; a message with no piece in it (a bucket none of whose tensors changed)
is only that, ``NBYTES`` negative (minus the header's bytes), the bucket untouched. The receiver
copies the words out of the cell and reads the header from that copy
(:meth:`IpcLinks.inline_header`), as untrusted as a bucket's. With a header in its cell, the
receiver's copy of the bucket is left to the receiver, who has read the header and knows the
pieces (:meth:`IpcLinks.copy_out`: the pieces copied and fingerprinted in one pass where the
fingerprint kernel runs), and not waited for message by message: :meth:`IpcLinks.settle` waits
once for all of a round's, before the receiver's vote, and only then acknowledges them (on a
ring, whose sender waits for them, once per message). So an unchanged bucket costs neither
side any work on the device, and the sender waits for its device once per group of buckets it
publishes (``WeightSender``; per bucket on a ring), the receiver once per round.

Host buckets (``ipc_device="cpu"``) of a trainer whose tensors are on a GPU (a device round
through host shared memory, ``DELTACKPT_DEVICE_ROUNDS=always``) are page-locked by the sender
when it first packs into them, and by a receiver when it first copies one to its GPU
(``cuda.register_host``), so those copies run at the link's speed and without waiting; each side
unlocks what it locked when the mapping or bucket is dropped (a re-plan, ``close``).

Lifetimes: the sender keeps a bucket until the receiver acknowledged the last round published
in it; a bucket a re-plan replaces is retired and dropped once acknowledged, or at ``close``.
``SyncGroup.close`` and ``reconnect`` drop every bucket, cell table and mapping of this rank.
PyTorch counts the mappings of a CPU bucket and removes its ``/dev/shm`` file when the last one
closes; its ``torch_shm_manager`` removes the files of a sender that exited or was killed once
every process that mapped them has exited. A CUDA bucket a receiver still maps stays allocated until it releases it
(PyTorch's CUDA IPC reference counts; ``torch.cuda.ipc_collect`` at close).
"""

from __future__ import annotations

import base64
import json
import re
import shutil
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np
import torch
from torch.multiprocessing.reductions import rebuild_cuda_tensor, rebuild_tensor, reduce_tensor

from deltackpt import cuda
from deltackpt.format.fingerprint import copy_fingerprinted
from deltackpt.options import fingerprint_kernel, fused_copies
from deltackpt.sync.cells import Done, Recv, wait_published
from deltackpt.sync.device_digest import CHUNK
from deltackpt.sync.errors import PeerLostError, PlanError

if TYPE_CHECKING:
    from deltackpt.sync.group import SyncGroup

__all__ = ["IpcLinks", "open_handle", "share", "tensor_handle"]

SEQ, NBYTES, GEN, ACK, HDR = range(5)  # the columns of a link's cells
HEAD = 5  # a device round's header words follow the columns
INLINE_WORDS = 392  # room for a header of up to 128 pieces (wire.header_words)
CELL_WORDS = HEAD + INLINE_WORDS
_NAME = re.compile(r"/torch_\d+_\d+_\d+")


# ---- handles ------------------------------------------------------------------------------


#: how often a call that registers shared memory with PyTorch's manager is tried (its answer is
#: awaited for 1 s a try: libshm's socket; a busy host misses that now and then)
MANAGER_TRIES = 5
_T = TypeVar("_T")


def with_manager(call: Callable[[], _T]) -> _T:
    """``call()``, tried again when PyTorch's shared-memory manager did not answer in time.
    (Each try names a new file; a registration whose answer came late is answered before the
    next one, in order, and the manager removes its files when this process exits.)"""
    for attempt in range(MANAGER_TRIES):
        try:
            return call()
        except RuntimeError as e:
            if "manager connection has timed out" not in str(e) or attempt == MANAGER_TRIES - 1:
                raise
            time.sleep(0.05 * 2**attempt)
    raise AssertionError("unreachable")  # pragma: no cover


def share(nbytes: int, device: torch.device) -> torch.Tensor:
    """A 1-D uint8 tensor of ``nbytes`` another process can map through :func:`tensor_handle`:
    CPU shared memory (PyTorch's file_system strategy), or device memory on CUDA. Memory the
    device or ``/dev/shm`` has no room for (PyTorch reserves shared memory up front) is a
    :class:`PlanError` that says what to change."""
    if device.type == "cuda":
        try:
            return torch.empty(nbytes, dtype=torch.uint8, device=device)
        except torch.cuda.OutOfMemoryError as e:
            raise PlanError(
                f"an ipc link's shared bucket needs {nbytes} bytes on {device}, which has no "
                f"room for them ({str(e).splitlines()[0]}). Lower bucket_bytes or "
                "SyncGroup(ipc_buckets=) (a trainer holds ipc_buckets x bucket_bytes per link), "
                "or use ipc_device='cpu' (host shared memory)"
            ) from e
    t = torch.empty(nbytes, dtype=torch.uint8)
    try:
        with_manager(t.untyped_storage()._share_filename_cpu_)
    except RuntimeError as e:
        if "shared memory" not in str(e):
            raise
        try:
            free = f"{shutil.disk_usage('/dev/shm').free} bytes free"
        except OSError:
            free = "no /dev/shm"
        raise PlanError(
            f"an ipc link's shared bucket needs {nbytes} bytes of shared memory, /dev/shm has "
            f"{free} ({e}). Give it more room (e.g. docker run --shm-size=8g), lower "
            "bucket_bytes or SyncGroup(ipc_buckets=) (a trainer holds ipc_buckets x "
            "bucket_bytes per link), or use ipc_device='cuda:N' or links='gloo'"
        ) from e
    return t


def tensor_handle(t: torch.Tensor) -> bytes:
    """The handle of a 1-D uint8 tensor made by :func:`share`, as JSON bytes."""
    rebuild, args = reduce_tensor(t)
    if rebuild is rebuild_cuda_tensor:
        return _cuda_handle(args)
    _, storage, (offset, size, _, _) = args
    manager, name, nbytes = storage._untyped_storage._share_filename_cpu_()
    doc = {
        "kind": "cpu",
        "manager": manager.decode(),
        "name": name.decode(),
        "storage": int(nbytes),
        "offset": int(offset),
        "numel": int(size[0]),
    }
    return json.dumps(doc).encode()


def open_handle(raw: bytes, numel: int, what: str) -> torch.Tensor:
    """Map the tensor a peer's :func:`tensor_handle` names; it must be ``numel`` bytes (the
    receiver's own schedule says how big the bucket is). ``what`` names the link in errors."""
    try:
        doc = json.loads(raw)
        kind = doc["kind"]
        got = int(doc["numel"])
    except (ValueError, KeyError, TypeError) as e:
        raise PeerLostError(f"{what}: unreadable handle ({e!r}); reconnect the group") from e
    if got != numel:
        raise PeerLostError(
            f"{what}: the handle names a tensor of {got} bytes, this rank's schedule expects "
            f"{numel}; every rank must run the same deltackpt and bucket_bytes"
        )
    if kind == "cuda":
        return _open_cuda_handle(doc)
    name, size, offset = str(doc["name"]), int(doc["storage"]), int(doc["offset"])
    if kind != "cpu" or not _NAME.fullmatch(name) or not 0 <= offset <= size - numel:
        raise PeerLostError(f"{what}: a handle that is not a bucket of this link: {doc}")
    storage = with_manager(
        lambda: torch.UntypedStorage._new_shared_filename_cpu(
            str(doc["manager"]).encode(), name.encode(), size
        )
    )
    typed = torch.storage.TypedStorage(wrap_storage=storage, dtype=torch.uint8, _internal=True)
    return rebuild_tensor(torch.Tensor, typed, (offset, (numel,), (1,), False))


def _cuda_handle(args: tuple[Any, ...]) -> bytes:
    """GPU only: the CUDA IPC handle ``reduce_tensor`` made (the arguments of
    ``rebuild_cuda_tensor``), as JSON: its byte strings in base64, the classes left out (the
    receiver rebuilds a plain uint8 tensor)."""
    (_, size, stride, offset, _, _, device, handle, ssize, soff, _, ref, ref_off, ev, ev_sync) = (
        args
    )

    def b64(x: bytes | None) -> str | None:
        return None if x is None else base64.b64encode(bytes(x)).decode()

    doc = {
        "kind": "cuda",
        "numel": int(size[0]),
        "stride": int(stride[0]),
        "offset": int(offset),
        "device": int(device),
        "handle": b64(handle),
        "storage": int(ssize),
        "storage_offset": int(soff),
        "ref": b64(ref),
        "ref_offset": int(ref_off),
        "event": b64(ev),
        "event_sync": bool(ev_sync),
    }
    return json.dumps(doc).encode()


def _open_cuda_handle(doc: dict[str, Any]) -> torch.Tensor:
    """GPU only: map a CUDA IPC handle of :func:`_cuda_handle` (``rebuild_cuda_tensor``)."""

    def raw(x: str | None) -> bytes | None:
        return None if x is None else base64.b64decode(x)

    return rebuild_cuda_tensor(
        torch.Tensor,
        torch.Size([int(doc["numel"])]),
        (int(doc["stride"]),),
        int(doc["offset"]),
        torch.storage.TypedStorage,
        torch.uint8,
        int(doc["device"]),
        raw(doc["handle"]),
        int(doc["storage"]),
        int(doc["storage_offset"]),
        False,
        raw(doc["ref"]),
        int(doc["ref_offset"]),
        raw(doc["event"]),
        bool(doc["event_sync"]),
    )


# ---- links --------------------------------------------------------------------------------


def _unlock(buckets: Iterable[_Bucket]) -> None:
    for b in buckets:
        if b.locked:
            b.locked = False
            cuda.unregister_host(b.shared)


@dataclass
class _Bucket:
    """One bucket a sender owns: ``shared`` is what the receiver maps, ``host`` where a host
    round packs (the shared tensor itself on CPU; for a CUDA bucket a private pinned buffer,
    made on the first host round: a device round packs into ``shared`` itself)."""

    gen: int
    shared: torch.Tensor
    host: torch.Tensor | None
    published: int = 0  # the last round published in it
    # a host bucket page-locked for a device's copies (cuda.register_host); None: not tried
    # (a refusal is not retried every round)
    locked: bool | None = None


@dataclass
class _Out:
    """A link this rank sends on: its cells and buckets, one per bucket of the round
    (``buckets[tag]``); with a ring of ``ring`` shared buckets, bucket ``tag`` is
    ``buckets[tag % ring]``'s tensor, the same object at every ``ring``-th tag."""

    cells: torch.Tensor
    cellv: np.ndarray
    slot: int
    buckets: list[_Bucket]
    ring: int = 0  # distinct shared buckets reused within a round; 0: one per bucket


@dataclass
class _In:
    """A link this rank receives on: where its cells' handle is, and the buckets mapped so far
    (bucket -> (generation, tensor))."""

    key: str
    n: int
    slot: int
    cells: torch.Tensor | None = None
    cellv: np.ndarray | None = None
    # the sender reuses its buckets within a round (a ring: generations repeat in the cells),
    # so each copy out is acknowledged as soon as it landed, not once before the vote
    ring: bool = False
    mapped: dict[int, tuple[int, torch.Tensor]] = field(default_factory=dict)
    # mapped host buckets copied to a GPU: page-locked (True) or refused (False, not retried)
    locked: dict[int, bool] = field(default_factory=dict)

    def unlock(self, tags: Iterable[int]) -> None:
        """Unlock the mappings of ``tags`` this rank page-locked (before they are dropped); a
        ring's memory another tag still maps stays locked (that tag's record says so)."""
        tags = list(tags)
        for t in tags:
            if self.locked.pop(t, False):
                gen = self.mapped[t][0]
                if not any(
                    u not in tags and g == gen and self.locked.get(u)
                    for u, (g, _) in self.mapped.items()
                ):
                    cuda.unregister_host(self.mapped[t][1])


@dataclass
class _Retired:
    """Buckets a re-plan replaced, kept with their old cells until the receiver acknowledged
    the last round published in each."""

    cells: torch.Tensor
    cellv: np.ndarray
    buckets: list[tuple[int, _Bucket]]

    def acknowledged(self) -> bool:
        return all(int(self.cellv[tag, ACK]) >= b.published for tag, b in self.buckets)


class IpcLinks:
    """The buckets of this rank's ipc links; ``open(links)`` once per schedule (module doc).
    ``device``: where the buckets a sender owns live (CPU shared memory, or a CUDA device).
    ``ring``: the most shared buckets this rank holds per link as a sender (>= 2;
    ``SyncGroup(ipc_buckets=)``), reused within a round once the receiver acknowledged its copy
    of the last message in each; None: one per bucket of the round. ``handles_sent`` /
    ``handles_opened`` count handles posted and mapped by this rank."""

    def __init__(self, group: SyncGroup, device: torch.device, ring: int | None = None) -> None:
        self.g, self.device, self.ring = group, device, ring
        self._out: dict[int, _Out] = {}
        self._in: dict[int, _In] = {}
        self._retired: list[_Retired] = []
        # (src, tag) -> the header the cell carried, and whether it was the whole message
        self._inline: dict[tuple[int, int], tuple[torch.Tensor, bool]] = {}
        # receives whose copy out of the bucket is queued, acknowledged by settle()
        self._pending: list[tuple[np.ndarray, int, int, torch.Tensor]] = []
        # (src, tag) -> a copy out of a bucket left to copy_out (bucket, staging, bytes)
        self._deferred: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor, int]] = {}
        self._gen = 0
        self.handles_sent = 0
        self.handles_opened = 0

    def _name(self, s: int, r: int) -> str:
        return f"ipc link {s}->{r}"

    # ---- setup ----------------------------------------------------------------------------

    def open(self, links: dict[tuple[int, int], tuple[int, int]]) -> None:
        """``links``: (sender, receiver) -> (buckets, slot bytes) for this rank's links; called
        inside a setup attempt (its number names the cells' handles)."""
        me, setup = self.g.rank, self.g.setups
        self.settle()  # copies a failed round left queued: landed before mappings are dropped
        out: dict[int, _Out] = {}
        ins: dict[int, _In] = {}
        for (s, r), (n, slot) in links.items():
            if s == me:
                out[r] = self._open_out(r, n, slot, setup)
            elif r == me:
                old = self._in.get(s)
                keep = {} if old is None or old.slot != slot else old.mapped
                mapped = {t: m for t, m in keep.items() if t < n}
                if old is not None:  # mappings dropped: unlocked first
                    old.unlock([t for t in old.locked if t not in mapped])
                locked = {} if old is None else old.locked
                ins[s] = _In(f"ipc/c/{setup}/{s}-{me}", n, slot, mapped=mapped, locked=locked)
        for s_, lk in self._in.items():  # links this rank no longer receives on
            if s_ not in ins:
                lk.unlock(lk.locked)
        for r, o in self._out.items():
            if r not in out:
                self._retire(o, list(enumerate(o.buckets)))
        self._out, self._in = out, ins

    def _open_out(self, r: int, n: int, slot: int, setup: int) -> _Out:
        me = self.g.rank
        old = self._out.get(r)
        m = n if self.ring is None else min(n, self.ring)  # distinct shared buckets
        keep = (
            []
            if old is None or old.slot != slot
            else list({id(b): b for b in old.buckets}.values())
        )
        phys = [keep[i] if i < len(keep) else self._new_bucket(r, slot) for i in range(m)]
        buckets = [phys[t % m] for t in range(n)] if m else []
        if old is not None:
            kept = {id(b) for b in buckets}
            self._retire(old, [(t, b) for t, b in enumerate(old.buckets) if id(b) not in kept])
        cells = share(n * CELL_WORDS * 8, torch.device("cpu")).view(torch.int64)
        cells = cells.view(n, CELL_WORDS)
        cells.zero_()
        cellv = cells.numpy()
        for t, b in enumerate(buckets):
            b.published = 0
            cellv[t, GEN] = b.gen
        key = f"ipc/c/{setup}/{me}-{r}"
        handle = tensor_handle(cells.view(-1).view(torch.uint8))
        self.g.guard("store set", lambda: self.g.store.set(key, handle))
        return _Out(cells, cellv, slot, buckets, m if m < n else 0)

    def _new_bucket(self, r: int, slot: int) -> _Bucket:
        self._gen += 1
        shared = share(slot, self.device)
        host = shared if shared.device.type == "cpu" else None
        key = f"ipc/h/{self.g.rank}-{r}/{self._gen}"
        handle = tensor_handle(shared)
        self.g.guard("store set", lambda: self.g.store.set(key, handle))
        self.handles_sent += 1
        return _Bucket(self._gen, shared, host)

    def _retire(self, o: _Out, buckets: list[tuple[int, _Bucket]]) -> None:
        if buckets:
            self._retired.append(_Retired(o.cells, o.cellv, buckets))

    def _drop_acknowledged(self) -> None:
        if self._retired:
            keep = []
            for x in self._retired:
                if x.acknowledged():
                    _unlock(b for _, b in x.buckets)
                else:
                    keep.append(x)
            self._retired = keep

    # ---- sender ---------------------------------------------------------------------------

    def window(self, dst: int, tag: int) -> torch.Tensor:
        """Where the sender packs bucket ``tag`` for ``dst`` (then :meth:`publish`); the
        receiver copied the last round's message out before it voted, so it is free once the
        last round's vote is in (on a ring, once the receiver copied the message before it in
        this round: waited for here)."""
        o = self._out[dst]
        b = o.buckets[tag]
        self._wait_free(dst, o, tag)
        if b.host is None:
            b.host = cuda.host_buffer(o.slot, True)
        return b.host[: o.slot]

    def device_window(self, dst: int, tag: int, lock: bool = False) -> torch.Tensor:
        """The bucket itself, where a device round packs (then ``publish(..., device=True)``):
        device memory for a CUDA bucket, the shared tensor on CPU. ``lock``: a host bucket a
        GPU copies into is page-locked first (once; ``cuda.register_host``), so those copies
        run at the link's speed without waiting."""
        o = self._out[dst]
        b = o.buckets[tag]
        self._wait_free(dst, o, tag)
        if lock and b.locked is None and b.shared.device.type == "cpu":
            b.locked = cuda.register_host(b.shared)
        return b.shared[: o.slot]

    def _wait_free(self, dst: int, o: _Out, tag: int) -> None:
        """With a ring: wait until the receiver acknowledged its copy of the message bucket
        ``tag - ring`` carried in this round's shared bucket (published: the sender publishes
        a ring's buckets one by one), with the liveness checks of a receive
        (:class:`PeerLostError` when ``dst`` dies or the round is lost)."""
        if not o.ring or tag < o.ring:
            return
        prev, seq, cellv = tag - o.ring, self.g.seq, o.cellv
        if int(cellv[prev, SEQ]) != seq or int(cellv[prev, NBYTES]) < 0:
            return  # not published in this round, or a header in its cell: the bucket unread
        what = f"{self._name(self.g.rank, dst)}, bucket {tag} reusing bucket {prev}'s memory"
        wait_published(self.g, dst, prev, seq, lambda: int(cellv[prev, ACK]), what, acked=True)

    def publish(
        self,
        dst: int,
        tag: int,
        n: int,
        device: bool = False,
        header: torch.Tensor | None = None,
        landed: bool = False,
    ) -> Done:
        """The first ``n`` bytes of the bucket are the message of the current round: packed
        in :meth:`window` (copied to a CUDA bucket here) or, ``device``, in
        :meth:`device_window` (the device's work queued so far has landed when the cell
        says so, waited for here unless ``landed``: the caller waited; ``header``: the
        message's header bytes on the host, written into the cell, the bucket's own header room
        left as it is)."""
        o = self._out[dst]
        b = o.buckets[tag]
        o.cellv[tag, HDR] = 0
        if header is not None:
            self._put_header(o, tag, header)
        if device:
            if not landed:
                cuda.wait_for(b.shared)
        elif b.shared is not b.host:  # a CUDA bucket: landed on the device before the cell says so
            assert b.host is not None
            cuda.copy_and_wait(b.shared[:n], b.host[:n])
        seq = self.g.seq
        o.cellv[tag, NBYTES] = n
        o.cellv[tag, SEQ] = seq
        b.published = seq
        self._drop_acknowledged()
        return Done()

    def publish_inline(self, dst: int, tag: int, header: torch.Tensor) -> Done:
        """A header-only message of the current round (``header``: its bytes, on the host, at
        most ``8 * INLINE_WORDS``) written into bucket ``tag``'s cell, the bucket untouched
        (module doc); the words before the round number, as :meth:`publish` does."""
        o = self._out[dst]
        n = self._put_header(o, tag, header)
        o.cellv[tag, NBYTES] = -n
        seq = self.g.seq
        o.cellv[tag, SEQ] = seq
        o.buckets[tag].published = seq
        self._drop_acknowledged()
        return Done()

    def _put_header(self, o: _Out, tag: int, header: torch.Tensor) -> int:
        n = header.numel()
        if n % 8 or not 0 < n <= 8 * INLINE_WORDS:
            raise ValueError(f"a header in a cell is whole words, at most {8 * INLINE_WORDS} bytes")
        o.cellv[tag, HEAD : HEAD + n // 8] = header.numpy().view(np.int64)
        o.cellv[tag, HDR] = n
        return n

    def inline_header(self, src: int, tag: int) -> tuple[torch.Tensor, bool] | None:
        """The header of bucket ``tag`` from ``src`` that the last receive found in its cell (a
        private copy of its words) and whether the message is that header alone; None when
        the header is in the bucket's message."""
        return self._inline.pop((src, tag), None)

    def settle(self) -> None:
        """Wait once for the copies out of the buckets whose header came in the cell (queued,
        not waited for, by the receives), then acknowledge them: before the receiver votes."""
        for (src, tag), (bucket, into, n) in list(self._deferred.items()):
            self._copy(src, tag, bucket, into, n)  # receives the receiver did not read
        self._deferred.clear()
        if self._pending:
            self.settle_copies()
            for cellv, tag, seq, _ in self._pending:
                cellv[tag, ACK] = seq
            self._pending.clear()

    def send(self, buf: torch.Tensor, dst: int, tag: int) -> Done:
        self.window(dst, tag)[: buf.numel()].copy_(buf)
        return self.publish(dst, tag, buf.numel())

    # ---- receiver -------------------------------------------------------------------------

    def recv(self, into: torch.Tensor, src: int, tag: int) -> Recv:
        return Recv(self, src, tag, into, self.g.seq)

    def _cells(self, src: int, lk: _In, seq: int) -> np.ndarray:
        """The link's cells, mapped on first use after a setup (the sender posted their handle
        in that setup, before it ended)."""
        if lk.cellv is not None:
            return lk.cellv
        g = self.g
        g.wait_until(
            lambda: bool(g.store.check([lk.key])),
            f"round {seq}: waiting for the cells of {self._name(src, g.rank)}",
            seq,
        )
        raw = bytes(g.guard("store get", lambda: g.store.get(lk.key)))
        t = open_handle(raw, lk.n * CELL_WORDS * 8, self._name(src, g.rank) + " cells")
        self.handles_opened += 1
        lk.cells = t.view(torch.int64).view(lk.n, CELL_WORDS)
        lk.cellv = lk.cells.numpy()
        lk.ring = len(set(lk.cellv[:, GEN].tolist())) < lk.n  # set by the sender, then posted
        return lk.cellv

    def _bucket(self, src: int, lk: _In, tag: int, gen: int) -> torch.Tensor:
        """Bucket ``tag`` as generation ``gen``: the mapping this rank holds, or the handle
        the sender posted for it (once per generation; the older mapping is dropped)."""
        got = lk.mapped.get(tag)
        if got is not None and got[0] == gen:
            return got[1]
        g = self.g
        what = self._name(src, g.rank)
        lk.unlock([tag])
        lk.mapped.pop(tag, None)
        same = next((m for m_gen, m in lk.mapped.values() if m_gen == gen), None)
        if same is not None:  # a ring: this memory is mapped for another bucket already
            lk.mapped[tag] = (gen, same)
            return same
        key = f"ipc/h/{src}-{g.rank}/{gen}"
        if not g.guard("store check", lambda: g.store.check([key])):
            raise PeerLostError(
                f"{what}: bucket {tag} names handle generation {gen}, which rank {src} never "
                "posted (its cell was overwritten); the round fails, reconnect the group"
            )
        raw = bytes(g.guard("store get", lambda: g.store.get(key)))
        t = open_handle(raw, lk.slot, f"{what} bucket {tag}")
        lk.mapped[tag] = (gen, t)
        self.handles_opened += 1
        return t

    def _wait_copy(self, src: int, tag: int, into: torch.Tensor, seq: int) -> None:
        lk = self._in[src]
        cellv = self._cells(src, lk, seq)
        what = self._name(src, self.g.rank)
        if self._deferred:  # copies the receiver left (headers it refused): a ring's sender
            self.settle()  # may wait for them; copied and acknowledged before this wait
        wait_published(self.g, src, tag, seq, lambda: int(cellv[tag, SEQ]), what)
        n, gen, hdr = int(cellv[tag, NBYTES]), int(cellv[tag, GEN]), int(cellv[tag, HDR])
        self._inline.pop((src, tag), None)
        self._deferred.pop((src, tag), None)  # a failed round's, never to land in this one
        if n < 0 or hdr:  # the header in the cell: its words copied out before anything
            size = -n if n < 0 else hdr
            if size % 8 or not 0 < size <= 8 * INLINE_WORDS:
                raise PeerLostError(
                    f"{what}: the cell of bucket {tag} claims a header of {size} bytes, "
                    f"at most {8 * INLINE_WORDS} in whole words fit"
                )
            words = torch.from_numpy(cellv[tag, HEAD : HEAD + size // 8].copy())
            self._inline[(src, tag)] = (words.view(torch.uint8), n < 0)
            if n < 0:
                cellv[tag, ACK] = seq
                return
        bucket = self._bucket(src, lk, tag, gen)
        if not 0 < n <= min(bucket.numel(), into.numel()):
            raise PeerLostError(
                f"{what}: the cell of bucket {tag} claims {n} bytes, the bucket holds "
                f"{bucket.numel()} and the staging {into.numel()}"
            )
        if into.device != bucket.device and tag not in lk.locked and bucket.device.type == "cpu":
            lk.locked[tag] = cuda.register_host(bucket)  # once: then copied without waiting
        if hdr:  # copied by copy_out, which knows the pieces (or by settle); waited for once
            self._deferred[(src, tag)] = (bucket, into, n)  # a round, before the vote
            self._pending.append((cellv, tag, seq, into))
            return
        self._copy(src, tag, bucket, into, n)  # out of the shared bucket before anything reads it
        cuda.wait_for(into)  # a copy on the device: landed before the acknowledgement
        cellv[tag, ACK] = seq

    def _copy(self, src: int, tag: int, bucket: torch.Tensor, into: torch.Tensor, n: int) -> None:
        lk = self._in[src]
        into[:n].copy_(bucket[:n], non_blocking=lk.locked.get(tag, False))

    def copy_out(
        self, src: int, tag: int, spans: list[tuple[int, int]]
    ) -> list[torch.Tensor] | None:
        """The copy out of the shared bucket that the last receive of bucket ``tag`` from
        ``src`` left to the receiver (its header came in the cell; ``spans``: where the header
        puts its pieces): the pieces copied and fingerprinted in one pass where the
        fingerprint kernel runs (``fingerprint.copy_fingerprinted``), their chunk
        fingerprints returned, one per span, for the receiver's verification; else the
        message copied whole and None. Nothing to copy (a header-only message, or copied
        already): None. The fingerprints are of the bytes written to the staging, so a sender
        that writes its bucket later changes nothing that was verified."""
        got = self._deferred.pop((src, tag), None)
        if got is None:
            return None
        bucket, into, n = got
        fps = None
        if spans and fused_copies() and all(o + k <= n for o, k in spans):  # else: copied
            fps = copy_fingerprinted(bucket, into, spans, CHUNK, fingerprint_kernel())
        if fps is None:  # whole, and its digests miss where the sender's bytes end
            self._copy(src, tag, bucket, into, n)
        if self._in[src].ring:  # the sender waits to reuse the bucket: landed, acknowledged
            self.settle()
        return fps

    # ---- cleanup --------------------------------------------------------------------------

    def close(self) -> None:
        """Drop every bucket, cell table and mapping of this rank (see module doc)."""
        self.settle_copies()
        for o in self._out.values():
            _unlock(o.buckets)
        for x in self._retired:
            _unlock(b for _, b in x.buckets)
        for lk in self._in.values():
            lk.unlock(lk.locked)
        self._out.clear()
        self._in.clear()
        self._retired.clear()
        self._inline.clear()
        self._pending.clear()
        self._deferred.clear()
        if self.device.type == "cuda":
            cuda.ipc_collect()

    def unlink(self) -> None:
        """Nothing to remove by name: PyTorch removes a shared bucket's file with its last
        mapping (:meth:`close`)."""

    def settle_copies(self) -> None:
        """Wait for queued copies out of mapped buckets (before they are unlocked or
        dropped)."""
        for t in {p[3].device: p[3] for p in self._pending}.values():
            cuda.wait_for(t)

    @property
    def reuses(self) -> bool:
        """Whether a link this rank sends on reuses its buckets within a round (more buckets
        than its ring): the sender then publishes each as soon as it is packed."""
        return any(o.ring for o in self._out.values())

    @property
    def retired(self) -> int:
        """Buckets a re-plan replaced that wait for the receiver's acknowledgement."""
        return len({id(b) for x in self._retired for _, b in x.buckets})

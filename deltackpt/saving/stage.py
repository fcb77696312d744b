"""Save step 2, stage (every rank, caller's thread): hash every chunk in place and copy the bytes
that must outlive the call into host buffers that are reused from save to save.

Allocating and page-faulting fresh memory runs at ~1-3 GB/s here, a copy into an already-touched
buffer at ~5-10 GB/s, so buffers are kept per source key and reused while the state's structure
stays the same. With xor deltas on, two arenas alternate: one holds the bytes of the last committed
save (the delta bases), the other receives the next save.

On CUDA the buffers are pinned and the device-to-host copies are issued non-blocking on a side
stream; ``staged`` completes when the stream's event fires. Sources with no pinned buffer yet
may instead be held in device memory and pinned behind the caller (:func:`stage`). On CPU
staging is synchronous, and
:func:`hash_and_stage` hashes each chunk and copies only what must outlive the call, in one pass
while the bytes are cache-warm; or (an async save of a world of one without delta bases, after a
save that found most of the state new: saving/order.py) :func:`copy_state` copies every source
and leaves the hashing to the background write. The arenas and the delta bases
(:class:`DeltaRef`) belong to the store's :class:`~deltackpt.saving.engine.StoreSaver`; this
module only fills them.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Mapping, MutableMapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import cast

import numpy as np
import torch

from deltackpt.cuda import Events, StageCopies, device_room, host_buffer, is_device
from deltackpt.errors import DeltackptError, SaveFailedError
from deltackpt.format.hashing import digest
from deltackpt.format.manifest import ChunkRecord
from deltackpt.format.policy import MAX_CHAIN
from deltackpt.saving.hooks import hooks
from deltackpt.saving.plan import SavePlan, chunk_view


@dataclass
class Arena:
    buffers: dict[tuple[str, int], torch.Tensor] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)  # chunks of one source race

    def nbytes(self) -> int:
        return sum(b.numel() for b in self.buffers.values())

    def has(self, key: str, n: int, pin: bool) -> bool:
        """Whether :meth:`buffer` would reuse a buffer rather than allocate one."""
        with self.lock:
            buf = self.buffers.get((key, n))
        return buf is not None and (not pin or buf.is_pinned())

    def buffer(self, key: str, n: int, pin: bool) -> torch.Tensor:
        with self.lock:
            buf = self.buffers.get((key, n))
            if buf is None or (pin and not buf.is_pinned()):
                buf = host_buffer(n, for_device=pin)
                self.buffers[(key, n)] = buf
            return buf

    def retain(self, keys: set[tuple[str, int]]) -> None:
        """Drop buffers of sources the current state no longer has (structure changed)."""
        for k in list(self.buffers):
            if k not in keys:
                del self.buffers[k]


class Unfilled(Sequence[np.ndarray]):
    """Per-source host bytes where some sources hold none yet (None): reading one of those is
    a bug (its chunks would be written from bytes that are not there), so it raises, saying
    ``why`` the source is empty. Async saves whose deferred step has yet to copy some sources
    (:func:`stage`) and device saves that copy only the changed chunks (saving/on_device.py)."""

    def __init__(self, arrays: list[np.ndarray | None], why: str) -> None:
        self._arrays = arrays
        self._why = why

    def __len__(self) -> int:
        return len(self._arrays)

    def __getitem__(self, i: int) -> np.ndarray:  # type: ignore[override]
        a = self._arrays[i]
        if a is None:
            raise DeltackptError(
                f"internal error: source {i} {self._why}; nothing was written. Please report this"
            )
        return a

    def fill(self, arrays: Mapping[int, np.ndarray]) -> None:
        for i, a in arrays.items():
            self._arrays[i] = a


class Staged:
    """Per source its staged bytes (``arrays``), and what must happen before they are read.

    ``event`` (None: nothing in flight) fires once the sources' bytes are copied or held, so the
    caller may change its tensors (``handle.staged``). :meth:`wait` waits for it and then runs the
    deferred step, if :func:`stage` left one (``deferred`` sources held on the device): only then
    may ``arrays`` be read (:class:`Unfilled` raises before). The background writer calls it."""

    def __init__(
        self,
        arrays: Sequence[np.ndarray],
        event: torch.cuda.Event | Events | None,
        step: Callable[[], None] | None = None,
        deferred: int = 0,
    ) -> None:
        self.arrays = arrays  # per source: its bytes (a view of an arena buffer, or live bytes)
        self.event = event  # copies still in flight until this fires
        self.deferred = deferred  # sources held on the device for the deferred step
        self._step = step
        self._failure: BaseException | None = None
        self._lock = threading.Lock()

    def held(self) -> None:
        """Block until the caller may change the sources (their bytes are copied or held)."""
        if self.event is not None:
            self.event.synchronize()

    def wait(self) -> None:
        """Block until ``arrays`` may be read: :meth:`held`, then the deferred step (once; its
        failure, a :class:`SaveFailedError`, is raised again by later calls)."""
        self.held()
        with self._lock:
            if self._failure is not None:
                raise self._failure
            step, self._step = self._step, None
            if step is None:
                return
            try:
                step()
            except BaseException as e:
                self._failure = e
                raise


def stage(plan: SavePlan, arena: Arena, defer: str = "off") -> Staged:
    """Copy every source of ``plan`` into ``arena`` buffers (pinned for CUDA sources, reused from
    save to save). CPU sources are copied before this returns, CUDA ones non-blocking on a side
    stream: ``staged.event`` fires when they land.

    A source with no buffer yet (the first save, or the state's structure changed) would get it
    allocated here, on the caller's thread, and pinning runs at ~0.4 s/GB (0.9 s of the first
    async save of 2.2 GB on an H100). With ``defer="auto"`` (``DELTACKPT_STAGE_DEFER``) such CUDA
    sources are instead copied into fresh device memory (milliseconds) where their device has room
    for them and a margin (:func:`~deltackpt.cuda.device_room`); the deferred step, run by
    :meth:`Staged.wait` on the background writer before it reads ``arrays``, allocates their
    buffers, copies the held bytes in and drops the device copies. Cost: the device holds a
    second copy of those sources from this call until the deferred step has moved it to the host.
    Without room, with ``defer="off"`` (also a distributed save, which hashes in the call) or
    where an allocation on the device fails, the buffers are pinned here as before: the fallback.
    ``defer="always"`` also defers CPU sources, a clone standing in for the device copy (tests).
    """
    keys = {(s.key, s.nbytes) for s in plan.sources}
    arena.retain(keys)
    later = _to_defer(plan, arena, defer)
    copies = StageCopies()
    arrays: list[np.ndarray | None] = []
    held: dict[int, torch.Tensor] = {}
    for i, s in enumerate(plan.sources):
        n = s.nbytes
        if n == 0:
            arrays.append(np.empty(0, dtype=np.uint8))
            continue
        if i in later:
            try:
                held[i] = copies.hold(s.data)
                arrays.append(None)
                continue
            except torch.cuda.OutOfMemoryError:
                later = set()  # no room after all: pin the rest here
        buf = arena.buffer(s.key, n, pin=is_device(s.data))
        copies.to_host(buf, s.data)
        arrays.append(buf.numpy())
    event = copies.mark()
    if not held:
        return Staged(cast(list[np.ndarray], arrays), event)
    pending = Unfilled(
        arrays,
        "of an async save was read before its deferred staging step (Staged.wait) copied it "
        "to the host",
    )

    nbytes = sum(t.numel() for t in held.values())

    def step() -> None:  # the deferred step (background thread)
        filled: dict[int, np.ndarray] = {}
        try:
            for i in list(held):
                src = plan.sources[i]
                buf = arena.buffer(src.key, src.nbytes, pin=is_device(src.data))
                # queued, then dropped: the allocator reuses its memory once the copy is done
                copies.to_host(buf, held.pop(i))
                filled[i] = buf.numpy()
            copies.synchronize()
        except Exception as e:
            with contextlib.suppress(Exception):
                copies.synchronize()  # nothing in flight into what is handed back
            raise SaveFailedError(
                f"staging {nbytes} bytes of an async save into host buffers failed: {e}. "
                "Nothing was written; committed snapshots are intact, and the next save "
                "stages afresh"
            ) from e
        finally:
            held.clear()  # drop the device copies
        pending.fill(filled)

    return Staged(pending, event, step, deferred=len(held))


def _to_defer(plan: SavePlan, arena: Arena, defer: str) -> set[int]:
    """The sources :func:`stage` holds on their device: those without a buffer in ``arena``
    (CUDA ones; CPU ones too with ``always``), all of a device or none (:func:`device_room`)."""
    if defer == "off":
        return set()
    per_device: dict[torch.device, list[int]] = {}
    for i, s in enumerate(plan.sources):
        on_device = is_device(s.data)
        if not s.nbytes or arena.has(s.key, s.nbytes, pin=on_device):
            continue
        if on_device or defer == "always":
            per_device.setdefault(s.data.device, []).append(i)
    out: set[int] = set()
    for device, idx in per_device.items():
        if device_room(device, sum(plan.sources[i].nbytes for i in idx)):
            out.update(idx)
    return out


COPY_PIECE = (16 << 20, 64 << 20)  # bounds of a copy job's bytes (copy_state)


def copy_state(plan: SavePlan, arena: Arena, pool: ThreadPoolExecutor, threads: int) -> Staged:
    """Copy-first staging (CPU, saving/order.py): every source of ``plan`` into ``arena`` on
    ``threads`` (the caller's and ``threads - 1`` of ``pool``'s), in jobs of 16-64 MiB
    (:data:`COPY_PIECE`; about 4 a thread where the state is large enough; small sources
    batched, so thousands of tiny tensors are not thousands of jobs). Large pieces copy faster:
    2 threads copy 256 MB in 0.53x a single thread's time in 16-128 MiB pieces, 0.61x in 4 MiB
    ones, 0.88x in 1 MiB ones. Returns once everything is copied."""
    lo_piece, hi_piece = COPY_PIECE
    piece = max(lo_piece, min(hi_piece, state_nbytes(plan) // (4 * max(1, threads))))
    arrays: list[np.ndarray] = []
    jobs: list[list[tuple[torch.Tensor, torch.Tensor]]] = []
    batch: list[tuple[torch.Tensor, torch.Tensor]] = []
    size = 0
    for s in plan.sources:
        n = s.nbytes
        if n == 0:
            arrays.append(np.empty(0, dtype=np.uint8))
            continue
        buf = arena.buffer(s.key, n, pin=False)
        arrays.append(buf.numpy())
        for lo in range(0, n, piece):
            hi = min(n, lo + piece)
            batch.append((buf[lo:hi], s.data[lo:hi]))
            size += hi - lo
            if size >= piece:
                jobs.append(batch)
                batch, size = [], 0
    if batch:
        jobs.append(batch)

    todo = iter(jobs)  # the caller's thread copies too, beside threads - 1 of the pool's
    lock = threading.Lock()

    def work() -> None:
        while True:
            with lock:
                job = next(todo, None)
            if job is None:
                return
            for dst, src in job:
                dst.copy_(src)  # releases the GIL

    helpers = [pool.submit(work) for _ in range(min(threads, len(jobs)) - 1)]
    try:
        work()
    finally:
        for f in helpers:
            f.result()
    return Staged(arrays, None)


def state_nbytes(plan: SavePlan) -> int:
    return sum(s.nbytes for s in plan.sources)


def stage_chunks(
    plan: SavePlan,
    live: list[np.ndarray],
    arenas: tuple[Arena, Arena],
    todo: dict[int, int],
    pool: ThreadPoolExecutor,
) -> dict[int, tuple[np.ndarray, int]]:
    """Copy the chunks in ``todo`` (chunk index -> arena) from the live source bytes into that
    arena's buffer of their source, at the same offset. Returns chunk -> (staged view, arena)."""
    jobs = []
    for ci, which in todo.items():
        si, start, length = plan.chunks[ci].parts[0]
        src = plan.sources[si]
        buf = arenas[which].buffer(src.key, src.nbytes, pin=False).numpy()
        jobs.append((ci, which, live[si][start : start + length], buf[start : start + length]))

    def copy(job: tuple[int, int, np.ndarray, np.ndarray]) -> None:
        # torch's copy releases the GIL (numpy's copyto would hold it)
        torch.from_numpy(job[3]).copy_(torch.from_numpy(job[2]))

    list(pool.map(copy, jobs))
    return {ci: (dst, which) for ci, which, _, dst in jobs}


@dataclass
class DeltaRef:
    """The raw bytes of a chunk as last committed by this process: the base of an xor delta."""

    digest: str
    data: np.ndarray
    depth: int  # how many xor links lead from this chunk to a keyframe
    arena: int = 0  # which staging arena holds ``data`` (the next change goes to the other)
    # xor payload bytes from the keyframe (excluded) up to this chunk (included): what a fresh
    # reader reads for this chunk beyond its keyframe. The write policy keeps it within
    # ``SaveOptions.chain_budget`` x the chunk's raw size (saving/write.py).
    chain_bytes: int = 0
    last_delta: int = 0  # payload bytes of this chunk's own xor link (0: it is a keyframe)
    # this save is the chunk position's keyframe slot (saving/chains.py, staggered keyframes)
    slot: bool = False

    def due(self, size: int, keyframe_every: int, chain_budget: float) -> bool:
        """Whether the next version of this chunk must be a keyframe before even trying a delta:
        the link cap is reached, this save is the position's keyframe slot and the chunk is a
        delta (:func:`~deltackpt.saving.chains.stagger`), or another delta as large as the last
        one would overflow the byte budget (a delta that is tried and overflows is re-encoded
        as a keyframe)."""
        if self.depth + 1 >= min(keyframe_every, MAX_CHAIN + 1):
            return True
        if self.slot and self.depth >= 1:
            return True
        return self.chain_bytes + max(self.last_delta, 1) > chain_budget * size


@dataclass
class StagedChunks:
    """What the hash pass copied into the arenas, per chunk index."""

    data: MutableMapping[int, np.ndarray] = field(default_factory=dict)  # chunk -> its bytes
    refs: dict[int, tuple[np.ndarray, int]] = field(default_factory=dict)  # -> (bytes, arena)
    new: set[int] = field(default_factory=set)  # copied because the store lacks them


def hash_and_stage(
    plan: SavePlan,
    live: list[np.ndarray],
    index: Mapping[str, ChunkRecord],
    refs: Mapping[str, DeltaRef] | None,
    stage_new: bool,
    arenas: tuple[Arena, Arena],
    pool: ThreadPoolExecutor,
    group_bufs: dict[int, np.ndarray],
) -> tuple[list[str], StagedChunks]:
    """Hash every chunk in place and, in the same pass while it is cache-warm, copy the chunks
    whose bytes must outlive the call: with delta bases (``refs`` not None), those whose digest
    changed (the next save's bases, into the arena that does not hold the current base); with
    ``stage_new``, one chunk of each digest the store lacks (an async save writes them later).
    Unchanged chunks are only read. Group chunks are gathered into ``group_bufs`` (private)."""
    use_refs = refs is not None
    bases: Mapping[str, DeltaRef] = refs if refs is not None else {}
    lock = threading.Lock()
    claimed: set[str] = set()
    out = StagedChunks()

    def copy(ci: int, view: np.ndarray, arena: int, new: bool) -> None:
        si, start, length = plan.chunks[ci].parts[0]
        src = plan.sources[si]
        buf = arenas[arena].buffer(src.key, src.nbytes, pin=False).numpy()[start : start + length]
        torch.from_numpy(buf).copy_(torch.from_numpy(view))  # releases the GIL
        hooks.on_stage_copy(ci)
        with lock:
            out.refs[ci] = (buf, arena)
            out.data[ci] = buf
            if new:
                out.new.add(ci)

    def one(ci: int) -> str:
        spec = plan.chunks[ci]
        view = chunk_view(spec, live.__getitem__, group_bufs, ci)
        d = digest(view)
        new = False
        if stage_new and d not in index:
            with lock:
                new = d not in claimed
                claimed.add(d)
        if spec.ref_key is None:  # group chunk: gathered into a private buffer already
            prior = bases.get(spec.base_key) if spec.base_key else None
            with lock:
                if new:
                    out.new.add(ci)
                if use_refs and spec.base_key and (prior is None or prior.digest != d):
                    out.refs[ci] = (view, 0)  # its next base: the private buffer itself
            return d
        prior = bases.get(spec.ref_key)
        changed = use_refs and (prior is None or prior.digest != d)
        if changed or new:
            arena = (1 - prior.arena) if (changed and prior is not None) else 0
            copy(ci, view, arena, new)
        return d

    digests = list(pool.map(one, range(len(plan.chunks))))
    return digests, out


def prefault(plan: SavePlan, arenas: tuple[Arena, ...]) -> None:
    """Allocate and touch the buffers of ``arenas`` the next save may copy into, now (behind an
    async save, or once at the end of the first sync save) rather than page-faulting them inside
    the next save's blocking call: fresh pages cost ~1-3 GB/s here, touched ones 5-10."""
    for arena in arenas:
        for src in plan.sources:
            if src.nbytes and (src.key, src.nbytes) not in arena.buffers:
                arena.buffer(src.key, src.nbytes, pin=False).zero_()


def chain_cost(d: str, records: Mapping[str, ChunkRecord]) -> tuple[int, int, int] | None:
    """(xor links, their payload bytes, the newest link's payload bytes) from chunk ``d`` down
    to its keyframe; None where that is not known here (a record missing, or a chain longer
    than the validator's MAX_CHAIN, which no committed manifest has)."""
    links = nbytes = 0
    last = -1
    while True:
        rec = records.get(d)
        if rec is None or links > MAX_CHAIN:
            return None
        if rec.base is None:
            return links, nbytes, max(last, 0)
        links, nbytes = links + 1, nbytes + rec.length
        if last < 0:
            last = rec.length
        d = rec.base


def chain_depth(d: str, records: Mapping[str, ChunkRecord]) -> int | None:
    """How many xor links lead from chunk ``d`` to its keyframe (None: not known here)."""
    cost = chain_cost(d, records)
    return None if cost is None else cost[0]


def next_refs(
    plan: SavePlan,
    digests: list[str],
    refs: Mapping[str, DeltaRef],
    staged: dict[int, tuple[np.ndarray, int]],
    records: Mapping[str, ChunkRecord],
) -> dict[str, DeltaRef]:
    """Delta bases for the next save: unchanged chunks keep their base where it is, changed ones
    point at their staged copy, with their chain's links and bytes read back from ``records``
    (so the first save of a process continues the chains the store already holds). Chunks whose
    chain is unknown here count as due for a keyframe."""
    out: dict[str, DeltaRef] = {}
    for ci, spec in enumerate(plan.chunks):
        key = spec.base_key
        if key is None:
            continue
        d = digests[ci]
        prior = refs.get(key)
        if prior is not None and prior.digest == d:
            out[key] = prior
        elif ci in staged:
            view, arena = staged[ci]
            cost = chain_cost(d, records)
            if cost is None:  # due: the cap of links is reached
                out[key] = DeltaRef(d, view, MAX_CHAIN, arena, 0, 0)
            else:
                out[key] = DeltaRef(d, view, cost[0], arena, cost[1], cost[2])
    return out

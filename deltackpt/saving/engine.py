"""The per-store save engine: :class:`StoreSaver`, and :class:`SaveHandle` for a save in flight.

Every save of a store (sync or async, one process or a process group, and the DCP writer's
thread pool) goes through that store's StoreSaver. On every rank, in the caller's thread, it runs
steps 1-2 of the save sequence (``deltackpt/distributed/save.py`` numbers all six): take the store's
save slot and lock, check, plan (saving/plan.py), hash in place and stage (saving/stage.py). Its
background thread runs steps 4-6 of async saves.

Per-store state lives here and nowhere else (not on :class:`~deltackpt.store.store.Store`):

* the save slot: one save per store at a time, held from step 1 until the save ends (any
  thread). A new save first waits for the previous one (back-pressure, reported as
  ``waited_seconds``) instead of holding a second copy of the state;
* the background thread (``deltackpt-commit``) and the I/O thread pools (``deltackpt-io``);
* two staging arenas and the delta bases: the bytes of the last committed save that the next
  one may xor against (saving/stage.py);
* which small tensors changed lately, so the plan groups them apart from frozen ones
  (saving/grouping.py);
* per process group, the plan cache of distributed saves (dist/save_plan.py);
* a background failure nobody has seen yet.

Lifetime: :func:`saver_for` creates a store's StoreSaver on its first save and keeps it in the
one registry below (``_SAVERS``) for the life of the process, as ``open_store`` keeps the Store
itself, until :meth:`StoreSaver.close` (waits for the save in flight, frees the arenas and delta
bases; the next save starts afresh). A failed save releases the slot and leaves the delta bases of
the last committed save intact (its own copies went to the arena that does not hold them); a
failed distributed save also forgets its group's plan cache, so the next one sends full plans. A
background failure is kept and raised exactly once: from ``result()``, or, if nobody asked, from
the next save of that store. A handle dropped unfinished warns, unless detached.

Interpreter exit waits for pending saves (:func:`_flush_all`). It must run before
``concurrent.futures`` stops its pools (a pending save still submits I/O jobs), and only
``threading._register_atexit`` runs that early: an ``atexit`` or ``weakref.finalize`` hook runs
after the pools refuse new work ("cannot schedule new futures after interpreter shutdown").
Background threads never run collectives.
"""

from __future__ import annotations

import atexit
import contextlib
import threading
import time
import warnings
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar, cast

import numpy as np

from deltackpt.cuda import is_device
from deltackpt.errors import DeltackptError, SaveFailedError
from deltackpt.format.codecs import DELTAS
from deltackpt.format.manifest import ChunkRecord
from deltackpt.options import (
    SaveOptions,
    default_device_scan,
    default_memory_budget,
    default_stage_defer,
)
from deltackpt.saving.chains import stagger
from deltackpt.saving.commit import check_can_save
from deltackpt.saving.grouping import ChangeHistory
from deltackpt.saving.on_device import Fingerprint, FingerprintKey, scan
from deltackpt.saving.order import StageOrder
from deltackpt.saving.plan import SavePlan, plan_state
from deltackpt.saving.stage import (
    Arena,
    DeltaRef,
    Staged,
    StagedChunks,
    copy_state,
    hash_and_stage,
    next_refs,
    prefault,
    stage,
    stage_chunks,
    state_nbytes,
)
from deltackpt.store.store import SnapshotInfo, Store, store_io_error

T = TypeVar("T")


@dataclass(frozen=True)
class SaveRequest:
    """A save call whose arguments ``deltackpt.api`` has checked."""

    store: Store
    name: str
    options: SaveOptions
    metadata: dict[str, Any]
    start: float  # time.perf_counter() when the call began


@dataclass
class Prepared:
    """One save on this rank after steps 1-2: its plan, hashes and staged copies."""

    plan: SavePlan
    staged: Staged  # per source: live bytes (CPU) or staged copies (CUDA)
    use_refs: bool  # xor against (and keep) delta bases
    locks: contextlib.ExitStack  # the save slot and the store lock, released when the save ends
    waited: float
    background: bool  # an async save that could stage what it needs
    digests: list[str] | None = None  # None: not hashed yet (CUDA)
    index: dict[str, ChunkRecord] | None = None  # the store's chunks at step 1 (None on CUDA)
    group_bufs: dict[int, np.ndarray] = field(default_factory=dict)
    copies: StagedChunks = field(default_factory=StagedChunks)
    blocked: float = 0.0  # seconds the caller was blocked (set when step 3 ends)
    # device saves (saving/on_device.py): the chunks' fingerprints, kept once the save commits
    fingerprints: dict[FingerprintKey, tuple[Fingerprint, str]] | None = None


class SaveHandle:
    """A save in flight. ``staged`` is done when the state may be mutated again; ``result()``
    returns the committed :class:`SnapshotInfo` or raises the background failure."""

    def __init__(
        self, name: str, staged: Future[None], future: Future[SnapshotInfo], saver: StoreSaver
    ) -> None:
        self.name = name
        self.staged = staged
        self._future = future
        self._saver = saver
        self._observed = False

    def done(self) -> bool:
        return self._future.done()

    def result(self, timeout: float | None = None) -> SnapshotInfo:
        self._observed = True
        try:
            return self._future.result(timeout)
        except TimeoutError:
            raise
        except BaseException as e:
            self._saver.mark_reported(e)
            raise

    def detach(self) -> None:
        """Do not warn if this handle is dropped unfinished: the caller learns the outcome
        another way (the :class:`~deltackpt.Checkpointer` does, from its next call). The save
        still runs; an unseen failure is raised by the next save of the store."""
        self._observed = True

    def __repr__(self) -> str:
        state = "done" if self.done() else "staged" if self.staged.done() else "staging"
        return f"SaveHandle({self.name!r}, {state})"

    def __del__(self) -> None:
        if not self._observed and not self._future.done():
            warnings.warn(
                f"deltackpt save {self.name!r} was dropped before it finished; it still runs, "
                "but call handle.result() to learn whether it committed",
                ResourceWarning,
                stacklevel=2,
            )


class StoreSaver:
    """Everything saves of one store keep in memory (see the module docstring)."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self._bg = ThreadPoolExecutor(1, thread_name_prefix="deltackpt-commit")
        self._pools: dict[int, ThreadPoolExecutor] = {}
        self._lock = threading.Lock()
        self._slot = threading.Lock()  # held from prepare() until the save ends (any thread)
        self._inflight: Future[SnapshotInfo] | None = None
        self._unreported: BaseException | None = None
        self._arenas = (Arena(), Arena())
        self._delta_refs: dict[str, DeltaRef] = {}
        self._saves = 0  # saves with delta bases: numbers the staggered keyframe slots
        self._group_caches: dict[int, object] = {}
        self._history = ChangeHistory()
        self.order = StageOrder()  # hash-first or copy-first (saving/order.py)
        # the last committed device save's chunk fingerprints and digests (saving/on_device.py)
        self._fingerprints: dict[FingerprintKey, tuple[Fingerprint, str]] = {}
        # the DCP plug-in's saves of device state (dcp/writer.py): its own host buffers and
        # fingerprints (its sources are DCP's write items, not this engine's)
        self.dcp_arena = Arena()
        self.dcp_fingerprints: dict[FingerprintKey, tuple[Fingerprint, str]] = {}

    @property
    def arenas(self) -> tuple[Arena, Arena]:
        """The staging arenas: [0] takes async copies; [0] and [1] alternate as delta bases."""
        return self._arenas

    @property
    def delta_bases(self) -> Mapping[str, DeltaRef]:
        """Per chunk key: its bytes as last committed by this process (xor bases)."""
        return self._delta_refs

    def pool(self, threads: int) -> ThreadPoolExecutor:
        with self._lock:
            p = self._pools.get(threads)
            if p is None:
                p = self._pools[threads] = ThreadPoolExecutor(
                    threads, thread_name_prefix="deltackpt-io"
                )
            return p

    def group_cache(self, key: int, new: Callable[[], T]) -> T:
        """This store's cache for process group ``key`` (dist/save_plan.py's PlanCache)."""
        with self._lock:
            cache = self._group_caches.get(key)
            if cache is None:
                cache = self._group_caches[key] = new()
            return cast(T, cache)

    # ---------------------------------------------------------------- the slot, back-pressure

    def wait_previous(self) -> float:
        """Take the store's save slot: block until the previous save (sync or async, from any
        thread) finished; raise its error if nobody has seen it. The slot is released by the
        save's ``locks`` (see :meth:`prepare`)."""
        t0 = time.perf_counter()
        self._slot.acquire()
        with self._lock:
            err, self._unreported = self._unreported, None
        if err is not None:
            self._slot.release()
            raise SaveFailedError(
                f"the previous background save failed and nobody called result(): {err}"
            ) from err
        return time.perf_counter() - t0

    def mark_reported(self, e: BaseException) -> None:
        with self._lock:
            if self._unreported is e:
                self._unreported = None

    def flush(self) -> None:
        """Wait for the save in flight, if any (its outcome stays with its handle)."""
        with self._lock:
            prev = self._inflight
        if prev is not None:
            with contextlib.suppress(BaseException):
                prev.result()

    def close(self) -> None:
        """Wait for the save in flight, free the arenas, delta bases and plan caches, stop the
        threads and leave the registry: the store's next save gets a new StoreSaver. Call it
        between saves (not from an ``after_commit`` hook, which runs on the saver's thread)."""
        self.flush()
        with self._slot:
            with _SAVERS_LOCK:
                if _SAVERS.get(id(self.store)) is self:
                    del _SAVERS[id(self.store)]
            self.drop_delta_bases()
            self._arenas[0].buffers.clear()
            self._fingerprints = {}
            self.dcp_arena.buffers.clear()
            self.dcp_fingerprints = {}
            self._group_caches.clear()
            self._history = ChangeHistory()
            self.order = StageOrder()
        self._bg.shutdown(wait=False)
        for p in self._pools.values():
            p.shutdown(wait=False)

    # ---------------------------------------------------------------- steps 1-2

    def prepare(self, state: Any, req: SaveRequest, background: bool, stage_new: bool) -> Prepared:
        """Steps 1-2 of every save: wait for the previous save, lock, check, plan, and hash every
        chunk straight from the live tensors (on CPU; on CUDA the state is first copied to pinned
        host buffers and hashed later). ``stage_new`` (a world of one) copies the chunks the store
        lacks in the same pass; a rank of N copies its assigned ones in :meth:`stage_owned`. An
        async save of a world of one without delta bases may instead copy the whole state and
        leave the hashing to step 4, as on CUDA (copy-first, saving/order.py)."""
        st, opts = self.store, req.options
        waited = self.wait_previous()
        locks = contextlib.ExitStack()
        locks.callback(self._slot.release)  # one save per store at a time: arenas are shared
        try:
            what = f"saving {req.name!r}"
            locks.enter_context(st.lock(exclusive=False, timeout=opts.lock_timeout, what=what))
            check_can_save(st, req.name, overwrite=opts.overwrite)
            plan = plan_state(
                state, st.chunk_bytes, st.small_bytes, opts.allow_pickle, self._history.is_hot
            )
            need = state_nbytes(plan)
            budget = (
                opts.memory_budget if opts.memory_budget is not None else default_memory_budget()
            )
            on_device = any(is_device(s.data) for s in plan.sources)
            how, defer = default_device_scan(), default_stage_defer()
            if (on_device or (defer == "always" and stage_new)) and background and need <= budget:
                # An async save: copy it all to pinned buffers (on a side stream); hashing and
                # writing happen behind the caller. No xor deltas on device state. Sources with
                # no pinned buffer yet may be held on the device and pinned behind the caller
                # (stage's deferred step); not over a group, whose ranks hash in the call.
                self.drop_delta_bases()
                staged = stage(plan, self._arenas[0], defer if stage_new else "off")
                return Prepared(plan, staged, False, locks, waited, background)
            if on_device or (how == "always" and not background):
                return self._prepare_scan(plan, req, locks, waited, trust=how != "off")
            live = Staged([s.data.numpy() for s in plan.sources], None)
            pol = opts.encoding  # delta bases are kept for xor and for patch deltas
            deltas_on = any(c in pol.codecs for c in DELTAS) and pol.force in (None, *DELTAS)
            use_refs = deltas_on and 2 * need <= budget
            if not use_refs:
                self.drop_delta_bases()
            if background and not use_refs and need > budget:
                background = False  # no room to stage: write from the live tensors, blocking
            keys = {(src.key, src.nbytes) for src in plan.sources}
            for arena in self._arenas:
                arena.retain(keys)
            if background and stage_new and not use_refs and self.order.copy_first():
                pool = self.pool(opts.threads)  # need <= budget: checked above
                staged = copy_state(plan, self._arenas[0], pool, opts.threads)
                return Prepared(plan, staged, False, locks, waited, True)
            index = st.chunk_index()
            if use_refs:  # staggered keyframe slots; bases that a fold shortened
                self._delta_refs = stagger(
                    self._delta_refs, index, self._saves, opts.keyframe_every
                )
                self._saves += 1
            p = Prepared(plan, live, use_refs, locks, waited, background, index=index)
            p.digests, p.copies = hash_and_stage(
                plan, live.arrays, index, self._delta_refs if use_refs else None,
                stage_new and background, self._arenas, self.pool(opts.threads), p.group_bufs,
            )  # fmt: skip
            return p
        except BaseException as e:
            locks.close()
            if isinstance(e, OSError) and not isinstance(e, DeltackptError):
                raise store_io_error(
                    e,
                    f"preparing to save {req.name!r} in store {str(st.root)!r} failed: {e}. "
                    "Nothing was written; committed snapshots are intact. Check permissions and "
                    "the disk, then save again",
                ) from e
            raise

    def _prepare_scan(self, plan: SavePlan, req: SaveRequest, locks: Any, waited: float,
                      trust: bool) -> Prepared:  # fmt: skip
        """Step 2 of a sync save of device state (saving/on_device.py): fingerprints on the
        device, only changed chunks copied and hashed; every chunk where not ``trust``
        (``DELTACKPT_DEVICE_SCAN=off``). No xor deltas on this path."""
        self.drop_delta_bases()
        self._arenas[0].retain({(src.key, src.nbytes) for src in plan.sources})
        index, bufs = self.store.chunk_index(), {}
        pool = self.pool(req.options.threads)
        known = self._fingerprints if trust else None
        found = scan(plan, self.store.chunk_bytes, known, index, self._arenas[0], pool, bufs)
        p = Prepared(plan, Staged(found.arrays, None), False, locks, waited, False, found.digests,
                     index, bufs, found.copies)  # fmt: skip
        p.fingerprints = found.fingerprints if trust else None  # keep the last table
        return p

    def stage_owned(self, p: Prepared, owned: set[int]) -> None:
        """End of step 3 (async saves): copy the chunks this rank must write that the hash pass
        did not copy, so the caller may mutate its state once this returns."""
        if p.digests is None or not p.background:
            return
        todo = {
            ci: 0
            for ci in owned
            if ci not in p.copies.data and p.plan.chunks[ci].ref_key is not None
        }
        staged = stage_chunks(p.plan, p.staged.arrays, self._arenas, todo, self.pool(4))
        p.copies.data.update({ci: view for ci, (view, _) in staged.items()})

    # ---------------------------------------------------------------- after the commit

    def keep_delta_bases(
        self,
        p: Prepared,
        before: Mapping[str, DeltaRef],
        records: Mapping[str, ChunkRecord],
        keyframe_every: int | None = None,
    ) -> None:
        """After a commit: the next save's delta bases (``before`` were this save's), with each
        chain's links and bytes read from ``records``, and what changed, for the next plan's
        groups. ``keyframe_every`` is accepted for callers of the depth-only policy and unused:
        the writer applies the link cap and the byte budget (saving/write.py)."""
        del keyframe_every
        if p.fingerprints is not None:
            self._fingerprints = p.fingerprints
        if p.digests is not None:
            self._history.learn(p.plan, p.digests, p.group_bufs)
            if p.background and not p.use_refs and p.index is not None:
                self.order.learn(p.plan, p.digests, p.index)
        if p.use_refs and p.digests is not None:
            self._delta_refs = next_refs(p.plan, p.digests, before, p.copies.refs, records)

    def drop_delta_bases(self) -> None:
        self._delta_refs = {}
        self._arenas[1].buffers.clear()

    def prefault(self, p: Prepared) -> None:
        """Touch the buffers the next save of this state may copy into (saving/stage.py)."""
        if p.use_refs or p.background:
            prefault(p.plan, self._arenas if p.use_refs else self._arenas[:1])

    # ---------------------------------------------------------------- the background thread

    def submit(self, name: str, job: Callable[[], SnapshotInfo], staged: Staged) -> SaveHandle:
        """Run ``job`` (steps 4-6) on the background thread as this store's save in flight; its
        failure is kept until someone sees it. ``handle.staged`` completes once ``staged`` is
        held (its deferred step, if any, runs in ``job``: ``staged.wait()`` in step 4)."""
        staged_future: Future[None] = Future()
        if staged.event is None:
            staged_future.set_result(None)

        def run() -> SnapshotInfo:
            try:
                if not staged_future.done():
                    try:
                        staged.held()
                        staged_future.set_result(None)
                    except BaseException as e:
                        staged_future.set_exception(e)
                return job()
            except BaseException as e:
                with self._lock:
                    self._unreported = e  # cleared by result(); else raised by the next save
                raise

        future = self._bg.submit(run)
        with self._lock:
            self._inflight = future
        return SaveHandle(name, staged_future, future, self)

    def completed(self, name: str, info: SnapshotInfo) -> SaveHandle:
        """The handle of an async save that ran to its commit in the caller's thread."""
        staged: Future[None] = Future()
        staged.set_result(None)
        future: Future[SnapshotInfo] = Future()
        future.set_result(info)
        return SaveHandle(name, staged, future, self)


# The one registry of per-store state: id(store) -> its StoreSaver. The saver holds its store, so
# the id stays that store's while the entry exists; StoreSaver.close() removes it.
_SAVERS: dict[int, StoreSaver] = {}
_SAVERS_LOCK = threading.Lock()


def saver_for(store: Store) -> StoreSaver:
    """The StoreSaver of ``store``, created on first use."""
    with _SAVERS_LOCK:
        s = _SAVERS.get(id(store))
        if s is None:
            s = _SAVERS[id(store)] = StoreSaver(store)
        return s


def _flush_all() -> None:
    with _SAVERS_LOCK:
        savers = list(_SAVERS.values())
    for s in savers:
        s.flush()


# threading's exit hooks run (in reverse order of registration) before atexit handlers and before
# concurrent.futures stops its pools; ours is registered after concurrent.futures' own.
_register = getattr(threading, "_register_atexit", None)
if _register is not None:
    _register(_flush_all)
else:  # pragma: no cover - other Pythons
    atexit.register(_flush_all)

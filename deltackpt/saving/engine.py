"""Async saves: block only while the state is staged; hash, encode, write and commit behind.

One save per store is in flight at a time. A new save first waits for the previous one
(back-pressure, reported as ``waited_seconds``) instead of holding a second copy of the state.
A background failure is kept and raised exactly once: from ``result()``, or, if nobody asked, from
the next save on that store. A handle dropped unfinished warns; interpreter exit flushes pending
saves. Background threads never run collectives.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import threading
import time
import warnings
import weakref
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch

from deltackpt.errors import DeltackptError, SaveFailedError, SnapshotExistsError, StoreError
from deltackpt.format.codecs import XOR
from deltackpt.format.hashing import digest
from deltackpt.format.manifest import ChunkRecord
from deltackpt.options import SaveOptions, default_memory_budget
from deltackpt.saving.plan import SavePlan, plan_state
from deltackpt.saving.stage import Arena, Staged, stage, stage_chunks, state_nbytes
from deltackpt.saving.write import chunk_view, closure, commit, next_refs, write_chunks
from deltackpt.store.durable import store_lock
from deltackpt.store.store import SnapshotInfo, Store, store_io_error


class SaveHandle:
    """A save in flight. ``staged`` is done when the state may be mutated again; ``result()``
    returns the committed :class:`SnapshotInfo` or raises the background failure."""

    def __init__(
        self, name: str, staged: Future[None], future: Future[SnapshotInfo], saver: Saver
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


class Saver:
    """Per-store state of async saves: the in-flight save, staging arenas, delta references."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self._bg = ThreadPoolExecutor(1, thread_name_prefix="deltackpt-commit")
        self._pools: dict[int, ThreadPoolExecutor] = {}
        self._lock = threading.Lock()
        self._slot = threading.Lock()  # held from prepare() until the save ends (any thread)
        self._inflight: Future[SnapshotInfo] | None = None
        self._unreported: BaseException | None = None
        self._arenas = (Arena(), Arena())
        _SAVERS.add(self)

    def pool(self, threads: int) -> ThreadPoolExecutor:
        with self._lock:
            p = self._pools.get(threads)
            if p is None:
                p = self._pools[threads] = ThreadPoolExecutor(
                    threads, thread_name_prefix="deltackpt-io"
                )
            return p

    def mark_reported(self, e: BaseException) -> None:
        with self._lock:
            if self._unreported is e:
                self._unreported = None

    def wait_previous(self) -> float:
        """Take the store's save slot: block until the previous save (sync or async, from any
        thread) finished; raise its error if nobody has seen it. The caller must release the
        slot (``self._slot.release()``) when its save is done or failed."""
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

    def flush(self) -> None:
        with self._lock:
            prev = self._inflight
        if prev is not None:
            with contextlib.suppress(BaseException):
                prev.result()

    def submit(self, name: str, job: Callable[[], SnapshotInfo]) -> SaveHandle:
        """Run ``job`` as this store's in-flight save; its errors are reported like any other."""

        def run() -> SnapshotInfo:
            try:
                return job()
            except BaseException as e:
                with self._lock:
                    self._unreported = e
                raise

        staged: Future[None] = Future()
        staged.set_result(None)
        future = self._bg.submit(run)
        with self._lock:
            self._inflight = future
        return SaveHandle(name, staged, future, self)

    def prepare(
        self,
        state: Any,
        name: str,
        opts: SaveOptions,
        t0: float,
        background: bool,
        stage_new: bool = False,
    ) -> _Prepared:
        """The blocking part of every save, first half: wait for the previous save, lock, plan,
        and hash every chunk straight from the live tensors (on CPU; on CUDA the state is first
        copied to pinned host buffers and hashed later). Staging follows in :meth:`stage_needed`,
        once it is known which chunks must be copied."""
        st = self.store
        waited = self.wait_previous()
        locks = contextlib.ExitStack()
        locks.callback(self._slot.release)  # one save per store at a time: arenas are shared
        try:
            locks.enter_context(
                store_lock(
                    st.lock_path,
                    exclusive=False,
                    timeout=opts.lock_timeout,
                    what=f"saving {name!r}",
                )
            )
            if not opts.overwrite and st.has(name):
                raise SnapshotExistsError(
                    f"store {str(st.root)!r} already has a committed snapshot {name!r}; pick a "
                    "new name, or pass overwrite=True (the old one stays loadable until the new "
                    "one commits)"
                )
            if not st.packs_dir.is_dir():
                raise StoreError(
                    f"store {str(st.root)!r} has no packs/ directory; it is damaged or not a store"
                )
            plan = plan_state(state, st.chunk_bytes, st.small_bytes, allow_pickle=opts.allow_pickle)
            need = state_nbytes(plan)
            budget = (
                opts.memory_budget if opts.memory_budget is not None else default_memory_budget()
            )
            if any(s.data.is_cuda for s in plan.sources):
                # Device memory cannot be hashed in place: copy it all to pinned buffers (async
                # on a side stream); hashing and writing happen behind. No xor deltas here.
                self._drop_refs()
                if background and need <= budget:
                    staged = stage(plan, self._arenas[0])
                else:
                    staged = Staged([s.data.cpu().numpy() for s in plan.sources], None)
                    background = False
                return _Prepared(plan, staged, False, locks, 0.0, waited, background)
            live = Staged([s.data.numpy() for s in plan.sources], None)
            xor_on = XOR in opts.encoding.codecs and opts.encoding.force in (None, XOR)
            use_refs = xor_on and 2 * need <= budget
            if not use_refs:
                self._drop_refs()
            if background and not use_refs and need > budget:
                background = False  # no room to stage: write from the live tensors, blocking
            keys = {(src.key, src.nbytes) for src in plan.sources}
            for arena in self._arenas:
                arena.retain(keys)
            p = _Prepared(plan, live, use_refs, locks, 0.0, waited, background)
            p.index = st.chunk_index()
            self._hash_and_stage(p, stage_new and background, opts)
            return p
        except BaseException as e:
            locks.close()
            if isinstance(e, OSError) and not isinstance(e, DeltackptError):
                raise store_io_error(
                    e,
                    f"preparing to save {name!r} in store {str(st.root)!r} failed: {e}. Nothing "
                    "was written; committed snapshots are intact. Check permissions and the "
                    "disk, then save again",
                ) from e
            raise

    def _hash_and_stage(self, p: _Prepared, stage_new: bool, opts: SaveOptions) -> None:
        """Hash every chunk in place and, in the same pass while it is cache-warm, copy the chunks
        whose bytes must outlive the call: with xor on, those whose digest changed (the next
        save's bases, into the arena that does not hold the current base); with ``stage_new``,
        those the store lacks (an async save writes them later). Unchanged chunks are only read."""
        plan, live, index = p.plan, p.staged.arrays, p.index
        refs = self.store.delta_refs if p.use_refs else {}
        lock = threading.Lock()
        claimed: set[str] = set()

        def one(ci: int) -> str:
            spec = plan.chunks[ci]
            view = chunk_view(spec, live.__getitem__, p.group_bufs, ci)
            d = digest(view)
            new = False
            if stage_new and d not in index:
                with lock:
                    new = d not in claimed
                    claimed.add(d)
            if spec.ref_key is None:  # group chunk: gathered into a private buffer already
                if new:
                    with self._lock:
                        p.new_staged.add(ci)
                return d
            prior = refs.get(spec.ref_key)
            changed = p.use_refs and (prior is None or prior.digest != d)
            if changed or new:
                arena = (1 - prior.arena) if (changed and prior is not None) else 0
                self._copy_chunk(p, ci, view, arena, new)
            return d

        p.digests = list(self.pool(opts.threads).map(one, range(len(plan.chunks))))

    def _copy_chunk(self, p: _Prepared, ci: int, view: np.ndarray, arena: int, new: bool) -> None:
        si, start, length = p.plan.chunks[ci].parts[0]
        src = p.plan.sources[si]
        buf = (
            self._arenas[arena]
            .buffer(src.key, src.nbytes, pin=False)
            .numpy()[start : start + length]
        )
        torch.from_numpy(buf).copy_(torch.from_numpy(view))  # releases the GIL
        with self._lock:
            p.staged_refs[ci] = (buf, arena)
            p.chunk_data[ci] = buf
            if new:
                p.new_staged.add(ci)

    def stage_needed(self, p: _Prepared, owned: set[int]) -> None:
        """The blocking part, second half (distributed saves, once rank 0 assigned the chunks):
        a background save also copies the assigned chunks not copied by the hash pass."""
        p.owned = owned
        if p.digests is None or not p.background:
            return
        todo = {
            ci: 0
            for ci in owned
            if ci not in p.chunk_data and p.plan.chunks[ci].ref_key is not None
        }
        staged = stage_chunks(p.plan, p.staged.arrays, self._arenas, todo, self.pool(4))
        p.chunk_data.update({ci: view for ci, (view, _) in staged.items()})

    def _prefault(self, p: _Prepared) -> None:
        """Allocate and touch the staging buffers the next save may copy into, now (behind an
        async save, or once at the end of the first sync save) rather than page-faulting them
        inside the next save's blocking call: fresh pages cost ~1-3 GB/s here, touched ones 5-10."""
        arenas = self._arenas if p.use_refs else self._arenas[:1]
        if not (p.use_refs or p.background):
            return
        for arena in arenas:
            for src in p.plan.sources:
                if src.nbytes and (src.key, src.nbytes) not in arena.buffers:
                    arena.buffer(src.key, src.nbytes, pin=False).zero_()

    def _drop_refs(self) -> None:
        self.store.delta_refs = {}
        self._arenas[1].buffers.clear()

    def run(
        self, p: _Prepared, name: str, opts: SaveOptions, metadata: dict[str, Any], t0: float
    ) -> SnapshotInfo:
        """The rest of a save: wait for device copies, hash/encode/write, commit. Any thread."""
        st = self.store
        try:
            p.staged.wait()
            pool = self.pool(opts.threads)
            if p.digests is None:  # CUDA: everything staged, hash now
                wr = write_chunks(
                    st, p.plan, p.staged.arrays.__getitem__, opts, pool, st.chunk_index(), None,
                    name=name,
                )  # fmt: skip
                info = commit(st, name, p.plan, wr, opts, metadata, t0, p.blocked, p.waited)
                return info
            refs = st.delta_refs if p.use_refs else None
            wr = write_chunks(
                st, p.plan, p.staged.arrays.__getitem__, opts, pool, p.index, refs,
                digests=p.digests, owned=p.owned, group_bufs=p.group_bufs, chunk_data=p.chunk_data,
                name=name,
            )  # fmt: skip
            records = closure(set(p.digests), wr.records, p.index)
            wr = replace(wr, records=records, chunks_reused=len(set(p.digests)) - wr.chunks_new)
            info = commit(st, name, p.plan, wr, opts, metadata, t0, p.blocked, p.waited)
            if p.use_refs and refs is not None:
                st.delta_refs = next_refs(
                    p.plan, p.digests, refs, p.staged_refs, records, opts.keyframe_every
                )
            self._prefault(p)
            return info
        except BaseException as e:
            err = _typed_io_error(e, st, name)
            if p.background:
                with self._lock:
                    self._unreported = err  # cleared by result(); else raised by the next save
            if err is e:
                raise
            raise err from e
        finally:
            p.locks.close()

    def prepare_all(
        self, state: Any, name: str, opts: SaveOptions, t0: float, background: bool
    ) -> _Prepared:
        """prepare + stage for a single-process save: this process writes every new chunk."""
        p = self.prepare(state, name, opts, t0, background, stage_new=True)
        try:
            if p.digests is not None:
                # the hash pass already copied the new chunks of a background save
                p.owned = p.new_staged if p.background else first_new(p.digests, p.index)
        except BaseException:
            p.locks.close()
            raise
        p.blocked = time.perf_counter() - t0
        return p

    def start(
        self,
        state: Any,
        name: str,
        opts: SaveOptions,
        metadata: dict[str, Any],
        t0: float,
        after_commit: Callable[[], None] | None = None,
    ) -> SaveHandle:
        p = self.prepare_all(state, name, opts, t0, background=True)
        staged_future: Future[None] = Future()
        future: Future[SnapshotInfo] = Future()
        if not p.background:  # over the memory budget: saved inline, already committed
            staged_future.set_result(None)
            future.set_result(self.run(p, name, opts, metadata, t0))
            _after(after_commit, name)
            return SaveHandle(name, staged_future, future, self)
        if p.staged.event is None:
            staged_future.set_result(None)

        def background() -> SnapshotInfo:
            if not staged_future.done():
                try:
                    p.staged.wait()
                    staged_future.set_result(None)
                except BaseException as e:
                    staged_future.set_exception(e)
            info = self.run(p, name, opts, metadata, t0)
            _after(after_commit, name)
            return info

        future = self._bg.submit(background)
        with self._lock:
            self._inflight = future
        return SaveHandle(name, staged_future, future, self)


def _typed_io_error(e: BaseException, st: Store, name: str) -> BaseException:
    """A bare OSError from the write/commit phase (pack and manifest writes wrap their own) as a
    StoreIOError that keeps the errno and says what is intact; anything else unchanged."""
    if not isinstance(e, OSError) or isinstance(e, DeltackptError):
        return e
    return store_io_error(
        e,
        f"saving {name!r} to store {str(st.root)!r} failed: {e}. Committed snapshots are intact; "
        f"{name!r} was not committed, and the next `deltackpt gc` deletes anything it left",
    )


def _after(hook: Callable[[], None] | None, name: str) -> None:
    """Run a post-commit hook (retention); its failure must not turn a committed save into an error."""
    if hook is None:
        return
    try:
        hook()
    except Exception as e:
        warnings.warn(
            f"post-commit hook after saving {name!r} failed: {e!r}", RuntimeWarning, stacklevel=1
        )


@dataclass
class _Prepared:
    plan: SavePlan
    staged: Staged  # per source: live bytes (CPU) or staged copies (CUDA)
    use_refs: bool
    locks: contextlib.ExitStack
    blocked: float
    waited: float
    background: bool
    digests: list[str] | None = None  # None: not hashed yet (CUDA)
    group_bufs: dict[int, np.ndarray] = field(default_factory=dict)
    index: dict[str, ChunkRecord] = field(default_factory=dict)
    owned: set[int] | None = None  # chunk indices this process writes
    chunk_data: dict[int, np.ndarray] = field(default_factory=dict)  # staged chunk copies
    staged_refs: dict[int, tuple[np.ndarray, int]] = field(default_factory=dict)
    new_staged: set[int] = field(default_factory=set)  # chunks copied because the store lacks them


def first_new(digests: list[str], index: dict[str, ChunkRecord]) -> set[int]:
    """Indices of the chunks to write: the first occurrence of each digest the store lacks."""
    seen: set[str] = set()
    out = set()
    for ci, d in enumerate(digests):
        if d not in index and d not in seen:
            seen.add(d)
            out.add(ci)
    return out


_SAVERS: weakref.WeakSet[Saver] = weakref.WeakSet()
_SAVER_LOCK = threading.Lock()


def saver_for(store: Store) -> Saver:
    with _SAVER_LOCK:
        s = getattr(store, "_saver", None)
        if s is None:
            s = Saver(store)
            store._saver = s  # type: ignore[attr-defined]
        return s


def _flush_all() -> None:
    for s in list(_SAVERS):
        s.flush()


# Flush before concurrent.futures stops accepting work at interpreter exit: threading's exit hooks
# run (in reverse order of registration) before atexit handlers and before pools shut down.
_register = getattr(threading, "_register_atexit", None)
if _register is not None:
    _register(_flush_all)
else:  # pragma: no cover - other Pythons
    atexit.register(_flush_all)


def async_save(
    state: Any,
    store: str | os.PathLike[str] | Store,
    name: str,
    *,
    metadata: dict[str, Any] | None = None,
    options: SaveOptions | None = None,
    after_commit: Callable[[], None] | None = None,
    process_group: Any = None,
    **kwargs: Any,
) -> SaveHandle:
    """Stage ``state`` into reused host buffers and save it in the background.

    Returns once the state is staged (on CPU; on CUDA once the copies are queued, with
    ``handle.staged`` done when they land). Training may mutate the state as soon as
    ``handle.staged`` is done. ``handle.result()`` returns the :class:`SnapshotInfo` once the
    snapshot is committed, or raises the background failure.

    >>> h = deltackpt.async_save({"model": model.state_dict()}, "ckpts", "step-200")  # doctest: +SKIP
    >>> ...  # keep training
    >>> h.result().bytes_written                                                     # doctest: +SKIP
    """
    from deltackpt.api import begin

    t0, opts, st, meta = begin(store, name, metadata, options, kwargs)
    if process_group is not None:
        from deltackpt.dist.save import dist_async_save

        return dist_async_save(state, st, name, opts, meta, process_group, t0)
    return saver_for(st).start(state, name, opts, meta, t0, after_commit)

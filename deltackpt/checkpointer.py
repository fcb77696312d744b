"""``Checkpointer``: the training-loop helper (save every N steps, resume from latest, retention).

``state`` maps names to tensors, plain values, nested containers, or *stateful* objects (anything
with ``state_dict()`` and ``load_state_dict()``: modules, optimizers, schedulers, GradScaler),
the convention of ``torch.distributed.checkpoint``. Stateful objects are saved through
``state_dict()`` and restored through ``load_state_dict()``, so a fresh optimizer whose state is
still empty resumes correctly.

Ownership: every snapshot a Checkpointer writes carries ``metadata["deltackpt.checkpointer"] =
{"name_format": ..., "step": ...}``. Retention deletes, and ``restore_latest`` restores, only
snapshots with that marker whose name is the checkpointer's name for that step; a snapshot
someone else saved (``deltackpt.save(..., "best", metadata={"step": 7})``) is never touched,
whatever its metadata says about steps.
"""

from __future__ import annotations

import contextlib
import operator
import os
import threading
import warnings
from collections.abc import Callable
from typing import Any

import torch

from deltackpt import rng as _rng
from deltackpt.api import async_save, save
from deltackpt.errors import InvalidArgumentError, SnapshotExistsError, SnapshotNotFoundError
from deltackpt.format.manifest import Manifest
from deltackpt.format.policy import MAX_CHAIN
from deltackpt.interop.peft import peft_metadata
from deltackpt.options import SaveOptions, default_lock_timeout
from deltackpt.resume import chosen_by_rank0, restore_state
from deltackpt.saving.chains import bounded_chains
from deltackpt.saving.engine import SaveHandle
from deltackpt.store.fold import DEFAULT_FOLD_CHAIN, FoldReport, fold
from deltackpt.store.leases import scan_leases
from deltackpt.store.lifecycle import _delete, gc
from deltackpt.store.location import store_root
from deltackpt.store.objstore import FsspecStorage, NoLockError
from deltackpt.store.store import Store, open_store, validate_name

# Reserved names. OWNER_KEY (in snapshot metadata) is how a Checkpointer recognises what it wrote;
# RNG_KEY (in the saved state) holds deltackpt.get_rng_state(). A user's state may not use RNG_KEY.
OWNER_KEY = "deltackpt.checkpointer"
RNG_KEY = "deltackpt.rng"


def _stateful(obj: Any) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(
        getattr(obj, "load_state_dict", None)
    )


def to_saveable(state: dict[str, Any]) -> dict[str, Any]:
    return {k: (v.state_dict() if _stateful(v) else v) for k, v in state.items()}


def restore_into(state: dict[str, Any], loaded: dict[str, Any]) -> None:
    """Put ``loaded`` values back into ``state`` in place (tensors copied, objects restored)."""
    for k, v in loaded.items():
        if k not in state:
            state[k] = v
            continue
        cur = state[k]
        if _stateful(cur):
            cur.load_state_dict(v)
        elif isinstance(cur, torch.Tensor) and isinstance(v, torch.Tensor) and cur.shape == v.shape:
            with torch.no_grad():
                cur.copy_(v)
        elif isinstance(cur, dict) and isinstance(v, dict):
            restore_into(cur, v)
        else:
            state[k] = v


# Packs hold the chunks of one save; once its snapshot is deleted, chunks later snapshots still
# use (unchanged tensors, delta bases) keep the whole pack alive. Without compaction that dead
# space grew a bf16 run with keep_last=3 to 4.8x the state (bench_restore.py); rewriting packs
# that are mostly dead bounds it at the cost of copying their live chunks once.
RETENTION_COMPACT_BELOW = 1.0

# ``Checkpointer(Tiers(...), ...)`` makes a tiered checkpointer. deltackpt.tiers sits above this
# module (its durable tier is a Checkpointer), so it registers its constructor here when it is
# imported, keyed by the Tiers class: whoever holds a Tiers has imported it.
TIERED: dict[type, Callable[..., Any]] = {}


class Checkpointer:
    """Save a training state every ``every`` steps, keep the last ``keep_last``, resume latest.

    >>> ckpt = deltackpt.Checkpointer("ckpts", every=100, keep_last=3)     # doctest: +SKIP
    >>> state = {"model": model, "optim": opt, "step": 0}                  # doctest: +SKIP
    >>> start = ckpt.restore_latest(state)      # 0 on a fresh run          # doctest: +SKIP
    >>> for step in range(start, total):                                   # doctest: +SKIP
    ...     train_step(); ckpt.maybe_save(step, state)
    >>> ckpt.close()                                                       # doctest: +SKIP

    Snapshots are named ``name_format.format(step=step)``. Their metadata holds ``"step"`` (for
    ``deltackpt ls``) and the reserved key ``"deltackpt.checkpointer"``:
    ``{"name_format": name_format, "step": step}``, the explicit record that this checkpointer
    wrote them. Retention (``keep_last``, plus every ``keep_every``-th step) runs after each
    commit, in the background for async saves, and deletes only snapshots carrying that record
    whose name is ``name_format``'s name for their step: snapshots saved any other way (a
    ``"best"`` saved with ``metadata={"step": 7}``, another checkpointer's ``name_format``) are
    never deleted. It holds the store lock while it decides and deletes, so a save in flight is
    never lost either. ``save`` refuses (``SnapshotExistsError``) to overwrite a snapshot of its
    name that it did not write.

    ``rng`` (default on) saves the random state of torch (CPU and, once initialised, CUDA),
    numpy's global generator and Python's ``random`` with every snapshot, under the reserved
    state key ``"deltackpt.rng"`` (see ``deltackpt.get_rng_state``), and ``restore_latest``
    puts it back, so dropout masks and other random draws resume exactly as an uninterrupted run
    would make them. With a ``process_group`` in ``save_options`` it is off by default: each rank
    has its own generators, and a distributed save keeps only rank 0's values.

    **Object stores** (``"s3://bucket/run"`` with ``storage_options=``) have no locks. There
    retention deletes only this checkpointer's own snapshots (their manifests: one object each,
    safe while other saves run) and collects no garbage, so the packs of deleted snapshots stay
    until a ``gc`` run with ``no_concurrent_saves=True`` (``deltackpt gc URL`` while nothing
    saves). ``sole_writer=True`` is the promise that no other process saves to (or loads a
    snapshot retention deletes from) the store while this checkpointer runs: the store is then
    opened with ``FsspecStorage(..., no_concurrent_saves=True)`` and retention also runs gc and
    compaction, as on a local disk (its own saves never overlap its retention). It needs no
    ``process_group`` (every rank would run gc) and a URL, not an opened Store.

    **Folding** (``fold_max_chain=K``, default None: off): delta saves (``encoding="smallest"``,
    or ``"auto"`` on an object store) grow chains of patches, and a fresh reader of the newest
    snapshot decodes every link (up to ``keyframe_every``). With ``fold_max_chain=K`` each
    committed save is followed by :func:`deltackpt.fold` of that snapshot (``max_chain=K``,
    ``keep_links=1``: followers of the previous version still patch) on one background daemon
    thread, never on the training thread, so once the fold has finished no chain of the snapshot
    has more than K links. One fold at a time: saves that commit while a fold runs are followed
    by one fold of the newest of them (the ones between keep their chains). With a
    ``process_group`` only rank 0 folds. A fold never deletes and runs beside saves, loads and gc
    (store/fold.py); retention, which takes the store lock exclusively, waits while a fold writes
    keyframes. A failed fold is a ``RuntimeWarning`` at the next ``save``, ``wait`` or ``close``,
    never an exception; a snapshot retention deleted meanwhile is skipped quietly. ``wait()``
    and ``close()`` wait for the fold too; ``folds`` lists the :class:`~deltackpt.FoldReport` of
    each. On an object store it needs ``sole_writer=True`` (the repoint needs the exclusive lock,
    which only a sole writer has); retention and folds then take turns in the checkpointer.

    **Tiers**: ``Checkpointer(deltackpt.tiers.Tiers(local=..., durable=..., replicas=1), every,
    process_group=pg)`` returns a :class:`deltackpt.tiers.TieredCheckpointer` (same calls, plus
    ``persist`` and ``flush``): every save to a node-local tier, replicas on peers, durable
    versions every ``Tiers.persist_every`` steps (docs/tiers.md). Retention is then set in the
    ``Tiers`` (``keep_last``, ``durable_keep_last``).
    """

    def __new__(cls, store: Any = None, *args: Any, **kwargs: Any) -> Any:
        make = TIERED.get(type(store)) if cls is Checkpointer else None
        if make is not None:  # Checkpointer(Tiers(...)): a TieredCheckpointer, same calls
            return make(store, *args, **kwargs)
        return super().__new__(cls)

    def __init__(
        self,
        store: str | os.PathLike[str] | Store,
        every: int = 100,
        keep_last: int | None = None,
        async_: bool = True,
        *,
        keep_every: int | None = None,
        name_format: str = "step-{step:08d}",
        rng: bool | None = None,
        storage_options: dict[str, Any] | None = None,
        sole_writer: bool = False,
        fold_max_chain: int | None = None,
        **save_options: Any,
    ) -> None:
        _positive("every", every, "every=100 (save after steps 99, 199, ...)")
        if keep_last is not None:
            _positive("keep_last", keep_last, "keep_last=3, or None to keep every snapshot")
        if keep_every is not None:
            _positive("keep_every", keep_every, "keep_every=1000, or None")
        _check_save_options(save_options)
        self.name_format = name_format
        self._check_name_format()
        distributed = save_options.get("process_group") is not None
        if rng is None:
            rng = not distributed
            if distributed:
                warnings.warn(
                    "Checkpointer with a process_group does not save RNG state (each rank has its "
                    "own generators; a distributed save keeps rank 0's values), so random draws "
                    "after a resume differ from an uninterrupted run. Pass rng=False to silence "
                    "this",
                    RuntimeWarning,
                    stacklevel=2,
                )
        elif not isinstance(rng, bool):
            raise InvalidArgumentError(
                f"Checkpointer(rng={rng!r}) is invalid: expected True, False or None (default)"
            )
        elif rng and distributed:
            raise InvalidArgumentError(
                "Checkpointer(rng=True) cannot be combined with a process_group: each rank has "
                "its own generators and a distributed save keeps only rank 0's values. Pass "
                "rng=False (and reseed per rank after a resume)"
            )
        _check_fold_max_chain(fold_max_chain)
        if (
            fold_max_chain is not None
            and not sole_writer
            and not isinstance(store, Store)
            and isinstance(store_root(store), str)  # a URL: refused before the store is made
        ):
            raise _fold_needs_lock(store, fold_max_chain)
        self.store = _open(store, storage_options, sole_writer, distributed)
        self.every = every
        self.keep_last = keep_last
        self.keep_every = keep_every
        self.async_ = async_
        self.rng = rng
        self.save_options = bounded_chains(save_options, keep_last)
        self._pending: SaveHandle | None = None
        self.infos: list[Any] = []  # SnapshotInfo of every committed save, in order
        self.fold_max_chain = fold_max_chain
        self.folds: list[FoldReport] = []  # FoldReport of every background fold, in order
        self._folder: _Folder | None = None
        if fold_max_chain is not None:
            storage = self.store.storage
            if isinstance(storage, FsspecStorage) and not storage.no_concurrent_saves:
                raise _fold_needs_lock(str(self.store.root), fold_max_chain)
            pg = save_options.get("process_group")
            if pg is None or _rank(pg) == 0:
                # sole_writer object stores have no lock: the checkpointer orders its own gc
                # (retention) and folds; local stores' flock does that for every process
                self._folder = _Folder(self, fold_max_chain, _has_store_lock(self.store))

    def _check_name_format(self) -> None:
        fix = "Use a format with a {step} field, e.g. name_format='step-{step:08d}'"
        try:
            names = {self.name_format.format(step=s) for s in (0, 1)}
        except (KeyError, IndexError, ValueError, AttributeError) as e:
            raise InvalidArgumentError(
                f"Checkpointer(name_format={self.name_format!r}) cannot format a step ({e!r}). "
                f"{fix}"
            ) from None
        if len(names) != 2:
            raise InvalidArgumentError(
                f"Checkpointer(name_format={self.name_format!r}) gives every step the same name, "
                f"so each save would replace the last. {fix}"
            )
        for n in names:
            validate_name(n)

    def name(self, step: int) -> str:
        return self.name_format.format(step=step)

    # ------------------------------------------------------------------------ ownership

    def _owned_step(self, m: Manifest) -> int | None:
        """The step of ``m`` if this checkpointer (its ``name_format``) wrote it, else None.

        Ownership is the explicit marker, and the name must be the one ``name_format`` gives that
        step: a marker copied onto another snapshot does not make it deletable."""
        meta = m.metadata if isinstance(m.metadata, dict) else {}
        mark = meta.get(OWNER_KEY)
        if not isinstance(mark, dict) or mark.get("name_format") != self.name_format:
            return None
        step = mark.get("step")
        if type(step) is not int or step < 0 or m.name != self.name(step):
            return None
        return step

    def _legacy_step(self, m: Manifest) -> int | None:
        """Snapshots from deltackpt versions before the marker: ``{"step": N}`` and this naming.
        Only ever restored (when nothing marked exists), never deleted."""
        meta = m.metadata if isinstance(m.metadata, dict) else {}
        step = meta.get("step")
        if OWNER_KEY in meta or type(step) is not int or step < 0 or m.name != self.name(step):
            return None
        return step

    def _latest_own(self) -> tuple[Manifest, int] | None:
        manifests = self.store.manifests()
        for pick in (self._owned_step, self._legacy_step):
            found = [(m, s) for m in manifests if (s := pick(m)) is not None]
            if found:
                return found[-1]  # manifests() is oldest first (by commit time)
        return None

    def _latest_name(self) -> tuple[str, int] | None:
        found = self._latest_own()
        return None if found is None else (found[0].name, found[1])

    def _check_state(self, state: Any, what: str) -> None:
        if not isinstance(state, dict):
            raise InvalidArgumentError(
                f"Checkpointer.{what}(state=...) needs a dict of names to values or stateful "
                f"objects, got {type(state).__name__}"
            )
        if RNG_KEY in state:
            raise InvalidArgumentError(
                f"Checkpointer.{what}: the state has a key {RNG_KEY!r}, which the Checkpointer "
                "reserves for the RNG state it saves. Rename that key (or, to handle RNG "
                "yourself, pass Checkpointer(..., rng=False) and use another key)"
            )

    # ------------------------------------------------------------------------ restore

    def restore_latest(self, state: dict[str, Any]) -> int:
        """Load the newest snapshot this checkpointer wrote into ``state`` and restore the RNG
        state saved with it; return the step to resume from (0 if there is none).

        "Newest" is by commit time among the snapshots carrying this checkpointer's marker (same
        ``name_format``): a snapshot saved later by other code (``save(..., "best")``) is not
        restored. Snapshots of older deltackpt versions (``{"step": N}`` metadata and this
        naming, no marker) are restored when no marked one exists. RNG state is put back last;
        anything drawn between this call and the next training step shifts the random stream.

        DTensors (FSDP2 ``fully_shard``, tensor parallelism) are restored in place, each rank
        reading only its own boxes, from a snapshot of any world size and placements; a fresh
        optimizer gets its moments as DTensors like its parameters. With a ``process_group``
        every rank calls this: rank 0 picks the snapshot for all, and if any rank fails every
        rank raises (:class:`~deltackpt.errors.DistributedError` on the others).

        A save of this checkpointer still in flight (``async_=True``) is waited for first, so
        "newest" includes it (a failed one raises its error here, as at any next call).
        """
        self._check_state(state, "restore_latest")
        self._collect()  # the save in flight (not a background fold: readers are safe with it)
        pg = self.save_options.get("process_group")
        found = chosen_by_rank0(pg, "Checkpointer.restore_latest", self._latest_name)
        if found is None:
            return 0
        name, step = found
        # In place: the live modules' and optimizers' tensors are read into directly and come
        # back as themselves, so load_state_dict below copies nothing and no second copy of the
        # state is ever held.
        loaded = restore_state(self.store, name, state, to_saveable(state), pg)
        rng_state = loaded.pop(RNG_KEY, None) if isinstance(loaded, dict) else None
        # Validate the RNG state before anything changes; apply it after everything else.
        apply_rng = _rng.prepare(rng_state, RNG_KEY) if self.rng and rng_state is not None else None
        restore_into(state, loaded)
        if apply_rng is not None:
            apply_rng()
        elif self.rng:
            warnings.warn(
                f"snapshot {name!r} holds no RNG state (saved with rng=False or by an older "
                "deltackpt), so random draws after this resume differ from an uninterrupted run",
                RuntimeWarning,
                stacklevel=2,
            )
        return step + 1

    # ------------------------------------------------------------------------ save

    def maybe_save(
        self, step: int, state: dict[str, Any], *, force: bool = False
    ) -> SaveHandle | None:
        """Save if ``step`` is due (every ``every`` steps, counting from ``every - 1``) or forced."""
        if not force and (step + 1) % self.every:
            return None
        return self.save(step, state)

    def save(self, step: int, state: dict[str, Any]) -> SaveHandle | None:
        try:
            index = operator.index(step)  # numpy ints too; metadata needs a plain int
        except TypeError:
            index = -1
        if index < 0:
            raise InvalidArgumentError(
                f"Checkpointer.save(step={step!r}) is invalid: expected an int >= 0 (the "
                "training step)"
            )
        step = index
        self._report_folds()
        self._collect()
        self._check_state(state, "save")
        name = self.name(step)
        self._refuse_foreign(name)
        sd = to_saveable(state)
        if self.rng:  # captured now, with the state: the draws of step `step` are done
            sd[RNG_KEY] = _rng.capture()
        meta = {"step": step, OWNER_KEY: {"name_format": self.name_format, "step": step}}
        meta.update(peft_metadata(state))  # a LoRA run's config, for export_peft and add_lora
        opts = dict(overwrite=True, **self.save_options)
        if self.async_:
            h = async_save(
                sd, self.store, name, metadata=meta,
                after_commit=lambda: self._after_commit(name), **opts,
            )  # fmt: skip
            h.detach()  # the checkpointer reports its errors from the next call
            self._pending = h
            return h
        self.infos.append(save(sd, self.store, name, metadata=meta, **opts))
        self._after_commit(name)
        return None

    def _refuse_foreign(self, name: str) -> None:
        """Saves overwrite (a resumed run may redo a step), but only snapshots of their own."""
        if not self.store.has(name):
            return
        try:
            m = self.store.manifest(name)
        except SnapshotNotFoundError:  # deleted meanwhile
            return
        if self._owned_step(m) is None:
            raise SnapshotExistsError(
                f"store {str(self.store.root)!r} has a snapshot {name!r} that this Checkpointer "
                f"did not write (no {OWNER_KEY!r} marker for name_format "
                f"{self.name_format!r}); it refuses to overwrite it. Rename or delete that "
                "snapshot, or use another name_format"
            )

    def _collect(self) -> None:
        """Finish the previous async save and raise its error, once."""
        h, self._pending = self._pending, None
        if h is not None:
            self.infos.append(h.result())

    def _after_commit(self, name: str) -> None:
        """Retention, then the background fold of ``name`` (also when retention failed: that
        error goes on to the caller, or warns on the saver thread)."""
        try:
            self._apply_retention()
        finally:
            if self._folder is not None:
                self._folder.request(name)

    def _report_folds(self) -> None:
        """Warn, once each, about background folds that failed since the last call."""
        if self._folder is None:
            return
        for msg in self._folder.take_failures():
            warnings.warn(msg, RuntimeWarning, stacklevel=3)

    def _apply_retention(self) -> None:
        """Delete this checkpointer's snapshots beyond the newest ``keep_last`` (and not on a
        ``keep_every`` step), from this run and earlier ones; nothing else.

        Deciding and deleting happen under the exclusive store lock: a save holds it shared from
        planning to commit, so a snapshot another writer commits meanwhile is either seen (and
        judged by its marker) or not yet there, never deleted unseen."""
        if self.keep_last is None:
            return
        timeout = self._lock_timeout()
        st = self.store
        with self._folder.turn if self._folder is not None else contextlib.nullcontext():
            self._retain(st, timeout)

    def _lock_timeout(self) -> float:
        timeout = self.save_options.get("lock_timeout")
        return default_lock_timeout() if timeout is None else timeout

    def _retain(self, st: Store, timeout: float) -> None:
        try:
            with st.lock(exclusive=True, timeout=timeout, what="retention"):
                doomed = self._delete_doomed()
        except NoLockError:  # an object store: own manifests only, no gc (class docstring)
            with st.lock(exclusive=False, timeout=timeout, what="retention"):
                self._delete_doomed()
            return
        if doomed:  # reclaim their space; deletes no snapshot (keep_last=None)
            gc(st, keep_last=None, compact_below=RETENTION_COMPACT_BELOW, lock_timeout=timeout)

    def _delete_doomed(self) -> list[str]:
        ours = [
            (m.name, s) for m in self.store.manifests() if (s := self._owned_step(m)) is not None
        ]
        keep = {n for n, _ in ours[-self.keep_last :]} if self.keep_last else set()
        if self.keep_every:
            keep |= {n for n, s in ours if (s + 1) % self.keep_every == 0}
        leases = scan_leases(self.store.storage)  # followers' leases (store/leases.py)
        if not leases.complete:  # a lease it could not read may keep any snapshot
            return []
        keep |= leases.leased()
        doomed = [n for n, _ in ours if n not in keep]
        for n in doomed:
            with contextlib.suppress(SnapshotNotFoundError):  # lockless: another rank did
                _delete(self.store, n)
        return doomed

    def wait(self) -> None:
        """Block until the pending save is committed (and raise its error, once) and, with
        ``fold_max_chain``, until the background fold has finished (a failed fold warns)."""
        try:
            self._collect()
        finally:
            if self._folder is not None:
                self._folder.join()
                self._report_folds()

    def close(self) -> None:
        self.wait()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _Folder:
    """The background fold of a Checkpointer (class docstring, "Folding"): one daemon thread at a
    time, started when a save commits and ended when nothing is left to fold; a commit while it
    runs replaces the snapshot waiting to be folded (the newest wins) instead of queueing it."""

    def __init__(self, ckpt: Checkpointer, max_chain: int, locked_store: bool) -> None:
        self.ckpt = ckpt
        self.max_chain = max_chain
        # Where the store has no lock (a sole_writer object store) retention's gc and a fold's
        # repoint must not overlap: both take this turn. A locked store needs none (and a turn
        # would make retention, and so the next save, wait for a whole fold).
        self.turn: contextlib.AbstractContextManager[Any] = (
            contextlib.nullcontext() if locked_store else threading.Lock()
        )
        self._cv = threading.Condition()
        self._next: str | None = None
        self._thread: threading.Thread | None = None
        self._failures: list[str] = []

    def request(self, name: str) -> None:
        with self._cv:
            self._next = name
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="deltackpt-fold", daemon=True
                )
                self._thread.start()

    def _run(self) -> None:
        try:
            while True:
                with self._cv:  # the exit is decided under the lock a request takes
                    name, self._next = self._next, None
                    if name is None:
                        self._thread = None
                        self._cv.notify_all()
                        return
                self._fold(name)
        except BaseException:  # _fold catches Exception; never leave join() waiting
            with self._cv:
                self._thread = None
                self._cv.notify_all()
            raise

    def _fold(self, name: str) -> None:
        ckpt = self.ckpt
        try:
            with self.turn:
                report = fold(
                    ckpt.store, name, max_chain=self.max_chain, keep_links=1,
                    lock_timeout=ckpt._lock_timeout(),
                )  # fmt: skip
        except SnapshotNotFoundError:  # retention (or someone) deleted it meanwhile: nothing to do
            return
        except Exception as e:
            with self._cv:
                self._failures.append(
                    f"background fold of snapshot {name!r} (Checkpointer(fold_max_chain="
                    f"{self.max_chain})) failed, training goes on and its chains stay as saved: "
                    f"{e!r}. Run `deltackpt fold {ckpt.store.root} {name}` to retry"
                )
            return
        ckpt.folds.append(report)

    def join(self) -> None:
        with self._cv:
            while self._thread is not None:
                self._cv.wait()

    def take_failures(self) -> list[str]:
        with self._cv:
            out, self._failures = self._failures, []
        return out


def _check_fold_max_chain(value: Any) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_CHAIN:
        raise InvalidArgumentError(
            f"Checkpointer(fold_max_chain={value!r}) is invalid: expected None (no background "
            f"fold) or an int between 1 and {MAX_CHAIN} (the most delta links a chunk of each "
            f"saved snapshot keeps). Pass e.g. fold_max_chain={DEFAULT_FOLD_CHAIN}"
        )


def _has_store_lock(st: Store) -> bool:
    return not isinstance(st.storage, FsspecStorage)


def _fold_needs_lock(store: Any, value: int) -> InvalidArgumentError:
    return InvalidArgumentError(
        f"Checkpointer({str(store)!r}, fold_max_chain={value!r}): a fold repoints a manifest "
        "under the exclusive store lock, and object stores have none. Pass sole_writer=True "
        "(no other process saves to the store), or drop fold_max_chain and run `deltackpt fold "
        "URL --no-concurrent-saves` while nothing saves"
    )


def _rank(process_group: Any) -> int:
    import torch.distributed as dist

    return int(dist.get_rank(process_group))


def _open(store: Any, storage_options: Any, sole_writer: bool, distributed: bool) -> Store:
    """The checkpointer's store; with ``sole_writer`` an object store that allows gc."""
    if not isinstance(sole_writer, bool):
        raise InvalidArgumentError(f"Checkpointer(sole_writer={sole_writer!r}): expected a bool")
    if not sole_writer:
        return open_store(store, storage_options=storage_options)
    root = store_root(store)
    if not isinstance(root, str) or distributed:
        raise InvalidArgumentError(
            f"Checkpointer({store!r}, sole_writer=True) applies to an object-store URL "
            "(s3://...) saved from one process (no process_group); drop sole_writer"
        )
    storage = FsspecStorage(root, storage_options, no_concurrent_saves=True)
    return open_store(root, storage=storage)


def _check_save_options(save_options: dict[str, Any]) -> None:
    """The ``**save_options`` a checkpointer hands every save, checked when it is made (they were
    first read at the first save, after the store had been created): save's options, its
    ``options=`` and ``process_group=``; not what the checkpointer sets itself."""
    for key in ("metadata", "overwrite"):
        if key in save_options:
            raise InvalidArgumentError(
                f"Checkpointer({key}=...): the checkpointer sets {key} itself (the step and its "
                "name format; it rewrites only its own names); leave it out"
            )
    fields = {k: v for k, v in save_options.items() if k not in ("options", "process_group")}
    SaveOptions.from_kwargs(save_options.get("options"), fields)


def _positive(name: str, value: Any, example: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidArgumentError(
            f"Checkpointer({name}={value!r}) is invalid: expected an int >= 1. Pass e.g. {example}"
        )

"""``DeltaCheckpointIO``: a Lightning ``CheckpointIO`` that keeps checkpoints in a deltackpt store.

>>> from deltackpt.integrations.lightning import DeltaCheckpointIO            # doctest: +SKIP
>>> trainer = L.Trainer(plugins=[DeltaCheckpointIO("ckpts")],                  # doctest: +SKIP
...                     callbacks=[ModelCheckpoint(save_top_k=2, monitor="loss", save_last=True)])
>>> trainer.fit(model, ckpt_path="last")                                        # doctest: +SKIP

Lightning calls, on global rank 0 only: ``save_checkpoint(checkpoint, path)`` for every file
``ModelCheckpoint`` (or ``trainer.save_checkpoint``) writes, ``remove_checkpoint(path)`` for every
file its top-k or ``last`` bookkeeping drops, ``load_checkpoint(path)`` on ``fit(ckpt_path=...)``
and ``teardown()`` at the end of each ``fit``/``validate``/... Each path becomes one snapshot
(:mod:`deltackpt.integrations.markers`: its name comes from the path, and a small JSON marker file
is left at the path after the commit, which is what ``ckpt_path="last"`` and the version counter
look for). Unchanged tensors between saves are not written again.

Ownership: every snapshot written here carries ``metadata["deltackpt.lightning"] = {"path": ...}``;
``remove_checkpoint(path)`` deletes a snapshot only when it carries that record for that very
path, so other snapshots of the store (saved by hand, by a ``Checkpointer``, written for another
directory) are never touched, and ``save_checkpoint`` refuses to overwrite a snapshot of its name
that this plug-in did not write. Names come from file names only, so two runs saving into one
store at the same time would overwrite each other's ``last.ckpt``: give each run its own store.

Values: Lightning's checkpoint dict (``state_dict``, ``optimizer_states``, ``lr_schedulers``,
``loops``, ``callbacks``, ``hyper_parameters``, ...) is nested dicts, lists, numbers, strings and
tensors, all stored without pickle. A value that is none of those (an object passed as a
hyper-parameter, say) raises :class:`~deltackpt.errors.UnsupportedValueError` naming its key,
unless ``allow_pickle=True`` was passed: then it is pickled, and loading unpickles it, which can
run code: only for stores you trust. ``AttributeDict`` values are stored as plain dicts and come
back as ``AttributeDict``.

RNG (``rng=True``, the default, unlike Lightning's own files): the global torch (CPU, and CUDA
once initialised), numpy and Python generators are saved with each checkpoint and put back by
``load_checkpoint``, so shuffles and dropout after a resume are those of an uninterrupted run.
(From a checkpoint taken mid-epoch Lightning itself cannot continue the epoch's data order unless
the dataloader is resumable, i.e. has ``state_dict``/``load_state_dict``; it warns so.)

Async (``async_save=True``): ``save_checkpoint`` returns once the state is staged into reused
host buffers; the write and commit run in the background and the marker appears after the
commit. The next ``save_checkpoint``, ``load_checkpoint``, a ``remove_checkpoint`` of that same
path and ``teardown`` wait for it and raise its error. Lightning's own ``AsyncCheckpointIO``
wrapper also works (it clones every tensor on the caller's thread and saves in its thread;
a removal that overtakes the save of that path in its queue is applied when that save commits),
but the RNG state is then captured on its thread, later than the checkpoint's step (a warning
says so): prefer ``async_save=True``, which captures it on the training thread.

Tiers: ``DeltaCheckpointIO(Tiers(local=..., durable=..., replicas=0, persist_every=...))`` saves
through :class:`~deltackpt.tiers.TieredCheckpointer` instead (a
:class:`~deltackpt.integrations.lightning_tiers.TieredCheckpointIO`; see that module).

Space: deleted snapshots free their chunks at the next garbage collection, which runs (holding
the store lock) after a removal once no save of this plug-in is in flight, and at ``teardown``.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass
from typing import Any

from deltackpt import rng as _rng
from deltackpt.api import async_save, save
from deltackpt.checkpointer import RETENTION_COMPACT_BELOW, RNG_KEY
from deltackpt.errors import (
    InvalidArgumentError,
    SnapshotExistsError,
    SnapshotNotFoundError,
    UnsupportedValueError,
)
from deltackpt.integrations.lightning_tiers import (
    TieredCheckpointIO,
    plain_dicts,
    rng_now,
    to_device,
)
from deltackpt.integrations.markers import (
    canonical,
    read_marker,
    remove_path,
    snapshot_name,
    write_marker,
)
from deltackpt.loading.assemble import load
from deltackpt.options import SaveOptions
from deltackpt.saving.engine import SaveHandle
from deltackpt.store.lifecycle import delete, gc
from deltackpt.store.store import SnapshotInfo, Store, open_store
from deltackpt.tiers.config import Tiers

try:
    from lightning.fabric.plugins import CheckpointIO
    from lightning.fabric.utilities.data import AttributeDict
except ImportError:  # the standalone pytorch_lightning package
    from lightning_fabric.plugins import CheckpointIO  # type: ignore[no-redef]
    from lightning_fabric.utilities.data import AttributeDict  # type: ignore[no-redef]

__all__ = ["OWNER_KEY", "DeltaCheckpointIO"]

OWNER_KEY = "deltackpt.lightning"  # snapshot metadata: {"path": ..., "attribute_dicts": [...]}


@dataclass
class _Pending:
    handle: SaveHandle
    path: str
    name: str
    step: int | None
    marked: list[bool]  # non-empty once after_commit wrote the marker


class DeltaCheckpointIO(CheckpointIO):
    """Lightning ``CheckpointIO`` over a deltackpt store (see the module docstring).

    ``store`` is a path, URL or opened :class:`~deltackpt.Store`; further keyword arguments are
    :class:`~deltackpt.SaveOptions` fields (``threads``, ``encoding``, ...). ``gc_on_remove``
    (default on) reclaims the space of removed checkpoints. ``infos`` lists the
    :class:`~deltackpt.SnapshotInfo` of every committed save (bytes written, blocking time).
    """

    def __new__(cls, store: Any = None, *args: Any, **kwargs: Any) -> Any:
        if cls is DeltaCheckpointIO and isinstance(store, Tiers):
            # DeltaCheckpointIO(Tiers(...)): lightning_tiers.py (async by default)
            return TieredCheckpointIO(store, *args, **kwargs)
        return super().__new__(cls)

    def __init__(
        self,
        store: Any,
        *,
        async_save: bool = False,
        allow_pickle: bool = False,
        rng: bool = True,
        gc_on_remove: bool = True,
        storage_options: dict[str, Any] | None = None,
        **save_options: Any,
    ) -> None:
        super().__init__()
        for flag, value in (
            ("async_save", async_save),
            ("allow_pickle", allow_pickle),
            ("rng", rng),
            ("gc_on_remove", gc_on_remove),
        ):
            if not isinstance(value, bool):
                raise InvalidArgumentError(
                    f"DeltaCheckpointIO({flag}={value!r}) is invalid: expected True or False"
                )
        for reserved in ("allow_pickle", "overwrite", "metadata"):
            if reserved in save_options:
                raise InvalidArgumentError(
                    f"DeltaCheckpointIO(..., {reserved}=...) is set by the plug-in itself; leave "
                    "it out"
                )
        SaveOptions.from_kwargs(None, dict(save_options))  # bad options fail here, not mid-fit
        self.store: Store = open_store(store, storage_options=storage_options)
        self.async_save = async_save
        self.allow_pickle = allow_pickle
        self.rng = rng
        self.gc_on_remove = gc_on_remove
        self.save_options = save_options
        self.infos: list[SnapshotInfo] = []
        self._lock = threading.RLock()
        self._pending: _Pending | None = None
        self._tombstones: set[str] = set()  # paths removed before their (queued) save committed
        self._saving: list[str] = []  # paths of blocking saves running, until their marker
        self._gc_due = False
        self._warned = False

    # ------------------------------------------------------------------------ save

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None
    ) -> None:
        if storage_options is not None:
            raise InvalidArgumentError(
                f"DeltaCheckpointIO.save_checkpoint(storage_options={storage_options!r}): "
                "per-save storage options are not supported; configure the store with "
                "DeltaCheckpointIO(store, storage_options=...)"
            )
        if not isinstance(checkpoint, dict):
            raise InvalidArgumentError(
                f"DeltaCheckpointIO.save_checkpoint: expected Lightning's checkpoint dict, got "
                f"{type(checkpoint).__name__}"
            )
        self._collect()
        where, name = canonical(path), snapshot_name(path)
        step = checkpoint.get("global_step")
        step = step if type(step) is int else None
        self._refuse_foreign(name)
        state, converted = self._to_state(checkpoint)
        meta: dict[str, Any] = {OWNER_KEY: {"path": where, "attribute_dicts": converted}}
        if step is not None:
            meta["step"] = step
        if type(checkpoint.get("epoch")) is int:
            meta["epoch"] = checkpoint["epoch"]
        opts = dict(overwrite=True, allow_pickle=self.allow_pickle, **self.save_options)
        try:
            if self.async_save:
                marked: list[bool] = []

                def after_commit() -> None:
                    self._committed(where, name, step, background=True)
                    marked.append(True)

                h = async_save(
                    state, self.store, name, metadata=meta, after_commit=after_commit, **opts
                )
                h.detach()  # its outcome is raised by the next call (_collect)
                self._pending = _Pending(h, where, name, step, marked)
                return
            with self._lock:
                self._saving.append(where)
            try:
                self.infos.append(save(state, self.store, name, metadata=meta, **opts))
            except BaseException:
                with self._lock:
                    self._saving.remove(where)
                raise
        except UnsupportedValueError as e:
            raise UnsupportedValueError(
                f"Lightning's checkpoint for {str(path)!r} cannot be stored without pickle: {e}. "
                "DeltaCheckpointIO(store, allow_pickle=True) stores such values pickled (loading "
                "them then unpickles, which can run code: only for stores you trust)"
            ) from e
        self._committed(where, name, step, background=False)

    def _to_state(self, checkpoint: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
        """A shallow copy of Lightning's dict as deltackpt stores it (Lightning's dict itself is
        never changed)."""
        if RNG_KEY in checkpoint:
            raise InvalidArgumentError(
                f"Lightning's checkpoint has a key {RNG_KEY!r}, which DeltaCheckpointIO reserves "
                "for the RNG state; rename it in on_save_checkpoint, or pass rng=False"
            )
        state, converted = plain_dicts(checkpoint)
        if self.rng:
            state[RNG_KEY] = rng_now(
                self, "Use DeltaCheckpointIO(store, async_save=True) instead, which captures it "
                "on the training thread",
            )  # fmt: skip
        return state, converted

    def _refuse_foreign(self, name: str) -> None:
        """Saves overwrite snapshots this plug-in wrote (for any path: a run whose checkpoint
        directory moved keeps its names), never one saved another way."""
        # _owner_path is None for "not ours" and for "deleted meanwhile": has() tells them apart
        if self.store.has(name) and self._owner_path(name) is None and self.store.has(name):
            raise SnapshotExistsError(
                f"store {str(self.store.root)!r} has a snapshot {name!r} that DeltaCheckpointIO "
                f"did not write (no {OWNER_KEY!r} metadata); it refuses to overwrite it. Rename "
                "or delete that snapshot, use another store, or another "
                "ModelCheckpoint(filename=...)"
            )

    def _owner_path(self, name: str) -> str | None:
        """The path this plug-in wrote snapshot ``name`` for, or None (not ours, or gone)."""
        try:
            meta = self.store.manifest(name).metadata
        except SnapshotNotFoundError:
            return None
        mark = meta.get(OWNER_KEY) if isinstance(meta, dict) else None
        p = mark.get("path") if isinstance(mark, dict) else None
        return p if isinstance(p, str) else None

    def _committed(self, where: str, name: str, step: int | None, background: bool) -> None:
        """After a commit: the marker (rewritten each time: ``ckpt_path="last"`` picks the newest
        ``last*.ckpt`` by modification time), or, if the path was removed meanwhile, the snapshot
        goes. ``_collect`` repeats it for an async save whose after_commit failed (it only warns)."""
        with self._lock:
            if where in self._tombstones:
                self._tombstones.discard(where)
                if self._owner_path(name) == where:
                    _delete_shared(self.store, name)
                    self._gc_due = True
            else:
                write_marker(where, str(self.store.root), name, step)
            if not background and where in self._saving:
                self._saving.remove(where)
        self._maybe_gc(in_flight_ok=background)

    def _collect(self) -> None:
        """Wait for this plug-in's async save and raise its failure, once."""
        with self._lock:
            p, self._pending = self._pending, None
        if p is None:
            return
        self.infos.append(p.handle.result())
        if not p.marked:
            self._committed(p.path, p.name, p.step, background=False)

    # ------------------------------------------------------------------------ remove

    def remove_checkpoint(self, path: Any) -> None:
        """Remove the marker at ``path`` and the snapshot this plug-in wrote for it; nothing else."""
        where, name = canonical(path), snapshot_name(path)
        pending = self._pending
        if pending is not None and pending.path == where:
            self._collect()
        with self._lock:
            # A save of this path still to commit (queued in a wrapper's thread) or committed but
            # without its marker yet: it must not leave a marker behind, nor its snapshot.
            if where in self._saving or not self.store.has(name):
                self._tombstones.add(where)
            remove_path(where)
            if self._owner_path(name) == where:
                _delete_shared(self.store, name)
                self._gc_due = True
        self._maybe_gc()

    def _maybe_gc(self, in_flight_ok: bool = False) -> None:
        """Reclaim removed snapshots' space unless a save of ours is in flight (gc would wait for
        it, holding up training; the save's end runs it instead)."""
        with self._lock:
            if not (self.gc_on_remove and self._gc_due) or self._saving:
                return
            if not in_flight_ok and self._pending is not None and not self._pending.handle.done():
                return
            self._gc_due = False
        gc(self.store, keep_last=None, compact_below=RETENTION_COMPACT_BELOW)

    # ------------------------------------------------------------------------ load

    def load_checkpoint(
        self, path: Any, map_location: Any | None = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        """Load the checkpoint saved for ``path`` as Lightning's dict, and restore the RNG state
        saved with it (``rng=True``). ``weights_only=True`` never unpickles."""
        self._collect()
        name = self._resolve(path)
        pickle_ok = self.allow_pickle and weights_only is not True
        loaded = load(self.store, name, allow_pickle=pickle_ok)
        if not isinstance(loaded, dict):
            raise InvalidArgumentError(
                f"snapshot {name!r} of store {str(self.store.root)!r} holds a "
                f"{type(loaded).__name__}, not a Lightning checkpoint dict"
            )
        meta = self.store.manifest(name).metadata
        mark = meta.get(OWNER_KEY) if isinstance(meta, dict) else None
        for k in mark.get("attribute_dicts", []) if isinstance(mark, dict) else []:
            if isinstance(loaded.get(k), dict):
                loaded[k] = AttributeDict(loaded[k])
        rng_state = loaded.pop(RNG_KEY, None)
        if self.rng and rng_state is not None:
            _rng.prepare(rng_state, RNG_KEY)()
        return to_device(loaded, map_location) if map_location is not None else loaded

    def _resolve(self, path: Any) -> str:
        """The snapshot for ``path``: the one written for it, else the one its marker names
        (a ``save_last="link"`` symlink, a moved directory), else one of the same name."""
        where, name = canonical(path), snapshot_name(path)
        if self._owner_path(name) == where:
            return name
        named, exists = read_marker(where)
        if named is not None and self.store.has(named):
            return named
        if self.store.has(name):
            return name
        if exists and named is None:
            raise InvalidArgumentError(
                f"{str(path)!r} is not a deltackpt marker file (a checkpoint saved by "
                "Lightning's TorchCheckpointIO?) and store "
                f"{str(self.store.root)!r} has no snapshot {name!r}; load it without "
                "DeltaCheckpointIO"
            )
        raise SnapshotNotFoundError(
            f"no checkpoint for {str(path)!r}: store {str(self.store.root)!r} has no snapshot "
            f"{name!r}{' and the marker names ' + repr(named) if named else ''}. Its snapshots: "
            f"{self.store.names()[-5:]} (last 5)"
        )

    def teardown(self) -> None:
        """End of a fit/validate/...: wait for the async save, collect removed snapshots' space."""
        try:
            self._collect()
        finally:
            with self._lock:
                self._tombstones.clear()
            self._maybe_gc()


def _delete_shared(st: Store, name: str) -> None:
    with contextlib.suppress(SnapshotNotFoundError):  # gone meanwhile: nothing to do
        delete(st, name)

"""``DeltaCheckpointIO(store)``'s backend: each checkpoint path is one snapshot of a store, named
from the path (:func:`~deltackpt.integrations.markers.snapshot_name`).

Ownership: every snapshot written here carries ``metadata["deltackpt.lightning"] = {"path": ...,
"attribute_dicts": [...]}``; :meth:`StoreBackend.remove` deletes a snapshot only when it carries
that record for that very path, so other snapshots of the store (saved by hand, by a
``Checkpointer``, written for another directory) are never touched, and a save refuses to
overwrite a snapshot of its name that this plug-in did not write. The RNG state is the saved
state's ``deltackpt.rng`` key.

Async: the save is :func:`deltackpt.async_save` with the marker written by its ``after_commit``;
a removal of the path being saved waits for it. Under Lightning's ``AsyncCheckpointIO`` wrapper
(saves on its thread), a removal that overtakes the save of that path in its queue is applied
when that save commits (a tombstone).

Space: deleted snapshots free their chunks at the next garbage collection, which runs (holding
the store lock) after a removal once no save of this plug-in is in flight, and at ``teardown``.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass
from typing import Any

from deltackpt.api import async_save as _async_save
from deltackpt.api import save
from deltackpt.checkpointer import RETENTION_COMPACT_BELOW, RNG_KEY
from deltackpt.errors import (
    InvalidArgumentError,
    SnapshotExistsError,
    SnapshotNotFoundError,
    UnsupportedValueError,
)
from deltackpt.integrations._lightning_state import OWNER_KEY, Extras
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

__all__ = ["StoreBackend"]


@dataclass
class _Pending:
    handle: SaveHandle
    path: str
    name: str
    step: int | None
    marked: list[bool]  # non-empty once after_commit wrote the marker


class StoreBackend:
    """Snapshots of ``store`` named from the checkpoint paths (see the module docstring)."""

    reserved = RNG_KEY  # a key of Lightning's dict that this backend stores the RNG under
    rng_advice = (
        "Use DeltaCheckpointIO(store, async_save=True) instead, which captures it on the "
        "training thread"
    )
    last_restore = None  # a store has no restore report

    def __init__(
        self,
        store: Any,
        *,
        async_save: bool | None,
        allow_pickle: bool | None,
        gc_on_remove: bool | None,
        storage_options: dict[str, Any] | None,
        save_options: dict[str, Any],
    ) -> None:
        for flag, value in (("allow_pickle", allow_pickle), ("gc_on_remove", gc_on_remove)):
            if value is not None and not isinstance(value, bool):
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
        self.async_save = bool(async_save)  # default: off
        self.allow_pickle = bool(allow_pickle)  # default: off
        self.gc_on_remove = gc_on_remove is not False  # default: on
        self.save_options = save_options
        self.infos: list[SnapshotInfo] = []
        self._lock = threading.RLock()
        self._pending: _Pending | None = None
        self._tombstones: set[str] = set()  # paths removed before their (queued) save committed
        self._saving: list[str] = []  # paths of blocking saves running, until their marker
        self._gc_due = False

    # ------------------------------------------------------------------------ save

    def check(self, checkpoint: dict[str, Any], path: Any) -> None:
        """Before the state is made: raise a pending save's error; refuse a foreign name."""
        self.wait()
        self._refuse_foreign(snapshot_name(path))

    def save(self, state: dict[str, Any], extras: Extras, path: Any) -> None:
        """Save ``state`` (Lightning's dict, made storable) as the snapshot for ``path``."""
        where, name = canonical(path), snapshot_name(path)
        step = state.get("global_step")
        step = step if type(step) is int else None
        if extras.rng is not None:
            state[RNG_KEY] = extras.rng
        mark = {"path": where, "attribute_dicts": extras.attribute_dicts}
        meta: dict[str, Any] = {OWNER_KEY: mark}
        if step is not None:
            meta["step"] = step
        if type(state.get("epoch")) is int:
            meta["epoch"] = state["epoch"]
        opts = dict(overwrite=True, allow_pickle=self.allow_pickle, **self.save_options)
        try:
            if self.async_save:
                marked: list[bool] = []

                def after_commit() -> None:
                    self._committed(where, name, step, background=True)
                    marked.append(True)

                h = _async_save(
                    state, self.store, name, metadata=meta, after_commit=after_commit, **opts
                )
                h.detach()  # its outcome is raised by the next call (wait)
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
        goes. ``wait`` repeats it for an async save whose after_commit failed (it only warns)."""
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

    def wait(self) -> None:
        """Wait for the async save and raise its failure, once."""
        with self._lock:
            p, self._pending = self._pending, None
        if p is None:
            return
        self.infos.append(p.handle.result())
        if not p.marked:
            self._committed(p.path, p.name, p.step, background=False)

    # ------------------------------------------------------------------------ remove

    def remove(self, path: Any) -> None:
        """Remove the marker at ``path`` and the snapshot this plug-in wrote for it; nothing else."""
        where, name = canonical(path), snapshot_name(path)
        pending = self._pending
        if pending is not None and pending.path == where:
            self.wait()
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

    def load(self, path: Any, weights_only: bool | None) -> tuple[dict[str, Any], Extras]:
        """The snapshot saved for ``path`` and its extras. ``weights_only=True`` never
        unpickles."""
        self.wait()
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
        names = mark.get("attribute_dicts") if isinstance(mark, dict) else None
        names = names if isinstance(names, list) else []
        return loaded, Extras(names, loaded.pop(RNG_KEY, None), RNG_KEY)

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
            self.wait()
        finally:
            with self._lock:
                self._tombstones.clear()
            self._maybe_gc()


def _delete_shared(st: Store, name: str) -> None:
    with contextlib.suppress(SnapshotNotFoundError):  # gone meanwhile: nothing to do
        delete(st, name)

"""``DeltaCheckpointIO``: a Lightning ``CheckpointIO`` that keeps checkpoints in a deltackpt store
or in tiers.

>>> from deltackpt.integrations.lightning import DeltaCheckpointIO            # doctest: +SKIP
>>> trainer = L.Trainer(plugins=[DeltaCheckpointIO("ckpts")],                  # doctest: +SKIP
...                     callbacks=[ModelCheckpoint(save_top_k=2, monitor="loss", save_last=True)])
>>> trainer.fit(model, ckpt_path="last")                                        # doctest: +SKIP
>>> io = DeltaCheckpointIO(Tiers(local="/dev/shm/run", durable="ckpts", replicas=0,
...                              persist_every=100))                            # doctest: +SKIP

Lightning calls, on global rank 0 only: ``save_checkpoint(checkpoint, path)`` for every file
``ModelCheckpoint`` (or ``trainer.save_checkpoint``) writes, ``remove_checkpoint(path)`` for every
file its top-k or ``last`` bookkeeping drops, ``load_checkpoint(path)`` (every rank) on
``fit(ckpt_path=...)`` and ``teardown()`` at the end of each ``fit``/``validate``/... After each
commit a small JSON marker file is left at the path (:mod:`deltackpt.integrations.markers`),
which is what ``ckpt_path="last"`` and ``ModelCheckpoint``'s version counter look for.

**A store** (path, URL or :class:`~deltackpt.Store`): each path becomes one snapshot named from
the path; unchanged tensors between saves are not written again. ``remove_checkpoint(path)``
deletes only the snapshot this plug-in wrote for that very path, and a save never overwrites a
snapshot it did not write (:mod:`deltackpt.integrations._lightning_store`: ownership, the
``AsyncCheckpointIO`` wrapper, garbage collection). Names come from file names only, so two runs
saving into one store at the same time would overwrite each other's ``last.ckpt``: give each
run its own store.

**Tiers** (a :class:`deltackpt.tiers.Tiers`, ``replicas=0``): each save goes to the local tier as
the step ``global_step`` (the files of one step are one tier snapshot), async by default, and the
first save at or past each multiple of ``persist_every`` also to the durable tier.
``ckpt_path="last"`` restores the newest step any tier can give (``last_restore`` says which),
another path exactly its step; ``remove_checkpoint`` removes the marker only (retention is the
tiers'); rank 0 loads and broadcasts to the other ranks
(:mod:`deltackpt.integrations._lightning_tiers`).

Values: Lightning's checkpoint dict (``state_dict``, ``optimizer_states``, ``lr_schedulers``,
``loops``, ``callbacks``, ``hyper_parameters``, ...) is nested dicts, lists, numbers, strings and
tensors, all stored without pickle. A value that is none of those (an object passed as a
hyper-parameter, say) raises :class:`~deltackpt.errors.UnsupportedValueError` naming its key,
unless ``allow_pickle=True`` was passed (a store only): then it is pickled, and loading unpickles
it, which can run code: only for stores you trust. ``AttributeDict`` values are stored as plain
dicts and come back as ``AttributeDict``.

RNG (``rng=True``, the default, unlike Lightning's own files): the global torch (CPU, and CUDA
once initialised), numpy and Python generators are saved with each checkpoint and put back by
``load_checkpoint``, so shuffles and dropout after a resume are those of an uninterrupted run.
(From a checkpoint taken mid-epoch Lightning itself cannot continue the epoch's data order unless
the dataloader is resumable, i.e. has ``state_dict``/``load_state_dict``; it warns so.)

Async (``async_save=True``; the default for tiers): ``save_checkpoint`` returns once the state
is staged; the write and commit run in the background and the marker appears after the commit.
The next ``save_checkpoint``, ``load_checkpoint`` and ``teardown`` (and :meth:`wait`) wait for
it and raise its error. Lightning's own ``AsyncCheckpointIO`` wrapper also works, but the RNG
state is then captured on its thread, later than the checkpoint's step (a warning says so):
prefer ``async_save=True``, which captures it on the training thread.

Written once for both: the argument checks, Lightning's dict <-> the stored state
(:mod:`deltackpt.integrations._lightning_state`: ``AttributeDict`` values, the RNG capture and
restore, ``map_location``), the pickling of the plug-in (``ddp_spawn``) and the marker files.
Where the state goes, how a path maps to a snapshot and what a removal deletes are the
backend's.
"""

from __future__ import annotations

from typing import Any

from deltackpt.errors import InvalidArgumentError
from deltackpt.integrations._lightning_state import (
    OWNER_KEY,
    Extras,
    plain_dicts,
    rng_now,
    to_device,
)
from deltackpt.integrations._lightning_store import StoreBackend
from deltackpt.integrations._lightning_tiers import TierBackend
from deltackpt.store.store import SnapshotInfo, Store
from deltackpt.tiers import RestoreReport, TieredCheckpointer, Tiers

try:
    from lightning.fabric.plugins import CheckpointIO
except ImportError:  # the standalone pytorch_lightning package
    from lightning_fabric.plugins import CheckpointIO  # type: ignore[no-redef]

__all__ = ["OWNER_KEY", "DeltaCheckpointIO"]


class DeltaCheckpointIO(CheckpointIO):
    """Lightning ``CheckpointIO`` over a deltackpt store or tiers (see the module docstring).

    ``store``: a path, URL or opened :class:`~deltackpt.Store`, or a
    :class:`deltackpt.tiers.Tiers` (``replicas=0``: Lightning saves on rank 0 only).
    ``async_save``: return once the state is staged (default: off for a store, on for tiers).
    ``rng`` (default on): save the global RNG state with each checkpoint and put it back on load.

    A store only: ``allow_pickle`` (default off), ``gc_on_remove`` (default on: reclaim the space
    of removed checkpoints), ``storage_options`` and further :class:`~deltackpt.SaveOptions`
    fields (``threads``, ``encoding``, ...); ``infos`` lists the :class:`~deltackpt.SnapshotInfo`
    of every committed save (bytes written, blocking time). Tiers refuse these (their options
    are set in the ``Tiers``); ``last_restore`` is the :class:`~deltackpt.tiers.RestoreReport` of
    the last ``last*.ckpt`` load.
    """

    def __init__(
        self,
        store: Any,
        *,
        async_save: bool | None = None,
        allow_pickle: bool | None = None,
        rng: bool = True,
        gc_on_remove: bool | None = None,
        storage_options: dict[str, Any] | None = None,
        **save_options: Any,
    ) -> None:
        super().__init__()
        tiered = isinstance(store, Tiers)
        for flag, value, default_ok in (("async_save", async_save, True), ("rng", rng, False)):
            if not isinstance(value, bool) and not (default_ok and value is None):
                raise InvalidArgumentError(
                    f"DeltaCheckpointIO({'Tiers(...), ' if tiered else ''}{flag}={value!r}) is "
                    "invalid: expected True or False"
                )
        options: dict[str, Any] = dict(
            async_save=async_save,
            allow_pickle=allow_pickle,
            gc_on_remove=gc_on_remove,
            storage_options=storage_options,
            save_options=save_options,
        )
        self._args = (store, rng, options)  # what a pickled copy is made from
        self._backend: StoreBackend | TierBackend = (
            TierBackend(store, **options) if tiered else StoreBackend(store, **options)
        )
        self.rng = rng
        self._warned = False  # the RNG captured off the main thread: warned once

    def __getstate__(self) -> dict[str, Any]:
        """Pickled (``ddp_spawn`` sends the plug-in to its processes): the configuration only;
        a save in flight stays with the original."""
        return {"args": self._args}

    def __setstate__(self, state: dict[str, Any]) -> None:
        store, rng, options = state["args"]
        options = dict(options)
        save_options = options.pop("save_options")
        self.__init__(store, rng=rng, **options, **save_options)  # type: ignore[misc]

    # ------------------------------------------------------------------------ what it saves to

    @property
    def store(self) -> Store:
        """The store (a store plug-in only)."""
        if isinstance(self._backend, TierBackend):
            raise InvalidArgumentError(
                "DeltaCheckpointIO(Tiers(...)).store: a tiered plug-in has no single store; use "
                ".tiers, or .checkpointer (a TieredCheckpointer)"
            )
        return self._backend.store

    @property
    def tiers(self) -> Tiers | None:
        """The :class:`~deltackpt.tiers.Tiers` (None for a store plug-in)."""
        return self._backend.tiers if isinstance(self._backend, TierBackend) else None

    @property
    def checkpointer(self) -> TieredCheckpointer | None:
        """The tiers' :class:`~deltackpt.tiers.TieredCheckpointer` (made on first use; None for
        a store plug-in)."""
        return self._backend.checkpointer() if isinstance(self._backend, TierBackend) else None

    @property
    def async_save(self) -> bool:
        return self._backend.async_save

    @property
    def infos(self) -> list[SnapshotInfo]:
        """Every committed save's :class:`~deltackpt.SnapshotInfo` (a store; empty for tiers:
        see ``checkpointer.stats``)."""
        return self._backend.infos if isinstance(self._backend, StoreBackend) else []

    @property
    def last_restore(self) -> RestoreReport | None:
        """Where the last ``last*.ckpt`` load of tiers came from (None for a store)."""
        return self._backend.last_restore

    # ------------------------------------------------------------------------ CheckpointIO

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None
    ) -> None:
        """Save Lightning's dict for ``path``; its marker appears there after the commit."""
        if storage_options is not None:
            raise InvalidArgumentError(
                f"DeltaCheckpointIO.save_checkpoint(storage_options={storage_options!r}): "
                "per-save storage options are not supported; configure the store with "
                "DeltaCheckpointIO(store, storage_options=...), or the tiers with "
                "Tiers(storage_options=...)"
            )
        if not isinstance(checkpoint, dict):
            raise InvalidArgumentError(
                f"DeltaCheckpointIO.save_checkpoint: expected Lightning's checkpoint dict, got "
                f"{type(checkpoint).__name__}"
            )
        self._backend.check(checkpoint, path)
        state, extras = self._to_state(checkpoint)
        self._backend.save(state, extras, path)

    def _to_state(self, checkpoint: dict[str, Any]) -> tuple[dict[str, Any], Extras]:
        """A shallow copy of Lightning's dict as deltackpt stores it (Lightning's dict itself is
        never changed), and what is saved beside it."""
        key = self._backend.reserved
        if key in checkpoint:
            raise InvalidArgumentError(
                f"Lightning's checkpoint has a key {key!r}, which DeltaCheckpointIO reserves "
                "for the RNG state; rename it in on_save_checkpoint"
            )
        state, converted = plain_dicts(checkpoint)
        rng = rng_now(self, self._backend.rng_advice) if self.rng else None
        return state, Extras(converted, rng)

    def remove_checkpoint(self, path: Any) -> None:
        """Remove the marker at ``path``; a store also deletes the snapshot this plug-in wrote
        for that very path (nothing else), tiers keep what their retention keeps."""
        self._backend.remove(path)

    def load_checkpoint(
        self, path: Any, map_location: Any | None = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        """Load the checkpoint saved for ``path`` as Lightning's dict, and restore the RNG state
        saved with it (``rng=True``). ``weights_only=True`` never unpickles."""
        loaded, extras = self._backend.load(path, weights_only)
        extras.apply(loaded, self.rng)
        return loaded if map_location is None else to_device(loaded, map_location)

    def wait(self) -> None:
        """Wait for the save in flight (an async save's commit and marker; tiers: also the
        durable version) and raise its error."""
        self._backend.wait()

    def teardown(self) -> None:
        """End of a fit/validate/...: wait for the save in flight; a store collects removed
        snapshots' space, tiers release their threads (the next use opens them again)."""
        self._backend.teardown()

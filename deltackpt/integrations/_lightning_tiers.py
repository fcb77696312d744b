"""``DeltaCheckpointIO(Tiers(...))``: Lightning checkpoints through tiered checkpoints.

Every checkpoint Lightning saves goes to the local tier (async: ``save_checkpoint`` returns once
the state is staged), as the tier snapshot of its ``global_step`` (``step-<global_step:08d>``;
the several files ``ModelCheckpoint`` writes for one step, ``last.ckpt`` and ``epoch=..``, are
one tier snapshot, the newest dict saved for that step). The first save at or past each multiple
of ``persist_every`` global steps also goes to the durable tier (in the background; once per
step: that version holds the first file's dict, whose weights, optimizer, loops and RNG are those
of the later files, only ``ModelCheckpoint``'s own bookkeeping can differ). A JSON
marker file (:mod:`deltackpt.integrations.markers`) is left at each path once the local save
committed, naming the tier step: that is what ``ckpt_path="last"`` and ``ModelCheckpoint``'s
version counter look for.

Loading: a ``last*.ckpt`` path (what ``ckpt_path="last"`` resolves to) restores the newest step
any tier can give (:meth:`TieredCheckpointer.restore_latest`: verified local snapshot, else the
durable tier), which may be newer than the marker (a crash after a commit, before its marker) or
older (the local tier was wiped; a ``RuntimeWarning`` says so). Any other path restores exactly
its step, from the local tier or else the durable tier; if no tier holds it any more,
:class:`~deltackpt.errors.SnapshotNotFoundError` names the path and the steps each tier holds.
Retention is the tiers' (``Tiers.keep_last``, ``durable_keep_last``): ``remove`` removes the
marker only, never a tier snapshot.

Ranks: Lightning calls ``save_checkpoint`` on global rank 0 only (single device, DDP, FSDP with
full state dicts), so there are no peers to hold replicas: ``Tiers(replicas=0)`` is required.
Every rank calls ``load_checkpoint``; under an initialised process group of several ranks rank 0
restores and broadcasts the checkpoint dict to the others.

Nothing is ever pickled (``allow_pickle`` is refused). The RNG state and the names of
``AttributeDict`` values travel inside the saved state under the reserved key
``"deltackpt.lightning"``.
"""

from __future__ import annotations

import io
import re
import threading
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from deltackpt.errors import (
    DistributedError,
    InvalidArgumentError,
    SnapshotNotFoundError,
    UnsupportedValueError,
)
from deltackpt.integrations._lightning_state import OWNER_KEY, Extras
from deltackpt.integrations.markers import canonical, read_marker, remove_path, write_marker
from deltackpt.loading.assemble import load
from deltackpt.tiers import RestoreReport, TieredCheckpointer, Tiers
from deltackpt.tiers.config import local_name
from deltackpt.tiers.restore import local_steps

__all__ = ["TierBackend"]

_STEP_NAME = re.compile(r"^step-(\d{8,})$")


def _last_prefix() -> str:
    """The name ``ModelCheckpoint`` gives its ``last`` files (``CHECKPOINT_NAME_LAST``)."""
    try:
        from lightning.pytorch.callbacks import ModelCheckpoint
    except ImportError:  # pragma: no cover - lightning.fabric without lightning.pytorch
        return "last"
    return str(ModelCheckpoint.CHECKPOINT_NAME_LAST or "last")


class TierBackend:
    """Tier snapshots named by ``global_step`` (see the module docstring). ``last_restore`` is
    the :class:`~deltackpt.tiers.RestoreReport` of the last ``last*.ckpt`` load."""

    reserved = OWNER_KEY  # a key of Lightning's dict that this backend stores its extras under
    rng_advice = "Drop the wrapper: tier saves are already async"

    def __init__(
        self,
        tiers: Tiers,
        *,
        async_save: bool | None,
        allow_pickle: bool | None,
        gc_on_remove: bool | None,
        storage_options: dict[str, Any] | None,
        save_options: dict[str, Any],
    ) -> None:
        other = dict(save_options)
        for k, v in (
            ("allow_pickle", allow_pickle),
            ("gc_on_remove", gc_on_remove),
            ("storage_options", storage_options),
        ):
            if v is not None:
                other[k] = v
        if other:
            raise InvalidArgumentError(
                f"DeltaCheckpointIO(Tiers(...), {', '.join(f'{k}=...' for k in sorted(other))}) "
                "is invalid: with tiers it takes only async_save= and rng= (nothing is pickled; "
                "storage options go in Tiers(storage_options=...); retention is Tiers(keep_last="
                "..., durable_keep_last=...)); leave the others out"
            )
        if tiers.replicas:
            raise InvalidArgumentError(
                f"DeltaCheckpointIO(Tiers(replicas={tiers.replicas})) is invalid: Lightning calls "
                "CheckpointIO on global rank 0 only (single device, DDP, FSDP full state dicts), "
                "so no peer rank can hold a replica. Pass Tiers(replicas=0); the durable tier "
                "(durable=..., persist_every=...) covers the loss of the node"
            )
        self.tiers = tiers
        self.async_save = async_save is not False  # default: on
        self.last_restore: RestoreReport | None = None
        self._ck: TieredCheckpointer | None = None
        self._lock = threading.Lock()
        self._marks: ThreadPoolExecutor | None = None
        self._marking: list[Future[None]] = []
        self._generation: dict[str, int] = {}  # per path: bumped by each save and removal
        self._persisted: int | None = None  # global_step // persist_every of the last persist

    # ------------------------------------------------------------------------ helpers

    def checkpointer(self) -> TieredCheckpointer:
        if self._ck is None:  # made on first use: only rank 0 ever saves
            self._ck = TieredCheckpointer(
                self.tiers, every=1, process_group=None, async_=self.async_save
            )
        return self._ck

    def wait(self) -> None:
        """Wait for the local save, its marker writes and any durable save; raise their error."""
        with self._lock:
            marking, self._marking = self._marking, []
        try:
            if self._ck is not None:
                self._ck.wait()
        finally:
            for f in marking:
                f.result()

    def _held(self) -> str:
        """The steps each tier holds, for error messages."""
        ck = self.checkpointer()
        local = sorted(local_steps(ck.own, 0, 1))
        return f"local tier {str(self.tiers.root)!r}: {local}; durable tier: " + (
            f"{ck.durable_steps()}" if ck.durable is not None else "none (Tiers(durable=None))"
        )

    # ------------------------------------------------------------------------ save

    def check(self, checkpoint: dict[str, Any], path: Any) -> None:
        """Before the state is made: a step to name the snapshot by; marker errors of earlier
        saves surface here, once."""
        step = checkpoint.get("global_step")
        if type(step) is not int or step < 0:
            raise InvalidArgumentError(
                f"DeltaCheckpointIO(Tiers(...)).save_checkpoint({str(path)!r}): the checkpoint's "
                f"'global_step' is {step!r}, expected an int >= 0 (tier snapshots are named by "
                "step); save Lightning's own checkpoint dict"
            )
        self.checkpointer()
        with self._lock:
            done = [f for f in self._marking if f.done()]
            self._marking = [f for f in self._marking if not f.done()]
        for f in done:
            f.result()

    def save(self, state: dict[str, Any], extras: Extras, path: Any) -> None:
        """Save ``state`` (Lightning's dict, made storable) as the tier step of its
        ``global_step``; the marker at ``path`` follows the local commit."""
        step: int = state["global_step"]
        where = canonical(path)
        extra: dict[str, Any] = {"attribute_dicts": extras.attribute_dicts}
        if extras.rng is not None:
            extra["rng"] = extras.rng
        state[OWNER_KEY] = extra
        try:
            pe = self.tiers.persist_every
            persist = pe is not None and step // pe > (self._persisted or 0)
            # persisted from the local tier in the background; once per step (its first file)
            handle = self.checkpointer().save(step, state, persist=persist)
            if persist:
                self._persisted = step // pe
        except UnsupportedValueError as e:
            raise UnsupportedValueError(
                f"Lightning's checkpoint for {str(path)!r} cannot be stored in tiers: {e}. "
                "Tiers never pickle: turn that value into tensors, numbers, strings, lists or "
                "dicts (or leave it out of the checkpoint in on_save_checkpoint)"
            ) from e
        with self._lock:
            gen = self._generation[where] = self._generation.get(where, 0) + 1
        if handle is None:  # a blocking save: committed already
            self._mark(None, where, step, gen)
            return
        with self._lock:
            if self._marks is None:
                self._marks = ThreadPoolExecutor(1, thread_name_prefix="deltackpt-marker")
            self._marking.append(self._marks.submit(self._mark, handle, where, step, gen))

    def _mark(self, handle: Any, where: str, step: int, gen: int) -> None:
        """After the local commit: the marker, unless the path was saved again or removed."""
        if handle is not None:
            handle.result()  # a failed save leaves no marker (its error comes from wait())
        with self._lock:
            if self._generation.get(where) == gen:
                write_marker(where, str(self.tiers.root), local_name(step), step)

    # ------------------------------------------------------------------------ remove

    def remove(self, path: Any) -> None:
        """Remove the marker at ``path`` (and cancel its pending write). Tier snapshots are
        kept or dropped by the tiers' own retention (``Tiers.keep_last``, ``durable_keep_last``)."""
        where = canonical(path)
        with self._lock:
            self._generation[where] = self._generation.get(where, 0) + 1
            remove_path(where)

    # ------------------------------------------------------------------------ load

    def load(self, path: Any, weights_only: bool | None) -> tuple[dict[str, Any], Extras]:
        """Lightning's dict for ``path`` (see the module docstring) and its extras; with several
        ranks, rank 0's. Nothing is pickled, whatever ``weights_only``."""
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            loaded = self._broadcast_load(path, dist)
        else:
            loaded = self._load(path)
        extra = loaded.pop(OWNER_KEY, None)
        extra = extra if isinstance(extra, dict) else {}
        names = extra.get("attribute_dicts")
        names = names if isinstance(names, list) else []
        return loaded, Extras(names, extra.get("rng"), f"{OWNER_KEY}/rng")

    def _broadcast_load(self, path: Any, dist: Any) -> dict[str, Any]:
        """Rank 0 loads, every other rank receives its dict (or its failure). The dict travels
        as ``torch.save`` bytes read back with ``weights_only=True`` (tensors, numbers, strings,
        lists and dicts: all a tier snapshot can hold)."""
        payload: list[Any] = [None]
        if dist.get_rank() == 0:
            try:
                buf = io.BytesIO()
                torch.save(self._load(path), buf)
                payload[0] = ("ok", buf.getvalue())
            except Exception as e:
                payload[0] = ("error", e)
        dist.broadcast_object_list(payload, src=0)
        kind, value = payload[0]
        if kind == "ok":
            return torch.load(io.BytesIO(value), weights_only=True)  # type: ignore[no-any-return]
        if dist.get_rank() == 0:
            raise value
        raise DistributedError(
            f"DeltaCheckpointIO(Tiers(...)).load_checkpoint({str(path)!r}) failed on rank 0: "
            f"{type(value).__name__}: {value}"
        )

    def _load(self, path: Any) -> dict[str, Any]:
        self.wait()
        where = canonical(path)
        named, exists = read_marker(where)
        m = _STEP_NAME.match(named) if named is not None else None
        if exists and m is None:
            raise InvalidArgumentError(
                f"{str(path)!r} is not a marker of DeltaCheckpointIO(Tiers(...)) (a file of "
                "Lightning's TorchCheckpointIO, or of DeltaCheckpointIO(store)?); load it with "
                "the CheckpointIO that saved it"
            )
        if not exists:
            raise SnapshotNotFoundError(
                f"no checkpoint at {str(path)!r} (no marker file there); the tiers hold: "
                f"{self._held()}"
            )
        assert m is not None
        step = int(m.group(1))
        ck = self.checkpointer()
        if _base(where).startswith(_last_prefix()):
            state: dict[str, Any] = {}
            ck.restore_latest(state)
            report = self.last_restore = ck.last_restore
            if report is None or report.step is None:
                raise SnapshotNotFoundError(
                    f"{str(path)!r} names step {step}, but no tier holds any usable step: "
                    f"{self._held()}; refused: {list(report.refused) if report else []}"
                )
            if report.step < step:
                warnings.warn(
                    f"{str(path)!r} names step {step}; the newest step the tiers can give is "
                    f"{report.step} (from {report.tier}), which is restored. Refused or "
                    f"missing: {list(report.refused) or 'the local tier holds nothing newer'}",
                    RuntimeWarning,
                    stacklevel=4,
                )
            self._persisted = self._bucket(report.step)
            return state
        loaded = self._load_step(ck, step, path)
        self._persisted = self._bucket(step)
        return loaded

    def _bucket(self, step: int) -> int | None:
        pe = self.tiers.persist_every
        return None if pe is None else step // pe

    def _load_step(self, ck: TieredCheckpointer, step: int, path: Any) -> dict[str, Any]:
        """Exactly ``step``: the local tier (every digest checked on read), else the durable."""
        problems: list[str] = []
        if step in local_steps(ck.own, 0, 1):
            try:
                return _as_dict(load(ck.own, local_name(step)), path)
            except Exception as e:  # damaged: try the durable tier
                problems.append(f"local: {type(e).__name__}: {e}")
        d = ck.durable
        if d is not None and d.store.has(d.name(step)):
            return _as_dict(load(d.store, d.name(step)), path)
        raise SnapshotNotFoundError(
            f"{str(path)!r} is step {step}, which no tier holds any more ({self._held()}"
            f"{'; refused: ' + '; '.join(problems) if problems else ''}). Tier retention is "
            "Tiers(keep_last=..., durable_keep_last=...); load a newer checkpoint (ckpt_path="
            "'last')"
        )

    # ------------------------------------------------------------------------ lifetime

    def teardown(self) -> None:
        """End of a fit/validate/...: wait for the local save, the markers and the durable
        save, then release the tiers' threads (the next use opens them again)."""
        try:
            self.wait()
        finally:
            ck, self._ck = self._ck, None
            marks, self._marks = self._marks, None
            if ck is not None:
                ck.close()
            if marks is not None:
                marks.shutdown(wait=True)


def _base(where: str) -> str:
    return where.rstrip("/").rsplit("/", 1)[-1]


def _as_dict(loaded: Any, path: Any) -> dict[str, Any]:
    if not isinstance(loaded, dict):
        raise InvalidArgumentError(
            f"the tier snapshot for {str(path)!r} holds a {type(loaded).__name__}, not a "
            "Lightning checkpoint dict"
        )
    return loaded

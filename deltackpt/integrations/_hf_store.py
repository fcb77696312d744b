"""``DeltaCheckpointCallback`` over a store: the saves (one writer, world process zero, through a
:class:`~deltackpt.Checkpointer`) and the resume point of ``resume_trainer`` (the snapshot's
``TrainerState`` from its manifest, the rest read in place into the live state)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from deltackpt.checkpointer import OWNER_KEY, Checkpointer, to_saveable
from deltackpt.errors import InvalidArgumentError
from deltackpt.format.tree import value_leaves
from deltackpt.integrations._hf_resume import STATE_KEY, ResumePoint, checked_text
from deltackpt.resume import restore_state
from deltackpt.store.store import Store, open_store

__all__ = ["StoreSaves", "latest_checkpoint", "resume_point"]


@dataclass
class StoreSaves:
    """The callback's saves to a store: world process zero saves, every save is a snapshot
    ``name_format.format(step=global_step)`` (``keep_last``: of this callback's snapshots)."""

    checkpointer: Checkpointer
    every_rank = False  # one writer: the Trainer's world process zero

    @classmethod
    def open(
        cls,
        store: str | os.PathLike[str] | Store,
        *,
        keep_last: int | None,
        async_save: bool | None,
        name_format: str,
        storage_options: dict[str, Any] | None,
        handle_sigterm: bool,
        save_options: dict[str, Any],
    ) -> StoreSaves:
        if handle_sigterm:
            raise InvalidArgumentError(
                "DeltaCheckpointCallback(handle_sigterm=True) needs tiers: pass a "
                "deltackpt.tiers.Tiers as the store (a SIGTERM then persists that step durably)"
            )
        return cls(
            Checkpointer(
                store,
                every=1,
                keep_last=keep_last,
                async_=bool(async_save),  # default: off
                name_format=name_format,
                rng=True,
                storage_options=storage_options,
                **save_options,
            )
        )

    @property
    def store(self) -> Store:
        return self.checkpointer.store

    def begin(self) -> None:
        pass

    def check_stop(self, control: Any) -> None:
        pass

    def save(self, step: int, live: dict[str, Any]) -> None:
        self.checkpointer.save(step, live)

    def wait(self) -> None:
        self.checkpointer.wait()

    def close(self) -> None:
        self.checkpointer.wait()


def latest_checkpoint(store: str | os.PathLike[str] | Store, name_format: str) -> str | None:
    """The newest snapshot a ``DeltaCheckpointCallback`` with ``name_format`` wrote to ``store``
    (by commit time), or None."""
    st = store if isinstance(store, Store) else open_store(store, create=False)
    best = None
    for m in st.manifests():  # oldest first
        mark = m.metadata.get(OWNER_KEY) if isinstance(m.metadata, dict) else None
        if not isinstance(mark, dict) or mark.get("name_format") != name_format:
            continue
        step = mark.get("step")
        if type(step) is int and step >= 0 and m.name == name_format.format(step=step):
            best = m.name
    return best


def resume_point(
    store: str | os.PathLike[str] | Store, name: str | None, name_format: str
) -> ResumePoint | None:
    """Snapshot ``name`` (default: the newest the callback wrote), or None on a fresh store. The
    ``TrainerState`` comes from the manifest (no tensor read); the rest is read in place into
    the live state once the Trainer has built it."""
    st = store if isinstance(store, Store) else open_store(store)  # a fresh one is empty
    chosen = name if name is not None else latest_checkpoint(st, name_format)
    if chosen is None:
        return None
    m = st.manifest(chosen)
    text = next((node for path, node in value_leaves(m.tree) if path == STATE_KEY), None)

    def fetch(live: dict[str, Any]) -> Any:
        return restore_state(st, chosen, live, to_saveable(live))

    return ResumePoint(checked_text(text, f"snapshot {m.name!r}", m.name), fetch)

"""``Checkpointer``: the training-loop helper (save every N steps, resume from latest, retention).

``state`` maps names to tensors, plain values, nested containers, or *stateful* objects (anything
with ``state_dict()`` and ``load_state_dict()``: modules, optimizers, schedulers, GradScaler),
the convention of ``torch.distributed.checkpoint``. Stateful objects are saved through
``state_dict()`` and restored through ``load_state_dict()``, so a fresh optimizer whose state is
still empty resumes correctly.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from deltackpt._async import SaveHandle, async_save
from deltackpt.errors import SnapshotNotFoundError
from deltackpt.lifecycle import gc
from deltackpt.loading import load
from deltackpt.saving import save
from deltackpt.store import Store, open_store


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


class Checkpointer:
    """Save a training state every ``every`` steps, keep the last ``keep_last``, resume latest.

    >>> ckpt = deltackpt.Checkpointer("ckpts", every=100, keep_last=3)     # doctest: +SKIP
    >>> state = {"model": model, "optim": opt, "step": 0}                  # doctest: +SKIP
    >>> start = ckpt.restore_latest(state)      # 0 on a fresh run          # doctest: +SKIP
    >>> for step in range(start, total):                                   # doctest: +SKIP
    ...     train_step(); ckpt.maybe_save(step, state)
    >>> ckpt.close()                                                       # doctest: +SKIP

    Snapshots are named ``name_format.format(step=step)`` and carry ``{"step": step}`` in their
    metadata. Retention (``keep_last``, plus every ``keep_every``-th step) runs after each commit
    in the background; gc holds the store lock, so it never deletes what an in-flight save needs.
    """

    def __init__(
        self,
        store: str | os.PathLike[str] | Store,
        every: int = 100,
        keep_last: int | None = None,
        async_: bool = True,
        *,
        keep_every: int | None = None,
        name_format: str = "step-{step:08d}",
        **save_options: Any,
    ) -> None:
        if every < 1:
            raise ValueError(f"every must be >= 1, got {every}")
        if keep_last is not None and keep_last < 1:
            raise ValueError(f"keep_last must be >= 1 or None, got {keep_last}")
        self.store = open_store(store)
        self.every = every
        self.keep_last = keep_last
        self.keep_every = keep_every
        self.async_ = async_
        self.name_format = name_format
        self.save_options = save_options
        self._pending: SaveHandle | None = None
        self.infos: list[Any] = []  # SnapshotInfo of every committed save, in order

    def name(self, step: int) -> str:
        return self.name_format.format(step=step)

    def restore_latest(self, state: dict[str, Any]) -> int:
        """Load the latest snapshot into ``state``; return the step to resume from (0 if none)."""
        try:
            info = self.store.info("latest")
        except SnapshotNotFoundError:
            return 0
        loaded = load(self.store, info.name)
        restore_into(state, loaded)
        step = info.metadata.get("step")
        return int(step) + 1 if step is not None else 0

    def maybe_save(
        self, step: int, state: dict[str, Any], *, force: bool = False
    ) -> SaveHandle | None:
        """Save if ``step`` is due (every ``every`` steps, counting from ``every - 1``) or forced."""
        if not force and (step + 1) % self.every:
            return None
        return self.save(step, state)

    def save(self, step: int, state: dict[str, Any]) -> SaveHandle | None:
        self._collect()
        sd = to_saveable(state)
        meta = {"step": step}
        opts = dict(overwrite=True, **self.save_options)
        if self.async_:
            h = async_save(
                sd,
                self.store,
                self.name(step),
                metadata=meta,
                after_commit=self._apply_retention,
                **opts,
            )
            h._observed = True  # the checkpointer reports its errors from the next call
            self._pending = h
            return h
        self.infos.append(save(sd, self.store, self.name(step), metadata=meta, **opts))
        self._apply_retention()
        return None

    def _collect(self) -> None:
        """Finish the previous async save and raise its error, once."""
        h, self._pending = self._pending, None
        if h is not None:
            self.infos.append(h.result())

    def _apply_retention(self) -> None:
        """Keep the newest ``keep_last`` snapshots of this checkpointer's naming (from this run and
        earlier ones), every ``keep_every``-th step, and anything it did not write."""
        if self.keep_last is None:
            return
        ours = [m for m in self.store.manifests() if "step" in m.metadata]
        keep = {m.name for m in self.store.manifests() if "step" not in m.metadata}
        keep |= {m.name for m in ours[-self.keep_last :]}
        if self.keep_every:
            keep |= {m.name for m in ours if (int(m.metadata["step"]) + 1) % self.keep_every == 0}
        if len(keep) < len(ours) + len(keep - {m.name for m in ours}):
            gc(self.store, keep=sorted(keep), keep_last=0, compact_below=0.0)

    def wait(self) -> None:
        """Block until the pending save is committed (and raise its error, once)."""
        self._collect()

    def close(self) -> None:
        self.wait()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

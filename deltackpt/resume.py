"""Resume a live training state in place: the load half of ``Checkpointer.restore_latest`` and
of the Hugging Face Trainer callback's resume.

Why its own step: a live state holds modules and optimizers whose tensors may be DTensors (FSDP2's
``fully_shard``, tensor parallelism). Loading such a state as plain full tensors and handing them
to ``load_state_dict`` fails (``got mixed torch.Tensor and DTensor``) and makes every rank read
every byte. Here each DTensor of the live state is read in place, its own box only
(:func:`deltackpt.loading.assemble.load_reusing`), and the moments a *fresh* optimizer does not
hold yet get DTensor targets shaped like their parameters (:func:`optimizer_targets`), as
``torch.distributed.checkpoint.state_dict`` gives them, so the optimizer's next step sees DTensors
everywhere. Any saved layout and world size loads into any live one.

With a process group (:func:`chosen_by_rank0` then :func:`restore_state`, every rank calling both): rank 0
chooses the snapshot and broadcasts its name, so no rank restores another one; each rank reads
only its own boxes; if any rank fails, every rank raises (a
:class:`~deltackpt.errors.DistributedError` on the others).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import torch

from deltackpt.distributed.collectives import Failed, Group
from deltackpt.errors import DistributedError, RankFailure
from deltackpt.format.dtensor import is_dtensor
from deltackpt.format.dtypes import dtype_from_name
from deltackpt.format.manifest import Manifest, TensorEntry
from deltackpt.format.tree import _key_segment
from deltackpt.loading.assemble import _agree, load_reusing
from deltackpt.store.store import Store

T = TypeVar("T")


def chosen_by_rank0(process_group: Any, what: str, choose: Callable[[], T]) -> T:
    """``choose()`` on rank 0 of ``process_group``, its value (or failure) on every rank; without
    a group, just ``choose()``. ``what`` names the operation in errors."""
    if process_group is None:
        return choose()
    g = Group(process_group)
    value: Any = None
    cause: BaseException | None = None
    if g.coordinator:
        try:
            value = ("ok", choose())
        except Exception as e:
            value, cause = Failed((RankFailure.of(g.rank, "plan", e),)), e
    try:
        value = g.broadcast(value)
    except Exception as e:
        raise DistributedError(
            f"{what}: the broadcast from rank 0 failed on rank {g.rank} of {g.world} "
            f"({type(e).__name__}: {e}); a peer died or the process group's timeout passed. "
            "Nothing was loaded: restart every rank and resume again"
        ) from e
    if isinstance(value, Failed):
        g.raise_failed(what, value, cause, "Nothing was loaded")
    return value[1]  # type: ignore[no-any-return]


def restore_state(
    store: Store,
    name: str,
    live: Mapping[str, Any],
    saveable: dict[str, Any],
    process_group: Any = None,
) -> Any:
    """Load snapshot ``name`` for ``live`` (the caller's state: stateful objects and values),
    reading into the tensors of ``saveable`` (``live`` with its stateful objects replaced by
    their ``state_dict()``) in place; return the loaded tree, for the caller to hand to
    ``load_state_dict``. With ``process_group`` every rank of it calls this."""

    def load() -> Any:
        optimizer_targets(live, saveable, store.manifest(name))
        return load_reusing(store, name, saveable)

    return load() if process_group is None else _agree(process_group, load)


def optimizer_targets(live: Mapping[str, Any], saveable: dict[str, Any], m: Manifest) -> None:
    """For each optimizer in ``live`` (anything with ``param_groups``) whose parameters are
    DTensors: give every saved state tensor of such a parameter that the live optimizer does not
    hold yet (a fresh one holds none) a new DTensor target with the parameter's mesh and
    placements, in ``saveable``'s copy of the optimizer's state dict. Tensors the optimizer
    already holds are read in place anyway; anything else (``step`` counters, plain parameters)
    stays as the snapshot has it."""
    entries = {e.path: e for e in m.tensors if e.storage is None}
    for key, obj in live.items():
        sd = saveable.get(key)
        groups = getattr(obj, "param_groups", None)
        if not (isinstance(sd, dict) and isinstance(groups, list)):
            continue
        state, saved_groups = sd.get("state"), sd.get("param_groups")
        if not (isinstance(state, dict) and isinstance(saved_groups, list)):
            continue
        params: dict[Any, Any] = {}
        for sg, g in zip(saved_groups, groups, strict=False):
            if isinstance(sg, dict) and isinstance(g, dict):
                params.update(zip(sg.get("params", ()), g.get("params", ()), strict=False))
        prefix = f"{_key_segment(key)}/state/"
        for path, e in entries.items():
            if not path.startswith(prefix):
                continue
            index, sep, field = path[len(prefix) :].partition("/")
            if not sep or "/" in field or not index.isdigit():
                continue
            p = params.get(int(index))
            slot = state.get(int(index))
            if isinstance(slot, dict) and field in slot:
                continue  # the live optimizer holds it: read in place
            target = _like(p, e)
            if target is not None:
                # a copy: the optimizer's own per-parameter dict stays untouched until
                # load_state_dict replaces it
                state[int(index)] = {**(slot if isinstance(slot, dict) else {}), field: target}


def _like(param: Any, e: TensorEntry) -> torch.Tensor | None:
    """A new DTensor placed as ``param``, with the saved entry's shape and dtype; None when
    ``param`` is not a DTensor of that shape."""
    if not is_dtensor(param) or tuple(param.shape) != e.shape:
        return None
    with torch.no_grad():
        return torch.empty_like(param, dtype=dtype_from_name(e.dtype), requires_grad=False)

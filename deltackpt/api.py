"""``deltackpt.save``: plan the state, write its new chunks, commit one manifest."""

from __future__ import annotations

import os
import time
from typing import Any

from deltackpt.errors import InvalidArgumentError
from deltackpt.options import SaveOptions
from deltackpt.saving.engine import saver_for
from deltackpt.store.store import SnapshotInfo, Store, open_store, validate_name


def save(
    state: Any,
    store: str | os.PathLike[str] | Store,
    name: str,
    *,
    metadata: dict[str, Any] | None = None,
    options: SaveOptions | None = None,
    process_group: Any = None,
    **kwargs: Any,
) -> SnapshotInfo:
    """Save ``state`` as snapshot ``name`` of ``store`` and return its :class:`SnapshotInfo`.

    Only chunks the store does not already hold are written; changed chunks are stored raw,
    byte-grouped zstd, or xor against this process's previous save of the same key, whichever is
    smallest (see :class:`deltackpt.format.codecs.EncodePolicy`). The call returns after the manifest
    is committed (durable). Keyword options are the fields of :class:`SaveOptions`
    (``allow_pickle``, ``overwrite``, ``threads``, ``encoding``, ...). ``metadata`` is a small
    JSON-serialisable dict kept in the manifest (e.g. ``{"step": 100, "loss": 1.9}``).

    With ``process_group`` every rank of the group calls ``save`` with its local state: DTensor
    shards are stored as pieces of their global tensors, other values are taken as replicated
    (rank 0's copy, as torch.distributed.checkpoint does), each rank writes its own packs and
    rank 0 commits one manifest once every rank's data is durable.

    >>> info = deltackpt.save({"model": model.state_dict(), "step": 100}, "ckpts", "step-100")  # doctest: +SKIP
    >>> info.bytes_written, info.chunks_reused                                                 # doctest: +SKIP
    """
    t0, opts, st, meta = begin(store, name, metadata, options, kwargs)
    if process_group is not None:
        from deltackpt.dist.save import dist_save

        return dist_save(state, st, name, opts, meta, process_group, t0)
    saver = saver_for(st)
    prepared = saver.prepare_all(state, name, opts, t0, background=False)
    return saver.run(prepared, name, opts, meta, t0)


def begin(
    store: str | os.PathLike[str] | Store,
    name: str,
    metadata: dict[str, Any] | None,
    options: SaveOptions | None,
    kwargs: dict[str, Any],
) -> tuple[float, SaveOptions, Store, dict[str, Any]]:
    """Validate a save's arguments (shared by save and async_save): start time, options, store,
    metadata."""
    t0 = time.perf_counter()
    opts = SaveOptions.from_kwargs(options, kwargs)
    st = open_store(store)
    validate_name(name)
    return t0, opts, st, _check_metadata(metadata)


def _check_metadata(metadata: dict[str, Any] | None) -> dict[str, Any]:
    """``metadata`` must be a dict of JSON values that come back as they went in: str keys at
    every level (json would silently turn ``{1: x}`` into ``{"1": x}``), finite floats, no
    cycles and no other objects."""
    fix = (
        "Pass a small dict of JSON values, e.g. metadata={'step': 100, 'loss': 1.9}; put tensors "
        "and objects in the state instead"
    )
    if metadata is None:
        return {}
    if not isinstance(metadata, dict):
        raise InvalidArgumentError(
            f"metadata={metadata!r:.80} is invalid: expected a dict, got "
            f"{type(metadata).__name__}. {fix}"
        )
    active: set[int] = set()  # containers on the current path: a repeat is a cycle

    def walk(v: Any, where: str) -> None:
        if v is None or isinstance(v, (str, bool, int)):
            return
        if isinstance(v, float):
            if v != v or v in (float("inf"), float("-inf")):
                raise InvalidArgumentError(
                    f"{where}={v!r} is invalid: JSON has no nan/inf, expected a finite float. "
                    f"Store it as a string (e.g. str(x)) or leave it out. {fix}"
                )
            return
        if not isinstance(v, (dict, list, tuple)):
            raise InvalidArgumentError(
                f"{where} is a {type(v).__module__}.{type(v).__qualname__} ({v!r:.60}); "
                f"metadata must be JSON-serialisable (str keys; str/int/float/bool/None/lists/"
                f"dicts, finite floats). Convert it (e.g. int(x), float(x), x.item()). {fix}"
            )
        if id(v) in active or len(active) > 100:
            raise InvalidArgumentError(
                f"{where} is nested too deep or refers to itself (a cycle); metadata must be "
                f"a tree of JSON values. {fix}"
            )
        active.add(id(v))
        if isinstance(v, dict):
            for k, item in v.items():
                if not isinstance(k, str):
                    raise InvalidArgumentError(
                        f"{where} has key {k!r} of type {type(k).__name__}; metadata keys must "
                        f"be str (JSON would turn it into {str(k)!r}). {fix}"
                    )
                walk(item, f"{where}[{k!r}]")
        else:
            for i, item in enumerate(v):
                walk(item, f"{where}[{i}]")
        active.discard(id(v))

    walk(metadata, "metadata")
    return dict(metadata)

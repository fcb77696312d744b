"""The public save functions: ``deltackpt.save`` and ``deltackpt.async_save``.

Both check their arguments here, before anything is touched, then run the one save sequence of
``deltackpt/distributed/save.py`` through the store's :class:`~deltackpt.saving.engine.StoreSaver`: in a
world of one without ``process_group``, over the group's ranks with one.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

from deltackpt.distributed.collectives import Group
from deltackpt.distributed.save import run_save, start_save
from deltackpt.errors import InvalidArgumentError
from deltackpt.options import SaveOptions
from deltackpt.saving.engine import SaveHandle, SaveRequest, saver_for
from deltackpt.store.store import SnapshotInfo, Store, open_store, validate_name


def save(
    state: Any,
    store: str | os.PathLike[str] | Store,
    name: str,
    *,
    metadata: dict[str, Any] | None = None,
    options: SaveOptions | None = None,
    process_group: Any = None,
    storage_options: dict[str, Any] | None = None,
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
    and stored once; if the ranks hold a plain value differently the save raises
    :class:`~deltackpt.errors.ReplicaMismatchError` naming the key and the ranks, unless
    ``replicated="rank0"`` asks for rank 0's copy (torch.distributed.checkpoint's behaviour).
    Each rank writes its own packs and
    rank 0 commits one manifest once every rank's data is durable.

    ``storage_options`` configure an object-store URL (``s3://bucket/prefix``: s3fs's ``key``,
    ``secret``, ``endpoint_url``, ...), as for :func:`~deltackpt.store.store.open_store`; on an
    object store each rank uploads its own packs and rank 0 publishes the manifest.

    >>> info = deltackpt.save({"model": model.state_dict(), "step": 100}, "ckpts", "step-100")  # doctest: +SKIP
    >>> info.bytes_written, info.chunks_reused                                                 # doctest: +SKIP
    """
    req = begin(store, name, metadata, options, kwargs, storage_options)
    return run_save(state, saver_for(req.store), Group(process_group), req)


def async_save(
    state: Any,
    store: str | os.PathLike[str] | Store,
    name: str,
    *,
    metadata: dict[str, Any] | None = None,
    options: SaveOptions | None = None,
    after_commit: Callable[[], None] | None = None,
    process_group: Any = None,
    storage_options: dict[str, Any] | None = None,
    **kwargs: Any,
) -> SaveHandle:
    """Stage ``state`` into reused host buffers and save it in the background.

    Returns once the state is staged (on CPU; on CUDA once the copies are queued, with
    ``handle.staged`` done when they land). Training may mutate the state as soon as this
    returns: on CUDA the device's current stream waits for the copies, so the next step's
    kernels run after them while this thread goes on (work on another stream, or writes from
    the host, wait for ``handle.staged`` first). ``handle.result()`` returns the
    :class:`SnapshotInfo` once the snapshot is committed, or raises the background failure.
    ``after_commit`` runs (on every rank) after a successful commit; its failure only warns.

    >>> h = deltackpt.async_save({"model": model.state_dict()}, "ckpts", "step-200")  # doctest: +SKIP
    >>> ...  # keep training
    >>> h.result().bytes_written                                                     # doctest: +SKIP
    """
    req = begin(store, name, metadata, options, kwargs, storage_options)
    return start_save(state, saver_for(req.store), Group(process_group), req, after_commit)


def begin(
    store: str | os.PathLike[str] | Store,
    name: str,
    metadata: dict[str, Any] | None,
    options: SaveOptions | None,
    kwargs: dict[str, Any],
    storage_options: dict[str, Any] | None = None,
) -> SaveRequest:
    """Validate a save's arguments (shared by save and async_save)."""
    t0 = time.perf_counter()
    opts = SaveOptions.from_kwargs(options, kwargs)
    validate_name(name)  # before the store: a new one would be created for nothing
    meta = check_metadata(metadata)
    st = open_store(store, storage_options=storage_options)
    opts = opts.for_storage(remote=st.storage.remote)
    return SaveRequest(st, name, opts, meta, t0)


def check_metadata(metadata: dict[str, Any] | None) -> dict[str, Any]:
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


_check_metadata = check_metadata  # the DCP writer's name for it, until it switches

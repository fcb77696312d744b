"""``deltackpt.save``: plan the state, write its new chunks, commit one manifest."""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from deltackpt._fsutil import store_lock
from deltackpt._plan import plan_state
from deltackpt._save import commit, write_chunks
from deltackpt.errors import SnapshotExistsError, StoreError
from deltackpt.options import SaveOptions
from deltackpt.store import SnapshotInfo, Store, open_store, validate_name


def save(
    state: Any,
    store: str | os.PathLike[str] | Store,
    name: str,
    *,
    metadata: dict[str, Any] | None = None,
    options: SaveOptions | None = None,
    **kwargs: Any,
) -> SnapshotInfo:
    """Save ``state`` as snapshot ``name`` of ``store`` and return its :class:`SnapshotInfo`.

    Only chunks the store does not already hold are written. The call returns after the manifest
    is committed (durable). Keyword options are the fields of :class:`SaveOptions`
    (``allow_pickle``, ``overwrite``, ``threads``, ``encoding``, ...). ``metadata`` is a small
    JSON-serialisable dict kept in the manifest (e.g. ``{"step": 100, "loss": 1.9}``).

    >>> info = deltackpt.save({"model": model.state_dict(), "step": 100}, "ckpts", "step-100")  # doctest: +SKIP
    >>> info.bytes_written, info.chunks_reused                                                 # doctest: +SKIP
    """
    t0 = time.perf_counter()
    opts = SaveOptions.from_kwargs(options, kwargs)
    st = open_store(store)
    validate_name(name)
    meta = _check_metadata(metadata)
    with store_lock(
        st.lock_path, exclusive=False, timeout=opts.lock_timeout, what=f"saving {name!r}"
    ):
        _check_free(st, name, opts)
        plan = plan_state(state, st.chunk_bytes, st.small_bytes, allow_pickle=opts.allow_pickle)
        arrays = [s.data.cpu().numpy() for s in plan.sources]
        with ThreadPoolExecutor(opts.threads, thread_name_prefix="deltackpt-save") as pool:
            wr = write_chunks(st, plan, arrays.__getitem__, opts, pool, st.chunk_index(), refs=None)
        blocked = time.perf_counter() - t0
        return commit(st, name, plan, wr, opts, meta, t0, blocked, 0.0)


def _check_free(st: Store, name: str, opts: SaveOptions) -> None:
    if not opts.overwrite and st.has(name):
        raise SnapshotExistsError(
            f"store {str(st.root)!r} already has a committed snapshot {name!r}; pick a new name "
            "or pass overwrite=True (the old one stays loadable until the new one commits)"
        )
    if not st.packs_dir.is_dir():
        raise StoreError(
            f"store {str(st.root)!r} has no packs/ directory; it is damaged or not a store"
        )


def _check_metadata(metadata: dict[str, Any] | None) -> dict[str, Any]:
    import json

    if metadata is None:
        return {}
    try:
        json.dumps(metadata, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise TypeError(
            f"metadata must be JSON-serialisable (str keys; str/int/float/bool/None/lists/dicts, "
            f"finite floats): {e}. Put tensors and objects in the state instead"
        ) from e
    return dict(metadata)

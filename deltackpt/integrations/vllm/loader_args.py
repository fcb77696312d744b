"""``load_format="deltackpt"``'s ``model_loader_extra_config``, checked and resolved without vLLM.

An engine started with ``--load-format deltackpt --model-loader-extra-config
'{"store": ..., "snapshot": ..., "key": ..., "follow": ...}'`` takes its weights from a snapshot
of a deltackpt store instead of the model directory's weight files (the directory still gives
the config). :func:`start_from` refuses a bad field before anything is read, with an
:class:`~deltackpt.errors.InvalidArgumentError` naming it, what it takes and the fix;
:func:`resolve` opens the store and names the snapshot to load. The loader itself is
:mod:`deltackpt.integrations.vllm.loader` (it imports vLLM; this module does not).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from deltackpt.errors import InvalidArgumentError, SnapshotNotFoundError
from deltackpt.store.store import Store, open_store

__all__ = ["FIELDS", "LATEST", "StartFrom", "resolve", "start_from"]

#: the snapshot name that means the store's newest committed snapshot when the engine starts
LATEST = "latest"
#: the fields of ``model_loader_extra_config`` and what each takes
FIELDS = {
    "store": "a store's directory or URL (required)",
    "snapshot": f"a snapshot name, or {LATEST!r} (the default): the newest committed one",
    "key": "where the state dict sits in the saved state ({'model': sd} -> 'model', the "
    "default), or null: the saved state is the state dict",
    "storage_options": "an object store's options (a mapping), or null",
    "follow": "true: keep the loaded copy for the worker extension's deltackpt_follow, whose "
    "first pull is then incremental (a host copy of the weights per worker); false (default)",
    "tp_boxes": "with follow: true to keep each worker's tensor-parallel boxes only (its share, "
    "for a deltackpt_follow(..., tp_boxes=True)), false the whole tensors, or null (default): "
    "the workers' DELTACKPT_VLLM_TP_BOXES",
}


@dataclass(frozen=True)
class StartFrom:
    """Where an engine's weights come from (see the module doc)."""

    store: str
    snapshot: str = LATEST
    key: str | None = "model"
    storage_options: dict[str, Any] | None = None
    follow: bool = False
    tp_boxes: bool | None = None  # None: the workers' DELTACKPT_VLLM_TP_BOXES


def _bad(field: str, value: Any) -> InvalidArgumentError:
    return InvalidArgumentError(
        f"load_format='deltackpt': model_loader_extra_config[{field!r}]={value!r:.80} is "
        f"invalid; expected {FIELDS[field]}"
    )


def start_from(extra: Any) -> StartFrom:
    """``model_loader_extra_config`` checked field by field (module doc)."""
    example = '{"store": "/ckpts/run", "snapshot": "latest"}'
    if not isinstance(extra, Mapping):
        raise InvalidArgumentError(
            f"load_format='deltackpt' needs model_loader_extra_config, a mapping such as "
            f"{example} (--model-loader-extra-config '{example}'); got {type(extra).__name__}"
        )
    unknown = sorted(set(extra) - set(FIELDS))
    if unknown:
        raise InvalidArgumentError(
            f"load_format='deltackpt': unknown model_loader_extra_config field(s) {unknown}; "
            f"the fields are {sorted(FIELDS)}"
        )
    if "store" not in extra:
        raise InvalidArgumentError(
            f"load_format='deltackpt': model_loader_extra_config has no 'store'; give the "
            f"store to start from, e.g. {example}"
        )
    store = extra["store"]
    if not isinstance(store, str) or not store.strip():
        raise _bad("store", store)
    snapshot = extra.get("snapshot", LATEST)
    if not isinstance(snapshot, str) or not snapshot:
        raise _bad("snapshot", snapshot)
    key = extra.get("key", "model")
    if key is not None and (not isinstance(key, str) or not key):
        raise _bad("key", key)
    options = extra.get("storage_options")
    if options is not None and not isinstance(options, Mapping):
        raise _bad("storage_options", options)
    follow = extra.get("follow", False)
    if not isinstance(follow, bool):
        raise _bad("follow", follow)
    boxes = extra.get("tp_boxes")
    if boxes is not None and not isinstance(boxes, bool):
        raise _bad("tp_boxes", boxes)
    options = None if options is None else dict(options)
    return StartFrom(store, snapshot, key, options, follow, boxes)


def resolve(start: StartFrom) -> tuple[Store, str]:
    """The store and the name of the snapshot to load: ``snapshot`` itself, or the newest
    committed one for :data:`LATEST`; :class:`~deltackpt.errors.SnapshotNotFoundError` when
    there is none (a missing store is the store's own error)."""
    store = open_store(start.store, create=False, storage_options=start.storage_options)
    names = store.names()  # committed, by commit order
    if start.snapshot == LATEST:
        if not names:
            raise SnapshotNotFoundError(
                f"load_format='deltackpt': store {start.store!r} has no committed snapshot to "
                "start from; save one first, or start from another store"
            )
        return store, names[-1]
    if not store.has(start.snapshot):
        shown = ", ".join(repr(n) for n in names[-5:]) or "none"
        raise SnapshotNotFoundError(
            f"load_format='deltackpt': store {start.store!r} has no snapshot "
            f"{start.snapshot!r} (its newest: {shown}); name one of them or {LATEST!r}"
        )
    return store, start.snapshot

"""Load step 3: assemble. ``deltackpt.load`` reads a committed snapshot into new tensors, or into
the tensors of ``into=`` (strict checks first), and sets its non-tensor values.

Which bytes each entry needs is :mod:`deltackpt.loading.plan` (step 1), reading, decoding and
verifying them is :mod:`deltackpt.store.chunks` (step 2). This module decides what is read where
(new buffers, the caller's tensors in place, a tied storage's home), copies what could not be read
in place, restores ``Parameter``/``requires_grad``, the values DCP stored as bytes and the tree.
A snapshot whose pack gc compaction removed while we read is read again once, from its
repointed manifest.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from typing import Any

import torch

from deltackpt.errors import (
    CorruptChunkError,
    DistributedError,
    InsufficientMemoryError,
    InvalidArgumentError,
    StateMismatchError,
)
from deltackpt.format.dcp_nesting import nested_manifest
from deltackpt.format.dcp_values import decode_byte_values
from deltackpt.format.dtensor import is_dtensor, local_tensor
from deltackpt.format.dtypes import dtype_from_name
from deltackpt.format.manifest import Manifest, TensorEntry
from deltackpt.format.tree import Node, _key_segment, flatten, tensor_paths, unflatten, value_leaves
from deltackpt.loading.homes import storage_homes
from deltackpt.loading.plan import Reads, copy_into, read_entry
from deltackpt.loading.select import KeySelection, Select, key_filter, prune_tree
from deltackpt.loading.stats import LoadStats, pack_readers
from deltackpt.loading.to_device import device_items, move_tensors, read_to_device, takes
from deltackpt.options import LoadOptions, default_device_scan
from deltackpt.store.store import LATEST, Store, open_store


def load(
    store: str | os.PathLike[str] | Store,
    name: str = LATEST,
    *,
    into: Any = None,
    options: LoadOptions | None = None,
    process_group: Any = None,
    keys: KeySelection = None,
    stats: LoadStats | None = None,
    **kwargs: Any,
) -> Any:
    """One process's load of snapshot ``name``: the ``all_ranks`` path of the public
    :func:`deltackpt.load` (``deltackpt/distributed/load.py``, which documents the arguments and adds
    ``mode=``). Every rank reads the saved pieces overlapping its own ``into`` shards (or the
    whole state without ``into``); ``process_group`` makes every rank raise if any rank fails;
    ``keys`` filters before any planning or read (:mod:`deltackpt.loading.select`); ``stats``
    (a :class:`~deltackpt.loading.stats.LoadStats`) counts what was read.
    """
    opts = LoadOptions.from_kwargs(options, kwargs)
    select = key_filter(keys)
    check_into(into, "load")
    if process_group is not None:
        again = lambda: load(store, name, into=into, options=opts, keys=keys, stats=stats)  # noqa: E731
        return _agree(process_group, again)
    st = open_store(store, create=False)
    return _retrying(st, st.manifest(name), lambda m: _load_once(st, m, into, opts, select, stats))


def check_into(into: Any, what: str) -> None:
    """Refuse an ``into=`` that cannot be loaded into in place (an int, a string, a module)
    where it is given, naming what to pass, instead of a key mismatch at the first read."""
    if into is None or isinstance(into, (dict, list, tuple, torch.Tensor)):
        return
    hint = (
        f" Pass into={type(into).__name__.lower()}.state_dict(): its tensors share the "
        "parameters' memory, so they are loaded in place"
        if callable(getattr(into, "state_dict", None))
        else ""
    )
    raise InvalidArgumentError(
        f"{what}(into={into!r:.60}) is invalid: expected the state to load into in place (a "
        f"dict, list or tuple of tensors and values, or a tensor), got {type(into).__name__}."
        + hint
    )


def load_reusing(
    store: str | os.PathLike[str] | Store,
    name: str,
    reuse: Any,
    *,
    options: LoadOptions | None = None,
) -> Any:
    """Load snapshot ``name`` as :func:`load` does without ``into``, but read every tensor that
    ``reuse`` holds at the same key path, with the same shape and dtype, *in place* and return
    that very tensor in the result; only the others are allocated.

    Used by ``Checkpointer.restore_latest``: the state dicts of live modules and optimizers are
    the ``reuse`` tree, so a resume needs no second copy of the state (peak memory = the state
    plus reader buffers, plus whatever the live objects do not hold yet, such as the moments of
    a fresh optimizer).

    A DTensor of ``reuse`` (FSDP2, tensor parallel) receives only its own box, read from the
    saved pieces that overlap it, whatever placements and world size saved the snapshot; it
    comes back as itself, so ``load_state_dict`` sees DTensors where the live object has them."""
    opts = options or LoadOptions()
    st = open_store(store, create=False)
    _, leaves = flatten(reuse, allow_pickle=True, check_tensors=False)
    targets = {leaf.path: leaf.tensor for leaf in leaves}

    def once(m: Manifest) -> Any:
        wanted = [
            i
            for i, e in enumerate(m.tensors)
            if (e.storage is None or is_dtensor(targets.get(e.path)))
            and _reusable(targets.get(e.path), e)
        ]
        rest = _to_device(st, m, opts, wanted, targets, None)  # GPU targets: pinned buckets
        with torch.no_grad():
            for i, t in _read_entries(st, m, opts, rest, targets).items():
                dst = targets[m.tensors[i].path]
                if t is not dst:
                    copy_into(dst, t, m.tensors[i].path)
        return _load_new(st, m, opts, {i: targets[m.tensors[i].path] for i in wanted})

    return _retrying(st, st.manifest(name), once)


def _reusable(t: Any, e: TensorEntry) -> bool:
    return (
        isinstance(t, torch.Tensor)
        and not (local_tensor(t) if is_dtensor(t) else t).is_meta
        and tuple(t.shape) == e.shape
        and t.dtype == dtype_from_name(e.dtype)
    )


def _retrying(st: Store, m: Manifest, fn: Callable[[Manifest], Any], tries: int = 4) -> Any:
    """``fn(m)``, read again from a fresh manifest when a pack it names went missing meanwhile.

    gc compaction repoints manifests before deleting the old pack, and retention may then delete
    the snapshot itself (manifest first, packs after): re-reading the manifest either finds the
    repointed one (read again, a bounded number of times) or none (SnapshotNotFoundError, which
    a follower takes as "the newest went meanwhile"). Real damage fails again with the same
    manifest and raises the CorruptChunkError."""
    for attempt in range(tries):
        try:
            return fn(m)
        except CorruptChunkError as e:
            if not e.missing_pack:
                raise
            fresh = st.manifest(m.name)  # SnapshotNotFoundError if retention deleted it
            if fresh is m or attempt == tries - 1:
                raise
            m = fresh
    raise AssertionError("unreachable")


def _load_once(
    st: Store,
    m: Manifest,
    into: Any,
    opts: LoadOptions,
    select: Select | None = None,
    stats: LoadStats | None = None,
) -> Any:
    m = nested_manifest(m)  # a DCP-written snapshot: the nesting DCP flattened
    if into is None:
        return _load_new(st, m, opts, select=select, stats=stats)
    _load_into(st, m, into, opts, select, stats)
    return into


def _agree(pg: Any, fn: Callable[[], Any]) -> Any:
    """Run ``fn`` on every rank; if any rank fails, every rank raises (no rank hangs or goes on
    with a half-loaded state while its peers stopped)."""
    import torch.distributed as dist

    try:
        result, err = fn(), None
    except Exception as e:
        result, err = None, e
    errors: list[Any] = [None] * dist.get_world_size(pg)
    try:  # bounded by the process group's timeout, like every wait for a peer
        dist.all_gather_object(errors, f"{type(err).__name__}: {err}" if err else None, group=pg)
    except Exception as e:
        raise DistributedError(
            f"load: the collective that agrees on the outcome failed on rank "
            f"{dist.get_rank(pg)} of {len(errors)} ({type(e).__name__}: {e}); a peer rank died or "
            "the process group's timeout passed. This rank's state may be partly loaded: load "
            "again once every rank is up"
        ) from (err or e)
    if err is not None:
        raise err
    failed = [(r, e) for r, e in enumerate(errors) if e]
    if failed:
        raise DistributedError(
            f"load failed on other ranks: {failed[:4]}; this rank's state may be partly loaded"
        )
    return result


def _physical_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 1 << 62


def _check_memory(m: Manifest, provided: dict[int, torch.Tensor], wanted: set[int]) -> None:
    """Refuse, before allocating, a load that needs more memory than the machine has (the
    manifest's sizes are validated, but a valid manifest may still describe huge tensors)."""
    sids = {e.storage.id for i, e in enumerate(m.tensors) if i in wanted and e.storage}
    need = sum(m.storages[sid][0] for sid in sids)
    for i, e in enumerate(m.tensors):
        if i in provided or i not in wanted:
            continue
        if e.data is not None:
            need += e.nbytes
        elif e.shards is not None:
            need += math.prod(e.shape) * dtype_from_name(e.dtype).itemsize
    have = _physical_memory()
    if need > have:
        raise InsufficientMemoryError(
            f"snapshot {m.name!r} holds {need} bytes of tensors, more than this machine's "
            f"{have} bytes of memory; load parts of it with into= (in place, strict=False), "
            "or on a larger machine"
        )


def _read_entries(
    st: Store,
    m: Manifest,
    opts: LoadOptions,
    wanted: list[int],
    targets: dict[str, torch.Tensor] | None = None,
    stats: LoadStats | None = None,
) -> dict[int, torch.Tensor]:
    """One read pass over the entries ``wanted`` (indices into ``m.tensors``): new tensors, or
    with ``targets`` (by key path) the tensors to read in place where they can be (see
    :func:`~deltackpt.loading.plan.read_entry`; the caller copies the others in)."""
    r = Reads(m)
    if targets is None:  # every shared storage read becomes one new buffer its views share
        for sid in sorted({e.storage.id for i in wanted if (e := m.tensors[i]).storage}):
            r.storage(sid, f"<storage of {len(m.storages[sid][1])} slices>")
    else:
        r.homes = storage_homes(m, wanted, targets)
    out = {
        i: read_entry(r, m.tensors[i], None if targets is None else targets[m.tensors[i].path])
        for i in wanted
    }
    with pack_readers(st, stats) as packs:
        r.run(packs, opts.verify, opts.threads, "deltackpt-load")
    if stats is not None:
        stats.chunks_read += len(r.jobs)
    return out


def _to_device(
    st: Store,
    m: Manifest,
    opts: LoadOptions,
    wanted: list[int],
    targets: dict[str, torch.Tensor],
    stats: LoadStats | None,
) -> list[int]:
    """Fill the targets in device memory that take their saved bytes as they are (whole
    tensors, and DTensors' leading-row boxes: loading/to_device.py) through pinned buckets;
    returns the wanted entries left to the general way (read, then ``copy_``)."""
    items = device_items(m, wanted, targets, default_device_scan() == "always")
    if not items:
        return wanted
    _read_to_device(st, m, opts, [(e, t) for _, e, t in items], stats)
    done = {i for i, _, _ in items}
    return [i for i in wanted if i not in done]


def _read_to_device(
    st: Store,
    m: Manifest,
    opts: LoadOptions,
    items: list[tuple[TensorEntry, torch.Tensor]],
    stats: LoadStats | None,
) -> None:
    with torch.no_grad(), pack_readers(st, stats) as packs:
        jobs = read_to_device(packs, m, items, opts.verify, opts.threads)
    if stats is not None:
        stats.chunks_read += jobs


def _load_new(
    st: Store,
    m: Manifest,
    opts: LoadOptions,
    provided: dict[int, torch.Tensor] | None = None,
    select: Select | None = None,
    stats: LoadStats | None = None,
) -> Any:
    """The snapshot (its ``select``-ed leaves) as new CPU tensors; tensors in ``provided`` (by
    index, already filled) are used as they are instead of being read."""
    provided = provided or {}
    tree, wanted = (m.tree, set(range(len(m.tensors))))
    if select is not None:
        tree, wanted = prune_tree(m.tree, select)
    _check_memory(m, provided, wanted)
    todo = [i for i in sorted(wanted) if i not in provided]
    direct: dict[int, torch.Tensor] = {}
    dev = None if opts.device is None else torch.device(opts.device)
    if dev is not None:  # whole tensors straight into new device tensors (map_location)
        forced = default_device_scan() == "always"
        for i in todo:
            e = m.tensors[i]
            if e.data is not None and e.storage is None and math.prod(e.shape):
                t = torch.empty(e.shape, dtype=dtype_from_name(e.dtype), device=dev)
                if takes(e, t, forced):
                    direct[i] = t
        if direct:
            _read_to_device(st, m, opts, [(m.tensors[i], t) for i, t in direct.items()], stats)
    new = _read_entries(st, m, opts, [i for i in todo if i not in direct], None, stats)
    if dev is not None:  # the rest (views of shared storages, saved blocks): moved, ties kept
        new = move_tensors(new, dev)
    new.update(direct)
    tensors = [
        provided[i] if i in provided else _finish(new[i], e) if i in new else None
        for i, e in enumerate(m.tensors)
    ]
    decode_byte_values(m, tensors, opts.allow_pickle)  # values DCP stored as torch.save bytes
    return unflatten(tree, tensors.__getitem__, allow_pickle=opts.allow_pickle)


def _finish(t: torch.Tensor, e: TensorEntry) -> torch.Tensor:
    if e.parameter:
        return torch.nn.Parameter(t, requires_grad=e.requires_grad)
    if e.requires_grad:
        t.requires_grad_(True)
    return t


def _load_into(
    st: Store,
    m: Manifest,
    into: Any,
    opts: LoadOptions,
    select: Select | None = None,
    stats: LoadStats | None = None,
) -> None:
    _, leaves = flatten(into, allow_pickle=True, check_tensors=False)
    targets = {leaf.path: leaf.tensor for leaf in leaves if select is None or select(leaf.path)}
    saved = {e.path: i for i, e in enumerate(m.tensors) if select is None or select(e.path)}
    _check_into(m, into, targets, saved, opts, select)

    # Device targets that take the saved bytes as they are: through pinned buckets
    # (loading/to_device.py). The rest: read into fresh buffers (or straight into CPU
    # targets), then copy_.
    wanted = [i for p, i in saved.items() if p in targets]
    wanted = _to_device(st, m, opts, wanted, targets, stats)
    new = _read_entries(st, m, opts, wanted, targets, stats)
    with torch.no_grad():
        for i, t in new.items():
            dst = targets[m.tensors[i].path]
            if t is not dst:
                copy_into(dst, t, m.tensors[i].path)
    _assign_values(m.tree, into, opts, select)


def _check_into(
    m: Manifest,
    into: Any,
    targets: dict[str, Any],
    saved: dict[str, int],
    opts: LoadOptions,
    select: Select | None = None,
) -> None:
    """Raise :class:`StateMismatchError` listing what differs between ``into`` and ``m``."""
    missing = sorted(set(targets) - set(saved))
    unexpected = sorted(set(saved) - set(targets))
    problems = []
    for path in sorted(set(targets) & set(saved)):
        e, t = m.tensors[saved[path]], targets[path]
        if tuple(t.shape) != e.shape or t.dtype != dtype_from_name(e.dtype):
            problems.append(
                f"{path!r}: snapshot has {e.dtype}{list(e.shape)}, target has "
                f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)}"
            )
        elif t.is_meta or (is_dtensor(t) and local_tensor(t).is_meta):
            problems.append(
                f"{path!r}: the target is a meta tensor, which has no memory to load into "
                "(materialise it first, e.g. module.to_empty(device='cpu'))"
            )
    # A key both sides have, with a tensor on one side and a plain value on the other, is a
    # mismatch even with strict=False: skipping it would leave the target silently unfilled.
    values = {
        p: f"the value {n!r:.40}" if not isinstance(n, dict) else f"a {next(iter(n))} value"
        for p, n in value_leaves(m.tree)
        if select is None or select(p)
    }
    for path in missing:
        if path in values:
            problems.append(f"{path!r}: snapshot holds {values[path]}, target holds a tensor")
    target_values = {
        p: v for p, v in _target_value_paths(into).items() if select is None or select(p)
    }
    for path in unexpected:
        if path in target_values:
            problems.append(
                f"{path!r}: snapshot holds a tensor, target holds {target_values[path]}"
            )
    if problems or (opts.strict and (missing or unexpected)):
        parts = []
        if problems:
            parts.append("shape/dtype/kind differ for " + "; ".join(problems[:10]))
        if opts.strict and missing:
            parts.append(f"keys in the target but not in the snapshot: {missing[:10]}")
        if opts.strict and unexpected:
            parts.append(f"keys in the snapshot but not in the target: {unexpected[:10]}")
        raise StateMismatchError(
            f"cannot load snapshot {m.name!r} into the given state: "
            + "; ".join(parts)
            + ". Fix the target, or pass strict=False to load only the keys both have"
        )


def _assign_values(
    tree: Node, target: Any, opts: LoadOptions, select: Select | None = None, path: str = ""
) -> None:
    """Set the snapshot's non-tensor values (step counters, lr, ...) into ``target`` in place;
    with ``select``, only the values at the key paths it selects."""
    if not isinstance(tree, dict):
        return
    sub = lambda seg: f"{path}/{seg}" if path else seg  # noqa: E731
    if ("dict" in tree or "odict" in tree) and isinstance(target, dict):
        for k_node, v_node in tree.get("dict") or tree.get("odict"):
            k = unflatten(k_node, _no_tensor, opts.allow_pickle)
            if _descend(v_node, select, sub(_key_segment(k))):
                if k in target:
                    _assign_values(v_node, target[k], opts, select, sub(_key_segment(k)))
            elif select is None or select(sub(_key_segment(k))):
                target[k] = unflatten(v_node, _no_tensor, opts.allow_pickle)
    elif "list" in tree and isinstance(target, list):
        for i, v_node in enumerate(tree["list"]):
            if _descend(v_node, select, sub(str(i))):
                if i < len(target):
                    _assign_values(v_node, target[i], opts, select, sub(str(i)))
            elif select is not None and not select(sub(str(i))):
                continue
            elif i < len(target):
                target[i] = unflatten(v_node, _no_tensor, opts.allow_pickle)
            else:
                target.append(unflatten(v_node, _no_tensor, opts.allow_pickle))
    elif "tuple" in tree and isinstance(target, tuple):
        for i, (v_node, t) in enumerate(zip(tree["tuple"], target, strict=False)):
            _assign_values(v_node, t, opts, select, sub(str(i)))


def _target_value_paths(obj: Any, path: str = "", depth: int = 0) -> dict[str, str]:
    """Key path -> type name of every non-tensor, non-container value in a load target."""
    if isinstance(obj, torch.Tensor):
        return {}
    if isinstance(obj, dict):
        out: dict[str, str] = {}
        for k, v in obj.items():
            seg = _key_segment(k)
            out.update(_target_value_paths(v, f"{path}/{seg}" if path else seg, depth + 1))
        return out
    if isinstance(obj, (list, tuple)) and depth < 100:
        out = {}
        for i, v in enumerate(obj):
            out.update(_target_value_paths(v, f"{path}/{i}" if path else str(i), depth + 1))
        return out
    return {path or ".": f"a {type(obj).__name__}"}


def _no_tensor(i: int) -> torch.Tensor:
    raise AssertionError("unreachable: value subtree has no tensors")


def _descend(node: Node, select: Select | None, path: str) -> bool:
    """Assign ``node`` value by value (it holds tensors, or ``select`` keeps only part of it)."""
    if _has_tensor(node):
        return True
    nested = isinstance(node, dict) and any(t in node for t in ("dict", "odict", "list", "tuple"))
    return select is not None and nested and not select(path)


def _has_tensor(node: Node) -> bool:
    return bool(tensor_paths(node)) if isinstance(node, dict) else False

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
    StateMismatchError,
)
from deltackpt.format.dcp_values import decode_byte_values
from deltackpt.format.dtensor import is_dtensor, local_box, local_tensor
from deltackpt.format.dtypes import dtype_from_name
from deltackpt.format.manifest import Manifest, TensorEntry
from deltackpt.format.tree import Node, _key_segment, flatten, tensor_paths, unflatten, value_leaves
from deltackpt.loading.plan import Reads, plain_cpu, read_entry
from deltackpt.options import LoadOptions
from deltackpt.store.store import LATEST, Store, open_store


def load(
    store: str | os.PathLike[str] | Store,
    name: str = LATEST,
    *,
    into: Any = None,
    options: LoadOptions | None = None,
    process_group: Any = None,
    **kwargs: Any,
) -> Any:
    """Load snapshot ``name`` (default: the latest committed one).

    Without ``into`` it returns the state with new CPU tensors, bit-exact, nesting and tied
    storages restored. With ``into`` it copies the snapshot into the existing tensors of ``into``
    (matched by key path, in place, any device) and sets its non-tensor values; with
    ``strict=True`` (default) the keys, shapes and dtypes must match exactly. Every chunk is
    checked against its digest unless ``verify=False``.

    Each rank of a job passes its own ``into`` (DTensors of any placement and mesh, or plain
    tensors) and reads only the saved pieces overlapping its shards, whatever world size saved
    them; ``process_group`` makes every rank raise if any rank fails.

    >>> state = deltackpt.load("ckpts")                                  # doctest: +SKIP
    >>> deltackpt.load("ckpts", "step-100", into={"model": model.state_dict()})  # doctest: +SKIP
    """
    opts = LoadOptions.from_kwargs(options, kwargs)
    if process_group is not None:
        return _agree(process_group, lambda: load(store, name, into=into, options=opts))
    st = open_store(store, create=False)
    return _retrying(st, st.manifest(name), lambda m: _load_once(st, m, into, opts))


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
    a fresh optimizer)."""
    opts = options or LoadOptions()
    st = open_store(store, create=False)
    _, leaves = flatten(reuse, allow_pickle=True, check_tensors=False)
    targets = {leaf.path: leaf.tensor for leaf in leaves}

    def once(m: Manifest) -> Any:
        wanted = [
            i
            for i, e in enumerate(m.tensors)
            if e.storage is None and _reusable(targets.get(e.path), e)
        ]
        with torch.no_grad():
            for i, t in _read_entries(st, m, opts, wanted, targets).items():
                dst = targets[m.tensors[i].path]
                if t is not dst:
                    dst.copy_(t)
        return _load_new(st, m, opts, {i: targets[m.tensors[i].path] for i in wanted})

    return _retrying(st, st.manifest(name), once)


def _reusable(t: Any, e: TensorEntry) -> bool:
    return (
        isinstance(t, torch.Tensor)
        and not is_dtensor(t)
        and not t.is_meta
        and tuple(t.shape) == e.shape
        and t.dtype == dtype_from_name(e.dtype)
    )


def _retrying(st: Store, m: Manifest, fn: Callable[[Manifest], Any]) -> Any:
    try:
        return fn(m)
    except CorruptChunkError as e:
        # gc compaction repoints manifests before deleting the old pack: if ours moved while we
        # read, read the new one once. Real damage fails again with the same error.
        if not e.missing_pack:
            raise
        fresh = st.manifest(m.name)
        if fresh is m:
            raise
        return fn(fresh)


def _load_once(st: Store, m: Manifest, into: Any, opts: LoadOptions) -> Any:
    if into is None:
        return _load_new(st, m, opts)
    _load_into(st, m, into, opts)
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
    dist.all_gather_object(errors, f"{type(err).__name__}: {err}" if err else None, group=pg)
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


def _check_memory(m: Manifest, provided: dict[int, torch.Tensor]) -> None:
    """Refuse, before allocating, a load that needs more memory than the machine has (the
    manifest's sizes are validated, but a valid manifest may still describe huge tensors)."""
    need = sum(n for n, _ in m.storages)
    for i, e in enumerate(m.tensors):
        if i in provided:
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
) -> dict[int, torch.Tensor]:
    """One read pass over the entries ``wanted`` (indices into ``m.tensors``): new tensors, or
    with ``targets`` (by key path) the tensors to read in place where they can be (see
    :func:`~deltackpt.loading.plan.read_entry`; the caller copies the others in)."""
    r = Reads(m)
    if targets is None:  # every shared storage becomes one new buffer its views share
        for sid, (_, data) in enumerate(m.storages):
            r.storage(sid, f"<storage of {len(data)} slices>")
    else:
        r.homes = _storage_homes(m, wanted, targets)
    out = {
        i: read_entry(r, m.tensors[i], None if targets is None else targets[m.tensors[i].path])
        for i in wanted
    }
    with st.pack_readers() as packs:
        r.run(packs, opts.verify, opts.threads, "deltackpt-load")
    return out


def _load_new(
    st: Store, m: Manifest, opts: LoadOptions, provided: dict[int, torch.Tensor] | None = None
) -> Any:
    """The snapshot as new CPU tensors; tensors in ``provided`` (by index, already filled) are
    used as they are instead of being read."""
    provided = provided or {}
    _check_memory(m, provided)
    new = _read_entries(st, m, opts, [i for i in range(len(m.tensors)) if i not in provided])
    tensors = [
        provided[i] if i in provided else _finish(new[i], e)  # provided: the caller's own
        for i, e in enumerate(m.tensors)
    ]
    decode_byte_values(m, tensors, opts.allow_pickle)  # values DCP stored as torch.save bytes
    return unflatten(m.tree, tensors.__getitem__, allow_pickle=opts.allow_pickle)


def _finish(t: torch.Tensor, e: TensorEntry) -> torch.Tensor:
    if e.parameter:
        return torch.nn.Parameter(t, requires_grad=e.requires_grad)
    if e.requires_grad:
        t.requires_grad_(True)
    return t


def _load_into(st: Store, m: Manifest, into: Any, opts: LoadOptions) -> None:
    _, leaves = flatten(into, allow_pickle=True, check_tensors=False)
    targets = {leaf.path: leaf.tensor for leaf in leaves}
    saved = {e.path: i for i, e in enumerate(m.tensors)}
    _check_into(m, into, targets, saved, opts)

    # Read every needed tensor into fresh buffers (or straight into CPU targets), then copy_.
    wanted = [i for p, i in saved.items() if p in targets]
    new = _read_entries(st, m, opts, wanted, targets)
    with torch.no_grad():
        for i, t in new.items():
            dst = targets[m.tensors[i].path]
            if t is dst:
                continue
            if is_dtensor(dst):  # saved as one shared storage: copy this rank's part
                offsets, shape = local_box(dst, m.tensors[i].path)
                for d, (o, n) in enumerate(zip(offsets, shape, strict=True)):
                    t = t.narrow(d, o, n)
                local_tensor(dst).copy_(t)
            else:
                dst.copy_(t)
    _assign_values(m.tree, into, opts)


def _check_into(
    m: Manifest, into: Any, targets: dict[str, Any], saved: dict[str, int], opts: LoadOptions
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
    }
    for path in missing:
        if path in values:
            problems.append(f"{path!r}: snapshot holds {values[path]}, target holds a tensor")
    target_values = _target_value_paths(into)
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


def _storage_homes(
    m: Manifest, wanted: list[int], targets: dict[str, torch.Tensor]
) -> dict[int, torch.Tensor]:
    """Per shared storage the ``wanted`` entries view, a target that can receive all of its
    bytes in place (a tied embedding loaded into the same model): no fresh buffer, no copy_."""
    users: dict[int, list[int]] = {}
    for i in wanted:
        sv = m.tensors[i].storage
        if sv is not None:
            users.setdefault(sv.id, []).append(i)
    homes = {}
    for sid, us in users.items():
        home = _storage_home(m, sid, us, targets)
        if home is not None:
            homes[sid] = home
    return homes


def _covers_storage(t: torch.Tensor, e: TensorEntry, nbytes: int) -> bool:
    """``t`` (the target of a tensor saved as a view of a shared storage) can receive the whole
    storage's bytes: a contiguous CPU tensor exactly as large, and the saved view is the whole
    storage in C order (so ``t`` equals the view once the bytes are in)."""
    assert e.storage is not None
    return (
        plain_cpu(t)
        and t.is_contiguous()
        and t.numel() * t.element_size() == nbytes
        and nbytes > 0
        # views of every dtype must start on an element boundary of the bytes read in place
        and t.storage_offset() * t.element_size() % 16 == 0
        and e.storage.offset == 0
        and tuple(e.storage.stride) == tuple(torch.empty(e.shape, device="meta").stride())
    )


def _storage_home(
    m: Manifest, sid: int, users: list[int], targets: dict[str, torch.Tensor]
) -> torch.Tensor | None:
    """A target that can receive the whole shared storage ``sid`` in place, or None. Refused
    when another target of the storage overlaps it other than as the very view the snapshot
    describes: reading in place would then change the bytes that target is copied from."""
    n = m.storages[sid][0]
    for k in users:
        home = targets[m.tensors[k].path]
        if not _covers_storage(home, m.tensors[k], n):
            continue
        base = home.untyped_storage().data_ptr()
        ok = True
        for j in users:
            t, sv = targets[m.tensors[j].path], m.tensors[j].storage
            assert sv is not None
            if is_dtensor(t) or t.device.type != "cpu" or t.untyped_storage().data_ptr() != base:
                continue  # separate memory: copied into after the read
            if not (
                t.data_ptr() == home.data_ptr() + sv.offset
                and tuple(t.shape) == m.tensors[j].shape
                and tuple(t.stride()) == tuple(sv.stride)
            ):
                ok = False
                break
        if ok:
            return home
    return None


def _assign_values(tree: Node, target: Any, opts: LoadOptions) -> None:
    """Set the snapshot's non-tensor values (step counters, lr, ...) into ``target`` in place."""
    if not isinstance(tree, dict):
        return
    if ("dict" in tree or "odict" in tree) and isinstance(target, dict):
        for k_node, v_node in tree.get("dict") or tree.get("odict"):
            k = unflatten(k_node, _no_tensor, opts.allow_pickle)
            if _has_tensor(v_node):
                if k in target:
                    _assign_values(v_node, target[k], opts)
            else:
                target[k] = unflatten(v_node, _no_tensor, opts.allow_pickle)
    elif "list" in tree and isinstance(target, list):
        for i, v_node in enumerate(tree["list"]):
            if _has_tensor(v_node):
                if i < len(target):
                    _assign_values(v_node, target[i], opts)
            elif i < len(target):
                target[i] = unflatten(v_node, _no_tensor, opts.allow_pickle)
            else:
                target.append(unflatten(v_node, _no_tensor, opts.allow_pickle))
    elif "tuple" in tree and isinstance(target, tuple):
        for v_node, t in zip(tree["tuple"], target, strict=False):
            _assign_values(v_node, t, opts)


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


def _has_tensor(node: Node) -> bool:
    return bool(tensor_paths(node)) if isinstance(node, dict) else False

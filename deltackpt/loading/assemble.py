"""``deltackpt.load``: read a committed snapshot into new tensors or into existing ones."""

from __future__ import annotations

import math
import os
from typing import Any

import numpy as np
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
from deltackpt.format.manifest import Manifest, Slice, TensorEntry
from deltackpt.format.tree import Node, _key_segment, flatten, tensor_paths, unflatten, value_leaves
from deltackpt.loading.reshard import PieceRead, finish_box_reads, plan_box_reads
from deltackpt.options import LoadOptions
from deltackpt.store.chunks import ChunkTargets, advise_huge, fresh_u8, run_jobs
from deltackpt.store.packs import PackReaders
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
            for i, t in _read_selected(st, m, wanted, targets, opts).items():
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


def _retrying(st: Store, m: Manifest, fn: Any) -> Any:
    try:
        return fn(m)
    except CorruptChunkError as e:
        # gc compaction repoints manifests before deleting the old pack: if ours moved while we
        # read, read the new one once. Real damage fails again with the same error.
        if not isinstance(e.__cause__, FileNotFoundError) and "is missing" not in str(e):
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


def _agree(pg: Any, fn: Any) -> Any:
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


def _slice_jobs(
    m: Manifest, dests: list[tuple[str, tuple[Slice, ...], np.ndarray]]
) -> list[ChunkTargets]:
    jobs: dict[str, ChunkTargets] = {}
    for path, slices, dst in dests:
        pos = 0
        for d, start, length in slices:
            job = jobs.get(d)
            if job is None:
                job = jobs[d] = ChunkTargets(d, where=f"snapshot {m.name!r} key {path!r}")
            job.targets.append((start, length, dst[pos : pos + length]))
            pos += length
    return list(jobs.values())


def _run(st: Store, m: Manifest, jobs: list[ChunkTargets], opts: LoadOptions) -> None:
    with PackReaders(st.packs_dir) as packs:
        run_jobs(packs, m.chunks, jobs, opts.verify, opts.threads, "deltackpt-load")


def _u8(n: int) -> torch.Tensor:
    return fresh_u8(n)


def _np(t: torch.Tensor) -> np.ndarray:
    return t.numpy() if t.numel() else np.empty(0, dtype=np.uint8)


def _typed(u8: torch.Tensor, e: TensorEntry) -> torch.Tensor:
    dtype = dtype_from_name(e.dtype)
    if u8.numel() == 0:
        return torch.empty(e.shape, dtype=dtype)
    return u8.view(dtype).reshape(e.shape)


def _finish(t: torch.Tensor, e: TensorEntry) -> torch.Tensor:
    if e.parameter:
        return torch.nn.Parameter(t, requires_grad=e.requires_grad)
    if e.requires_grad:
        t.requires_grad_(True)
    return t


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


def _load_new(
    st: Store, m: Manifest, opts: LoadOptions, provided: dict[int, torch.Tensor] | None = None
) -> Any:
    """The snapshot as new CPU tensors; tensors in ``provided`` (by index, already filled) are
    used as they are instead of being read."""
    provided = provided or {}
    _check_memory(m, provided)
    dests: list[tuple[str, tuple[Slice, ...], np.ndarray]] = []
    storages = [_u8(n) for n, _ in m.storages]
    for (_, data), buf in zip(m.storages, storages, strict=True):
        dests.append((f"<storage of {len(data)} slices>", data, _np(buf)))
    whole: list[torch.Tensor | None] = []
    box_reads: list[tuple[list[PieceRead], torch.Tensor]] = []
    for i, e in enumerate(m.tensors):
        if i in provided:
            whole.append(None)
        elif e.data is not None:
            buf = _u8(e.nbytes)
            dests.append((e.path, e.data, _np(buf)))
            whole.append(buf)
        elif e.shards is not None:
            full = advise_huge(torch.empty(e.shape, dtype=dtype_from_name(e.dtype)))
            reads = plan_box_reads(e, full, ((0,) * len(e.shape), e.shape))
            dests.extend((e.path, r.slices, r.buf) for r in reads)
            box_reads.append((reads, full))
            whole.append(full)
        else:
            whole.append(None)
    _run(st, m, _slice_jobs(m, dests), opts)
    for reads, full in box_reads:
        finish_box_reads(reads, full.dtype)

    tensors: list[torch.Tensor] = []
    for i, (e, buf) in enumerate(zip(m.tensors, whole, strict=True)):
        dtype = dtype_from_name(e.dtype)
        if i in provided:
            tensors.append(provided[i])  # already filled in place: the caller's own tensor
            continue
        if e.shards is not None and buf is not None:
            t = buf
        elif buf is not None:
            t = _typed(buf, e)
        elif e.storage is not None:
            size = torch.empty(0, dtype=dtype).element_size()
            t = torch.empty(0, dtype=dtype).set_(
                storages[e.storage.id].untyped_storage(),
                e.storage.offset // size,
                e.shape,
                e.storage.stride,
            )
        else:
            t = torch.empty(e.shape, dtype=dtype)
        tensors.append(_finish(t, e))
    decode_byte_values(m, tensors, opts.allow_pickle)  # values DCP stored as torch.save bytes
    return unflatten(m.tree, tensors.__getitem__, allow_pickle=opts.allow_pickle)


def _load_into(st: Store, m: Manifest, into: Any, opts: LoadOptions) -> None:
    _, leaves = flatten(into, allow_pickle=True, check_tensors=False)
    targets = {leaf.path: leaf.tensor for leaf in leaves}
    saved = {e.path: i for i, e in enumerate(m.tensors)}
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

    # Read every needed tensor into fresh buffers (or straight into CPU targets), then copy_.
    wanted = [i for p, i in saved.items() if p in targets]
    new = _read_selected(st, m, wanted, targets, opts)
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


def _read_selected(
    st: Store, m: Manifest, wanted: list[int], targets: dict[str, torch.Tensor], opts: LoadOptions
) -> dict[int, torch.Tensor]:
    dests: list[tuple[str, tuple[Slice, ...], np.ndarray]] = []
    storage_bufs: dict[int, torch.Tensor] = {}
    out: dict[int, torch.Tensor] = {}
    box_reads: list[tuple[list[PieceRead], torch.dtype]] = []
    storage_users: dict[int, list[int]] = {}
    for i in wanted:
        sv = m.tensors[i].storage
        if sv is not None:
            storage_users.setdefault(sv.id, []).append(i)
    for i in wanted:
        e = m.tensors[i]
        dst = targets[e.path]
        if is_dtensor(dst) and e.storage is None:
            # Each rank reads only the rows of the saved pieces that overlap its own shard.
            reads = plan_box_reads(e, local_tensor(dst), local_box(dst, e.path))
            dests.extend((e.path, r.slices, r.buf) for r in reads)
            box_reads.append((reads, dst.dtype))
            out[i] = dst
        elif e.shards is not None:
            full = advise_huge(torch.empty(e.shape, dtype=dtype_from_name(e.dtype)))
            reads = plan_box_reads(e, full, ((0,) * len(e.shape), e.shape))
            dests.extend((e.path, r.slices, r.buf) for r in reads)
            box_reads.append((reads, full.dtype))
            out[i] = full
        elif e.data is not None:
            if (
                dst.device.type == "cpu"
                and dst.is_contiguous()
                and dst.numel()
                and not dst.is_conj()
                and not dst.is_neg()
            ):
                u8 = dst.detach().reshape(-1).view(torch.uint8)
                out[i] = dst  # read in place
            else:
                u8 = _u8(e.nbytes)
                out[i] = _typed(u8, e)
            dests.append((e.path, e.data, _np(u8)))
        elif e.storage is not None:
            sid = e.storage.id
            if sid not in storage_bufs:
                n, data = m.storages[sid]
                # A CPU target covering the whole saved storage (a tied embedding loaded into
                # the same model) takes the bytes in place: no fresh buffer, no copy_ after.
                home = _storage_home(m, sid, storage_users.get(sid, []), targets)
                storage_bufs[sid] = (
                    _u8(n) if home is None else home.detach().reshape(-1).view(torch.uint8)
                )
                dests.append((e.path, data, _np(storage_bufs[sid])))
            dtype = dtype_from_name(e.dtype)
            size = torch.empty(0, dtype=dtype).element_size()
            buf = storage_bufs[sid]
            view = torch.empty(0, dtype=dtype).set_(
                buf.untyped_storage(),
                (buf.storage_offset() + e.storage.offset) // size,
                e.shape,
                e.storage.stride,
            )
            out[i] = dst if _same_memory(view, dst) else view
    _run(st, m, _slice_jobs(m, dests), opts)
    for reads, dtype in box_reads:
        finish_box_reads(reads, dtype)
    return out


def _plain_cpu(t: torch.Tensor) -> bool:
    return (
        isinstance(t, torch.Tensor)
        and not is_dtensor(t)
        and t.device.type == "cpu"
        and not t.is_meta
        and not t.is_conj()
        and not t.is_neg()
    )


def _covers_storage(t: torch.Tensor, e: TensorEntry, nbytes: int) -> bool:
    """``t`` (the target of a tensor saved as a view of a shared storage) can receive the whole
    storage's bytes: a contiguous CPU tensor exactly as large, and the saved view is the whole
    storage in C order (so ``t`` equals the view once the bytes are in)."""
    assert e.storage is not None
    return (
        _plain_cpu(t)
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


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """``b`` is exactly the tensor view ``a`` (same bytes, shape, strides, dtype): copying ``a``
    into it would be a no-op."""
    return (
        _plain_cpu(b)
        and a.dtype == b.dtype
        and a.shape == b.shape
        and a.stride() == b.stride()
        and a.data_ptr() == b.data_ptr()
    )


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

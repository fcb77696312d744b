"""Save step 1, plan (every rank, no I/O): which byte ranges a state consists of and how they
map onto chunks.

A *source* is one contiguous run of bytes to store: a tensor's bytes, or the covering byte range of
a storage that several tensors view (tied weights). Sources of at least ``small_bytes`` are cut into
``chunk_bytes`` chunks at fixed offsets, so an unchanged region of a tensor always yields the same
chunk digests (dedupe, deltas). Smaller sources are packed in tree order into group chunks, so a
state with thousands of tiny tensors does not become thousands of tiny objects; hot and cold
sources (expected to change at the next save or not: saving/grouping.py decides) go to separate
groups, so frozen tensors are not rewritten beside trained ones.

:func:`chunk_view` gives a chunk's bytes from the plan's sources; the hash pass (step 2) and the
writer (step 4) read chunks through it.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import xxhash

from deltackpt.format.dtensor import is_dtensor, local_box, local_tensor
from deltackpt.format.dtypes import dtype_name
from deltackpt.format.tree import Leaf, Node, flatten

GROUP_ALIGN = 64  # small tensors start at this alignment inside a group chunk

SourceArray = Callable[[int], np.ndarray]  # source index -> its bytes as a uint8 numpy array
# (source key, nbytes, requires grad) -> is it hot (saving/grouping.py's ChangeHistory.is_hot)
HotOf = Callable[[str, int, bool], bool]


@dataclass
class Source:
    key: str  # names the bytes across saves (tensor path, or first path of a shared storage)
    data: torch.Tensor  # 1-D uint8 contiguous view of the bytes (may alias live memory)
    itemsize: int  # element size, for byte-grouped encodings
    trained: bool = False  # a tensor of it requires grad

    @property
    def nbytes(self) -> int:
        return self.data.numel()


@dataclass
class EntryPlan:
    path: str
    dtype: str
    shape: tuple[int, ...]
    parameter: bool
    requires_grad: bool
    source: int | None = None  # whole-tensor bytes
    storage: tuple[int, int, tuple[int, ...]] | None = None  # (storage id, byte offset, stride)
    # sharded tensor (``shape`` is the global shape): (global offsets, local shape, source index)
    shards: list[tuple[tuple[int, ...], tuple[int, ...], int]] | None = None


@dataclass
class ChunkSpec:
    parts: list[tuple[int, int, int]]  # (source, start in source, length), laid out back to back
    size: int
    itemsize: int
    ref_key: str | None  # "<source key>#<chunk index>" for whole-source chunks; None for groups
    offsets: list[int] = field(default_factory=list)  # where each part starts in the chunk
    # names this chunk's delta base across saves: ref_key, or for a group chunk its members
    # (keys, sizes, offsets), so a group whose membership is unchanged xors against its last
    # version too (a LoRA run's adapters live in groups)
    base_key: str | None = None


@dataclass
class SavePlan:
    tree: Node
    entries: list[EntryPlan]
    storage_sources: list[int]  # storage id -> source index
    sources: list[Source]
    chunks: list[ChunkSpec]
    source_slices: list[list[tuple[int, int, int]]]  # per source: (chunk, start in chunk, length)

    @property
    def logical_bytes(self) -> int:
        return sum(s.nbytes for s in self.sources)


def tensor_bytes(t: torch.Tensor) -> torch.Tensor:
    """1-D uint8 view of ``t``'s bytes in C order (a copy only when it is not contiguous)."""
    t = t.detach()
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    t = t.contiguous()
    if t.numel() == 0:
        return torch.empty(0, dtype=torch.uint8, device=t.device)
    return t.reshape(-1).view(torch.uint8)


def _storage_key(t: torch.Tensor) -> tuple[str, int] | None:
    st = t.untyped_storage()
    if st.nbytes() == 0:
        return None
    return (str(t.device), st.data_ptr())


def _extent(t: torch.Tensor) -> tuple[int, int]:
    """Byte range [lo, hi) of the storage that ``t`` touches."""
    size = t.element_size()
    lo = int(t.storage_offset()) * size
    if t.numel() == 0:
        return lo, lo
    last = sum((int(n) - 1) * s for n, s in zip(t.shape, t.stride(), strict=True))
    return lo, lo + (last + 1) * size


def plan_state(
    state: Any,
    chunk_bytes: int,
    small_bytes: int,
    allow_pickle: bool = False,
    hot_of: HotOf | None = None,
) -> SavePlan:
    """The plan of ``state``. ``hot_of`` (None: plain tree order) splits small sources into hot
    and cold groups."""
    tree, leaves = flatten(state, allow_pickle=allow_pickle)
    entries: list[EntryPlan] = []
    sources: list[Source] = []
    storage_sources: list[int] = []

    by_storage: dict[tuple[str, int], list[int]] = {}
    for i, leaf in enumerate(leaves):
        if is_dtensor(leaf.tensor):
            continue
        k = _storage_key(leaf.tensor)
        if k is not None:
            by_storage.setdefault(k, []).append(i)
    shared: dict[int, tuple[int, int]] = {}  # leaf index -> (storage id, lo of the storage range)
    for idxs in by_storage.values():
        if len(idxs) < 2:
            continue
        ranges = [_extent(leaves[i].tensor) for i in idxs]
        lo, hi = min(r[0] for r in ranges), max(r[1] for r in ranges)
        t0 = leaves[idxs[0]].tensor
        region = torch.empty(0, dtype=torch.uint8, device=t0.device).set_(
            t0.untyped_storage(), lo, (hi - lo,), (1,)
        )
        sid = len(storage_sources)
        storage_sources.append(len(sources))
        trained = any(leaves[i].tensor.requires_grad for i in idxs)
        sources.append(Source(leaves[idxs[0]].path, region.detach(), 1, trained))
        for i in idxs:
            shared[i] = (sid, lo)

    for i, leaf in enumerate(leaves):
        entries.append(_entry(leaf, i, shared, sources))

    hot = None
    if hot_of is not None:
        hot = [s.nbytes < small_bytes and hot_of(s.key, s.nbytes, s.trained) for s in sources]
    chunks, slices = layout_chunks(
        [s.nbytes for s in sources],
        [s.itemsize for s in sources],
        [s.key for s in sources],
        chunk_bytes,
        small_bytes,
        hot,
    )
    return SavePlan(tree, entries, storage_sources, sources, chunks, slices)


def _entry(
    leaf: Leaf, i: int, shared: dict[int, tuple[int, int]], sources: list[Source]
) -> EntryPlan:
    t = leaf.tensor
    if is_dtensor(t):
        offsets, local_shape = local_box(t, leaf.path)
        local = local_tensor(t)
        e = EntryPlan(
            leaf.path, dtype_name(t.dtype, leaf.path), tuple(t.shape), False, bool(t.requires_grad)
        )
        e.shards = []
        if local.numel():
            e.shards.append((offsets, local_shape, len(sources)))
            key = f"{leaf.path}@{','.join(map(str, offsets))}"
            sources.append(
                Source(key, tensor_bytes(local), local.element_size(), bool(t.requires_grad))
            )
        return e
    e = EntryPlan(
        path=leaf.path,
        dtype=dtype_name(t.dtype, leaf.path),
        shape=tuple(t.shape),
        parameter=isinstance(t, torch.nn.Parameter),
        requires_grad=bool(t.requires_grad),
    )
    if i in shared:
        sid, lo = shared[i]
        e.storage = (sid, int(t.storage_offset()) * t.element_size() - lo, tuple(t.stride()))
    else:
        e.source = len(sources)
        sources.append(Source(leaf.path, tensor_bytes(t), t.element_size(), t.requires_grad))
    return e


def layout_chunks(
    sizes: list[int],
    itemsizes: list[int],
    keys: list[str],
    chunk_bytes: int,
    small_bytes: int,
    hot: list[bool] | None = None,
) -> tuple[list[ChunkSpec], list[list[tuple[int, int, int]]]]:
    """Cut sources into chunks. Pure: the same sizes (and ``hot`` classes) always give the same
    layout. Small sources are packed in order into group chunks, hot and cold ones apart."""
    chunks: list[ChunkSpec] = []
    slices: list[list[tuple[int, int, int]]] = [[] for _ in sizes]
    open_groups: dict[bool, tuple[ChunkSpec, int]] = {}  # class -> (its open group, index)
    for si, n in enumerate(sizes):
        if n == 0:
            continue
        if n >= small_bytes:
            for ci, start in enumerate(range(0, n, chunk_bytes)):
                length = min(chunk_bytes, n - start)
                slices[si].append((len(chunks), 0, length))
                key = f"{keys[si]}#{ci}"
                chunks.append(
                    ChunkSpec([(si, start, length)], length, itemsizes[si], key, [0], key)
                )
            continue
        cls = bool(hot[si]) if hot is not None else False
        group, group_index = open_groups.get(cls, (None, -1))
        pos = -(-group.size // GROUP_ALIGN) * GROUP_ALIGN if group else 0
        if group is None or pos + n > chunk_bytes:
            group = ChunkSpec([], 0, 1, None)
            group_index = len(chunks)
            chunks.append(group)
            open_groups[cls] = (group, group_index)
            pos = 0
        slices[si].append((group_index, pos, n))
        # byte-grouped by its members' element size when they share one (bf16 adapters: the
        # exponent bytes together), else not grouped; GROUP_ALIGN keeps every member aligned
        group.itemsize = itemsizes[si] if not group.parts or group.itemsize == itemsizes[si] else 1
        group.parts.append((si, 0, n))
        group.offsets.append(pos)
        group.size = pos + n
    for spec in chunks:
        if spec.ref_key is None:
            parts = zip(spec.parts, spec.offsets, strict=True)
            members = [(keys[si], n, off) for (si, _, n), off in parts]
            spec.base_key = "group:" + xxhash.xxh3_64_hexdigest(json.dumps(members).encode())
    return chunks, slices


def chunk_view(
    spec: ChunkSpec,
    source_array: SourceArray,
    scratch: dict[int, np.ndarray],
    ci: int,
    reuse: bool = False,
) -> np.ndarray:
    """The chunk's raw bytes: a view of its source, or small sources gathered into a buffer."""
    if spec.ref_key is not None:
        si, start, length = spec.parts[0]
        return source_array(si)[start : start + length]
    buf = scratch.get(ci)
    if reuse and buf is not None and buf.size == spec.size:
        return buf  # gathered by the hash pass: a private copy already
    if buf is None or buf.size != spec.size:
        buf = np.zeros(spec.size, dtype=np.uint8)
        scratch[ci] = buf
    pos_end = 0
    for (si, start, length), off in zip(spec.parts, spec.offsets, strict=True):
        if off > pos_end:
            buf[pos_end:off] = 0  # alignment padding: keep it deterministic
        buf[off : off + length] = source_array(si)[start : start + length]
        pos_end = off + length
    return buf

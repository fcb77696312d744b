"""Validation of untrusted manifests: every reference, bound and count, before anything is read.

A store on disk is input, like a downloaded file. :func:`deltackpt.format.manifest.Manifest.from_json_bytes`
checks the form (types, digest); this module checks what the form cannot: that every slice names
a chunk of the manifest and stays inside it, that a tensor's slices add up to exactly
``prod(shape) x itemsize`` bytes (else a load would hand out uninitialised memory), that shards
cover their tensor exactly once, that storage views stay inside their storage, that xor chains
end at a keyframe, that chunk sizes stay under the store's chunk size (no huge allocation from a
forged record), and that the tree is well formed, bounded in depth, and points at each tensor at
most once. A manifest that passes is safe to load: the worst it can do is describe other bytes
of the same store, which the chunk digests then vouch for.

All failures raise :class:`deltackpt.errors.ManifestError` with the snapshot and field named.
"""

from __future__ import annotations

import base64
import binascii
import math
import re
from typing import Any

import torch

from deltackpt.errors import DeltackptError, ManifestError
from deltackpt.format import codecs
from deltackpt.format.boxes import tiling_problem
from deltackpt.format.dtypes import dtype_from_name
from deltackpt.format.manifest import ChunkRecord, Manifest, Slice
from deltackpt.format.policy import MAX_CHAIN  # xor links on one keyframe (writers stay below)

MAX_TREE_DEPTH = 100  # containers inside containers; state dicts are ~5-10 deep
_MAX_BYTES = 1 << 62  # no tensor or storage is larger than this (and its products never overflow)
_DEVICE_RE = re.compile(r"^[a-z_]{1,16}(:\d{1,6})?$")
_SCALARS = (str, int, bool, type(None))


class _Check:
    def __init__(self, m: Manifest, where: str) -> None:
        self.m = m
        self.where = where

    def fail(self, field: str, msg: str) -> ManifestError:
        return ManifestError(
            f"{self.where}: {field} {msg}; the manifest is damaged or hostile. Run "
            "`deltackpt verify` to list damaged snapshots, and load another one",
            snapshot=self.m.name,
            field=field,
        )


def validate_manifest(m: Manifest, max_chunk: int, where: str | None = None) -> None:
    """Raise :class:`ManifestError` unless ``m`` is internally consistent and within bounds.

    ``max_chunk`` is the store's ``chunk_bytes``: no chunk's raw size may exceed it."""
    c = _Check(m, where or f"snapshot {m.name!r}")
    _check_chunks(c, m.chunks, max_chunk)
    storage_sizes = []
    for i, (nbytes, data) in enumerate(m.storages):
        field = f"storages[{i}]"
        if nbytes > _MAX_BYTES:
            raise c.fail(f"{field}.nbytes", f"is {nbytes}, over the limit {_MAX_BYTES}")
        _check_slices(c, data, field, nbytes)
        storage_sizes.append(nbytes)
    paths: set[str] = set()
    for i, e in enumerate(m.tensors):
        field = f"tensors[{i}] ({e.path[:80]!r})"
        if e.path in paths:
            raise c.fail(field, "repeats a path another tensor has")
        paths.add(e.path)
        try:
            dtype = dtype_from_name(e.dtype)
        except DeltackptError:
            raise c.fail(f"{field}.dtype", f"is {e.dtype[:40]!r}, not a torch dtype") from None
        itemsize = torch.empty(0, dtype=dtype).element_size()
        numel = math.prod(e.shape)
        if numel * itemsize > _MAX_BYTES:
            raise c.fail(f"{field}.shape", f"{list(e.shape)} is over {_MAX_BYTES} bytes")
        if e.data is not None:
            _check_slices(c, e.data, f"{field}.data", numel * itemsize)
        elif e.shards is not None:
            _check_shards(c, e, field, itemsize)
        elif e.storage is not None:
            _check_view(c, e, field, itemsize, storage_sizes)
    _check_tree(c, m.tree, len(m.tensors))


def _check_chunks(c: _Check, chunks: dict[str, ChunkRecord], max_chunk: int) -> None:
    for d, r in chunks.items():
        field = f"chunks[{d}]"
        if r.codec not in codecs.CODECS:
            raise c.fail(f"{field}.codec", f"is {r.codec[:20]!r}; known: {list(codecs.CODECS)}")
        if r.size > max_chunk:
            raise c.fail(f"{field}.size", f"is {r.size}, over the store's chunk size {max_chunk}")
        if r.codec == codecs.RAW and r.length != r.size:
            raise c.fail(
                f"{field}.length", f"is {r.length}, a raw chunk's must be its size {r.size}"
            )
        # zstd's worst case is a little over the input; anything longer is not a payload of ours
        if r.length > r.size + (r.size >> 6) + 4096:
            raise c.fail(f"{field}.length", f"is {r.length}, impossible for size {r.size}")
        if r.offset + r.length > _MAX_BYTES:
            raise c.fail(f"{field}.offset", f"is {r.offset}, over the limit")
        if (r.codec in codecs.DELTAS) != (r.base is not None):
            raise c.fail(
                f"{field}.base", f"must be set exactly for xor/patch chunks (codec {r.codec})"
            )
        if r.base is not None:
            base = chunks.get(r.base)
            if base is None:
                raise c.fail(f"{field}.base", f"names {r.base}, which has no record here")
            if base.size != r.size:
                raise c.fail(f"{field}.base", f"has size {base.size}, expected {r.size}")
    # every xor chain ends at a keyframe within MAX_CHAIN links (no cycles)
    depth: dict[str, int] = {}
    for d in chunks:
        chain = []
        cur: str | None = d
        while cur is not None and cur not in depth:
            chain.append(cur)
            if len(chain) > MAX_CHAIN + 1:
                raise c.fail(
                    f"chunks[{d}].base", f"starts a chain longer than {MAX_CHAIN} (or a cycle)"
                )
            cur = chunks[cur].base
        n = depth[cur] if cur is not None else -1
        for x in reversed(chain):
            n += 1
            if n > MAX_CHAIN:
                raise c.fail(f"chunks[{x}].base", f"starts a chain longer than {MAX_CHAIN}")
            depth[x] = n


def _check_slices(c: _Check, data: tuple[Slice, ...], field: str, expected: int) -> None:
    total = 0
    for i, (d, start, length) in enumerate(data):
        rec = c.m.chunks.get(d)
        if rec is None:
            raise c.fail(f"{field}[{i}]", f"names chunk {d}, which has no record here")
        if start + length > rec.size:
            raise c.fail(
                f"{field}[{i}]",
                f"reads bytes [{start}, {start + length}) of a {rec.size}-byte chunk",
            )
        total += length
    if total != expected:
        raise c.fail(field, f"holds {total} bytes, expected {expected}")


def _check_shards(c: _Check, e: Any, field: str, itemsize: int) -> None:
    ndim = len(e.shape)
    boxes = []
    for i, sh in enumerate(e.shards):
        f = f"{field}.shards[{i}]"
        if len(sh.offsets) != ndim or len(sh.shape) != ndim:
            raise c.fail(
                f,
                f"has {len(sh.offsets)}-d offsets / {len(sh.shape)}-d shape for a {ndim}-d tensor",
            )
        for o, n, g in zip(sh.offsets, sh.shape, e.shape, strict=True):
            if o + n > g:
                raise c.fail(
                    f,
                    f"offsets {list(sh.offsets)} shape {list(sh.shape)} leave the tensor {list(e.shape)}",
                )
        _check_slices(c, sh.data, f"{f}.data", math.prod(sh.shape) * itemsize)
        boxes.append((sh.offsets, sh.shape))
    problem = tiling_problem(e.shape, boxes)  # the rule distributed saves check before commit
    if problem is not None:
        raise c.fail(f"{field}.shards", problem[0])


def _check_view(c: _Check, e: Any, field: str, itemsize: int, sizes: list[int]) -> None:
    v = e.storage
    if v.id >= len(sizes):
        raise c.fail(f"{field}.storage.id", f"is {v.id}, but there are {len(sizes)} storages")
    if len(v.stride) != len(e.shape):
        raise c.fail(
            f"{field}.storage.stride", f"has {len(v.stride)} dims, shape has {len(e.shape)}"
        )
    if v.offset % itemsize:
        raise c.fail(f"{field}.storage.offset", f"{v.offset} is not a multiple of {itemsize}")
    if math.prod(e.shape) == 0:
        return
    end = v.offset + itemsize * (
        1 + sum((n - 1) * s for n, s in zip(e.shape, v.stride, strict=True))
    )
    if end > sizes[v.id]:
        raise c.fail(f"{field}.storage", f"ends at byte {end} of a {sizes[v.id]}-byte storage")


_TAGS = {"dict", "odict", "list", "tuple", "tensor", "float", "bytes", "size", "dtype", "device",
         "pickle", "rng"}  # fmt: skip


def _check_tree(c: _Check, tree: Any, n_tensors: int) -> None:
    """Walk the tree without recursion (a hostile tree can be deep); check every node."""
    seen: set[int] = set()
    stack: list[tuple[Any, int, bool, str]] = [(tree, 0, False, "tree")]
    while stack:
        node, depth, is_key, field = stack.pop()
        if depth > MAX_TREE_DEPTH:
            raise c.fail(field, f"nests deeper than {MAX_TREE_DEPTH} levels")
        if isinstance(node, _SCALARS):
            continue
        if not isinstance(node, dict) or not node:
            raise c.fail(field, f"is not a tree node: {node!r:.60}")
        tags = [k for k in node if k != "meta"]
        if len(tags) != 1 or tags[0] not in _TAGS or ("meta" in node and tags[0] != "odict"):
            raise c.fail(field, f"has keys {sorted(node)[:5]}, not one known tag")
        tag = tags[0]
        value = node[tag]
        f = f"{field}.{tag}"
        if is_key and tag not in ("float", "bytes", "tuple"):
            raise c.fail(field, f"is a dict key of kind {tag!r}, which cannot be a key")
        if tag == "tensor":
            if type(value) is not int or not 0 <= value < n_tensors:
                raise c.fail(f, f"is {value!r:.20}, not an index below {n_tensors}")
            if value in seen:
                raise c.fail(f, f"points at tensor {value} a second time")
            seen.add(value)
        elif tag in ("dict", "odict"):
            if not isinstance(value, list):
                raise c.fail(f, "is not a list of [key, value] pairs")
            for i, kv in enumerate(value):
                if not isinstance(kv, list) or len(kv) != 2:
                    raise c.fail(f"{f}[{i}]", "is not a [key, value] pair")
                stack.append((kv[0], depth + 1, True, f"{f}[{i}][0]"))
                stack.append((kv[1], depth + 1, False, f"{f}[{i}][1]"))
            if "meta" in node:
                stack.append((node["meta"], depth + 1, False, f"{field}.meta"))
        elif tag in ("list", "tuple"):
            if not isinstance(value, list):
                raise c.fail(f, "is not a list")
            stack.extend((v, depth + 1, is_key, f"{f}[{i}]") for i, v in enumerate(value))
        elif tag == "float":
            try:
                float.fromhex(value)
            except (TypeError, ValueError):
                raise c.fail(f, f"is {value!r:.40}, not a hex float") from None
        elif tag in ("bytes", "pickle"):
            try:
                base64.b64decode(value, validate=True)
            except (TypeError, ValueError, binascii.Error):
                raise c.fail(f, "is not base64") from None
        elif tag == "size":
            if (
                not isinstance(value, list)
                or len(value) > 64
                or any(type(x) is not int or x < 0 for x in value)
            ):
                raise c.fail(f, f"is {value!r:.40}, not a list of sizes")
        elif tag == "dtype":
            try:
                dtype_from_name(value)
            except (DeltackptError, TypeError):
                raise c.fail(f, f"is {value!r:.40}, not a torch dtype") from None
        elif tag == "device":
            if not isinstance(value, str) or not _DEVICE_RE.match(value):
                raise c.fail(f, f"is {value!r:.40}, not a device string")
            try:
                torch.device(value)
            except RuntimeError:
                raise c.fail(f, f"is {value!r:.40}, not a device torch knows") from None

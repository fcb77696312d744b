"""The changed elements of a buffer against its base, as a list: found, packed, unpacked.

Shared by the store's ``patch`` codec (:mod:`deltackpt.format.codecs`) and weight sync's
``PACKED`` pieces (:mod:`deltackpt.sync.delta_codec`). An optimizer step at a small learning
rate changes a few percent of the bf16 elements; listing them costs (4 + itemsize) bytes each
before zstd, and applying the list is a scatter of those elements onto the base, so a reader
touches only what changed (an xor payload decodes to the whole chunk whatever the change).

Payload (little endian)::

    [u64 count k][one zstd frame of k * (4 + itemsize) bytes: the index gaps as uint32
     (the first gap is the first index), grouped by byte significance, then the k new values,
     grouped by byte significance]

Grouping puts the zero high bytes of small gaps and the shared exponent bytes of the values
together, where zstd-1 compresses them well. Indices are uint32: a buffer of up to 2**32
elements.

:func:`unpack_changes` reads untrusted payloads: the count, the frame's declared size, a
strictly increasing index list below the element count are all checked before a caller writes
anything, and every allocation is bounded by the element count.
"""

from __future__ import annotations

import struct
from collections.abc import Callable

import numpy as np
import zstandard

from deltackpt.errors import CodecError
from deltackpt.format.grouping import _decompressor, _group, _ungroup

__all__ = [
    "HEADER",
    "UINT",
    "apply_patch",
    "changed_elements",
    "encode_patch",
    "pack_changes",
    "unpack_changes",
]

HEADER = struct.Struct("<Q")  # count k; then one zstd frame of k * (4 + itemsize) bytes
UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
MAX_ELEMENTS = 1 << 32  # indices are uint32
PATCH_BELOW = 0.25  # encode_patch gives up when more than this share of the elements changed

try:  # the fused loops (setup.py builds them; numpy below does the same, slower)
    from deltackpt._native import diff_sparse as _native_diff
    from deltackpt._native import unpack_gaps as _native_gaps
except ImportError:  # pragma: no cover - depends on the install
    _native_diff = _native_gaps = None


def _work(buf: np.ndarray | None, nbytes: int) -> np.ndarray:
    return buf[:nbytes] if buf is not None and buf.size >= nbytes else np.empty(nbytes, np.uint8)


def changed_elements(
    new: np.ndarray,
    base: np.ndarray,
    itemsize: int,
    cap: int,
    idx_buf: np.ndarray | None = None,
    vals_buf: np.ndarray | None = None,
    lin_out: np.ndarray | None = None,
    update: bool = False,
) -> tuple[np.ndarray, np.ndarray] | None:
    """(element indices as uint32, their new values) where the flat uint8 arrays ``new`` and
    ``base`` (same size, whole ``itemsize`` elements, < 2**32 of them) differ, or None when more
    than ``cap`` elements do. One fused pass in C (``deltackpt._native``: 64 words compared into a
    mask at a time, AVX2 where there is one; 4-6 GB/s per core here, GIL released), else numpy: compare 8-byte words, then the elements of the words that differ.
    ``idx_buf``/``vals_buf``: uint8 work buffers to fill (the results may be views of them).
    ``lin_out`` (5 uint64, zeroed): the C loop adds the linear-digest terms of the changed words
    (format/lindigest.py), old in [0:2], new in [2:4], and sets [4] to 1; numpy leaves it.
    ``update``: ``base`` (writable) becomes ``new`` on the way, the changed words written while
    they are in cache (a scatter afterwards is another pass over every line an RL step touches:
    nearly all); when None is returned, ``base`` may be partly written."""
    uint = UINT[itemsize]
    if _native_diff is not None:
        room = cap + 8  # the loop checks room a word at a time
        idx = _work(idx_buf, 4 * room).view(np.uint32)
        vals = _work(vals_buf, itemsize * room).view(uint)
        k = _native_diff(new, base, itemsize, idx, vals, lin_out, False, update)
        if k < 0:
            return None
        if lin_out is not None:
            lin_out[4] = 1
        return idx[:k], vals[:k]
    words = new.size // 8
    wi = np.flatnonzero(new[: 8 * words].view(np.uint64) != base[: 8 * words].view(np.uint64))
    per = 8 // itemsize
    if wi.size > cap:  # every differing word holds at least one changed element
        return None
    e_new = new[: 8 * words].view(uint).reshape(-1, per)[wi].reshape(-1)
    e_base = base[: 8 * words].view(uint).reshape(-1, per)[wi].reshape(-1)
    sub = np.flatnonzero(e_new != e_base)
    idx = (wi[sub // per] * per + sub % per).astype(np.uint32)
    vals = e_new[sub]
    tail_new, tail_base = new[8 * words :].view(uint), base[8 * words :].view(uint)
    t = np.flatnonzero(tail_new != tail_base)
    if t.size:
        idx = np.concatenate([idx, (t + words * per).astype(np.uint32)])
        vals = np.concatenate([vals, tail_new[t]])
    if idx.size > cap:
        return None
    if update:
        base.view(uint)[idx] = vals
    return idx, vals


def pack_changes(
    idx: np.ndarray, vals: np.ndarray, itemsize: int, cctx: zstandard.ZstdCompressor
) -> bytes:
    """The payload of k >= 1 changes (module doc); ``cctx`` writes the content size."""
    k = idx.size
    raw = np.empty(k * (4 + itemsize), dtype=np.uint8)
    gaps = np.empty(k, dtype=np.uint32)
    np.subtract(idx[1:], idx[:-1], out=gaps[1:])
    gaps[:1] = idx[:1]
    _group(gaps.view(np.uint8), 4, raw[: 4 * k])
    _group(np.ascontiguousarray(vals).view(np.uint8), itemsize, raw[4 * k :])
    return HEADER.pack(k) + cctx.compress(raw)


def unpack_changes(
    data: np.ndarray,
    itemsize: int,
    n: int,
    take: Callable[[int], np.ndarray] | None = None,
    error: type[Exception] = CodecError,
) -> tuple[np.ndarray, np.ndarray]:
    """(element indices as int64, new values) of a payload for a buffer of ``n`` elements,
    validated (count, frame size, strictly increasing indices below ``n``); ``take(nbytes)``
    returns a uint8 work buffer (default: a fresh one); ``error`` is the exception type raised
    on a malformed payload."""
    if data.size < HEADER.size:
        raise error(f"patch payload has {data.size} bytes, expected >= {HEADER.size}")
    (k,) = HEADER.unpack_from(data, 0)
    if not 0 < k <= n:
        raise error(f"patch payload claims {k} changed elements, the buffer has {n}")
    frame = data[HEADER.size :]
    size = k * (4 + itemsize)
    try:
        declared = zstandard.frame_content_size(frame)
    except zstandard.ZstdError as exc:
        raise error(f"patch payload ({frame.size} bytes) is not a zstd frame: {exc}") from exc
    if declared != size:
        raise error(f"patch zstd frame declares {declared} bytes, expected {size}")
    raw = take(size) if take is not None else np.empty(size, dtype=np.uint8)
    decompress_exact(frame, raw, error, "patch")
    vals = np.empty(k, dtype=UINT[itemsize])
    _ungroup(raw[4 * k :], itemsize, vals.view(np.uint8))
    if _native_gaps is not None:  # ungrouped, summed and checked in one pass
        idx = np.empty(k, dtype=np.int64)
        status, j = _native_gaps(raw[: 4 * k], n, idx)
        if status == 1:
            raise error("patch payload names an element twice (a zero index gap)")
        if status == 2:
            raise error(f"patch payload's change {j} has an index out of range for {n} elements")
        return idx, vals
    gaps = np.empty(k, dtype=np.uint32)
    _ungroup(raw[: 4 * k], 4, gaps.view(np.uint8))
    if k > 1 and int(gaps[1:].min()) == 0:
        raise error("patch payload names an element twice (a zero index gap)")
    idx = np.cumsum(gaps, dtype=np.int64)  # intp: fancy indexing takes it as is (3x faster)
    if not 0 <= int(idx[-1]) < n:  # gaps summing past 2**63 wrap negative: caught here too
        raise error(f"patch payload index {int(idx[-1])} is out of range for {n} elements")
    return idx, vals


def decompress_exact(frame: np.ndarray, dst: np.ndarray, error: type[Exception], what: str) -> None:
    """Decompress one frame into ``dst``: exactly ``len(dst)`` bytes, nothing after them.

    ``stream_reader().readinto`` into a kept buffer: 3x faster than ``decompress()``, which
    returns a fresh bytes object whose pages fault in on every call.
    """
    got = extra = 0
    try:
        with _decompressor().stream_reader(frame) as reader:
            while got < dst.size:
                step = reader.readinto(dst[got:])
                if step == 0:
                    break
                got += step
            extra = len(reader.read(1))
    except zstandard.ZstdError as exc:
        raise error(f"{what} payload failed to decompress: {exc}") from exc
    if got != dst.size or extra:
        more = " and more" if extra else ""
        raise error(f"{what} zstd frame decoded to {got}{more} bytes, expected {dst.size}")


def encode_patch(
    raw: np.ndarray,
    base: np.ndarray,
    itemsize: int,
    cctx: zstandard.ZstdCompressor,
    lin_out: np.ndarray | None = None,
) -> bytes | None:
    """The payload of ``raw`` against ``base`` (flat uint8, same size), or None when a patch
    does not apply: an element size other than 1/2/4/8 or not dividing the size, 2**32
    elements or more, none changed, or more than ``PATCH_BELOW`` of them. ``lin_out``: see
    :func:`changed_elements`."""
    n = raw.size // itemsize if itemsize in UINT else 0
    if not 0 < n < MAX_ELEMENTS or raw.size % itemsize:
        return None
    found = changed_elements(raw, base, itemsize, int(n * PATCH_BELOW), lin_out=lin_out)
    if found is None or found[0].size == 0:
        return None
    return pack_changes(found[0], found[1], itemsize, cctx)


def apply_patch(
    payload: np.ndarray, size: int, itemsize: int, base: np.ndarray, out: np.ndarray
) -> None:
    """``out`` = ``base`` with the payload's elements replaced (all flat uint8 of ``size``
    bytes); validated before ``out`` is written. In place (``out`` is ``base``) only the
    changed elements are touched."""
    if itemsize not in UINT or size % itemsize:
        raise CodecError(
            f"patch payload of a {size}-byte chunk with itemsize {itemsize}: expected itemsize "
            "1, 2, 4 or 8 dividing the chunk size; the manifest entry is corrupt"
        )
    idx, vals = unpack_changes(payload, itemsize, size // itemsize)
    if out.ctypes.data != base.ctypes.data:
        np.copyto(out, base)
    out.view(UINT[itemsize])[idx] = vals

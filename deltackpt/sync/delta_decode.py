"""Decoding patches of weight sync: untrusted payloads (from the network or a shared-memory
window) back into a piece's new bytes. The kinds and their layouts are specified in
:mod:`deltackpt.sync.delta_codec`.

Everything is validated before ``out`` is written: lengths, headers, counts, index bounds and
order, and the zstd content size; every allocation is bounded by ``len(out)``. Wrong-but-in-
bounds data (a bitmap naming other elements) is left to the caller's digest of the result.
"""

from __future__ import annotations

import numpy as np
import zstandard

from deltackpt.format.changes import decompress_exact, unpack_changes
from deltackpt.format.codecs import _ungroup
from deltackpt.sync.delta_codec import (
    _HEADER,
    _INDEX_MODES,
    _UINT,
    BITMAP,
    DENSE,
    KIND_NAMES,
    PACKED,
    PLANES,
    SPARSE,
    Scratch,
    _check_layout,
    _flat_u8,
    _pad8,
    _thread_scratch,
)
from deltackpt.sync.errors import SyncError

__all__ = ["decode_into", "packed_changes"]


def decode_into(
    kind: int,
    payload: np.ndarray | bytes | memoryview,
    base: np.ndarray | None,
    itemsize: int,
    out: np.ndarray,
    *,
    scratch: Scratch | None = None,
) -> None:
    """Write the piece ``payload`` encodes (against ``base``) into ``out``.

    ``out`` may be ``base`` itself (apply in place); any other overlap is refused. ``base``
    may be None for DENSE. The payload is untrusted: everything is validated before ``out``
    is written, and malformed input raises :class:`SyncError`.
    """
    out = _flat_u8(out, "out")
    if not out.flags.writeable:
        raise SyncError("out is read-only; pass a writable np.uint8 array")
    _check_layout(out.size, itemsize)
    data = _payload_u8(payload)
    if kind == DENSE:
        _check_len("dense", data.size, out.size)
        np.copyto(out, data)
        return
    if kind not in (SPARSE, PLANES, PACKED):
        raise SyncError(f"unknown delta kind {kind!r}; expected one of {sorted(KIND_NAMES)}")
    base = _check_base(base, out, kind)
    work = scratch if scratch is not None else _thread_scratch()
    if kind == SPARSE:
        _decode_sparse(data, base, itemsize, out)
    elif kind == PACKED:
        idx, vals = packed_changes(data, itemsize, out.size // itemsize, work)
        if out is not base:
            np.copyto(out, base)
        out.view(_UINT[itemsize])[idx] = vals
    else:
        _decode_planes(data, base, itemsize, out, work)


def _payload_u8(payload: np.ndarray | bytes | memoryview) -> np.ndarray:
    if isinstance(payload, np.ndarray):
        return _flat_u8(payload, "payload")
    try:
        return np.frombuffer(payload, dtype=np.uint8)
    except (TypeError, ValueError) as exc:
        raise SyncError(f"payload must be a uint8 buffer, got {type(payload).__name__}") from exc


def _check_len(what: str, actual: int, expected: int) -> None:
    if actual != expected:
        raise SyncError(f"{what} payload has {actual} bytes, expected {expected}")


def _check_base(base: np.ndarray | None, out: np.ndarray, kind: int) -> np.ndarray:
    if base is None:
        raise SyncError(f"a {KIND_NAMES[kind]} payload needs the base piece, got base=None")
    base = _flat_u8(base, "base")
    if base.size != out.size:
        raise SyncError(f"base has {base.size} bytes, expected {out.size} (the size of out)")
    same = base.__array_interface__["data"][0] == out.__array_interface__["data"][0]
    if not same and np.may_share_memory(base, out):
        raise SyncError("out overlaps base without being it; pass out=base or a separate array")
    return base


def _decode_sparse(data: np.ndarray, base: np.ndarray, itemsize: int, out: np.ndarray) -> None:
    n = out.size // itemsize
    if data.size < _HEADER.size:
        raise SyncError(f"sparse payload has {data.size} bytes, expected >= {_HEADER.size}")
    mode, k = _HEADER.unpack_from(data, 0)
    if bytes(data[1:8]) != bytes(7):
        raise SyncError("sparse payload header has non-zero reserved bytes")
    if k > n:
        raise SyncError(f"sparse payload claims {k} changed elements, the piece has only {n}")
    if mode != BITMAP and mode not in _INDEX_MODES:
        raise SyncError(f"sparse payload mode {mode} is unknown; expected 0 (bitmap) or 2/4/8")
    pos = _HEADER.size + _pad8(k * itemsize)
    positions = (n + 7) // 8 if mode == BITMAP else k * mode
    _check_len(f"sparse (mode {mode}, {k} values)", data.size, pos + positions)
    uint = _UINT[itemsize]
    vals = data[_HEADER.size : _HEADER.size + k * itemsize].view(uint)
    idx = _bitmap_indices(data[pos:], n, k) if mode == BITMAP else data[pos:].view(_UINT[mode])
    if mode != BITMAP and k and int(idx.max()) >= n:
        raise SyncError(f"sparse payload index {int(idx.max())} is out of range for {n} elements")
    if out is not base:
        np.copyto(out, base)
    out.view(uint)[idx] = vals


def packed_changes(
    data: np.ndarray, itemsize: int, n: int, work: Scratch | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """(element indices, new values) of a PACKED payload for a piece of ``n`` elements,
    validated (count, frame size, strictly increasing indices below ``n``)."""
    work = work if work is not None else _thread_scratch()
    return unpack_changes(data, itemsize, n, lambda size: work.take("packed", size), SyncError)


def _bitmap_indices(bitmap: np.ndarray, n: int, k: int) -> np.ndarray:
    bits = np.unpackbits(bitmap, count=n)  # n bytes, bounded by the piece size
    set_bits = int(np.count_nonzero(bits))
    if set_bits != k:
        raise SyncError(f"sparse bitmap marks {set_bits} elements, the header says {k}")
    if n % 8 and int(bitmap[-1]) & ((1 << (8 - n % 8)) - 1):
        raise SyncError(f"sparse bitmap sets padding bits past element {n}")
    return np.flatnonzero(bits)


def _decode_planes(
    data: np.ndarray, base: np.ndarray, itemsize: int, out: np.ndarray, work: Scratch
) -> None:
    if data.size > out.size:
        raise SyncError(f"planes payload has {data.size} bytes, more than the piece ({out.size})")
    try:
        declared = zstandard.frame_content_size(data)
    except zstandard.ZstdError as exc:
        raise SyncError(f"planes payload ({data.size} bytes) is not a zstd frame: {exc}") from exc
    if declared != out.size:
        raise SyncError(f"planes zstd frame declares {declared} bytes, expected {out.size}")
    grouped = work.take("grouped", out.size)
    _decompress_exact(data, grouped)
    delta = work.take("xor", out.size)
    _ungroup(grouped, itemsize, delta)
    np.bitwise_xor(delta, base, out=out)  # also right when out is base


def _decompress_exact(frame: np.ndarray, dst: np.ndarray) -> None:
    decompress_exact(frame, dst, SyncError, "planes")

"""Lossless per-chunk encodings: ``raw``, ``zstd`` (byte-grouped zstd) and ``xor`` (delta vs base).

A chunk is a contiguous run of raw tensor bytes. :func:`encode` picks, per chunk, the cheapest
allowed encoding that actually saves space; :func:`decode` restores the exact bytes.

Payload format (the codec name and the grouping width ``itemsize`` are recorded by the caller in
the manifest; the decoded size is the chunk size, also in the manifest):

* ``raw``  -- the chunk bytes, unchanged.
* ``zstd`` -- one zstd frame (content size and xxh64 content checksum written) of the *grouped*
  chunk: with ``n = size // itemsize``, byte 0 of each of the ``n`` elements, then byte 1 of each,
  ... byte ``itemsize-1`` of each, then the ``size % itemsize`` tail bytes unchanged.
  ``itemsize == 1`` means no grouping (plain zstd of the chunk).
* ``xor``  -- as ``zstd``, but of ``chunk XOR base``, where ``base`` is the raw bytes of the same
  chunk (same size) in an earlier snapshot; decoding needs that base.
* ``patch`` -- the elements (``itemsize`` bytes each) that differ from ``base``: their count, then
  one zstd frame of the index gaps and the new values (layout: :mod:`deltackpt.format.changes`).
  Decoding copies ``base`` and scatters the values; in place (``out`` is ``base``) it touches only
  the changed elements. Written instead of ``xor`` when at most ``changes.PATCH_BELOW`` of the
  elements changed and it is at most ``PATCH_PREFERENCE`` x the best other size: an optimizer
  step at a small learning rate (a few percent of bf16 elements) codes to about the same bytes
  either way, and a patch applies at scatter speed where ``xor`` decodes the whole chunk.

Grouping puts the exponent/sign bytes of floats next to each other, where they compress well
(the ZipNN idea); XOR against the previous snapshot turns a small optimizer step into mostly-zero
high bytes. Choice: a cheap probe compresses a ~64 KiB sample (spread slices) per candidate, so
incompressible chunks are stored raw at a few percent of the cost of compressing them. Which
codecs may be picked, and what gain each must reach, is an :class:`EncodePolicy`
(:mod:`deltackpt.format.policy`, re-exported here with the codec names and ``ENCODINGS``).

Thread safety: :func:`encode` and :func:`decode` may run concurrently from many threads. zstd
contexts and scratch buffers are per thread (``threading.local``); zstandard and numpy release
the GIL for the heavy work, and no Python code loops over bytes.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np
import zstandard

from deltackpt.errors import CodecError
from deltackpt.format import changes
from deltackpt.format.grouping import Buffer, _decompressor, _group, _scratch, _u8, _ungroup
from deltackpt.format.policy import (
    CODECS,
    DEFAULT_POLICY,
    DELTAS,
    ENCODINGS,
    PATCH,
    RAW,
    XOR,
    ZSTD,
    EncodePolicy,
)

__all__ = [  # the policy names stay importable from here, where encode() takes them
    "CODECS",
    "DEFAULT_POLICY",
    "DELTAS",
    "ENCODINGS",
    "PATCH",
    "RAW",
    "XOR",
    "ZSTD",
    "Buffer",
    "EncodePolicy",
    "Encoded",
    "decode",
    "decode_chain",
    "encode",
]

_PROBE_SLICES = 4  # spread slices per probe sample: catches chunks whose halves differ
# A patch is written when at most this times the best other size. Measured with
# benchmarks/bench_refit.py at 1e8 parameters (12 RL steps at lr 1e-6, 6 at 1e-5, 1 at 1e-3):
# 1.25 -> 2.0 wrote +0.5% / +0.3% / +2.6% bytes per version and made a fresh reader's load of the
# latest 1.3-3x faster (about 1 chunk in 6 had gone xor at random near the border: a whole-chunk
# decode per link where a patch is a scatter in place), catch-ups too.
PATCH_PREFERENCE = 2.0


@dataclass(frozen=True)
class Encoded:
    """Result of :func:`encode`: store ``payload``; record ``codec`` and ``itemsize``."""

    codec: str
    payload: memoryview
    itemsize: int


# --------------------------------------------------------------------------- per-thread state

_tls = threading.local()


def _compressor(level: int) -> zstandard.ZstdCompressor:
    # ZstdCompressor is not thread-safe: one per (thread, level). threads=0 keeps zstd single
    # threaded, because the caller's pool already parallelizes across chunks.
    cache: dict[int, zstandard.ZstdCompressor] | None = getattr(_tls, "cctx", None)
    if cache is None:
        cache = _tls.cctx = {}
    cctx = cache.get(level)
    if cctx is None:
        cctx = cache[level] = zstandard.ZstdCompressor(
            level=level, write_content_size=True, write_checksum=True, threads=0
        )
    return cctx


def _effective_itemsize(size: int, itemsize: int) -> int:
    # Grouping fewer than two elements is the identity; report 1 so the manifest says so.
    return itemsize if size >= 2 * itemsize else 1


# --------------------------------------------------------------------------- encoding


def _prepare(codec: str, raw: np.ndarray, base: np.ndarray | None, itemsize: int) -> np.ndarray:
    """Return the grouped (and for XOR, delta'd) bytes, in a per-thread scratch buffer."""
    grouped = _scratch("group", raw.size)
    src = raw
    if codec == XOR:
        assert base is not None
        src = _scratch("xor", raw.size)
        np.bitwise_xor(raw, base, out=src)
    _group(src, itemsize, grouped)
    return grouped


def _compress(
    codec: str, raw: np.ndarray, base: np.ndarray | None, itemsize: int, level: int
) -> bytes:
    return _compressor(level).compress(_prepare(codec, raw, base, itemsize))


def _sample(arr: np.ndarray, itemsize: int, total: int, scratch: str) -> np.ndarray:
    """Concatenate _PROBE_SLICES slices spread over arr, each itemsize-aligned, ~total bytes."""
    k = _PROBE_SLICES
    piece = max(itemsize, (total // k) // itemsize * itemsize)
    if arr.size < k * piece:
        return arr  # tiny probe_bytes vs a large itemsize: just probe everything
    last = arr.size - piece
    starts = [(last * i // (k - 1)) // itemsize * itemsize for i in range(k)]
    out = _scratch(scratch, k * piece)
    return np.concatenate([arr[s : s + piece] for s in starts], out=out)


def _probe_ratio(
    codec: str, raw: np.ndarray, base: np.ndarray | None, itemsize: int, policy: EncodePolicy
) -> float:
    # Aligned slices keep element boundaries, so grouping the concatenation equals grouping each.
    sample_raw = _sample(raw, itemsize, policy.probe_bytes, "probe_raw")
    sample_base = (
        None if base is None else _sample(base, itemsize, policy.probe_bytes, "probe_base")
    )
    size = len(_compress(codec, sample_raw, sample_base, itemsize, policy.level))
    return size / sample_raw.size


def _raw_result(raw: np.ndarray) -> Encoded:
    return Encoded(RAW, memoryview(raw), 1)


def encode(
    raw: Buffer,
    itemsize: int,
    base: Buffer | None = None,
    policy: EncodePolicy = DEFAULT_POLICY,
    lin_out: np.ndarray | None = None,
) -> Encoded:
    """Encode one chunk. ``base`` is the same chunk's raw bytes in an earlier snapshot (optional).
    ``lin_out``: filled by the patch candidate's scan (:func:`changes.changed_elements`).

    Returns RAW (payload is ``raw`` itself, zero copy) unless an allowed encoding is at most
    ``policy.min_gain`` times the raw size.
    """
    _check_itemsize(itemsize)
    arr = _u8(raw, "raw")
    size = arr.size
    base_arr = _u8(base, "base") if base is not None else None
    if base_arr is not None and base_arr.size != size:
        base_arr = None  # a resized tensor: XOR is not applicable

    if policy.force is not None:
        return _encode_forced(arr, base_arr, itemsize, policy, lin_out)

    candidates = [
        c for c in (ZSTD, XOR) if c in policy.codecs and (c != XOR or base_arr is not None)
    ]
    patch = None
    if base_arr is not None and any(c in policy.codecs for c in DELTAS):
        patch = changes.encode_patch(arr, base_arr, itemsize, _compressor(1), lin_out)
        if not candidates:
            return _patch_result(patch, size, size, itemsize, policy) or _raw_result(arr)
    raw_allowed = RAW in policy.codecs
    if not candidates:
        return _raw_result(arr)
    if raw_allowed and size == 0:
        return _raw_result(arr)  # nothing can beat zero bytes

    eff = _effective_itemsize(size, itemsize)

    def gain(codec: str) -> float:
        return min(policy.min_gain, policy.zstd_min_gain) if codec == ZSTD else policy.min_gain

    if policy.probe_bytes == 0 or size <= policy.probe_bytes:
        # Small chunk: compressing it fully per candidate costs no more than probing it.
        best_codec, best = min(
            ((c, _compress(c, arr, base_arr, eff, policy.level)) for c in candidates),
            key=lambda cb: len(cb[1]),  # ties keep ZSTD: it does not depend on a base
        )
        if (res := _patch_result(patch, len(best), size, itemsize, policy)) is not None:
            return res
    else:
        ratios = {c: _probe_ratio(c, arr, base_arr, eff, policy) for c in candidates}
        best_codec = min(candidates, key=ratios.__getitem__)
        than = ratios[best_codec] * size
        if (res := _patch_result(patch, than, size, itemsize, policy)) is not None:
            return res
        if raw_allowed and ratios[best_codec] > gain(best_codec):
            return _raw_result(arr)  # not worth it: skip compressing the whole chunk
        best = _compress(best_codec, arr, base_arr, eff, policy.level)

    if raw_allowed and len(best) > gain(best_codec) * size:
        return _raw_result(arr)
    return Encoded(best_codec, memoryview(best), eff)


def _patch_result(
    patch: bytes | None, than: float, size: int, itemsize: int, policy: EncodePolicy
) -> Encoded | None:
    """PATCH when there is one, it is at most ``PATCH_PREFERENCE`` x ``than`` (the best other
    encoding's size) and meets the delta gain (unless raw is not allowed); else None."""
    if patch is None or len(patch) > PATCH_PREFERENCE * than:
        return None
    if RAW in policy.codecs and len(patch) > policy.min_gain * size:
        return None
    return Encoded(PATCH, memoryview(patch), itemsize)


def _encode_forced(
    arr: np.ndarray,
    base_arr: np.ndarray | None,
    itemsize: int,
    policy: EncodePolicy,
    lin_out: np.ndarray | None = None,
) -> Encoded:
    codec = policy.force
    if codec == RAW:
        return _raw_result(arr)
    if codec == PATCH:
        if base_arr is not None:
            patch = changes.encode_patch(
                arr, base_arr, itemsize, _compressor(policy.level), lin_out
            )
            if patch is not None:
                return Encoded(PATCH, memoryview(patch), itemsize)
        codec = XOR  # no base, too many changes, or an odd layout: xor (or zstd) instead
    if codec == XOR and base_arr is None:
        codec = ZSTD
    assert codec is not None
    eff = _effective_itemsize(arr.size, itemsize)
    return Encoded(codec, memoryview(_compress(codec, arr, base_arr, eff, policy.level)), eff)


# --------------------------------------------------------------------------- decoding


def _check_itemsize(itemsize: int) -> None:
    if not isinstance(itemsize, int) or itemsize < 1:
        raise CodecError(
            f"itemsize must be a positive int (the element size in bytes), got {itemsize!r}"
        )


def _decompress(codec: str, payload: np.ndarray, size: int) -> np.ndarray:
    """Decompress one zstd frame that must hold exactly ``size`` bytes."""
    try:
        declared = zstandard.frame_content_size(payload)
    except zstandard.ZstdError as exc:
        raise CodecError(
            f"{codec} payload ({payload.size} bytes) is not a zstd frame: {exc}; "
            "the chunk is corrupt, restore it from another copy or re-save"
        ) from exc
    if declared != size:
        raise CodecError(
            f"{codec} payload declares {declared} decoded bytes, expected {size}; the manifest "
            "and the chunk disagree (corrupt chunk or wrong manifest entry)"
        )
    # A fresh bytes object per chunk: measured no slower than stream_reader().readinto() into
    # per-thread scratch (glibc reuses the freed 4 MiB blocks), and simpler.
    try:
        data = _decompressor().decompress(payload, max_output_size=size)
    except zstandard.ZstdError as exc:
        raise CodecError(
            f"{codec} payload ({payload.size} bytes, {size} expected decoded) failed to "
            f"decompress: {exc}; the chunk is corrupt, restore it from another copy or re-save"
        ) from exc
    if len(data) != size:
        raise CodecError(
            f"{codec} payload decoded to {len(data)} bytes, expected {size}; the chunk is corrupt, "
            "restore it from another copy or re-save"
        )
    return np.frombuffer(data, dtype=np.uint8)


def decode(
    codec: str, payload: Buffer, size: int, itemsize: int, out: Buffer, base: Buffer | None = None
) -> None:
    """Decode ``payload`` into ``out`` (writable, exactly ``size`` bytes).

    ``itemsize`` is the value :func:`encode` returned in ``Encoded.itemsize``; ``base`` is needed
    for ``XOR`` and must be the exact base bytes used at encode time. ``out`` may be ``base``
    itself (decode a delta in place); other overlaps between ``out`` and the inputs are not
    supported.
    """
    if codec not in CODECS:
        raise CodecError(
            f"unknown codec {codec!r}; this version reads {CODECS!r} (upgrade deltackpt?)"
        )
    _check_itemsize(itemsize)
    dst = _u8(out, "out", writable=True)
    if dst.size != size:
        raise CodecError(
            f"out has {dst.size} bytes, expected {size}; pass a buffer of exactly size bytes"
        )
    src = _u8(payload, "payload")

    if codec == RAW:
        if src.size != size:
            raise CodecError(
                f"raw payload has {src.size} bytes, expected {size}; the chunk is corrupt"
            )
        np.copyto(dst, src)
        return

    base_arr: np.ndarray | None = None
    if codec in DELTAS:
        if base is None:
            raise CodecError(
                f"{codec} payload needs base= (the same chunk's bytes in the base snapshot)"
            )
        base_arr = _u8(base, "base")
        if base_arr.size != size:
            raise CodecError(
                f"{codec} base has {base_arr.size} bytes, expected {size}; pass the base chunk "
                "the payload was encoded against"
            )
    if codec == PATCH:
        assert base_arr is not None
        changes.apply_patch(src, size, itemsize, base_arr, dst)
        return

    grouped = _decompress(codec, src, size)
    if base_arr is None:
        _ungroup(grouped, itemsize, dst)
        return
    # Un-group into scratch, then one XOR pass into out: same cost as un-grouping into out and
    # XOR-ing in place, but also correct when out *is* base (updating weights in place).
    delta = _scratch("ungroup", size)
    _ungroup(grouped, itemsize, delta)
    np.bitwise_xor(delta, base_arr, out=dst)


def patch_in_place(payload: Buffer, size: int, itemsize: int, out: Buffer) -> None:
    """Apply a ``patch`` payload onto ``out``, which holds its base (``size`` bytes)."""
    dst = _u8(out, "out", writable=True)
    if dst.size != size:
        raise CodecError(
            f"out has {dst.size} bytes, expected {size}; pass a buffer of exactly size bytes"
        )
    changes.apply_patch(_u8(payload, "payload"), size, itemsize, dst, dst)


def decode_chain(levels: list[tuple[str, Buffer, int]], size: int, out: Buffer) -> None:
    """Decode a keyframe and the xor deltas built on it (oldest first) into ``out``.

    ``levels[0]`` is ``(RAW or ZSTD, payload, itemsize)``, every later level ``(XOR or PATCH,
    payload, itemsize)``. XOR commutes with byte-grouping, so xor levels are combined in the
    grouped domain and un-grouped once, instead of un-grouping and re-XOR-ing at every level;
    a chain with patches decodes level by level (each patch is a scatter in place).
    """
    dst = _u8(out, "out", writable=True)
    if dst.size != size:
        raise CodecError(
            f"out has {dst.size} bytes, expected {size}; pass a buffer of exactly size bytes"
        )
    if not levels or levels[0][0] in DELTAS or any(c not in DELTAS for c, _, _ in levels[1:]):
        raise CodecError(
            f"a chain is a raw/zstd keyframe then xor/patch deltas, got {[c for c, _, _ in levels]}"
        )
    widths = {k for c, _, k in levels if c != RAW}
    if len(widths) > 1 or any(c == PATCH for c, _, _ in levels):  # decode level by level
        codec, payload, k = levels[0]
        decode(codec, payload, size, k, dst)
        for codec, payload, k in levels[1:]:
            decode(codec, payload, size, k, dst, base=dst)
        return
    k = widths.pop() if widths else 1
    acc = _scratch("chain", size)
    codec, payload, _ = levels[0]
    src = _u8(payload, "payload")
    if codec == RAW:
        if src.size != size:
            raise CodecError(
                f"raw payload has {src.size} bytes, expected {size}; the chunk is corrupt"
            )
        _group(src, k, acc)
    else:
        np.copyto(acc, _decompress(codec, src, size))
    for codec, payload, _ in levels[1:]:
        np.bitwise_xor(acc, _decompress(codec, _u8(payload, "payload"), size), out=acc)
    _ungroup(acc, k, dst)

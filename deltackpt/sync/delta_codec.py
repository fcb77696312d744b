"""Delta codec for weight sync: send what changed in a piece since its last committed version.

A *piece* is the flat uint8 buffer of one tensor box in the wire dtype (element size
``itemsize`` in 1/2/4/8). The sender keeps the bytes it last committed (``base``) and ships one
of three kinds, recorded by the caller in its wire header:

* ``DENSE``  -- the new bytes as they are (the payload is a view of ``new``: zero copy).
* ``SPARSE`` -- the changed elements. Layout (little endian)::

      [u8 mode][7 zero bytes][u64 count k]
      [k new element values, itemsize each][zero padding to a multiple of 8]
      [position list]

  ``mode`` says how positions are written: ``0`` = a bitmap of ``ceil(n / 8)`` bytes
  (``np.packbits`` order: bit 7 of byte 0 is element 0; padding bits zero), ``2``/``4``/``8`` =
  ``k`` element indices of that width. The encoder writes whichever is smaller (indices are 2
  bytes when the piece has <= 65536 elements, 8 above 2**32 elements, else 4).
* ``PLANES`` -- one zstd frame (level 1, content size written, no checksum: the caller hashes
  the result) of ``new XOR base`` grouped by byte significance (byte ``j`` of every element
  together, :func:`deltackpt.format.codecs._group`). Small optimizer steps flip low mantissa
  bits only, so the high planes are zero runs and the low plane is mostly zero.

Selection rule (:func:`encode`): one pass computes the changed-element mask and count ``k``;
the DENSE and SPARSE sizes then follow exactly from ``k``. zstd (the only expensive candidate)
runs only when both hold:

1. the best exact size is above ``nbytes / 64`` (``_TINY``): below that zstd could save at most
   1.6% of the dense bytes for a full xor + group + compress pass;
2. a probe predicts a win: the grouped xor of a ~64 KiB sample (4 spread slices, the probe of
   :mod:`deltackpt.format.codecs`) is compressed and scaled to the piece; zstd runs on the
   whole piece when that estimate is below ``0.9 x`` the best exact size. Pieces up to
   ``_PROBE_ALL`` (256 KiB) skip the probe and are compressed whole: the probe would cost as
   much.

The final choice is the smallest payload actually built; a non-dense payload is never larger
than ``nbytes`` (DENSE is always a legal answer, whatever ``allow`` says, so
:func:`max_payload` is ``nbytes``).

Why a probe and not a density cap: what decides whether zstd wins is the entropy of the xor,
not the fraction of changed elements. Measured on 8 MiB bf16 pieces (sizes / dense; scan in
``benchmarks/bench_delta_codec.py --scan``):

=======================  =======  ======  ======  ======  =========
data (8 MiB, bf16)       changed  sparse  planes  chosen  zstd GB/s
=======================  =======  ======  ======  ======  =========
AdamW lr 1e-8 (1 step)   0.08%    0.23%   0.11%   0.23%   6.2
AdamW lr 3e-7            1.54%    4.57%   1.87%   1.87%   2.1
AdamW lr 1e-6            4.25%    10.4%   4.44%   4.44%   1.1
AdamW lr 1e-5            25.1%    31.4%   14.9%   14.9%   0.57
AdamW lr 1e-4            87.3%    93.6%   30.4%   30.4%   0.99
random values, 1%        1.00%    2.98%   3.15%   2.98%   1.6
random values, 10%       10.0%    16.3%   22.6%   16.3%   0.36
=======================  =======  ======  ======  ======  =========

On optimizer steps PLANES is 2-3x smaller than SPARSE at *every* density (it stays at 30%
where SPARSE and DENSE are ~100%), while for random replacements it never wins: a density
threshold would either skip the pre-training case or waste zstd passes on random data. The
probe (about 1-3% of a full pass on large pieces) separates the two. Rule 1 keeps the tiny
case fast (SPARSE encodes at several GB/s; the zstd pass is ~1 GB/s).

Speed (single core, 32 MiB bf16 piece, 3% changed, a 2-core AMD EPYC VM; memcpy ~20 GB/s):
mask ``np.not_equal`` 13 GB/s, ``flatnonzero`` 4 GB/s, gather/scatter by index 20+ GB/s,
boolean-mask gather/scatter 3 GB/s (so both directions go through an index array),
packbits/unpackbits 50+ GB/s, group/ungroup 3.6 GB/s, zstd-1 compress 1.3 GB/s, decompress
into a reused buffer (``stream_reader().readinto``) 3.2 GB/s vs 1.1 GB/s for ``decompress()``
(a fresh bytes object faults its pages in each time). zstd dominates a PLANES encode (its cost
grows with the number of non-zero runs: 1.3 GB/s at 3% changed, 0.6 GB/s at 15-25%), so PLANES
encodes at ~0.8 GB/s/core at 3% and SPARSE at ~2 GB/s; a CPU-bound sender trades bytes for speed
with ``allow={DENSE, SPARSE}`` (its bitmap decode, unpackbits + flatnonzero + scatter, is
the slow side at 0.5-0.8 GB/s above 4% changed). End-to-end rates:
``benchmarks/bench_delta_codec.py``.

Decoding (untrusted payloads, validated before anything is written) is in
:mod:`deltackpt.sync.delta_decode`.

Threads: numpy and zstandard release the GIL for the heavy work. Work buffers live in a
:class:`Scratch` (one per thread by default); zstd contexts are per thread.
"""

from __future__ import annotations

import struct
import threading
from dataclasses import dataclass, field

import numpy as np
import zstandard

from deltackpt.format.changes import UINT as _UINT
from deltackpt.format.changes import changed_elements, pack_changes
from deltackpt.format.codecs import _group, _sample
from deltackpt.sync.errors import SyncError

__all__ = [
    "ALL",
    "DENSE",
    "PACKED",
    "PLANES",
    "SPARSE",
    "Encoded",
    "Scratch",
    "encode",
    "max_payload",
]

DENSE, SPARSE, PLANES, PACKED = 1, 2, 3, 4
ALL: frozenset[int] = frozenset({DENSE, SPARSE, PLANES, PACKED})
KIND_NAMES = {DENSE: "dense", SPARSE: "sparse", PLANES: "planes", PACKED: "packed"}
# PACKED is tried when at most this share of the elements changed (``encode(packed_below=)``):
# above it zstd over the list costs more than over the xor planes (measured, module doc)
PACKED_BELOW = 0.25

BITMAP = 0  # SPARSE mode byte; index modes are the index width in bytes (2, 4, 8)
_INDEX_MODES = (2, 4, 8)
_HEADER = struct.Struct("<B7xQ")  # mode, count

_TINY = 64  # skip zstd when the best exact payload is <= nbytes / _TINY
_PROBE_BYTES = 64 << 10  # sample compressed to predict the PLANES size
_PROBE_ALL = 256 << 10  # pieces up to this size are compressed whole instead of probed
_PROBE_MARGIN = 0.9  # run the full zstd pass only when the probe predicts < 0.9 x best
_ZSTD_LEVEL = 1


@dataclass(frozen=True)
class Encoded:
    """One encoded piece: write ``kind`` into the wire header and send ``payload``."""

    kind: int
    payload: np.ndarray | bytes
    nbytes: int  # len(payload)
    # (element indices, new values) when the encoder listed them (PACKED, SPARSE): a caller
    # that keeps ``base`` can update it with these k elements instead of copying the piece
    changes: tuple[np.ndarray, np.ndarray] | None = None
    # ``base`` already holds the new bytes (``encode(update_base=True)`` and changes listed)
    base_updated: bool = False


@dataclass
class Scratch:
    """Work buffers kept across calls, so a sync round does not allocate per piece.

    Not thread-safe: one per thread (``encode``/``decode_into`` use a thread-local one when
    none is passed). Buffers above ``keep`` bytes are allocated per call and not kept, so one
    odd huge piece does not pin its size for the life of the thread.
    """

    keep: int = 64 << 20
    _bufs: dict[str, np.ndarray] = field(default_factory=dict, repr=False)

    def take(self, name: str, nbytes: int) -> np.ndarray:
        """A uint8 buffer of exactly ``nbytes`` (a prefix of a kept, grown-as-needed one)."""
        buf = self._bufs.get(name)
        if buf is None or buf.size < nbytes:
            buf = np.empty(max(nbytes, 1), dtype=np.uint8)
            if nbytes <= self.keep:
                self._bufs[name] = buf
        return buf[:nbytes]


_tls = threading.local()


def _thread_scratch() -> Scratch:
    scratch: Scratch | None = getattr(_tls, "scratch", None)
    if scratch is None:
        scratch = _tls.scratch = Scratch()
    return scratch


def _compressor() -> zstandard.ZstdCompressor:
    # Not thread-safe, so one per thread; threads=0 because callers parallelize over pieces.
    # No frame checksum: the receiver checks an xxh3 digest of the decoded piece anyway.
    cctx: zstandard.ZstdCompressor | None = getattr(_tls, "cctx", None)
    if cctx is None:
        cctx = _tls.cctx = zstandard.ZstdCompressor(
            level=_ZSTD_LEVEL, write_content_size=True, write_checksum=False, threads=0
        )
    return cctx


# --------------------------------------------------------------------------- sizes


def _pad8(n: int) -> int:
    return (n + 7) & ~7


def _index_width(n: int) -> int:
    return 2 if n <= 1 << 16 else 4 if n <= 1 << 32 else 8


def _sparse_layout(n: int, k: int, itemsize: int) -> tuple[int, int]:
    """(mode, payload size) of the smaller SPARSE form for k changed of n elements."""
    values = _HEADER.size + _pad8(k * itemsize)
    width = _index_width(n)
    bitmap = (n + 7) // 8
    return (BITMAP, values + bitmap) if bitmap <= k * width else (width, values + k * width)


def max_payload(nbytes: int, itemsize: int) -> int:
    """Upper bound of any payload :func:`encode` returns for a piece of ``nbytes``.

    Every kind is capped at the DENSE size: the encoder falls back to DENSE otherwise.
    """
    _check_layout(nbytes, itemsize)
    return nbytes


# --------------------------------------------------------------------------- encoding


def _check_layout(nbytes: int, itemsize: int) -> None:
    if itemsize not in _UINT:
        raise SyncError(f"itemsize must be 1, 2, 4 or 8 (the wire element size), got {itemsize!r}")
    if nbytes < 0 or nbytes % itemsize:
        raise SyncError(
            f"a piece of {nbytes} bytes is not a whole number of {itemsize}-byte elements"
        )


def _flat_u8(arr: np.ndarray, what: str) -> np.ndarray:
    if not isinstance(arr, np.ndarray) or arr.dtype != np.uint8 or not arr.flags.c_contiguous:
        raise SyncError(f"{what} must be a C-contiguous np.uint8 array, got {_describe(arr)}")
    return arr.reshape(-1)


def _describe(arr: object) -> str:
    if isinstance(arr, np.ndarray):
        return f"{arr.dtype} array of shape {arr.shape}"
    return type(arr).__name__


def encode(
    new: np.ndarray,
    base: np.ndarray,
    itemsize: int,
    *,
    allow: frozenset[int] = ALL,
    scratch: Scratch | None = None,
    packed_below: float = PACKED_BELOW,
    update_base: bool = False,
) -> Encoded | None:
    """Encode ``new`` against ``base`` (the piece as last committed); None if they are equal.

    Returns the smallest of the ``allow``-ed kinds (DENSE whenever nothing allowed is smaller
    than the piece); PACKED (and SPARSE built from its list) when at most ``packed_below`` of
    the elements changed. With ``allow`` holding PACKED but not PLANES, a piece with more
    changes is DENSE at once (the time-first policy: nothing slower than the list is tried).
    With an explicit ``scratch``, a SPARSE payload is a view of it, valid until the next
    ``encode`` with that scratch; without one it is a fresh array.

    ``update_base`` (``base`` writable; only where ``allow`` leaves PLANES out, which needs the
    old base after the list is taken): the list's pass writes the changed words into ``base``
    (``Encoded.base_updated``; the caller keeping ``base`` has nothing left to do). When more
    than ``packed_below`` changed, the result is DENSE and ``base`` may be partly written.
    """
    new, base = _flat_u8(new, "new"), _flat_u8(base, "base")
    if new.size != base.size:
        raise SyncError(f"new has {new.size} bytes but base has {base.size}; same piece?")
    _check_layout(new.size, itemsize)
    work = scratch if scratch is not None else _thread_scratch()
    uint = _UINT[itemsize]
    n = new.size // itemsize
    update = update_base and PLANES not in allow
    if PACKED in allow and n < 1 << 32:
        found = _changed(new, base, itemsize, int(n * packed_below), work, update)
        if found is None and PLANES not in allow:
            return Encoded(DENSE, new, new.size)
        if found is not None:
            idx, vals = found
            if idx.size == 0:
                return None
            packed = _encode_packed(idx, vals, itemsize)
            mode, sparse_size = _sparse_layout(n, idx.size, itemsize)
            if SPARSE in allow and sparse_size < min(packed.nbytes, new.size):
                mask = work.take("mask", n).view(np.bool_)
                mask[:] = False
                mask[idx] = True
                dst = work.take("payload", sparse_size) if scratch is not None else None
                enc = _encode_sparse(new.view(uint), mask, idx.size, mode, sparse_size, dst)
                return Encoded(enc.kind, enc.payload, enc.nbytes, (idx, vals), update)
            if packed.nbytes < new.size:
                return Encoded(packed.kind, packed.payload, packed.nbytes, (idx, vals), update)
            if update:  # no list pays, and base is new already: no second compare below
                return Encoded(DENSE, new, new.size, None, True)
    mask = work.take("mask", n).view(np.bool_)
    np.not_equal(new.view(uint), base.view(uint), out=mask)
    k = int(np.count_nonzero(mask))
    if k == 0:
        return None

    mode, sparse_size = _sparse_layout(n, k, itemsize)
    use_sparse = SPARSE in allow and sparse_size < new.size
    cheap = sparse_size if use_sparse else new.size  # exact, known before building anything
    if PLANES in allow and _planes_worth_trying(new, base, itemsize, cheap):
        planes = _encode_planes(new, base, itemsize, work)
        if planes.nbytes < cheap:
            return planes  # the sparse payload is never built
    if not use_sparse:
        return Encoded(DENSE, new, new.size)
    dst = work.take("payload", sparse_size) if scratch is not None else None
    return _encode_sparse(new.view(uint), mask, k, mode, sparse_size, dst)


def _changed(
    new: np.ndarray, base: np.ndarray, itemsize: int, cap: int, work: Scratch, update: bool
) -> tuple[np.ndarray, np.ndarray] | None:
    """(element indices as uint32, their new values) of the elements that differ, or None when
    more than ``cap`` do (:func:`deltackpt.format.changes.changed_elements`; ``update``: base
    becomes new on the way)."""
    room = cap + 8
    idx, vals = work.take("idx", 4 * room), work.take("vals", itemsize * room)
    return changed_elements(new, base, itemsize, cap, idx, vals, update=update)


def _encode_packed(idx: np.ndarray, vals: np.ndarray, itemsize: int) -> Encoded:
    """PACKED: the changed elements' index gaps and new values in one zstd frame (the layout of
    :mod:`deltackpt.format.changes`). zstd runs over ~(4 + itemsize) / itemsize x the changed
    share of the piece, not over the piece."""
    payload = pack_changes(idx, vals, itemsize, _compressor())
    return Encoded(PACKED, payload, len(payload))


def _encode_sparse(
    elems: np.ndarray, mask: np.ndarray, k: int, mode: int, size: int, dst: np.ndarray | None
) -> Encoded:
    payload = np.empty(size, dtype=np.uint8) if dst is None else dst
    _HEADER.pack_into(payload, 0, mode, k)
    idx = np.flatnonzero(mask)  # int64; fancy indexing with it beats boolean masks ~7x
    vals_end = _HEADER.size + k * elems.itemsize
    np.take(elems, idx, out=payload[_HEADER.size : vals_end].view(elems.dtype))
    pos = _HEADER.size + _pad8(k * elems.itemsize)
    payload[vals_end:pos] = 0
    if mode == BITMAP:
        payload[pos:] = np.packbits(mask)
    else:
        np.copyto(payload[pos:].view(_UINT[mode]), idx, casting="unsafe")
    vals = payload[_HEADER.size : vals_end].view(elems.dtype)
    return Encoded(SPARSE, payload, size, (idx, vals))


def _planes_worth_trying(new: np.ndarray, base: np.ndarray, itemsize: int, best: int) -> bool:
    """Rules 1 and 2 of the module docstring: is a full zstd pass likely to beat ``best``?"""
    if best * _TINY <= new.size:
        return False
    if new.size <= _PROBE_ALL:
        return True
    sample_new = _sample(new, itemsize, _PROBE_BYTES, "delta_probe_new")
    sample_base = _sample(base, itemsize, _PROBE_BYTES, "delta_probe_base")
    delta = np.bitwise_xor(sample_new, sample_base)
    grouped = np.empty_like(delta)
    _group(delta, itemsize, grouped)
    estimate = len(_compressor().compress(grouped)) * new.size / max(delta.size, 1)
    return estimate < _PROBE_MARGIN * best


def _encode_planes(new: np.ndarray, base: np.ndarray, itemsize: int, work: Scratch) -> Encoded:
    delta = work.take("xor", new.size)
    np.bitwise_xor(new, base, out=delta)
    grouped = work.take("grouped", new.size)
    _group(delta, itemsize, grouped)
    frame = _compressor().compress(grouped)
    return Encoded(PLANES, frame, len(frame))

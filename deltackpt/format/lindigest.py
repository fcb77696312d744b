"""The linear digest of a chunk: a checksum a patch can update at the cost of the patch.

Why: catching a follower up from version N to N+1 (``load(into=held, since=...)``) after an
RL-like step changes 1-3% of the elements, yet checking the result with a hash of every chunk
costs a pass over the whole state (two, with the check that ``into`` holds N). The linear digest
of a buffer is a sum over its 8-byte words, so the digest of N+1 is the digest of N minus the
terms of the words a patch overwrites plus the terms of their new values: work in proportion
to the change.

Definition (``lin-2x64``, docs/format.md): the buffer's bytes as little-endian 64-bit words
``w_0 .. w_{n-1}``, the last one zero-padded; two lanes ``a`` with ``(M, S)`` =
``(0x9E3779B97F4A7C15, 0x243F6A8885A308D3)`` and ``(0xD6E8FEB86659FD93, 0x13198A2E03707344)``;
lane value ``sum_i fmix64(w_i ^ (S + i * M)) mod 2**64`` (``fmix64``: murmur3's finalizer);
written as 32 lowercase hex digits, lane 0 first. It is a checksum against damage and mix-ups
(a wrong base, a corrupt payload), not against an adversary: a store on disk is still checked
with xxh3-128 wherever its bytes are read whole.

``deltackpt._native`` runs the loops in C, GIL released: ~27 GB/s per core where the processor
has AVX-512 (chosen at run time), ~5.5 GB/s otherwise; numpy below gives the same values, slower.
"""

from __future__ import annotations

import numpy as np

__all__ = [
    "LIN",
    "Lin",
    "changed_words",
    "lin_digest",
    "lin_shift",
    "lin_update",
    "terms_at",
    "words_at",
]

LIN = "lin-2x64"
_M = (0x9E3779B97F4A7C15, 0xD6E8FEB86659FD93)
_S = (0x243F6A8885A308D3, 0x13198A2E03707344)
_MASK = (1 << 64) - 1
_BLOCK = 1 << 20  # words per numpy block

try:  # setup.py builds it; numpy below gives the same sums
    from deltackpt._native import lin_at as _native_at
    from deltackpt._native import lin_sum as _native_sum
    from deltackpt._native import lin_terms as _native_terms
except ImportError:  # pragma: no cover - depends on the install
    _native_at = _native_sum = _native_terms = None

Lin = tuple[int, int]


def _fmix(x: np.ndarray) -> np.ndarray:
    x ^= x >> np.uint64(33)
    x *= np.uint64(0xFF51AFD7ED558CCD)
    x ^= x >> np.uint64(33)
    x *= np.uint64(0xC4CEB9FE1A85EC53)
    x ^= x >> np.uint64(33)
    return x


def _terms_np(idx: np.ndarray, words: np.ndarray) -> Lin:
    out = []
    with np.errstate(over="ignore"):
        for m, s in zip(_M, _S, strict=True):
            k = idx.astype(np.uint64) * np.uint64(m) + np.uint64(s)
            out.append(int(_fmix(words ^ k).sum(dtype=np.uint64)))
    return out[0], out[1]


def terms(idx: np.ndarray, words: np.ndarray) -> Lin:
    """The summed terms of ``words`` (uint64) at word indices ``idx`` (int64), per lane."""
    idx = np.ascontiguousarray(idx, dtype=np.int64)
    words = np.ascontiguousarray(words, dtype=np.uint64)
    if _native_terms is not None:
        return _native_terms(idx, words)
    return _terms_np(idx, words)


def _sums(buf: np.ndarray) -> Lin:
    if _native_sum is not None:
        return _native_sum(buf)
    n = buf.size // 8
    a = b = 0
    full = buf[: 8 * n].view(np.uint64) if n else np.empty(0, np.uint64)
    for lo in range(0, n, _BLOCK):
        ta, tb = _terms_np(
            np.arange(lo, min(n, lo + _BLOCK), dtype=np.int64), full[lo : lo + _BLOCK]
        )
        a, b = (a + ta) & _MASK, (b + tb) & _MASK
    if buf.size > 8 * n:
        ta, tb = _terms_np(np.array([n], np.int64), words_at(buf, np.array([n], np.int64)))
        a, b = (a + ta) & _MASK, (b + tb) & _MASK
    return a, b


def _hex(v: Lin) -> str:
    return f"{v[0]:016x}{v[1]:016x}"


def _parse(h: str) -> Lin:
    return int(h[:16], 16), int(h[16:], 16)


def lin_digest(buf: np.ndarray) -> str:
    """The linear digest of a flat uint8 array (module doc), as 32 hex digits."""
    return _hex(_sums(np.ascontiguousarray(buf).reshape(-1).view(np.uint8)))


def words_at(buf: np.ndarray, idx: np.ndarray) -> np.ndarray:
    """The 64-bit words of flat uint8 ``buf`` at word indices ``idx`` (the last one
    zero-padded), as a fresh uint64 array."""
    n = buf.size // 8
    out = np.zeros(idx.size, dtype=np.uint64)
    full = idx < n
    if n:
        out[full] = buf[: 8 * n].view(np.uint64)[idx[full]]
    if not full.all():  # the tail word
        tail = np.zeros(8, dtype=np.uint8)
        tail[: buf.size - 8 * n] = buf[8 * n :]
        out[~full] = tail.view(np.uint64)[0]
    return out


def changed_words(elements: list[np.ndarray], itemsize: int) -> np.ndarray:
    """The sorted word indices (int64) that hold any of the given element indices, each array
    strictly increasing (as patch payloads are validated to be); elements of ``itemsize`` in
    {1, 2, 4, 8} bytes never straddle two words. Linear time: no sort of one level's indices."""
    per = 8 // itemsize
    parts = [np.asarray(e, dtype=np.int64) // per for e in elements if len(e)]
    if not parts:
        return np.empty(0, dtype=np.int64)
    if len(parts) > 1:  # a chain of patches: the union, through a mark per word
        marks = np.zeros(max(int(p[-1]) for p in parts) + 1, dtype=np.bool_)
        for p in parts:
            marks[p] = True
        return np.flatnonzero(marks)
    w = parts[0]
    if w.size < 2 or per == 1:
        return w
    keep = np.empty(w.size, dtype=np.bool_)
    keep[0] = True
    np.not_equal(w[1:], w[:-1], out=keep[1:])
    return w[keep]


def terms_at(buf: np.ndarray, idx: np.ndarray) -> Lin:
    """The summed terms of flat uint8 ``buf``'s words at word indices ``idx`` (unique, int64),
    read in place."""
    if _native_at is not None:
        return _native_at(buf, np.ascontiguousarray(idx, dtype=np.int64))
    return terms(idx, words_at(buf, idx))


def lin_shift(held: str, old: Lin, new: Lin) -> str:
    """The linear digest after some words changed, from the digest ``held`` before and the
    summed terms of those words' old and new values (:func:`terms_at`, or a C scan's sums)."""
    h = _parse(held)
    return _hex(((h[0] - old[0] + new[0]) & _MASK, (h[1] - old[1] + new[1]) & _MASK))


def lin_update(held: str, idx: np.ndarray, old: np.ndarray | Lin, new: np.ndarray | Lin) -> str:
    """:func:`lin_shift` for words ``idx`` (unique) changed from ``old`` to ``new`` (the words,
    or their summed terms)."""
    o = old if isinstance(old, tuple) else terms(idx, old)
    n = new if isinstance(new, tuple) else terms(idx, new)
    return lin_shift(held, o, n)

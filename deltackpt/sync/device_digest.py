"""Digests of the pieces of a bucket message computed where the message lives (CPU or CUDA), by
torch integer operations that give the same 128 bits on every device: how a round on a CUDA
ipc link (``ipc_links.py``, ``SyncGroup(links="ipc", ipc_device="cuda:N")``) is verified
without bringing its bytes to the host.

A host round hashes every piece with xxh3-128 (``wire.py``). xxh3 needs the bytes on the host;
a device round keeps them on the device from the trainer's tensor to the receiver's, so its
header says so (``wire.MAGIC_DEVICE``) and carries this digest instead. For a piece of ``n``
bytes, as 8-byte words ``w_i`` (the tail zero-padded to a word)::

    m_i = mix(w_i ^ P[i mod K])                     mix: splitmix64's finaliser (a bijection)
    a   = sum(m_i)                                  mod 2**64
    b   = sum(m_i * Q[i mod K] * (2 * (i div K) + 1))   mod 2**64

with ``P``, ``Q`` and ``K`` (1 MiB of words) the position keys of ``format/fingerprint.py``:
the same words as a chunk fingerprint, over a whole piece. ``i`` counts from the piece's first
word, so a piece's digest does not depend on where it lies in a message (:func:`piece_digest`
of the piece alone gives it). What it detects, as the chunk fingerprint: a change of one word
always; a change of several, missed only when both sums collide (about 2**-120 per changed
piece for ordinary data: torn or stale copies, a wrong bucket, a bug); it is not a defence
against someone who can write the bucket and knows the fixed keys (neither is xxh3 there: the
header that carries the digests is in the same bucket).

All pieces of one message in one pass: every word's position in its piece comes from a running
sum of the piece starts, the two sums from two cumulative sums read at the piece boundaries,
and one device-to-host copy returns the digests (~25 elementwise passes over the message's
words, whatever the number of pieces). Device memory while it runs: about four times the
message's bytes (its words' keys, positions and two running sums).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from deltackpt.format.fingerprint import _C1, _C2, _MASKS, _mix_, position_keys
from deltackpt.options import default_digest_compile

__all__ = ["KEY_WORDS", "message_digests", "piece_digest"]

KEY_WORDS = (1 << 20) // 8  # K: position keys per run of words (the chunk fingerprint's)


def message_digests(buf: torch.Tensor, spans: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """The digest of each ``(offset, nbytes)`` span of ``buf`` (1-D uint8, on any device;
    offsets multiples of 8, spans not overlapping): the bytes past a span's end in its last
    word are not part of it. One device-to-host copy."""
    if not spans:
        return []
    if any(o % 8 or o < 0 or n < 0 for o, n in spans):
        raise ValueError(f"spans must start at multiples of 8 bytes: {list(spans)[:4]}...")
    dev = buf.device
    order = sorted(range(len(spans)), key=lambda k: spans[k][0])
    end = max(o + n for o, n in spans)
    nwords = -(-end // 8)
    if end > buf.numel():
        raise ValueError(f"spans end at byte {end}, past the buffer's {buf.numel()}")
    if nwords * 8 > buf.numel() or buf.data_ptr() % 8:  # the last word runs past the buffer
        data = torch.zeros(nwords * 8, dtype=torch.uint8, device=dev)
        data[:end] = buf[:end]
    else:
        data = buf[: nwords * 8]
    words = data.view(torch.int64)
    starts = [spans[k][0] // 8 for k in order]
    # each word's position in the piece that starts at or before it
    marks = torch.zeros(nwords + 1, dtype=torch.int64, device=dev)
    first = torch.tensor(starts, dtype=torch.int64)
    step = first.clone()
    step[1:] -= first[:-1]
    marks.index_add_(0, first.to(dev), step.to(dev))  # equal starts (empty pieces) add up
    rel = torch.arange(nwords, dtype=torch.int64, device=dev)
    rel.sub_(torch.cumsum(marks[:nwords], 0))
    p, q = position_keys(dev, KEY_WORDS)
    # a piece that ends inside a word: that word's bytes past the end are not the piece's
    tails = [(spans[k][0] + spans[k][1]) for k in order if spans[k][1] % 8]
    if tails:
        last = torch.tensor([e // 8 for e in tails], dtype=torch.int64, device=dev)
        keep = torch.tensor([(1 << (8 * (e % 8))) - 1 for e in tails], dtype=torch.int64)
        words = words.clone()
        words[last] = torch.bitwise_and(words[last], keep.to(dev))
    z, wz = _terms()(words, rel, p, q)
    del rel
    a = torch.zeros(nwords + 1, dtype=torch.int64, device=dev)
    torch.cumsum(z, 0, out=a[1:])
    del z
    b = torch.zeros(nwords + 1, dtype=torch.int64, device=dev)
    torch.cumsum(wz, 0, out=b[1:])
    del wz
    lo = torch.tensor(starts, dtype=torch.int64, device=dev)
    hi = torch.tensor(
        [-(-(spans[k][0] + spans[k][1]) // 8) for k in order], dtype=torch.int64, device=dev
    )
    out = torch.stack([a[hi] - a[lo], b[hi] - b[lo]], dim=1).cpu().tolist()
    got: list[tuple[int, int]] = [(0, 0)] * len(spans)
    for j, k in enumerate(order):
        got[k] = (int(out[j][0]), int(out[j][1]))
    return got


def mix_terms(
    words: torch.Tensor, rel: torch.Tensor, p: torch.Tensor, q: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every word's two terms: ``m_i`` and ``m_i * Q[i mod K] * (2 * (i div K) + 1)``, for the
    words ``words`` at positions ``rel`` in their pieces (the reference: torch operations
    one pass each)."""
    at = torch.remainder(rel, KEY_WORDS)
    z = torch.bitwise_xor(words, p[at])
    _mix_(z, torch.empty_like(z))
    weight = torch.div(rel, KEY_WORDS, rounding_mode="floor").mul_(2).add_(1)
    weight.mul_(q[at])
    return z, weight.mul_(z)


def _mix_pure(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser without in-place work (what a compiler fuses)."""
    for s, c in ((30, _C1), (27, _C2), (31, None)):
        x = x ^ ((x >> s) & _MASKS[s])
        if c is not None:
            x = x * c
    return x


def _mix_terms_pure(
    words: torch.Tensor, rel: torch.Tensor, p: torch.Tensor, q: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    at = rel % KEY_WORDS
    z = _mix_pure(words ^ p[at])
    return z, z * (q[at] * ((rel // KEY_WORDS) * 2 + 1))


_COMPILED: list[object] = []


def _terms() -> object:
    """:func:`mix_terms`, or with ``DELTACKPT_DIGEST_COMPILE=on`` the same terms by one fused
    kernel (``torch.compile``; the same integers: a test and the device check compare them)."""
    if default_digest_compile() != "on":
        return mix_terms
    if not _COMPILED:
        _COMPILED.append(torch.compile(_mix_terms_pure, dynamic=True))
    return _COMPILED[0]


def piece_digest(data: torch.Tensor) -> tuple[int, int]:
    """The digest of one piece's bytes (1-D uint8), as :func:`message_digests` gives it for
    the same bytes anywhere in a message."""
    return message_digests(data.reshape(-1), [(0, data.numel())])[0]

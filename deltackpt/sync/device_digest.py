"""Digests of the pieces of a bucket message computed where the message lives (CPU or CUDA), by
torch integer operations that give the same 128 bits on every device: how a round on a CUDA
ipc link (``ipc_links.py``, ``SyncGroup(links="ipc", ipc_device="cuda:N")``) is verified
without bringing its bytes to the host.

A host round hashes every piece with xxh3-128 (``wire.py``). xxh3 needs the bytes on the host;
a device round keeps them on the device from the trainer's tensor to the receiver's, so its
header says so (``wire.MAGIC_DEVICE``) and carries this digest instead: the chunk fingerprints
of ``format/fingerprint.py`` over the piece (1 MiB chunks counted from the piece's first byte,
the tail zero-padded to a word), folded into one pair by the same fingerprint over the list of
chunk fingerprints::

    digest(piece) = fingerprint(a_0, b_0, a_1, b_1, ...)      (a_c, b_c): chunk c's two sums

so a piece's digest does not depend on where it lies in a message, and a sender whose device
scan fingerprinted a whole tensor this round (``host_mirror.py``) has its digest for the cost
of the fold. What it detects, as the chunk fingerprint: a change of one word, always (it moves
its chunk's ``a``, which moves the fold's); a change of several, missed only when the sums
collide (about 2**-120 per changed piece for ordinary data: torn or stale copies, a wrong
bucket, a bug); it is not a defence against someone who can write the bucket and knows the
fixed keys (neither is xxh3 there: the header that carries the digests is in the same bucket).

Cost: the pieces' chunks are fingerprinted together (``fingerprint.many_fingerprints``: pieces
of half a slab or more in place, the others' full chunks and all tails concatenated into a few
slabs, one copy), at the fingerprint's speed (~117 GB/s on one H200, 88 GB/s on one H100,
measured); the folds of all pieces together; one device-to-host copy per message. Device memory
while it runs: the slabs and two work buffers of at most ``fingerprint.SLAB_BYTES`` each.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from deltackpt import cuda
from deltackpt.format.fingerprint import fingerprint_rows, many_fingerprints
from deltackpt.options import fingerprint_kernel

__all__ = [
    "CHUNK",
    "fold",
    "message_digest_rows",
    "message_digests",
    "piece_digest",
    "rows_on_host",
]

CHUNK = 1 << 20  # bytes per chunk fingerprint (the sender's device scan uses the same)
_WORDS = CHUNK // 8


def fold(fps: Sequence[torch.Tensor]) -> torch.Tensor:
    """The digests [n, 2] of ``n`` pieces from their chunk fingerprints (each [chunks, 2], on
    one device): the fingerprint of each list of words ``a_0, b_0, a_1, ...`` (a list of no
    words: 0, 0), all at once. Lists of as many words are stacked into one matrix and
    fingerprinted together (``fingerprint.fingerprint_rows``): a few operations per distinct
    length, not per piece (a bucket of a model's tensors has a handful of lengths; the host
    work of a round of many tensors is what a device round is short of)."""
    counts = [f.numel() for f in fps]
    if max(counts) > _WORDS:
        raise ValueError(f"a piece of more than {_WORDS // 2} chunks ({_WORDS // 2} MiB)")
    dev = fps[0].device
    by_words: dict[int, list[int]] = {}
    for i, n in enumerate(counts):
        by_words.setdefault(n, []).append(i)
    kernel = "compile" if fingerprint_kernel() == "compile" else "torch"
    parts: list[torch.Tensor] = []
    order: list[int] = []
    for n, idx in by_words.items():
        if n:
            words = torch.stack([fps[i].reshape(-1) for i in idx])  # [len(idx), n] int64
            parts.append(fingerprint_rows(words, kernel))
        else:
            parts.append(torch.zeros(len(idx), 2, dtype=torch.int64, device=dev))
        order += idx
    rows = parts[0] if len(parts) == 1 else torch.cat(parts)
    if order == list(range(len(fps))):
        return rows
    at = cuda.to_device(torch.tensor(order, dtype=torch.int64), dev)
    return torch.empty_like(rows).index_copy_(0, at, rows)


def message_digest_rows(
    buf: torch.Tensor,
    spans: Sequence[tuple[int, int]],
    known: Mapping[int, torch.Tensor] | None = None,
    sources: Mapping[int, torch.Tensor] | None = None,
) -> torch.Tensor:
    """:func:`message_digests` left where ``buf`` lives: an int64 tensor [len(spans), 2],
    nothing waited for (the sender writes them into its header on the device, the receiver
    compares a round's at once). ``sources``: span index -> the span's bytes (flat uint8) on
    another device, where they were copied into ``buf`` from (a GPU's tensors packed into a
    host bucket): given for every span that is not ``known``, the digests are taken there and
    left there, and nothing of ``buf`` is read."""
    dev = buf.device
    if sources:
        dev = next(iter(sources.values())).device
    elif known:
        dev = next(iter(known.values())).device
    if not spans:
        return torch.zeros(0, 2, dtype=torch.int64, device=dev)
    if any(o < 0 or n < 0 or o + n > buf.numel() for o, n in spans):
        raise ValueError(f"spans must lie in the buffer of {buf.numel()} bytes: {list(spans)[:4]}")
    known = known or {}
    # a known list of no chunks (an empty tensor's scan) is not used: the digest counts one
    # chunk of no words. (A known list need not match its span: a device patch's span is the
    # patch, its digest the new piece's, from the scan.)
    fps: list[torch.Tensor | None] = [
        f if (f := known.get(k)) is not None and f.shape[0] else None for k in range(len(spans))
    ]
    todo = [k for k, (_, n) in enumerate(spans) if fps[k] is None and n]
    srcs = sources or {}
    if any(srcs[k].numel() != spans[k][1] for k in todo if k in srcs):
        raise ValueError("a source must hold its span's bytes")
    views = iter(_views(buf, [spans[k] for k in todo if k not in srcs]))
    pieces = [srcs[k] if k in srcs else next(views) for k in todo]
    got = many_fingerprints(pieces, CHUNK, fingerprint_kernel())
    for k, f in zip(todo, got, strict=True):
        fps[k] = f
    for k, (_, n) in enumerate(spans):
        if not n:  # one chunk of no words
            fps[k] = torch.zeros(1, 2, dtype=torch.int64, device=dev)
    return fold([f.to(dev) for f in fps if f is not None])


def _views(buf: torch.Tensor, spans: Sequence[tuple[int, int]]) -> list[torch.Tensor]:
    """``buf[o : o + n]`` for each span, in order: where the spans lie in rising order without
    overlapping (a message's pieces), from one ``split`` of ``buf`` into them and the gaps
    between them (one call, not a slice per piece: the host work of a round of many tensors)."""
    if not spans:
        return []
    sizes: list[int] = []
    at = spans[0][0]
    for o, n in spans:
        if o < at:  # out of order or overlapping: a slice each
            return [buf[o : o + n] for o, n in spans]
        sizes += (o - at, n)
        at = o + n
    return list(buf[spans[0][0] : at].split(sizes)[1::2])


def rows_on_host(rows: Sequence[torch.Tensor]) -> list[list[list[int]]]:
    """Digest rows (:func:`message_digest_rows`' tensors) read to the host, each as a list of
    ``[a, b]``: one copy per device they lie on (the rows of a round's messages may lie on
    the GPU whose tensors were copied into host buckets, on the CPU where a bucket had nothing
    to digest, or on another GPU), never a concatenation across devices."""
    by_dev: dict[torch.device, list[int]] = {}
    for i, r in enumerate(rows):
        if r.shape[0]:
            by_dev.setdefault(r.device, []).append(i)
    out: list[list[list[int]]] = [[] for _ in rows]
    for idx in by_dev.values():
        flat = torch.cat([rows[i] for i in idx]).cpu().tolist()
        at = 0
        for i in idx:
            out[i] = flat[at : at + rows[i].shape[0]]
            at += rows[i].shape[0]
    return out


def message_digests(
    buf: torch.Tensor,
    spans: Sequence[tuple[int, int]],
    known: Mapping[int, torch.Tensor] | None = None,
    sources: Mapping[int, torch.Tensor] | None = None,
) -> list[tuple[int, int]]:
    """The digest of each ``(offset, nbytes)`` span of ``buf`` (1-D uint8, on any device).
    ``known``: span index -> its chunk fingerprints, already taken (the sender's device scan
    of a whole tensor): only folded; ``sources``: as :func:`message_digest_rows`. One
    device-to-host copy."""
    out = message_digest_rows(buf, spans, known, sources).cpu().tolist()
    return [(int(a), int(b)) for a, b in out]


def piece_digest(data: torch.Tensor) -> tuple[int, int]:
    """The digest of one piece's bytes (1-D uint8), as :func:`message_digests` gives it for
    the same bytes anywhere in a message."""
    return message_digests(data.reshape(-1), [(0, data.numel())])[0]

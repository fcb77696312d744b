"""The bytes of a bucket message, and filling / hashing its pieces from strided sources.

One message per planned bucket per round, ``header + payload``:

* header, int64 words: magic, round seq, version, bucket index, status (1 ok, 2 abort),
  pieces present, payload bytes, base version + 1 (0: no patches); then per planned piece
  three words: ``flag | kind << 2 | length << 8`` (flag 0 absent, 1 in this message, 2 sent as
  its own message; kind :data:`RAW` or a patch kind of ``delta_codec``; length its payload
  bytes) and the xxh3-128 of the piece's *new* bytes as two int64. Its size is fixed by the
  schedule, so the receiver knows it. A device round's message (a CUDA ipc link: the bytes
  never leave the device) starts with :data:`MAGIC_DEVICE` and carries the device digest of
  ``device_digest.py`` instead of xxh3, and raw pieces or device patches
  (:data:`DEVICE_PATCH`, ``device_delta.py``).
* payload: the present pieces, each at the next ``align``-byte offset: first those in the
  message, in planned order, then those sent on their own (:func:`layout`, computed the same
  way at both ends from the flags and lengths). A full round sends every piece raw; a delta
  round only the pieces that changed since the last committed round, raw or as a patch
  against the bytes the receiver holds (the round's base version). A failed sender sends
  header-only messages with status 2 for the rest of the round, so no posted receive waits
  for bytes that never come.
* zero-copy pieces (gloo links): a large contiguous piece that needs no cast is sent straight
  from the trainer's tensor as its own message, tag :func:`direct_tag`, after its bucket's
  message; the receiver posts its receive into the piece's place in the staging slot as soon
  as it has read the header. The header still carries its digest, hashed in place.

Pieces are boxes of the sender's local shard (strided views: a column slice of a row shard).
:func:`pack` casts (or gathers) one in row chunks of ~256 KiB and hashes each chunk while it
is in cache, from the sender's own memory: into a small private scratch, hashed there, then
copied into the flat buffer when that buffer is a shared-memory window another process can
write (the digest names the bytes the sender meant to send: docs/sync.md, Untrusted shared
memory), straight into the buffer when it is the sender's private ring. :func:`hash_piece`
hashes the same bytes without writing them anywhere big (contiguous same-dtype sources are
hashed in place; others through a small scratch buffer), so a delta round reads every source
once and copies only the changed pieces. The digest of a piece is the same either way (xxh3 is streamed over the same
byte sequence).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch
import xxhash

from deltackpt.sync import delta_codec
from deltackpt.sync.errors import SyncError

__all__ = [
    "ABORT",
    "DIRECT",
    "HEAD",
    "OK",
    "direct_tag",
    "hash_piece",
    "hash_tensor",
    "header_words",
    "layout",
    "pack",
    "raw_bytes",
    "read_header",
]

MAGIC = 0x6D786E73796E64  # "mxnsynd": pieces carry a kind and a length
# a device round's message (sync/device_digest.py): its digests are device digests, not xxh3
MAGIC_DEVICE = 0x6D786E73796E65
RAW = 0  # a piece's kind: its bytes as they are; else a delta_codec kind (PATCH_KINDS)
PATCH_KINDS = frozenset((delta_codec.SPARSE, delta_codec.PLANES, delta_codec.PACKED))
DEVICE_PATCH = 5  # a device round's patch of changed elements (sync/device_delta.py)
HEAD = 8
OK, ABORT = 1, 2
IN_MESSAGE, DIRECT = 1, 2  # piece flags (0: absent)
MAX_DIRECT = 1023  # zero-copy pieces per bucket (the tag has 10 bits for them)
MAX_DIRECT_BUCKETS = 1 << 20  # buckets per link that may carry zero-copy pieces
_CHUNK = 256 << 10


def direct_tag(index: int, j: int) -> int:
    """Tag of the ``j``-th zero-copy piece of bucket ``index`` (bucket messages use the bucket
    index: below ``1 << 30``)."""
    return (1 << 30) | (index << 10) | j


def layout(
    sizes: list[int], flags: list[int], start: int, align: int
) -> tuple[list[int | None], int, int]:
    """(offset of every piece or None, end of the bucket message, end of the payload): pieces
    flagged :data:`IN_MESSAGE` first, in planned order, then the :data:`DIRECT` ones, each at
    the next ``align``-byte offset from ``start``, taking ``sizes[k]`` bytes (its payload
    length: a patch is shorter than its piece). Any subset in this order ends at most
    ``align`` bytes past the planned capacity (only the padding of the last piece differs)."""
    offsets: list[int | None] = [None] * len(sizes)
    pos = start
    for want in (IN_MESSAGE, DIRECT):
        for k, (n, f) in enumerate(zip(sizes, flags, strict=True)):
            if f == want:
                pos = -(-pos // align) * align
                offsets[k] = pos
                pos += n
        if want == IN_MESSAGE:
            msg_end = pos
    return offsets, msg_end, pos


def header_words(n_pieces: int) -> int:
    return HEAD + 3 * n_pieces


def digest_words(h: xxhash.xxh3_128) -> tuple[int, int]:
    raw = h.digest()
    return int.from_bytes(raw[:8], "big", signed=True), int.from_bytes(raw[8:], "big", signed=True)


@dataclass(frozen=True)
class Piece:
    """One present piece in a header: ``flag`` (:data:`IN_MESSAGE` / :data:`DIRECT`),
    ``kind`` (:data:`RAW`, or a ``delta_codec`` kind: a patch against the receiver's base),
    ``length`` (its payload bytes) and the xxh3-128 of the piece's *new* bytes."""

    flag: int
    kind: int
    length: int
    digest: tuple[int, int]


@dataclass(frozen=True)
class Header:
    """A bucket message's header as read (validated) by :func:`read_header`. ``base``: the
    version the round's patches apply to (None: no patches)."""

    status: int
    version: int
    base: int | None
    pieces: list[Piece | None]
    payload: int
    device: bool = False  # the digests are device digests (MAGIC_DEVICE), not xxh3-128

    @property
    def flags(self) -> list[int]:
        return [0 if p is None else p.flag for p in self.pieces]

    @property
    def lengths(self) -> list[int]:
        return [0 if p is None else p.length for p in self.pieces]


def write_header(
    buf: torch.Tensor,
    seq: int,
    version: int,
    index: int,
    status: int,
    pieces: list[Piece | None],
    payload: int,
    base: int | None = None,
    device: bool = False,
) -> int:
    """Fill the header at the start of ``buf`` (uint8, on any device); returns its size in
    bytes. ``device``: the digests are device digests (``device_digest.py``)."""
    n = len(pieces)
    words = np.zeros(header_words(n), dtype=np.int64)
    words[:HEAD] = [
        MAGIC_DEVICE if device else MAGIC,
        seq,
        version,
        index,
        status,
        sum(p is not None for p in pieces),
        payload,
        0 if base is None else base + 1,
    ]
    for k, p in enumerate(pieces):
        if p is not None:
            code = p.flag | p.kind << 2 | p.length << 8
            words[HEAD + 3 * k : HEAD + 3 * k + 3] = (code, p.digest[0], p.digest[1])
    raw = words.view(np.uint8)
    buf[: raw.size].copy_(torch.from_numpy(raw))
    return raw.size


def put_digests(buf: torch.Tensor, present: list[int], rows: torch.Tensor) -> None:
    """Write the digests ``rows`` [len(present), 2] (where ``buf`` lives) of pieces
    ``present`` (rising) into the header :func:`write_header` left at the start of ``buf``:
    one copy per run of consecutive pieces, nothing waited for (device to device, or from a GPU
    into a page-locked host bucket: the publish waits for the digests' device; into pageable
    memory CUDA itself copies before returning)."""
    if not present:
        return
    n = present[-1] + 1
    words = buf[HEAD * 8 : (HEAD + 3 * n) * 8].view(torch.int64).view(n, 3)
    j = 0
    while j < len(present):
        e = j
        while e + 1 < len(present) and present[e + 1] == present[e] + 1:
            e += 1
        words[present[j] : present[e] + 1, 1:].copy_(rows[j : e + 1], non_blocking=True)
        j = e + 1


def read_header(buf: torch.Tensor, seq: int, index: int, sizes: list[int], capacity: int) -> Header:
    """The header of a received message whose planned pieces are ``sizes`` bytes each;
    :class:`SyncError` when it is not the message expected here (untrusted input)."""
    n_pieces = len(sizes)
    size = header_words(n_pieces) * 8
    if buf.numel() < size:
        raise SyncError(
            f"bucket {index} of round {seq}: its header holds {buf.numel()} bytes, a header of "
            f"{n_pieces} pieces {size}; the ranks disagree about the schedule or a message was "
            "corrupted"
        )
    head = buf[:size] if buf.device.type == "cpu" else buf[:size].cpu()  # a device slot
    words = head.numpy().view(np.int64)
    magic, s, version, idx, status, npresent, payload, base = (int(x) for x in words[:HEAD])
    if (
        magic not in (MAGIC, MAGIC_DEVICE)
        or s != seq
        or idx != index
        or status not in (OK, ABORT)
        or base < 0
    ):
        raise SyncError(
            f"bucket message out of step: expected round {seq} bucket {index}, got magic "
            f"{magic:#x} round {s} bucket {idx} status {status}; the ranks disagree about "
            "the schedule or a message was corrupted"
        )
    # every piece's word checked at once (numpy), then the present ones made into Pieces
    table = words[HEAD : HEAD + 3 * n_pieces].reshape(n_pieces, 3)
    code = table[:, 0]
    flag, kind, length = code & 3, (code >> 2) & 63, code >> 8
    planned = np.asarray(sizes, dtype=np.int64)
    present = flag != 0
    raw = kind == RAW
    if magic == MAGIC:
        patch_kind = np.isin(kind, np.fromiter(PATCH_KINDS, np.int64, len(PATCH_KINDS)))
    else:
        patch_kind = kind == DEVICE_PATCH
    ok = ((flag == 0) | (flag == IN_MESSAGE) | (flag == DIRECT)) & (code >= 0)
    ok &= present | (code == 0)
    ok &= ~(present & raw) | (length == planned)
    # a patch: in the message, never longer than the piece; a host patch in a host round's
    # message, a device patch in a device round's
    ok &= ~(present & ~raw) | (
        (flag == IN_MESSAGE) & (length > 0) & (length <= planned) & patch_kind
    )
    if status != OK:
        ok &= ~present
    bad = np.flatnonzero(~ok)
    if bad.size:
        k = int(bad[0])
        raise SyncError(
            f"bucket {index} of round {seq}: piece {k} has flag {int(flag[k])} kind "
            f"{int(kind[k])} length {int(length[k])} (status {status}, planned {sizes[k]} "
            "bytes); expected flag 0, 1 or 2 (none in an abort message), a raw piece of its "
            "planned size or a patch no longer than it"
        )
    patches = np.flatnonzero(present & ~raw)
    if patches.size and not base:  # a patch applies to the version the header names
        raise SyncError(
            f"bucket {index} of round {seq}: its header names patched pieces (piece "
            f"{int(patches[0])}) but no version they patch; a message was corrupted"
        )
    pieces: list[Piece | None] = [None] * n_pieces
    at = np.flatnonzero(present)
    for k, f, kd, n, hi, lo in zip(
        at.tolist(),
        flag[at].tolist(),
        kind[at].tolist(),
        length[at].tolist(),
        table[at, 1].tolist(),
        table[at, 2].tolist(),
        strict=True,
    ):
        pieces[k] = Piece(f, kd, n, (hi, lo))
    if sum(p is not None for p in pieces) != npresent or not 0 <= payload <= capacity:
        raise SyncError(
            f"bucket {index} of round {seq}: header claims {npresent} pieces / {payload} "
            f"bytes, flags say {sum(p is not None for p in pieces)} (capacity {capacity})"
        )
    return Header(
        status, version, base - 1 if base else None, pieces, payload, magic == MAGIC_DEVICE
    )


def _rows(src: torch.Tensor, itemsize: int) -> Iterator[torch.Tensor]:
    """``src`` in chunks of whole leading-dim rows, about ``_CHUNK`` bytes each."""
    if src.dim() == 0:
        yield src.reshape(1)
        return
    if src.shape[0] == 0:
        return
    row = max(1, math.prod(src.shape[1:]) * itemsize)
    step = max(1, _CHUNK // row)
    for i in range(0, src.shape[0], step):
        yield src[i : i + step]


def copy_into(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)``; as raw bytes when no cast is needed and both rows are contiguous
    (a byte copy is a plain memcpy per row, much faster than an element-typed bf16 copy)."""
    _cast_into(dst, src)


def _cast_into(dst: torch.Tensor, src: torch.Tensor) -> None:
    """:func:`copy_into` into this process' own memory (the private scratch of :func:`pack`
    and :func:`hash_piece`); :func:`copy_into` is what writes a message or a target."""
    if (
        dst.dtype == src.dtype
        and dst.dtype.itemsize > 1
        and dst.dim() >= 1
        and dst.shape == src.shape
        and dst.stride(-1) == 1
        and src.stride(-1) == 1
    ):
        try:
            dst.view(torch.uint8).copy_(src.view(torch.uint8))
            return
        except RuntimeError:  # a layout the byte view does not take (conj/neg bits, ...)
            pass
    dst.copy_(src)


def pack(
    src: torch.Tensor,
    dst: torch.Tensor,
    wire: torch.dtype,
    digest: tuple[int, int] | None = None,
    scratch: torch.Tensor | None = None,
    *,
    shared: bool = True,
) -> tuple[int, int]:
    """Copy (cast) ``src`` into the flat uint8 ``dst`` (exactly its bytes); returns the digest
    of the bytes meant for ``dst``, hashed from this process' own memory. A contiguous source
    that needs no cast is hashed in place and copied in one go (``digest``: its raw bytes'
    digest, already known, so it is only copied). Any other is cast chunk by chunk: with
    ``shared`` (``dst`` may be written by another process: a shared-memory link window) into
    ``scratch`` (uint8, grown when a chunk does not fit; None: allocated here), hashed there
    and copied into ``dst``, so a write into ``dst`` after the copy is never hashed; without it
    (``dst`` is the caller's private buffer) straight into ``dst``, hashed there while the
    chunk is in cache (one pass less: about 1.5x faster)."""
    if src.dtype == wire and src.is_contiguous():
        raw = src.reshape(-1).view(torch.uint8)
        if digest is None:
            h = xxhash.xxh3_128()
            h.update(raw.numpy())
            digest = digest_words(h)
        dst.copy_(raw)
        return digest
    h = xxhash.xxh3_128()
    pos = 0
    for chunk in _rows(src, wire.itemsize):
        n = chunk.numel() * wire.itemsize
        if not shared:
            copy_into(dst[pos : pos + n].view(wire).view(chunk.shape), chunk)
            h.update(dst[pos : pos + n].numpy())
            pos += n
            continue
        if scratch is None or n > scratch.numel():
            scratch = torch.empty(n, dtype=torch.uint8)
        mine = scratch[:n]
        _cast_into(mine.view(wire).view(chunk.shape), chunk)
        h.update(mine.numpy())  # private: a write into dst after the copy is never hashed
        copy_into(dst[pos : pos + n], mine)
        pos += n
    return digest_words(h)


def raw_bytes(t: torch.Tensor, wire: torch.dtype) -> torch.Tensor | None:
    """``t`` as its flat uint8 bytes where they are its values as ``wire`` (of that dtype,
    contiguous, no conjugate or negative bit): a piece copied to or from it is a byte copy;
    None where it needs more (a cast, a box with gaps)."""
    if t.dtype != wire or not t.is_contiguous() or t.is_conj() or t.is_neg():
        return None
    return t.reshape(-1).view(torch.uint8)


def fill(dst: torch.Tensor, src: torch.Tensor, wire: torch.dtype) -> None:
    """Copy (cast) ``src`` into the flat uint8 ``dst`` (exactly its bytes), without hashing."""
    raw = raw_bytes(src, wire)
    if raw is not None:
        dst.copy_(raw)
    elif src.numel():
        copy_into(dst.view(wire).view(src.shape), src)


def hash_piece(src: torch.Tensor, wire: torch.dtype, scratch: torch.Tensor) -> tuple[int, int]:
    """The digest :func:`pack` would return for ``src``, without writing it to a bucket.
    ``scratch``: a uint8 buffer of at least ``_CHUNK`` bytes (or one row) to cast into."""
    h = xxhash.xxh3_128()
    if src.dtype == wire and src.is_contiguous():
        h.update(src.reshape(-1).view(torch.uint8).numpy())
        return digest_words(h)
    for chunk in _rows(src, wire.itemsize):
        n = chunk.numel() * wire.itemsize
        if n > scratch.numel():
            scratch = torch.empty(n, dtype=torch.uint8)
        _cast_into(scratch[:n].view(wire).view(chunk.shape), chunk)
        h.update(scratch[:n].numpy())
    return digest_words(h)


SCRATCH = _CHUNK


def hash_tensor(t: torch.Tensor) -> tuple[int, int]:
    """Digest of a contiguous tensor's raw bytes, in place (its own dtype, no cast)."""
    h = xxhash.xxh3_128()
    if t.numel():
        h.update(t.reshape(-1).view(torch.uint8).numpy())
    return digest_words(h)


def verify(buf: torch.Tensor) -> tuple[int, int]:
    """Digest of received bytes (a flat uint8 view; on a device: copied to the host first)."""
    h = xxhash.xxh3_128()
    h.update(buf.cpu().numpy())
    return digest_words(h)

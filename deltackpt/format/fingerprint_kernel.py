"""The chunk fingerprints of ``fingerprint.py`` as one Triton kernel (CUDA;
``DELTACKPT_FINGERPRINT_COMPILE=auto``, the default, or ``triton``): the same integers as the torch operations, which stay
the reference.

The torch operations make ~16 passes over the bytes (each a kernel, each reading and writing the
work buffers); ``torch.compile`` fuses them (about 4x faster on an H100, measured) but its first
call compiles for ~15 s, and each call checks its guards. This kernel reads each word once and
keeps everything else in registers, fingerprints every chunk of every source in one launch
without copying them together (each row of its table is a word address and a byte count, as
the grouped GEMM of Triton's tutorials takes its matrices; a row's last word counts only its
bytes), and needs no work buffers: one row of partial sums per block of words, summed by torch
afterwards. Its first call compiles in about a second (cached on disk by Triton).

The same kernel also stores the words it loads (``COPY``): :func:`copy_spans` (a receiver's copy
of a message out of the shared bucket) and :func:`copy_into` (a sender's pack of whole tensors
into its bucket) copy and fingerprint in one pass, the fingerprints those of the words stored
(docs/sync.md, Device passes; ``DELTACKPT_FUSED_COPY``).

On CPU tensors it runs in Triton's interpreter (numpy, ``TRITON_INTERPRET=1`` set before Triton
is imported): how the test suite checks it where Triton is installed without a GPU; nothing on
CPU uses it otherwise.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from deltackpt import cuda

try:  # the kernel's language, at module level as Triton's compiler reads it
    import triton.language as tl
except ImportError:  # no Triton: available() says so and nothing here runs
    tl = None

__all__ = [
    "BLOCK",
    "INTERPRET_BLOCK",
    "available",
    "copy_into",
    "copy_spans",
    "disable",
    "many",
    "refused",
    "refused_into",
    "table",
    "whole_words",
]


def _interpreting() -> bool:
    """Whether Triton runs kernels in its interpreter (its knob, which ``TRITON_INTERPRET=1``
    sets: Triton reads the variable, not deltackpt)."""
    import triton

    knobs = getattr(triton, "knobs", None)  # Triton >= 3.4
    return bool(knobs is not None and knobs.runtime.interpret)


BLOCK = 2048  # words per program (16 KiB of the source, with the keys' 32 KiB: from L2)
#: words per program in Triton's interpreter (CPU tensors: the tests), which runs the programs
#: one by one in numpy: fewer, larger ones (the same kernel; the sums wrap, in any order)
INTERPRET_BLOCK = 1 << 14


def _body(
    addr_ptr,
    dst_ptr,
    bytes_ptr,
    p_ptr,
    q_ptr,
    out_ptr,
    NBLK,
    BLOCK: tl.constexpr,
    COPY: tl.constexpr,
):
    """Block ``blk`` of row ``row``: its words' two partial sums into ``out[row, blk]``; a
    row's last word counts only its row's bytes (the rest zero, as a zero-padded tail: the
    fingerprints of ``fingerprint.py``). With ``COPY``, the words it loaded also stored, whole,
    at ``dst_ptr``'s row (:func:`copy_spans`: the fingerprints are those of exactly the bytes
    written)."""
    row = tl.program_id(0)
    blk = tl.program_id(1)
    nb = tl.load(bytes_ptr + row)
    n = (nb + 7) // 8
    offs = blk * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    base = tl.load(addr_ptr + row).to(tl.pointer_type(tl.int64))
    raw = tl.load(base + offs, mask=m, other=0)
    if COPY:
        dst = tl.load(dst_ptr + row).to(tl.pointer_type(tl.int64))
        tl.store(dst + offs, raw, mask=m)
    w = raw.to(tl.uint64, bitcast=True)
    # the last word's bytes past the row's end: zero (little-endian: its high bytes)
    ones = tl.full((), -1, tl.int64).to(tl.uint64, bitcast=True)
    keep = ones >> ((8 * n - nb) * 8).to(tl.uint64)
    w = tl.where(offs == n - 1, w & keep, w)
    p = tl.load(p_ptr + offs, mask=m, other=0).to(tl.uint64, bitcast=True)
    q = tl.load(q_ptr + offs, mask=m, other=0).to(tl.uint64, bitcast=True)
    z = w ^ p
    z = z ^ (z >> 30)
    z = z * 0xBF58476D1CE4E5B9
    z = z ^ (z >> 27)
    z = z * 0x94D049BB133111EB
    z = z ^ (z >> 31)
    z = tl.where(m, z, 0)
    a = tl.sum(z, axis=0)
    b = tl.sum(z * q, axis=0)
    at = out_ptr + (row * NBLK + blk) * 2
    tl.store(at, a.to(tl.int64, bitcast=True))
    tl.store(at + 1, b.to(tl.int64, bitcast=True))


_KERNEL: list[Any] = []


def _kernel() -> Any:
    """The kernel (``triton.jit``: compiled for the GPU at its first launch; under
    ``TRITON_INTERPRET=1``, set before Triton is imported, run by its interpreter)."""
    if not _KERNEL:
        import triton

        _KERNEL.append(triton.jit(_body))
    return _KERNEL[0]


_FAILED: list[BaseException] = []  # the kernel failed under ``auto``: not tried again


def disable(why: BaseException) -> None:
    """The kernel failed (``DELTACKPT_FINGERPRINT_COMPILE=auto``): :func:`available` says no
    from now on in this process."""
    _FAILED.append(why)


def available(device: torch.device) -> bool:
    """Whether this kernel can fingerprint bytes on ``device``: Triton is importable (and the
    kernel did not fail under ``auto``), and on CPU its interpreter was asked for
    (``TRITON_INTERPRET=1``: the tests)."""
    if tl is None or _FAILED:
        return False
    return device.type == "cuda" or (device.type == "cpu" and _interpreting())


def table(
    sources: Sequence[torch.Tensor], chunk_bytes: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[torch.Tensor]]:
    """The kernel's table for ``sources`` (1-D uint8, one device): per row (a chunk, or a
    source's last partial chunk), its first word's address and its byte count; the rows per
    source; the copies the table points into, which must live until the launch. A source not
    8-byte aligned is copied first, and so is a tail whose last word lies past the source's
    storage (zero-padded, so that no word is read past what the source owns; a tail ending
    inside a word of its storage is read in place, the kernel counting only its bytes): both
    rare, done per source; everything else is a few numpy operations for all the sources (no
    Python per source past reading its address and size: a round of many small tensors is
    host work otherwise)."""
    n = len(sources)
    ptr = np.fromiter((s.data_ptr() for s in sources), np.int64, n)
    size = np.fromiter((s.numel() for s in sources), np.int64, n)
    full, tail = np.divmod(size, chunk_bytes)
    tail_at = ptr + full * chunk_bytes
    keep: list[torch.Tensor] = []
    for i in np.flatnonzero(((ptr % 8 != 0) & (size > 0)) | (tail % 8 != 0)).tolist():
        s = sources[i]
        if s.data_ptr() % 8:
            s = s.clone()
            keep.append(s)
            ptr[i] = s.data_ptr()
            tail_at[i] = ptr[i] + full[i] * chunk_bytes
        if tail[i] % 8 and not whole_words(s):  # its last word past its storage: a copy
            t = int(tail[i])
            padded = torch.zeros(-(-t // 8) * 8, dtype=torch.uint8, device=s.device)
            padded[:t] = s[int(full[i]) * chunk_bytes :]
            keep.append(padded)
            tail_at[i] = padded.data_ptr()
    addr, nbytes, rows_of = _rows(ptr, size, chunk_bytes, tail_at)
    return addr, nbytes, rows_of, keep


def _rows(
    ptr: np.ndarray, size: np.ndarray, chunk_bytes: int, tail_at: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per row (a chunk of a source at ``ptr`` of ``size`` bytes, or its last partial chunk,
    read at ``tail_at`` where given): its address and byte count; the rows per source."""
    full, tail = np.divmod(size, chunk_bytes)
    if tail_at is None:
        tail_at = ptr + full * chunk_bytes
    rows_of = full + (tail > 0)
    src = np.repeat(np.arange(ptr.size, dtype=np.int64), rows_of)
    first = np.cumsum(rows_of) - rows_of  # each source's first row
    j = np.arange(src.size, dtype=np.int64) - first[src]  # a row's chunk in its source
    last = j == full[src]  # a source's partial last chunk
    addr = np.where(last, tail_at[src], ptr[src] + j * chunk_bytes)
    nbytes = np.where(last, tail[src], chunk_bytes)
    return addr, nbytes, rows_of


def many(
    sources: Sequence[torch.Tensor], chunk_bytes: int, p: torch.Tensor, q: torch.Tensor
) -> list[torch.Tensor]:
    """``fingerprint.many_fingerprints`` of ``sources`` (1-D uint8, one device) in one launch;
    ``p``, ``q``: the position keys of a chunk (``fingerprint.position_keys``); the rows of the
    launch from :func:`table`."""
    addr, nbytes, rows_of, keep = table(sources, chunk_bytes)
    out = _launch(sources[0].device, chunk_bytes, p, q, addr, addr, nbytes, rows_of, copy=False)
    del keep  # the launch is queued on the stream: the copies' memory is reused after it
    return out


def _launch(
    device: torch.device,
    chunk_bytes: int,
    p: torch.Tensor,
    q: torch.Tensor,
    addr: np.ndarray,
    dst: np.ndarray,
    nbytes: np.ndarray,
    rows_of: np.ndarray,
    copy: bool,
) -> list[torch.Tensor]:
    """One launch over the rows of a table (with ``copy``, each row also stored at ``dst``);
    each source's fingerprints [rows, 2] on ``device``."""
    rows = int(addr.size)
    if not rows:
        return [torch.zeros(0, 2, dtype=torch.int64, device=device) for _ in rows_of]
    tab = cuda.to_device(torch.from_numpy(np.stack([addr, dst, nbytes])), device)  # no wait
    block = BLOCK if device.type == "cuda" else INTERPRET_BLOCK
    nblk = -(-(chunk_bytes // 8) // block)
    part = torch.empty(rows, nblk, 2, dtype=torch.int64, device=device)
    args = (tab[0], tab[1], tab[2], p, q, part, nblk)
    kernel = _kernel()
    if device.type == "cuda":  # Triton launches on the current device: make it the sources'
        with torch.cuda.device(device):
            kernel[(rows, nblk)](*args, BLOCK=block, COPY=copy)
    else:
        kernel[(rows, nblk)](*args, BLOCK=block, COPY=copy)
    out = part.sum(dim=1)  # wrapping sums: in any order, the same
    return list(out.split(rows_of.tolist()))


def refused(src: torch.Tensor, dst: torch.Tensor, spans: Sequence[tuple[int, int]]) -> str | None:
    """Why :func:`copy_spans` cannot copy ``spans`` of ``src`` into ``dst``, or None."""
    if src.dim() != 1 or dst.dim() != 1 or src.dtype != torch.uint8 or dst.dtype != torch.uint8:
        return "copy_spans copies between 1-D uint8 tensors"
    if not (src.is_contiguous() and dst.is_contiguous()):
        return "copy_spans copies between contiguous tensors"
    if src.device != dst.device:
        return f"copy_spans copies on one device, not {src.device} -> {dst.device}"
    if not spans:
        return None
    at = np.array(spans, dtype=np.int64).reshape(-1, 2)
    off, size = at[:, 0], at[:, 1]
    if (size < 0).any() or (off < 0).any():
        return f"a span's offset and length cannot be negative: {list(spans)[:4]}"
    if src.data_ptr() % 8 or dst.data_ptr() % 8 or (off % 8).any():
        return "copy_spans copies spans that start at aligned words of both tensors"
    room = min(src.numel(), dst.numel())
    if (off + -(-size // 8) * 8 > room).any():
        return f"a span's last word lies past the {room} bytes of the tensors"
    return None


def copy_spans(
    src: torch.Tensor,
    dst: torch.Tensor,
    spans: Sequence[tuple[int, int]],
    chunk_bytes: int,
    p: torch.Tensor,
    q: torch.Tensor,
) -> list[torch.Tensor]:
    """Copy each ``(offset, nbytes)`` span of ``src`` to the same offset of ``dst`` (1-D
    uint8, one device) and return :func:`many`'s fingerprints of each span's bytes, in one
    launch that reads each word once: a receiver's copy of a message out of the shared bucket
    and its verification together (a copy, then fingerprints of the copy, read the bytes
    twice). The fingerprints are those of the words stored, so they vouch for exactly what
    was written. Words are copied whole: a span ending inside a word also copies the rest of
    that word (a message's pieces start at aligned offsets, so it is padding). Every span must
    start 8-byte aligned in both tensors and its last word lie in both (ValueError otherwise,
    before anything launches: :func:`refused` says why)."""
    why = refused(src, dst, spans)
    if why is not None:
        raise ValueError(why)
    if not spans:
        return []
    at = np.array(spans, dtype=np.int64).reshape(-1, 2)
    off, size = at[:, 0], at[:, 1]
    return _copy(src.device, src.data_ptr() + off, size, dst.data_ptr() + off, chunk_bytes, p, q)


def refused_into(
    sources: Sequence[torch.Tensor], dst: torch.Tensor, offsets: Sequence[int]
) -> str | None:
    """Why :func:`copy_into` cannot copy ``sources`` into ``dst`` at ``offsets``, or None."""
    if dst.dim() != 1 or dst.dtype != torch.uint8 or not dst.is_contiguous():
        return "copy_into copies into a contiguous 1-D uint8 tensor"
    if len(sources) != len(offsets):
        return f"{len(sources)} sources but {len(offsets)} offsets"
    if dst.data_ptr() % 8:
        return "copy_into copies into a tensor that starts at an aligned word"
    for s, o in zip(sources, offsets, strict=True):
        if s.dim() != 1 or s.dtype != torch.uint8 or s.device != dst.device:
            return f"a source must be 1-D uint8 on {dst.device}"
        if not whole_words(s):
            return "a source must start at an aligned word and its last word lie in its storage"
        if o % 8 or o < 0 or o + -(-s.numel() // 8) * 8 > dst.numel():
            return f"offset {o} is not an aligned word of the destination with room for its source"
    return None


def whole_words(t: torch.Tensor) -> bool:
    """Whether ``t``'s bytes can be read word by word in place: it is contiguous, starts at an
    aligned word, and the word its last byte is in lies inside its storage (no read past what
    it owns)."""
    nbytes = t.numel() * t.element_size()
    words = -(-nbytes // 8) * 8
    at = t.storage_offset() * t.element_size()
    return (
        t.is_contiguous() and t.data_ptr() % 8 == 0 and at + words <= t.untyped_storage().nbytes()
    )


def copy_into(
    sources: Sequence[torch.Tensor],
    dst: torch.Tensor,
    offsets: Sequence[int],
    chunk_bytes: int,
    p: torch.Tensor,
    q: torch.Tensor,
) -> list[torch.Tensor]:
    """Copy each of ``sources`` (1-D uint8) into ``dst`` at its offset and return
    :func:`many`'s fingerprints of each, in one launch that reads each word once: a sender's
    pack of whole tensors into a bucket and the fingerprints its header's digests and its next
    round's change detection need (the scan's read of those tensors saved). Words are copied
    whole, as by :func:`copy_spans`: a source ending inside a word is read to the end of that
    word (inside its storage) and the word stored whole (the bucket's padding). ValueError
    before anything launches where :func:`refused_into` says why."""
    why = refused_into(sources, dst, offsets)
    if why is not None:
        raise ValueError(why)
    if not sources:
        return []
    n = len(sources)
    ptr = np.fromiter((s.data_ptr() for s in sources), np.int64, n)
    size = np.fromiter((s.numel() for s in sources), np.int64, n)
    to = np.asarray(offsets, dtype=np.int64) + dst.data_ptr()
    return _copy(dst.device, ptr, size, to, chunk_bytes, p, q)


def _copy(
    device: torch.device,
    ptr: np.ndarray,
    size: np.ndarray,
    to: np.ndarray,
    chunk_bytes: int,
    p: torch.Tensor,
    q: torch.Tensor,
) -> list[torch.Tensor]:
    """One fused launch: the ``size[i]`` bytes at address ``ptr[i]`` stored at ``to[i]``, and
    each one's fingerprints (:func:`copy_spans`, :func:`copy_into`: checked before)."""
    addr, nbytes, rows_of = _rows(ptr, size, chunk_bytes)
    which = np.repeat(np.arange(ptr.size, dtype=np.int64), rows_of)
    dst_at = addr - ptr[which] + to[which]  # each row at its offset in its source's place
    return _launch(device, chunk_bytes, p, q, addr, dst_at, nbytes, rows_of, copy=True)

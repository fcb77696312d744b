"""Chunk fingerprints computed where the bytes live (CPU or CUDA) by torch integer operations
that give the same 128 bits on every device: how a save of device state finds what changed
without copying unchanged chunks to the host.

Hashing needs the bytes on the host, and a copy of CUDA state to the host costs PCIe time (or
~1 GB/s through pageable memory) for every chunk, changed or not. So a save of device state
fingerprints every chunk on its device, compares with the fingerprint the same chunk had at the
last save of this process, and copies and hashes only the chunks whose fingerprint moved
(saving/device.py). The fingerprint of a chunk of 8-byte words ``w_i`` (the chunk's tail
zero-padded to a word) is two wrapping 64-bit sums::

    m_i = mix(w_i ^ P_i)        mix: splitmix64's finaliser, a bijection of 64-bit words
    a   = sum(m_i)        mod 2**64
    b   = sum(m_i * Q_i)  mod 2**64

``P_i`` and ``Q_i`` (odd) are fixed pseudo-random words per position in a chunk, made once per
device by the same operations. A wrapping integer sum does not depend on the order of the
reduction, so CPU and CUDA give identical results (the gpu tests check it).

What it detects: a change of one word, always (``mix`` is a bijection, so ``m_i`` moves and so
does ``a``); a word moved to another position, always with probability ~1 - 2**-64 (``P``). A
change of several words is missed only when both sums collide: treating ``mix`` as a random
function, about 2**-120 per changed chunk. It is not collision-resistant against someone who
knows ``P`` and ``Q`` and crafts the state (neither is xxh3, which names chunks in the store).

Cost: ~20 elementwise passes over the bytes on the device (a few ms per GB on an H100). On the
host the same integers come from one C pass (``_native.fp_rows``, ~4 GB/s per core here, 5x the
torch operations; those remain where the extension is not built); still slower than xxh3, so CPU
state is hashed directly and this runs on CPU only when asked for (device digests of host
tensors: a CPU engine's check, the test suite's stand-ins). Device memory: ``P`` and ``Q`` (2 x chunk_bytes) kept per device, and two
work buffers of at most :data:`SLAB_BYTES` while it runs.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable, Sequence

import torch

from deltackpt import cuda
from deltackpt.format import fingerprint_kernel

__all__ = [
    "KERNELS",
    "SLAB_BYTES",
    "copy_fingerprinted",
    "fingerprint_rows",
    "fuses",
    "many_fingerprints",
    "pack_fingerprinted",
    "source_fingerprints",
]

SLAB_BYTES = 64 << 20  # bytes fingerprinted per pass (bounds the work buffers)

try:  # host bytes in one C pass (setup.py builds it; the torch operations give the same integers)
    from deltackpt._native import fp_rows as _native_rows
except ImportError:  # pragma: no cover - depends on the install
    _native_rows = None
KERNELS = ("auto", "torch", "compile", "triton")  # how (source_fingerprints): the same integers


def _signed(x: int) -> int:
    """A 64-bit constant as the int64 torch stores it."""
    return x - (1 << 64) if x >= 1 << 63 else x


_C1 = _signed(0xBF58476D1CE4E5B9)
_C2 = _signed(0x94D049BB133111EB)
_GOLDEN = _signed(0x9E3779B97F4A7C15)
_SEED_P = _signed(0x243F6A8885A308D3)  # digits of pi: nothing up the sleeve
_SEED_Q = _signed(0x13198A2E03707344)
_SHIFTS = (30, 27, 31)
_MASKS = {s: (1 << (64 - s)) - 1 for s in _SHIFTS}  # logical right shift of an int64


def _mix_(z: torch.Tensor, tmp: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser in place on int64 ``z`` (``tmp``: a work buffer like ``z``)."""
    for s, c in ((30, _C1), (27, _C2), (31, None)):
        torch.bitwise_right_shift(z, s, out=tmp)
        tmp.bitwise_and_(_MASKS[s])
        z.bitwise_xor_(tmp)
        if c is not None:
            z.mul_(c)
    return z


_KEYS: dict[tuple[str, int], tuple[torch.Tensor, torch.Tensor]] = {}
_KEYS_LOCK = threading.Lock()


def position_keys(device: torch.device, words: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(P, Q)``: int64 vectors of ``words`` pseudo-random words on ``device`` (``Q`` odd),
    made once per (device, length) from fixed seeds, identical on every device."""
    key = (str(device), words)
    with _KEYS_LOCK:
        got = _KEYS.get(key)
        if got is None:
            i = torch.arange(words, dtype=torch.int64, device=device).mul_(_GOLDEN)
            tmp = torch.empty_like(i)
            p = _mix_(i.add(_SEED_P), tmp)
            q = _mix_(i.add_(_SEED_Q), tmp).bitwise_or_(1)
            got = _KEYS[key] = (p, q)
        return got


_PADS: dict[tuple[str, int], torch.Tensor] = {}


def _padding_sums(device: torch.device, words: int) -> torch.Tensor:
    """[words + 1, 2]: row ``i`` is what the zero words at positions ``i .. words - 1`` add to
    a fingerprint's two sums (``mix(P_j)`` and ``mix(P_j) * Q_j`` summed, wrapping), so a row
    zero-padded to any width ``w`` has the fingerprint of its first ``L`` words once
    ``S[L] - S[w]`` is taken off. Made once per (device, length)."""
    key = (str(device), words)
    with _KEYS_LOCK:
        got = _PADS.get(key)
    if got is None:
        p, q = position_keys(device, words)
        m = _mix_(p.clone(), torch.empty_like(p))
        pair = torch.stack([m, m * q], dim=1)
        tail = pair.flip(0).cumsum(0).flip(0)  # wrapping sums: the same on every device
        got = torch.cat([tail, torch.zeros(1, 2, dtype=torch.int64, device=device)])
        with _KEYS_LOCK:
            _PADS[key] = got
    return got


def _words(data: torch.Tensor) -> torch.Tensor:
    """``data`` (1-D uint8, a multiple of 8 bytes) as int64 words; a copy if it is not 8-byte
    aligned."""
    if data.data_ptr() % 8:
        data = data.clone()
    return data.view(torch.int64)


def _fingerprint_rows(
    words: torch.Tensor, p: torch.Tensor, q: torch.Tensor, kernel: str = "torch"
) -> torch.Tensor:
    """``words`` [rows, n] (n <= len(p)) -> [rows, 2] fingerprints (``kernel="compile"``, on
    CUDA: by the compiled :func:`_rows_pure`)."""
    n = words.shape[1]
    if kernel == "compile" and words.device.type == "cuda":
        return _fused()(words, p[:n], q[:n])
    if words.device.type == "cpu" and _native_rows is not None and n and words.shape[0]:
        # host words: one pass in C (~20 torch passes otherwise), the same integers
        words = words.contiguous()
        out = torch.empty(words.shape[0], 2, dtype=torch.int64)
        _native_rows(words.numpy(), n, p.numpy(), q.numpy(), out.numpy())
        return out
    z = torch.bitwise_xor(words, p[:n])
    tmp = torch.empty_like(z)
    _mix_(z, tmp)
    a = z.sum(dim=1)
    b = torch.mul(z, q[:n], out=tmp).sum(dim=1)
    return torch.stack([a, b], dim=1)


def fingerprint_rows(words: torch.Tensor, kernel: str = "torch") -> torch.Tensor:
    """The fingerprints [rows, 2] of each row of ``words`` (int64 [rows, n], ``n`` at most a
    chunk's words, on any device): each row as the words of one chunk, the same integers as
    :func:`source_fingerprints` of those bytes. ``kernel``: ``torch`` or ``compile``."""
    n = words.shape[1]  # the keys of a position are the same in keys of any length: a few kept
    p, q = position_keys(words.device, 1 << max(0, n - 1).bit_length())
    return _fingerprint_rows(words, p, q, kernel)


def _rows_pure(words: torch.Tensor, p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """:func:`_fingerprint_rows` without in-place work or work buffers: what ``torch.compile``
    fuses into an elementwise pass and two row sums (the same integers)."""
    z = words ^ p
    for s, c in ((30, _C1), (27, _C2), (31, None)):
        z = z ^ ((z >> s) & _MASKS[s])
        if c is not None:
            z = z * c
    return torch.stack([z.sum(dim=1), (z * q).sum(dim=1)], dim=1)


_FUSED: list[object] = []


def _fused() -> object:
    """:func:`_rows_pure` compiled once per process (the first call compiles: seconds;
    measured by benchmarks/bench_digest.py). Callers pass ``kernel`` from
    ``DELTACKPT_FINGERPRINT_COMPILE`` (this module reads no environment)."""
    if not _FUSED:
        _FUSED.append(torch.compile(_rows_pure, dynamic=True))
    return _FUSED[0]


def source_fingerprints(
    data: torch.Tensor, chunk_bytes: int, kernel: str = "torch"
) -> torch.Tensor:
    """Fingerprints of the chunks of one source: ``data`` (1-D uint8, on any device) cut at
    multiples of ``chunk_bytes`` (a multiple of 8, as the store's always is). Returns an int64
    tensor [chunks, 2] on ``data``'s device; nothing is copied to the host. ``kernel``: how
    (:data:`KERNELS`; all give the same integers): ``torch`` operations, fused by
    ``torch.compile`` on CUDA (``compile``), or the Triton kernel of ``fingerprint_kernel.py``
    where it can run (``triton``: its errors raised; ``auto``: the torch operations where it
    cannot run or failed once, with a warning)."""
    if chunk_bytes <= 0 or chunk_bytes % 8:
        raise ValueError(f"chunk_bytes must be a positive multiple of 8, got {chunk_bytes}")
    if kernel in ("auto", "triton") and fingerprint_kernel.available(data.device):
        return many_fingerprints([data], chunk_bytes, kernel)[0]
    n = data.numel()
    device = data.device
    words_per_chunk = chunk_bytes // 8
    p, q = position_keys(device, words_per_chunk)
    full = n // chunk_bytes
    out: list[torch.Tensor] = []
    rows = max(1, SLAB_BYTES // chunk_bytes)
    for lo in range(0, full, rows):
        hi = min(full, lo + rows)
        slab = _words(data[lo * chunk_bytes : hi * chunk_bytes]).view(hi - lo, words_per_chunk)
        out.append(_fingerprint_rows(slab, p, q, kernel))
    tail = n - full * chunk_bytes
    if tail:
        padded = torch.zeros(-(-tail // 8) * 8, dtype=torch.uint8, device=device)
        padded[:tail] = data[full * chunk_bytes :]
        out.append(_fingerprint_rows(padded.view(torch.int64).view(1, -1), p, q, kernel))
    if not out:
        return torch.zeros(0, 2, dtype=torch.int64, device=device)
    return torch.cat(out)


def _by_kernel(
    sources: Sequence[torch.Tensor], chunk_bytes: int, p: torch.Tensor, q: torch.Tensor, kernel: str
) -> list[torch.Tensor] | None:
    """The Triton kernel's fingerprints; under ``auto`` None when it fails (warned once, then
    not tried again in this process: the torch operations give the same integers)."""
    if kernel == "triton":
        return fingerprint_kernel.many(sources, chunk_bytes, p, q)
    try:
        return fingerprint_kernel.many(sources, chunk_bytes, p, q)
    except Exception as e:
        _kernel_failed(e)
        return None


def _kernel_failed(e: BaseException) -> None:
    """Under ``auto``: the kernel failed; warned once and not tried again in this process."""
    fingerprint_kernel.disable(e)
    warnings.warn(
        f"deltackpt: the Triton fingerprint kernel failed ({type(e).__name__}: "
        f"{str(e)[:300]}); chunk fingerprints use torch operations from now on (the same "
        "integers, slower). DELTACKPT_FINGERPRINT_COMPILE=off skips the kernel; =triton "
        "raises its error",
        RuntimeWarning,
        stacklevel=4,
    )


def fuses(device: torch.device, kernel: str = "auto") -> bool:
    """Whether :func:`copy_fingerprinted` and :func:`pack_fingerprinted` can copy and
    fingerprint in one pass on ``device``: ``kernel`` ``auto`` or ``triton`` and the Triton
    kernel runs there (and did not fail under ``auto``)."""
    return kernel in ("auto", "triton") and fingerprint_kernel.available(device)


def copy_fingerprinted(
    src: torch.Tensor,
    dst: torch.Tensor,
    spans: Sequence[tuple[int, int]],
    chunk_bytes: int,
    kernel: str = "auto",
) -> list[torch.Tensor] | None:
    """Copy each ``(offset, nbytes)`` span of ``src`` to the same offset of ``dst`` and return
    each span's :func:`source_fingerprints`, in one pass that reads each word once
    (``fingerprint_kernel.copy_spans``), where that kernel runs (:func:`fuses`) and can copy
    the spans word by word (``refused``). None otherwise, nothing copied: the caller copies,
    then fingerprints the copy (the same integers, one more read of the bytes)."""
    if not fuses(src.device, kernel) or fingerprint_kernel.refused(src, dst, spans) is not None:
        return None
    p, q = position_keys(src.device, chunk_bytes // 8)
    return _run_fused(
        lambda: fingerprint_kernel.copy_spans(src, dst, spans, chunk_bytes, p, q), kernel
    )


def pack_fingerprinted(
    sources: Sequence[torch.Tensor],
    dst: torch.Tensor,
    offsets: Sequence[int],
    chunk_bytes: int,
    kernel: str = "auto",
) -> list[torch.Tensor] | None:
    """Copy each of ``sources`` (1-D uint8) into ``dst`` at its offset and return each one's
    :func:`source_fingerprints`, in one pass (``fingerprint_kernel.copy_into``), where that
    kernel runs (:func:`fuses`) and can copy them word by word (``refused_into``). None
    otherwise, nothing copied."""
    if not fuses(dst.device, kernel):
        return None
    if fingerprint_kernel.refused_into(sources, dst, offsets) is not None:
        return None
    p, q = position_keys(dst.device, chunk_bytes // 8)
    return _run_fused(
        lambda: fingerprint_kernel.copy_into(sources, dst, offsets, chunk_bytes, p, q), kernel
    )


def _run_fused(run: Callable[[], list[torch.Tensor]], kernel: str) -> list[torch.Tensor] | None:
    """``run()``, the fused kernel's launch; under ``auto`` None when it fails (warned once,
    the kernel not tried again in this process), under ``triton`` its error raised."""
    if kernel == "triton":
        return run()
    try:
        return run()
    except Exception as e:
        _kernel_failed(e)
        return None


def many_fingerprints(
    sources: Sequence[torch.Tensor], chunk_bytes: int, kernel: str = "torch"
) -> list[torch.Tensor]:
    """:func:`source_fingerprints` of each of ``sources`` (1-D uint8, all on one device), with
    the same integers, in a few passes instead of one set per source: the full chunks of
    sources smaller than half a slab are fingerprinted together (concatenated into slabs of
    at most :data:`SLAB_BYTES`, one copy), larger ones in place; the tails (a source's last
    partial chunk, a small source whole) together, zero-padded to a power of two of words per
    row (at most 2x their bytes; the padding's share taken off by :func:`_padding_sums`).
    What a device round's digests and a device scan of many tensors cost: the launches of a
    few passes, not of ~20 per tensor. ``kernel="triton"`` or ``"auto"`` (where it can run):
    all of them in one launch of ``fingerprint_kernel.py``, nothing copied."""
    if chunk_bytes <= 0 or chunk_bytes % 8:
        raise ValueError(f"chunk_bytes must be a positive multiple of 8, got {chunk_bytes}")
    if not sources:
        return []
    device = sources[0].device
    if any(s.device != device or s.dim() != 1 or s.dtype != torch.uint8 for s in sources):
        raise ValueError("sources must be 1-D uint8 tensors on one device")
    wpc = chunk_bytes // 8
    p, q = position_keys(device, wpc)
    if kernel in ("auto", "triton") and fingerprint_kernel.available(device):
        got = _by_kernel(sources, chunk_bytes, p, q, kernel)
        if got is not None:
            return got
    parts: list[list[torch.Tensor]] = [[] for _ in sources]  # per source, its rows in order
    heads: list[list[torch.Tensor]] = [[] for _ in sources]  # full-chunk rows (before the tail)
    group: list[int] = []
    group_bytes = 0

    def flush() -> None:
        nonlocal group, group_bytes
        if group:
            regions = [
                sources[i][: (sources[i].numel() // chunk_bytes) * chunk_bytes] for i in group
            ]
            slab = torch.cat(regions) if len(regions) > 1 else _words(regions[0]).view(torch.uint8)
            rows = _fingerprint_rows(slab.view(torch.int64).view(-1, wpc), p, q, kernel)
            at = 0
            for i, r in zip(group, regions, strict=True):
                k = r.numel() // chunk_bytes
                heads[i].append(rows[at : at + k])
                at += k
        group, group_bytes = [], 0

    for i, s in enumerate(sources):
        full = s.numel() // chunk_bytes
        if not full:
            continue
        nbytes = full * chunk_bytes
        if nbytes >= SLAB_BYTES // 2:  # big enough to pass alone, in place
            per = max(1, SLAB_BYTES // chunk_bytes)
            for lo in range(0, full, per):
                hi = min(full, lo + per)
                slab = _words(s[lo * chunk_bytes : hi * chunk_bytes]).view(hi - lo, wpc)
                heads[i].append(_fingerprint_rows(slab, p, q, kernel))
            continue
        if group_bytes + nbytes > SLAB_BYTES:
            flush()
        group.append(i)
        group_bytes += nbytes
    flush()
    for i in range(len(sources)):
        parts[i].extend(heads[i])
    # the tails, by width class (a power of two of words, at most a chunk's)
    classes: dict[int, list[int]] = {}
    for i, s in enumerate(sources):
        tail = s.numel() % chunk_bytes
        if tail:
            width = min(wpc, 1 << (-(-tail // 8) - 1).bit_length())
            classes.setdefault(width, []).append(i)
    if classes:
        sums = _padding_sums(device, wpc)
        zeros = torch.zeros(max(w for w in classes) * 8, dtype=torch.uint8, device=device)
    for width, members in classes.items():
        per = max(1, SLAB_BYTES // (width * 8))
        for lo in range(0, len(members), per):
            batch = members[lo : lo + per]
            pieces: list[torch.Tensor] = []
            lengths: list[int] = []
            for i in batch:
                s = sources[i]
                tail = s[(s.numel() // chunk_bytes) * chunk_bytes :]
                pieces += [tail, zeros[: width * 8 - tail.numel()]]
                lengths.append(-(-tail.numel() // 8))
            mat = torch.cat(pieces).view(torch.int64).view(len(batch), width)
            rows = _fingerprint_rows(mat, p, q, kernel)
            at = cuda.to_device(torch.tensor(lengths, dtype=torch.int64), device)
            rows = rows - (sums.index_select(0, at) - sums[width])
            for j, i in enumerate(batch):
                parts[i].append(rows[j : j + 1])
    out: list[torch.Tensor] = []
    for got in parts:
        if not got:
            out.append(torch.zeros(0, 2, dtype=torch.int64, device=device))
        else:
            out.append(got[0] if len(got) == 1 else torch.cat(got))
    return out

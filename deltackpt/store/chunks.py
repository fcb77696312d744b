"""Reading chunks back: read (into the destination when possible), decode, verify the digest.

The one read engine of load (new tensors and ``into=``), ``load_reusing``, the DCP StoreReader and
verify. Raw chunks are read by one ranged read scattered straight into their destination ranges
(``PackReaders.readv_into``: a copy out of the mapped pack, or ``preadv``) and hashed there,
streaming over the pieces (no intermediate copy, even for a grouped chunk holding many small
tensors); raw chunks that lie back to back in one pack are read by one ranged read.
Encoded chunks (zstd, xor chains) go through a per-thread scratch buffer reused across chunks and
are decoded on the pool, one job per chunk, so decode overlaps with the reads of other jobs.
"""

from __future__ import annotations

import ctypes
import mmap
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import xxhash

from deltackpt.errors import CodecError, CorruptChunkError, StoreIOError, UnsafePathError
from deltackpt.format import codecs
from deltackpt.format.hashing import digest
from deltackpt.format.manifest import ChunkRecord
from deltackpt.store.packs import PACK_ALIGN, PackReaders, pack_name

_local = threading.local()

# Fresh memory for new tensors is faulted in by the pread that fills it. On 4 KiB pages that
# fault cost dominates a warm load (measured here: 247 MB faulted in ~195 ms, 4 KiB at a time,
# vs ~18 ms on 2 MiB transparent huge pages, and ~25 ms for the copy itself), so large buffers
# are advised MADV_HUGEPAGE before the read. Linux only; elsewhere (or if libc cannot be
# reached) this is a no-op. The memory stays torch's own: the tensors are ordinary.
_HUGE = 2 << 20
_HUGE_MIN = 4 << 20
_madvise: Any = None


def _load_madvise() -> Any:
    global _madvise
    if _madvise is None:
        _madvise = False
        advice = getattr(mmap, "MADV_HUGEPAGE", None)
        if sys.platform.startswith("linux") and advice is not None:
            try:
                fn = ctypes.CDLL(None, use_errno=True).madvise
                fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
                fn.restype = ctypes.c_int
                _madvise = (fn, advice)
            except (OSError, AttributeError):
                pass
    return _madvise


def advise_huge(t: torch.Tensor) -> torch.Tensor:
    """Ask for huge pages under the 2 MiB-aligned interior of a fresh CPU tensor ``t``."""
    n = t.numel() * t.element_size()
    if n < _HUGE_MIN or t.device.type != "cpu":
        return t
    ma = _load_madvise()
    if ma:
        p = t.data_ptr()
        lo, hi = (p + _HUGE - 1) & ~(_HUGE - 1), (p + n) & ~(_HUGE - 1)
        if hi > lo:
            ma[0](lo, hi - lo, ma[1])  # advice only: a failure changes nothing
    return t


def fresh_u8(n: int) -> torch.Tensor:
    """A new uint8 CPU tensor of ``n`` bytes that a read is about to fill."""
    return advise_huge(torch.empty(n, dtype=torch.uint8))


def _scratch(name: str, n: int) -> np.ndarray:
    buf = getattr(_local, name, None)
    if buf is None or buf.size < n:
        buf = np.empty(max(n, 1), dtype=np.uint8)
        setattr(_local, name, buf)
    return buf[:n]


@dataclass
class ChunkTargets:
    """Where one chunk's bytes go: (start in chunk, length, destination array) triples."""

    digest: str
    targets: list[tuple[int, int, np.ndarray]] = field(default_factory=list)
    where: str = ""  # snapshot and tensor key, for error messages


class ChunkReader:
    """Reads and verifies chunks of one store; safe to call from many threads."""

    def __init__(
        self, packs: PackReaders, records: dict[str, ChunkRecord], verify: bool = True
    ) -> None:
        self.packs = packs
        self.records = records
        self.verify = verify

    def _corrupt(
        self, d: str, where: str, why: str, missing_pack: bool = False
    ) -> CorruptChunkError:
        """The error for chunk ``d``; ``missing_pack``: the cause is that its pack does not exist
        (see :class:`~deltackpt.errors.CorruptChunkError`)."""
        rec = self.records.get(d)
        loc = f"pack {rec.pack} offset {rec.offset}" if rec else "no record"
        return CorruptChunkError(
            f"chunk {d} of {where} ({loc}) is corrupt: {why}. Run `deltackpt verify` to list "
            "every damaged snapshot; load an earlier snapshot or restore the store from a copy",
            missing_pack=missing_pack,
        )

    def _missing(self, d: str, where: str, pack: str) -> CorruptChunkError:
        why = f"its pack file {pack_name(pack)} is missing"
        return self._corrupt(d, where, why, missing_pack=True)

    def _read_payload(self, d: str, rec: ChunkRecord, out: np.ndarray, where: str) -> None:
        try:
            n = self.packs.read_into(rec.pack, rec.offset, out)
        except FileNotFoundError:
            raise self._missing(d, where, rec.pack) from None
        except UnsafePathError as e:
            raise self._corrupt(d, where, str(e)) from e
        except StoreIOError:  # an object store that failed or fell silent: not damage
            raise
        except OSError as e:  # EIO, EISDIR, ...: this chunk is unreadable, the rest may be fine
            raise self._corrupt(d, where, f"its pack cannot be read ({e})") from e
        if n != out.size:
            raise self._corrupt(d, where, f"pack is truncated: read {n} of {out.size} bytes")

    def payload(self, d: str, where: str) -> np.ndarray:
        """The stored payload of chunk ``d`` (encoded, as in its pack), in a new array."""
        rec = self.records.get(d)
        if rec is None:
            raise self._corrupt(d, where, "the manifest has no location for it")
        out = np.empty(rec.length, dtype=np.uint8)
        self._read_payload(d, rec, out, where)
        return out

    def mapped(self, d: str) -> np.ndarray | None:
        """Raw chunk ``d`` where it lies in its mapped local pack, without a copy
        (:meth:`PackReaders.view`), or None: an encoded chunk, an object store, or a pack that
        cannot be mapped or ends first (then a read reports what is wrong)."""
        rec = self.records.get(d)
        if rec is None or rec.codec != codecs.RAW or rec.length != rec.size:
            return None
        return self.packs.view(rec.pack, rec.offset, rec.size)

    def check_mapped(self, d: str, view: np.ndarray, where: str) -> None:
        """Verify raw chunk ``d`` where it lies (``view``: from :meth:`mapped`), as a read
        would once its bytes landed."""
        self._check(d, view, where)

    def _check(self, d: str, raw: np.ndarray, where: str) -> None:
        if self.verify:
            actual = digest(raw)
            if actual != d:
                raise self._corrupt(d, where, f"its bytes hash to {actual}, expected {d}")

    def decode_into(
        self,
        d: str,
        out: np.ndarray,
        where: str,
        depth: int = 0,
        base_raw: np.ndarray | None = None,
    ) -> None:
        """Decode chunk ``d`` into ``out`` (its raw size) and verify it. An xor chunk decodes its
        base chain first, unless the caller passes the base's verified raw bytes as ``base_raw``."""
        rec = self.records.get(d)
        if rec is None:
            raise self._corrupt(d, where, "the manifest has no location for it")
        if out.size != rec.size:
            raise self._corrupt(d, where, f"manifest size {rec.size} != expected {out.size}")
        if rec.codec == codecs.RAW:
            self._read_payload(d, rec, out, where)
        elif rec.codec in codecs.DELTAS and base_raw is None:
            self._decode_chain(d, rec, out, where)
        else:
            payload = (
                np.empty(rec.length, dtype=np.uint8) if depth else _scratch("payload", rec.length)
            )
            self._read_payload(d, rec, payload, where)
            base = base_raw
            if rec.base is not None and base is None:
                if depth > 64:
                    raise self._corrupt(
                        d, where, "its xor delta chain is longer than 64 (a cycle?)"
                    )
                base = np.empty(rec.size, dtype=np.uint8)
                self.decode_into(rec.base, base, where, depth + 1)
            try:
                codecs.decode(rec.codec, payload, rec.size, rec.itemsize, out, base=base)
            except CodecError as e:
                raise self._corrupt(
                    d, where, f"its {rec.codec} payload does not decode ({e})"
                ) from e
        self._check(d, out, where)

    def _decode_chain(self, d: str, rec: ChunkRecord, out: np.ndarray, where: str) -> None:
        """Read a delta chain down to its keyframe and decode it in one pass (the digest of the
        result is checked by the caller; intermediate levels are not materialised)."""
        chain = [(d, rec)]
        while chain[-1][1].base is not None:
            base = chain[-1][1].base
            brec = self.records.get(base)
            if brec is None:
                raise self._corrupt(
                    d, where, f"its xor base {base} has no location in the manifest"
                )
            if len(chain) > 64:
                raise self._corrupt(d, where, "its xor delta chain is longer than 64 (a cycle?)")
            chain.append((base, brec))
        for cd, crec in chain:
            if crec.size != rec.size:
                raise self._corrupt(
                    d, where, f"chain member {cd} has size {crec.size}, expected {rec.size}"
                )
        key, krec = chain[-1]
        if krec.codec == codecs.RAW and all(c.codec == codecs.PATCH for _, c in chain[:-1]):
            # a raw keyframe read straight into out, each patch written onto it in place (only
            # its elements): about a raw read plus the changes
            self._read_payload(key, krec, out, where)
            for cd, crec in reversed(chain[:-1]):
                payload = np.empty(crec.length, dtype=np.uint8)
                self._read_payload(cd, crec, payload, where)
                try:
                    codecs.decode(crec.codec, payload, rec.size, crec.itemsize, out, base=out)
                except CodecError as e:
                    raise self._corrupt(d, where, f"its patch chain does not decode ({e})") from e
            return
        levels = []
        for cd, crec in reversed(chain):
            payload = np.empty(crec.length, dtype=np.uint8)
            self._read_payload(cd, crec, payload, where)
            levels.append((crec.codec, payload, crec.itemsize))
        try:
            codecs.decode_chain(levels, rec.size, out)
        except CodecError as e:
            raise self._corrupt(d, where, f"its xor chain does not decode ({e})") from e

    def read(self, job: ChunkTargets) -> int:
        """Deliver one chunk to its targets; return the raw bytes decoded."""
        return self.read_run([job])

    def read_run(self, run: list[ChunkTargets]) -> int:
        """Deliver chunks to their targets; return the raw bytes decoded. A run of several
        chunks must be raw chunks of one pack in offset order (see :func:`plan_runs`)."""
        if len(run) == 1:
            job = run[0]
            rec = self.records.get(job.digest)
            if rec is None:
                raise self._corrupt(job.digest, job.where, "the manifest has no location for it")
            if rec.codec != codecs.RAW:
                return self._read_scratch(job, rec)
        layouts = [(j, self.records[j.digest], _layout(j, self.records[j.digest])) for j in run]
        if all(lay is not None for _, _, lay in layouts):
            self._scatter(layouts)  # type: ignore[arg-type]
        else:  # some targets overlap in a way a scatter read cannot serve: chunk by chunk
            for job, rec, lay in layouts:
                if lay is None:
                    self._read_scratch(job, rec)
                else:
                    self._scatter([(job, rec, lay)])
        return sum(rec.size for _, rec, _ in layouts)

    def _scatter(self, layouts: list[tuple[ChunkTargets, ChunkRecord, _Layout]]) -> None:
        """One preadv for raw chunks lying back to back in one pack, straight into their
        destinations; then each chunk is hashed where its bytes landed."""
        first = layouts[0][1]
        iov: list[memoryview] = []
        ends: list[int] = []  # bytes into the read where each chunk's payload ends
        pos = first.offset
        pad = _scratch("pad", PACK_ALIGN)
        gaps = _scratch("gaps", sum(lay.gap_bytes for _, _, lay in layouts))
        g = 0
        for _, rec, lay in layouts:
            if rec.offset > pos:  # alignment padding between payloads: read and dropped
                iov.append(memoryview(pad[: rec.offset - pos]))
            for piece in lay.pieces:
                if isinstance(piece, int):  # bytes no target wants: still hashed
                    iov.append(memoryview(gaps[g : g + piece]))
                    g += piece
                else:
                    iov.append(memoryview(piece).cast("B"))
            pos = rec.offset + rec.size
            ends.append(pos - first.offset)
        job0 = layouts[0][0]
        try:
            n = self.packs.readv_into(first.pack, first.offset, iov)
        except FileNotFoundError:
            raise self._missing(job0.digest, job0.where, first.pack) from None
        except UnsafePathError as e:
            raise self._corrupt(job0.digest, job0.where, str(e)) from e
        except StoreIOError:  # an object store that failed or fell silent: not damage
            raise
        except OSError as e:  # EIO, EISDIR, ...: these chunks are unreadable, others may be fine
            raise self._corrupt(job0.digest, job0.where, f"its pack cannot be read ({e})") from e
        g = 0
        for (job, rec, lay), end in zip(layouts, ends, strict=True):
            if n < end:
                got = max(0, n - (end - rec.size))
                raise self._corrupt(
                    job.digest, job.where, f"pack is truncated: read {got} of {rec.size} bytes"
                )
            if self.verify:
                h = xxhash.xxh3_128()
                for piece in lay.pieces:
                    if isinstance(piece, int):
                        h.update(memoryview(gaps[g : g + piece]))
                        g += piece
                    else:
                        h.update(memoryview(piece).cast("B"))
                actual = h.hexdigest()
                if actual != job.digest:
                    raise self._corrupt(
                        job.digest, job.where, f"its bytes hash to {actual}, expected {job.digest}"
                    )
            for src, dst in lay.copies:  # targets wanting bytes another target already holds
                dst[:] = src

    def _read_scratch(self, job: ChunkTargets, rec: ChunkRecord) -> int:
        """Decode a chunk into the per-thread scratch buffer, then copy out each target; a chunk
        with one target covering all of it (the usual case for a large tensor) is decoded
        straight into the destination, whatever its codec."""
        if len(job.targets) == 1:
            start, length, dst = job.targets[0]
            if start == 0 and length == rec.size:
                self.decode_into(job.digest, dst, job.where)
                return rec.size
        raw = _scratch("raw", rec.size)
        self.decode_into(job.digest, raw, job.where)
        for start, length, dst in job.targets:
            dst[:] = raw[start : start + length]
        return rec.size


@dataclass
class _Layout:
    """How a raw chunk's bytes [0, size) map onto destinations, in chunk order: each piece is a
    destination array or the length of a span no target wants. ``copies`` fill targets whose
    bytes another target receives (duplicates), after the read."""

    pieces: list[np.ndarray | int]
    copies: list[tuple[np.ndarray, np.ndarray]]
    gap_bytes: int


def _layout(job: ChunkTargets, rec: ChunkRecord) -> _Layout | None:
    pieces: list[np.ndarray | int] = []
    copies: list[tuple[np.ndarray, np.ndarray]] = []
    placed: list[tuple[int, int, np.ndarray]] = []
    cursor = gap_bytes = 0
    for start, length, dst in sorted(job.targets, key=lambda t: (t[0], -t[1])):
        if length == 0:
            continue
        if dst.dtype != np.uint8 or not dst.flags.c_contiguous or dst.size != length:
            return None
        if start < 0 or start + length > rec.size:
            return None  # the scratch path reports it through the usual size checks
        if start >= cursor:
            if start > cursor:
                pieces.append(start - cursor)
                gap_bytes += start - cursor
            pieces.append(dst)
            placed.append((start, length, dst))
            cursor = start + length
            continue
        # Overlaps bytes already going to an earlier target: copy them from there afterwards.
        for ps, pn, pdst in reversed(placed):
            if ps <= start and start + length <= ps + pn:
                copies.append((pdst[start - ps : start - ps + length], dst))
                break
        else:
            return None
    if cursor < rec.size:
        pieces.append(rec.size - cursor)
        gap_bytes += rec.size - cursor
    return _Layout(pieces, copies, gap_bytes)


# A run of coalesced raw chunks is read by one preadv and handled by one pool job: large enough
# that per-job Python work and syscalls vanish, small enough that the pool stays balanced.
RUN_BYTES = 16 << 20
RUN_IOVECS = 512


def plan_runs(
    jobs: list[ChunkTargets], records: dict[str, ChunkRecord], threads: int = 1
) -> list[list[ChunkTargets]]:
    """Group jobs into pool work items: raw chunks adjacent in one pack (only alignment padding
    between them) form one run; every other chunk is a run of its own. Encoded chunks come first
    (decoding is the slow part, it should start early), then runs by pack and offset."""
    total = sum(records[j.digest].size for j in jobs if j.digest in records)
    # Keep at least ~4 runs per thread so the last one does not leave the others idle.
    cap = max(1 << 20, min(RUN_BYTES, total // max(1, 4 * threads)))
    encoded: list[list[ChunkTargets]] = []
    raw: list[tuple[str, int, ChunkTargets]] = []
    for j in jobs:
        rec = records.get(j.digest)
        if rec is None or rec.codec != codecs.RAW:
            encoded.append([j])  # unknown digests are reported by read_run
        else:
            raw.append((rec.pack, rec.offset, j))
    raw.sort(key=lambda x: (x[0], x[1]))
    runs: list[list[ChunkTargets]] = []
    cur: list[ChunkTargets] = []
    cur_pack, cur_end, cur_bytes, cur_iov = "", -1, 0, 0
    for pack, offset, j in raw:
        rec = records[j.digest]
        n_iov = len(j.targets) * 2 + 2
        if (
            cur
            and pack == cur_pack
            and cur_end <= offset < cur_end + PACK_ALIGN
            and cur_bytes + rec.size <= cap
            and cur_iov + n_iov <= RUN_IOVECS
        ):
            cur.append(j)
            cur_bytes += rec.size
            cur_iov += n_iov
        else:
            if cur:
                runs.append(cur)
            cur, cur_bytes, cur_iov = [j], rec.size, n_iov
        cur_pack, cur_end = pack, offset + rec.size
    if cur:
        runs.append(cur)
    encoded.sort(key=lambda r: -records[r[0].digest].size if r[0].digest in records else 0)
    return encoded + runs


def run_jobs(
    packs: PackReaders,
    records: dict[str, ChunkRecord],
    jobs: list[ChunkTargets],
    verify: bool,
    threads: int,
    name: str = "deltackpt-read",
) -> int:
    """Read, decode and verify every job on ``threads`` threads; return raw bytes delivered.
    The first error (a :class:`CorruptChunkError` naming the chunk and key) is raised after the
    jobs in flight finish; no job still queued starts."""
    reader = ChunkReader(packs, records, verify=verify)
    runs = plan_runs(jobs, records, threads)
    if threads <= 1 or len(runs) <= 1:
        return sum(reader.read_run(r) for r in runs)
    with ThreadPoolExecutor(min(threads, len(runs)), thread_name_prefix=name) as pool:
        futures = [pool.submit(reader.read_run, r) for r in runs]
        try:
            return sum(f.result() for f in futures)
        except BaseException:
            for f in futures:
                f.cancel()
            raise

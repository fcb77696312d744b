"""Reading chunks back: pread (into the destination when possible), decode, verify the digest.

Used by load and verify. A chunk stored raw whose bytes fill one destination range is read
straight into the destination tensor's memory and hashed there: no intermediate copy. Everything
else goes through a per-thread scratch buffer that is reused across chunks.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import numpy as np

from deltackpt import codecs
from deltackpt._hashing import digest
from deltackpt.errors import CodecError, CorruptChunkError, UnsafePathError
from deltackpt.manifest import ChunkRecord
from deltackpt.pack import PackReaders

_local = threading.local()


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

    def _corrupt(self, d: str, where: str, why: str) -> CorruptChunkError:
        rec = self.records.get(d)
        loc = f"pack {rec.pack} offset {rec.offset}" if rec else "no record"
        return CorruptChunkError(
            f"chunk {d} of {where} ({loc}) is corrupt: {why}. Run `deltackpt verify` to list "
            "every damaged snapshot; load an earlier snapshot or restore the store from a copy"
        )

    def _read_payload(self, d: str, rec: ChunkRecord, out: np.ndarray, where: str) -> None:
        try:
            n = self.packs.read_into(rec.pack, rec.offset, out)
        except FileNotFoundError:
            raise self._corrupt(d, where, f"its pack file {rec.pack}.pack is missing") from None
        except UnsafePathError as e:
            raise self._corrupt(d, where, str(e)) from e
        except OSError as e:  # EIO, EISDIR, ...: this chunk is unreadable, the rest may be fine
            raise self._corrupt(d, where, f"its pack cannot be read ({e})") from e
        if n != out.size:
            raise self._corrupt(d, where, f"pack is truncated: read {n} of {out.size} bytes")

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
        elif rec.codec == codecs.XOR and base_raw is None:
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
        levels = []
        for cd, crec in reversed(chain):
            if crec.size != rec.size:
                raise self._corrupt(
                    d, where, f"chain member {cd} has size {crec.size}, expected {rec.size}"
                )
            payload = np.empty(crec.length, dtype=np.uint8)
            self._read_payload(cd, crec, payload, where)
            levels.append((crec.codec, payload, crec.itemsize))
        try:
            codecs.decode_chain(levels, rec.size, out)
        except CodecError as e:
            raise self._corrupt(d, where, f"its xor chain does not decode ({e})") from e

    def read(self, job: ChunkTargets) -> int:
        """Deliver one chunk to its targets; return the raw bytes decoded."""
        rec = self.records.get(job.digest)
        if rec is None:
            raise self._corrupt(job.digest, job.where, "the manifest has no location for it")
        if len(job.targets) == 1 and rec.codec == codecs.RAW:
            start, length, dst = job.targets[0]
            if start == 0 and length == rec.size:
                self.decode_into(job.digest, dst, job.where)
                return rec.size
        raw = _scratch("raw", rec.size)
        self.decode_into(job.digest, raw, job.where)
        for start, length, dst in job.targets:
            dst[:] = raw[start : start + length]
        return rec.size

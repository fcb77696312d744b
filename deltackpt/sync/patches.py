"""Element-sparse delta rounds: what a sender keeps to patch against, and how a receiver turns a
bucket of patches back into the new bytes before it verifies them.

An RL step with a small learning rate changes a few percent of the bf16 elements, spread over
nearly every tensor, so sending the changed *tensors* re-sends almost everything. Instead:

* **Sender** (:class:`Bases`): keeps, per piece (tensor, box, wire dtype), the bytes it last
  committed. In a delta round a changed piece is packed as before (new bytes, hashed while
  copied), then ``delta_codec.encode`` compares it with its base and, when that is smaller,
  the message carries the patch instead (the changed elements, compressed, or zstd byte planes
  of the xor) with the digest of the *new* bytes. A piece sent to several receivers (1 -> N
  broadcast) is encoded once per round. The encoder updates the base right away (the k changed
  elements); after the commit vote, every piece the round sent whole is copied into its base
  from the source tensor (unchanged until ``push`` returns). A failed round may leave bases
  ahead of the receivers: the next round is full and rewrites them all. Under the time-first
  policy (``encode="auto"``) a piece with too many changes to patch drops its base and goes
  whole for ``REST_ROUNDS`` rounds (no diff, no base copy: a pre-training-like step costs what
  a whole-piece delta round costs), then its base is recorded again.
  Memory: one copy of the pieces this rank sends on patching links, in the wire dtype (for a
  bf16 wire from fp32 master weights: half the master shard), allocated by the first round.
* **Receiver** (:func:`expand`): a bucket with patches is laid out compactly on the wire. Its
  pieces are moved, last first, to the places they take when every present piece is whole
  (each piece's compact offset is at most its whole offset, so no move overwrites bytes not yet
  moved); a patched piece's base is gathered there from the receiver's own copy (the target
  tensor it holds) and the patch applied in place. Then the bucket is verified against the
  digests of the new bytes and applied at commit as any other: no memory beyond the staging
  slot and one patch. A ``PACKED`` piece whose base is a contiguous host tensor is not
  gathered: :func:`patched_digest` hashes base and changed elements together, and the commit
  writes the elements into the base (``apply.py``). A receiver that holds another version than the round's base (edited,
  partly loaded, restarted) gets bytes that fail their digest: the round fails on every rank,
  nothing is applied, and the next round is full.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import numpy as np
import torch
import xxhash

from deltackpt.sync import delta_codec, delta_decode, wire
from deltackpt.sync.dtypes import wire_dtype
from deltackpt.sync.errors import SyncError
from deltackpt.sync.schedule import LinkBucket

__all__ = ["REST_ROUNDS", "BaseKey", "Bases", "Changes", "expand"]

#: Rounds a piece goes without a base after it changed too much to patch (time-first policy).
REST_ROUNDS = 8

#: The changed elements of a piece: flat element indices and their new values (raw uints).
Changes = tuple[np.ndarray, np.ndarray]

#: A piece as bases know it: (tensor index, box offset, box size, wire dtype name).
BaseKey = tuple[int, tuple[int, ...], tuple[int, ...], str]


def base_key(p: object) -> BaseKey:
    return (p.tensor, p.box.offset, p.box.size, p.dtype)  # type: ignore[attr-defined]


class Bases:
    """The sender's committed bytes per piece, and this round's encodings (see module doc).
    Packing threads encode pieces at once: a piece (1 -> N: the same piece in several
    receivers' buckets) is encoded under its own lock, with each thread's own scratch."""

    def __init__(self) -> None:
        # what encode may send (delta_codec.encode's allow / packed_below): set by the sender
        # from its encode= option and the link kind
        self.allow: frozenset[int] = delta_codec.ALL
        self.packed_below = delta_codec.PACKED_BELOW
        self._base: dict[BaseKey, torch.Tensor] = {}
        self._sent: dict[BaseKey, tuple[torch.Tensor, torch.dtype]] = {}
        self._cache: dict[BaseKey, tuple[int, np.ndarray] | None] = {}
        self._updated: set[BaseKey] = set()  # bases already brought to this round's bytes
        self._resting: dict[BaseKey, int] = {}  # pieces without a base for that many rounds
        self._tls = threading.local()  # .scratch: each packing thread's work buffers
        self._locks: dict[BaseKey, threading.RLock] = {}

    @property
    def nbytes(self) -> int:
        return sum(b.numel() for b in self._base.values())

    def start_round(self) -> None:
        self._sent.clear()
        self._cache.clear()
        self._updated.clear()

    def clear(self) -> None:
        self._base.clear()
        self._resting.clear()
        self.start_round()

    def has(self, key: BaseKey) -> bool:
        return key in self._base

    @property
    def _scratch(self) -> delta_codec.Scratch:
        got = getattr(self._tls, "scratch", None)
        if got is None:
            got = self._tls.scratch = delta_codec.Scratch()
        return got

    def lock(self, key: BaseKey) -> threading.RLock:
        """Held while piece ``key`` is encoded (its base read and written)."""
        got = self._locks.get(key)
        return got if got is not None else self._locks.setdefault(key, threading.RLock())

    def encode(
        self, key: BaseKey, new: torch.Tensor, itemsize: int
    ) -> tuple[int, np.ndarray] | None:
        """The patch of ``new`` (the piece's new wire bytes, flat uint8) against its base, as
        (kind, payload); None when sending it raw is cheaper; kind 0 when nothing changed. The
        base becomes ``new`` right away (the k changed elements are written into it, or the
        piece copied): if the round fails, the next one is full and rewrites every base."""
        with self.lock(key):
            return self._encode(key, new, itemsize)

    def _encode(
        self, key: BaseKey, new: torch.Tensor, itemsize: int
    ) -> tuple[int, np.ndarray] | None:
        if key not in self._cache:
            base = self._base[key].numpy()
            raw = new.numpy()
            enc = delta_codec.encode(
                raw,
                base,
                itemsize,
                allow=self.allow,
                scratch=self._scratch,
                packed_below=self.packed_below,
                update_base=True,  # where no zstd planes are tried (the time-first policy)
            )
            if enc is None:
                self._cache[key] = (0, np.empty(0, np.uint8))  # unchanged
                return self._cache[key]
            if enc.kind == delta_codec.DENSE and delta_codec.PLANES not in self.allow:
                # too many changes for the time-first policy: stop keeping this base for a
                # while (no copy, no diff) instead of paying for both every round
                del self._base[key]
                self._resting[key] = REST_ROUNDS
                self._cache[key] = None
                return None
            if not enc.base_updated:  # (else the diff wrote the changed words as it found them)
                if enc.changes is not None:
                    idx, vals = enc.changes
                    base.view(vals.dtype)[idx] = vals
                else:
                    np.copyto(base, raw)
            self._updated.add(key)
            if enc.kind == delta_codec.DENSE:
                self._cache[key] = None
            else:  # a copy: the payload may be a view of the scratch
                payload = np.frombuffer(enc.payload, np.uint8, enc.nbytes)
                self._cache[key] = (enc.kind, payload.copy())
        return self._cache[key]

    def sent(self, key: BaseKey, src: torch.Tensor, dtype: torch.dtype) -> None:
        """Piece ``key`` (``src`` cast to ``dtype``) was sent this round: its base after commit
        (unless the piece is resting: it changed too much to patch lately)."""
        if key not in self._resting:
            self._sent[key] = (src, dtype)

    def commit(self) -> None:
        """After the vote: every piece sent this round becomes its base (from the sources)."""
        for key, (src, dt) in self._sent.items():
            if key in self._updated:
                continue
            n = src.numel() * dt.itemsize
            base = self._base.get(key)
            if base is None or base.numel() != n:
                base = self._base[key] = torch.empty(n, dtype=torch.uint8)
            wire.fill(base, src, dt)
        for key in list(self._resting):  # one more committed round without a base
            self._resting[key] -= 1
            if self._resting[key] <= 0:  # sent whole next time, its base recorded again
                del self._resting[key]
        self.start_round()


def expand(
    bk: LinkBucket,
    slot: torch.Tensor,
    header: wire.Header,
    offsets: list[int | None],
    start: int,
    align: int,
    base_of: Callable[[int], torch.Tensor],
) -> tuple[list[int | None], dict[int, Changes], dict[int, np.ndarray]]:
    """Turn a received bucket with patches into its pieces' new bytes, each whole at its own
    offset; ``base_of(k)`` is the receiver's current bytes of piece ``k`` (its target box, in
    the wire dtype). Returns the offsets, per ``PACKED`` piece its changed elements (flat
    indices, new values: at commit those are written into the target instead of copying the
    whole piece), and the ``PACKED`` pieces left out of ``slot``: piece -> its base's bytes.
    Those are the pieces whose base is a contiguous host tensor (so the commit writes their
    elements into it, never their bytes from the slot): their new bytes are never assembled,
    :func:`patched_digest` hashes base and patch together in cache-sized chunks (the bytes
    written to the slot and read back took 2x as long on a 2-core host:
    ``benchmarks/bench_patch_check.py``). Raises :class:`SyncError` on a malformed patch."""
    flags = header.flags
    if wire.DIRECT in flags:
        raise SyncError("a bucket with patches has zero-copy pieces; the sender never sends both")
    sizes = [p.nbytes for p in bk.pieces]
    whole, _, end = wire.layout(sizes, flags, start, align)
    if end > slot.numel():
        raise SyncError(f"its pieces take {end} bytes, the slot holds {slot.numel()}")
    raw = slot.numpy()
    changes: dict[int, Changes] = {}
    left: dict[int, np.ndarray] = {}
    for k in reversed(range(len(bk.pieces))):
        piece, c, d = header.pieces[k], offsets[k], whole[k]
        if piece is None or c is None or d is None:
            continue
        n = sizes[k]
        if piece.kind == wire.RAW:
            if c != d:
                np.copyto(raw[d : d + n], raw[c : c + n])  # overlapping: numpy buffers it
            continue
        dt = wire_dtype(bk.pieces[k].dtype)
        base = base_of(k)
        if base.dtype != dt:
            raise SyncError(
                f"piece {k} is a patch but this receiver holds it as {base.dtype}, not {dt}"
            )
        out = raw[d : d + n]
        if piece.kind == delta_codec.PACKED:
            # decoded into arrays of their own before anything is written over its payload
            idx, vals = changes[k] = delta_decode.packed_changes(
                raw[c : c + piece.length], dt.itemsize, n // dt.itemsize
            )
            flat = wire.raw_bytes(base, dt) if base.device.type == "cpu" else None
            if flat is not None and flat.numel() == n:  # hashed with its base, not assembled
                left[k] = flat.numpy()
                continue
            wire.copy_into(slot[d : d + n].view(dt).view(base.shape), base)
            out.view(vals.dtype)[idx] = vals
            continue
        payload = raw[c : c + piece.length].copy()  # its place is overwritten next
        wire.copy_into(slot[d : d + n].view(dt).view(base.shape), base)
        delta_decode.decode_into(piece.kind, payload, out, dt.itemsize, out)
    return whole, changes, left


#: elements of a piece hashed at a time by :func:`patched_digest` (512 KiB of bf16: a core's L2)
PATCHED_CHUNK = 1 << 18


def patched_digest(base: np.ndarray, idx: np.ndarray, vals: np.ndarray) -> tuple[int, int]:
    """The digest of ``base`` (a piece's bytes, uint8) with ``vals`` written at element indices
    ``idx`` (rising, validated by the decoder), without writing it: each chunk of elements is
    copied into a small buffer, patched there and hashed (a chunk nothing changed in is hashed
    in place). The same digest as :func:`wire.verify` of the patched bytes."""
    words = base.view(vals.dtype)
    n, step = words.size, PATCHED_CHUNK
    h = xxhash.xxh3_128()
    cuts = np.searchsorted(idx, np.arange(0, n + step, step, dtype=np.int64))
    buf = np.empty(min(step, n), dtype=vals.dtype)
    for j, s in enumerate(range(0, n, step)):
        e, a, b = min(s + step, n), int(cuts[j]), int(cuts[j + 1])
        if a == b:
            h.update(words[s:e])
            continue
        part = buf[: e - s]
        np.copyto(part, words[s:e])
        part[idx[a:b] - s] = vals[a:b]
        h.update(part)
    return wire.digest_words(h)

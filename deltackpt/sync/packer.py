"""One bucket message of a trainer: which pieces go, raw or as patches, and the header that
names them. :class:`Packer` runs on the sender's packing threads, a bucket each (and, for buckets
with nothing to send, its calling thread); :class:`~deltackpt.sync.sender.WeightSender` owns it and sets
its per-round state (the local tensors, the committed version patches apply to).

A piece that changed goes in one of three ways: zero-copy (gloo, large, contiguous, no cast:
sent from the tensor as its own message), raw (copied, cast, hashed chunk by chunk from this
rank's memory), or as a patch against the base the sender keeps (``patches.Bases``) when that
is smaller; a message with patches carries no zero-copy piece (``patches.expand`` relies on
it). The digest in the header is always that of the piece's new bytes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from deltackpt import cuda
from deltackpt.format.fingerprint import pack_fingerprinted
from deltackpt.format.fingerprint_kernel import whole_words
from deltackpt.options import fingerprint_kernel
from deltackpt.sync import wire
from deltackpt.sync.detect import Detector
from deltackpt.sync.device_delta import patch_bytes, write_patch
from deltackpt.sync.device_digest import CHUNK, message_digest_rows
from deltackpt.sync.dtypes import wire_dtype
from deltackpt.sync.group import SyncGroup
from deltackpt.sync.ipc_links import INLINE_WORDS
from deltackpt.sync.patches import Bases, base_key
from deltackpt.sync.rounds import payload_start
from deltackpt.sync.schedule import LinkBucket, Schedule, Transfer
from deltackpt.sync.schedule_decl import Held

__all__ = ["DeviceDigests", "Packed", "Packer"]


@dataclass
class DeviceDigests:
    """A device round's piece digests, still on the device: piece ``present[j]`` has digest
    ``rows[j]``; the sender reads them when it publishes the bucket with its header in the
    link's cell (``inline``), else with the round's others after its last bucket."""

    present: list[int]
    rows: torch.Tensor
    # the header's bytes on the host (digests not yet in), sent in the ipc link's cell
    # (``ipc_links.py``) once the bucket has landed; with no piece, all of the message
    inline: torch.Tensor | None = None

    def header(self, host: list[list[int]]) -> torch.Tensor:
        """:attr:`inline` with the digests ``host`` (``rows`` read) written in."""
        assert self.inline is not None
        out = self.inline.clone()
        words = out.view(torch.int64)
        for k, (a, b) in zip(self.present, host, strict=True):
            words[wire.HEAD + 3 * k + 1] = a
            words[wire.HEAD + 3 * k + 2] = b
        return out

    def resolve(self, host: list[list[int]], n: int) -> list[tuple[int, int] | None]:
        """The digests per piece of a bucket of ``n`` pieces, from ``host`` (``rows`` read)."""
        out: list[tuple[int, int] | None] = [None] * n
        for k, (a, b) in zip(self.present, host, strict=True):
            out[k] = (int(a), int(b))
        return out


# message bytes, digests, payload bytes, zero-copy pieces (flat bytes of the source, tag)
Packed = tuple[
    int, list[tuple[int, int] | None] | DeviceDigests, int, list[tuple[torch.Tensor, int]]
]


#: a piece's view of its local tensor (``Packer._views``)
_View = tuple[Transfer, torch.Tensor, torch.Tensor, torch.Tensor | None, bool]


@dataclass
class Packer:
    """Fills bucket messages of one trainer rank (see module doc)."""

    group: SyncGroup
    align: int
    zero_copy_min: int | None
    detector: Detector
    bases: Bases
    patch_links: set[int] = field(default_factory=set)
    local: dict[str, torch.Tensor] = field(default_factory=dict)
    boxes: dict[str, Held] = field(default_factory=dict)
    base_version: int | None = None  # the version the receivers hold (patches apply to it)
    # a device round: this round's chunk fingerprints of the scanned tensors (host_mirror.scan)
    fingerprints: dict[str, torch.Tensor] = field(default_factory=dict)
    # ... and the changed elements found against the device bases (device_patches.py)
    device_changes: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    # a full device round: the tensors the scan left to the pack to fingerprint as it copies
    # them (host_mirror.scan(defer=)), and where their fingerprints go (HostMirror.provide)
    fuse: frozenset[str] = frozenset()
    provide: Callable[[str, torch.Tensor], None] | None = None
    # (receiver, bucket index) -> its header's host buffer in device rounds
    _headers: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)
    # (receiver, bucket index, piece) -> (the piece, the local tensor, the piece's view of it,
    # that view's raw bytes where it is contiguous in the wire dtype (else None), whether it is
    # the whole tensor so): kept while both are the same objects (_changed)
    _views: dict[tuple[int, int, int], _View] = field(default_factory=dict)

    def forget(self) -> None:
        """A new schedule: drop the views of the last one's pieces (and the tensors they
        hold)."""
        self._views.clear()

    def message(
        self, sched: Schedule, bk: LinkBucket, buf: torch.Tensor, seq: int, version: int, full: bool
    ) -> Packed:
        """Fill ``buf`` with the message of ``bk``: changed (or all) pieces, then the header;
        zero-copy pieces are hashed in place and returned to be sent on their own."""
        srcs: list[tuple[torch.Tensor, torch.dtype] | None] = []
        flags: list[int] = []
        # shm: buf is the link window, writable by other processes; else this rank's ring
        shared = self.group.window(bk.receiver, bk.index) is not None
        zero_copy = (
            self.zero_copy_min is not None and not shared and bk.index < wire.MAX_DIRECT_BUCKETS
        )
        ndirect = 0
        scratch = torch.empty(wire.SCRATCH, dtype=torch.uint8)
        for p, got in zip(bk.pieces, self._changed(sched, bk, full, scratch), strict=True):
            if got is None:
                srcs.append(None)
                flags.append(0)
                continue
            _, src, dt = got
            direct = (
                zero_copy
                and p.nbytes >= max(1, self.zero_copy_min or 0)
                and ndirect < wire.MAX_DIRECT
                and src.dtype == dt
                and src.device.type == "cpu"
                and src.is_contiguous()
            )
            ndirect += direct
            srcs.append((src, dt))
            flags.append(wire.DIRECT if direct else wire.IN_MESSAGE)
        patching = not full and self._patching(sched, bk)
        if patching:  # patches and zero-copy pieces never share a message (patches.expand)
            flags = [wire.IN_MESSAGE if f else 0 for f in flags]
        start = payload_start(bk, self.align)
        heads: list[wire.Piece | None] = [None] * len(bk.pieces)
        sends: list[tuple[torch.Tensor, int]] = []
        pos = start
        for want in (wire.IN_MESSAGE, wire.DIRECT):  # the order of wire.layout
            if want == wire.DIRECT:
                msg_end = pos
            for k, (p, sd) in enumerate(zip(bk.pieces, srcs, strict=True)):
                if sd is None or flags[k] != want:
                    continue
                src, dt = sd
                name = sched.tensors[p.tensor].name
                whole = p.box == self.boxes[name].box and dt == self.local[name].dtype
                # the piece is the whole local tensor, same bytes: a digest taken of it this
                # round (change detection) is the piece's; no second read of the tensor
                known = None if full or not whole else self.detector.known(name)
                pos = -(-pos // self.align) * self.align
                kind, length = wire.RAW, p.nbytes
                if want == wire.DIRECT:
                    d = known or wire.hash_piece(src, dt, scratch)  # contiguous, no cast: in place
                    sends.append(
                        (src.reshape(-1).view(torch.uint8), wire.direct_tag(bk.index, len(sends)))
                    )
                else:
                    room = buf[pos : pos + p.nbytes]
                    got = self._piece(p, src, dt, room, known, patching, scratch, shared)
                    if got is None:  # no byte of it changed since the last commit
                        continue
                    d, kind, length = got
                if full and whole:
                    self.detector.record(name, d)
                if self._keeps_base(sched, bk, p):
                    self.bases.sent(base_key(p), src, dt)
                heads[k] = wire.Piece(want, kind, length, d)
                pos += length
        patched = any(h is not None and h.kind != wire.RAW for h in heads)
        wire.write_header(
            buf,
            seq,
            version,
            bk.index,
            wire.OK,
            heads,
            pos - start,
            self.base_version if patched else None,
        )
        present = [None if h is None else h.digest for h in heads]
        payload = sum(h.length for h in heads if h is not None)
        return msg_end, present, payload, sends

    def device_message(
        self, sched: Schedule, bk: LinkBucket, buf: torch.Tensor, seq: int, version: int, full: bool
    ) -> Packed:
        """A device round's message of ``bk`` (``WeightSender``: an ipc link on CUDA): every
        changed (or, ``full``, every) piece copied and cast from the local tensor into ``buf``,
        the bucket itself, where both live (device to device), raw; then the device digests of
        all of them in one pass (``device_digest.py``), left on the device; then the header, on
        the host for the link's cell when it fits (:class:`DeviceDigests`), else into the
        bucket with the digests written in there. The change is the device scan's (``Detector.start_round(scanned=)``), and so
        are the chunk fingerprints of a piece that is a whole scanned tensor: its digest is
        their fold (the bytes the sender meant to send, read once this round). A whole tensor
        whose changed elements the device found (``DELTACKPT_DEVICE_PATCH``) goes as a device
        patch when its receiver holds the last version and that is smaller
        (``device_delta.py``)."""
        start = payload_start(bk, self.align)
        pos = start
        scratch = torch.empty(wire.SCRATCH, dtype=torch.uint8)  # a host tensor's own test
        spans: list[tuple[int, int]] = []
        present: list[int] = []
        known: dict[int, torch.Tensor] = {}  # a whole scanned tensor: its digest is a fold
        kinds: dict[int, int] = {}  # pieces sent as device patches
        sources: dict[int, torch.Tensor] = {}  # pieces copied from another device: their bytes
        # plain copies on the bucket's device, all in one call (torch._foreach_copy_: on a GPU
        # a few launches for all of them, not one per piece)
        into: list[torch.Tensor] = []
        froms: list[torch.Tensor] = []
        # whole tensors the scan left to this pack: copied and fingerprinted in one pass
        fused: list[tuple[int, str, torch.Tensor, int]] = []  # (span, name, bytes, offset)
        for k, (p, got) in enumerate(
            zip(bk.pieces, self._changed(sched, bk, full, scratch), strict=True)
        ):
            if got is None:
                continue
            name, src, dt = got
            pos = -(-pos // self.align) * self.align
            fp = self.fingerprints.get(name)
            _, _, _, flat, whole = self._views[(bk.receiver, bk.index, k)]  # by _changed
            found = self.device_changes.get(name) if whole and fp is not None else None
            length = p.nbytes
            if (
                found is not None
                and not full
                and self.base_version is not None
                and sched.wanted[bk.receiver][p.want][0].patch  # it holds the wire dtype
                and p.nbytes % 8 == 0
                and src.numel() < 1 << 31  # int32 indices
                and patch_bytes(found[0].numel(), dt.itemsize) < p.nbytes
            ):  # the changed elements only; the digest is of the new piece (its scan's fold)
                length = write_patch(buf[pos : pos + p.nbytes], *found)
                kinds[k] = wire.DEVICE_PATCH
            elif src.is_cuda and not buf.is_cuda:  # a GPU's tensor into a host bucket
                # (page-locked): digested on that GPU; a host tensor into a CUDA bucket, or
                # one GPU's into another's, is copied in below and digested in the bucket
                piece = _on_device(src, dt, p.nbytes)
                buf[pos : pos + p.nbytes].copy_(piece, non_blocking=True)
                if not (fp is not None and whole):
                    sources[len(spans)] = piece  # its digest taken where it is
            elif flat is not None and src.device == buf.device:
                if whole and fp is None and name in self.fuse and whole_words(flat):
                    fused.append((len(spans), name, flat, pos))
                else:
                    into.append(buf[pos : pos + p.nbytes])  # copied together below
                    froms.append(flat)
            else:
                wire.fill(buf[pos : pos + p.nbytes], src, dt)
            if fp is not None and whole:
                known[len(spans)] = fp
            spans.append((pos, length))
            present.append(k)
            pos += length
        if fused:
            fps = pack_fingerprinted(
                [f[2] for f in fused], buf, [f[3] for f in fused], CHUNK, fingerprint_kernel()
            )
            if fps is None:  # the kernel did not run: copied plainly, digested in the bucket
                into += [buf[o : o + f.numel()] for _, _, f, o in fused]
                froms += [f for _, _, f, _ in fused]
            else:
                for (i, name, _, _), fp in zip(fused, fps, strict=True):
                    known[i] = fp
                    if self.provide is not None:
                        self.provide(name, fp)
        if into:
            torch._foreach_copy_(into, froms)
        heads: list[wire.Piece | None] = [None] * len(bk.pieces)
        for k, (_, n) in zip(present, spans, strict=True):  # digests: written in later
            heads[k] = wire.Piece(wire.IN_MESSAGE, kinds.get(k, wire.RAW), n, (0, 0))
        base = self.base_version if kinds else None
        host = self._header_buffer(bk, buf.device)
        size = wire.write_header(
            host, seq, version, bk.index, wire.OK, heads, pos - start, base, device=True
        )
        rows = message_digest_rows(buf, spans, known, sources)
        payload = sum(n for _, n in spans)
        if size <= 8 * INLINE_WORDS:  # the header goes in the link's cell, digests filled in
            return pos, DeviceDigests(present, rows, host[:size]), payload, []
        buf[:size].copy_(host[:size], non_blocking=host.is_pinned())
        wire.put_digests(buf, present, rows)  # nothing waited for: the publish waits once
        return pos, DeviceDigests(present, rows), payload, []

    def _header_buffer(self, bk: LinkBucket, device: torch.device) -> torch.Tensor:
        """Bucket ``bk``'s own host buffer for its header (pinned where the bucket is on a
        GPU: copied without waiting; reused next round, after this round's publish waited for
        the copy)."""
        key = (bk.receiver, bk.index)
        size = wire.header_words(len(bk.pieces)) * 8
        got = self._headers.get(key)
        if got is None or got.numel() < size:
            got = self._headers[key] = cuda.host_buffer(size, device.type == "cuda")
        return got

    def _changed(
        self, sched: Schedule, bk: LinkBucket, full: bool, scratch: torch.Tensor
    ) -> list[tuple[str, torch.Tensor, torch.dtype] | None]:
        """Per piece of ``bk``: (tensor name, its box of the local tensor, wire dtype) when it
        goes this round (every piece if ``full``, else those the detector says changed), None
        when it does not."""
        out: list[tuple[str, torch.Tensor, torch.dtype] | None] = []
        views = self._views
        for k, p in enumerate(bk.pieces):
            name = sched.tensors[p.tensor].name
            key = (bk.receiver, bk.index, k)
            t = self.local[name]
            dt = wire_dtype(p.dtype)
            got = views.get(key)
            if got is not None and got[0] is p and got[1] is t:
                src = got[2]
            else:  # a new schedule or another local tensor: the view made again
                held = self.boxes[name].box
                src = t[p.box.within(held)]
                flat = wire.raw_bytes(src, dt)
                views[key] = (p, t, src, flat, flat is not None and p.box == held)
            sent = full or self.detector.piece_changed(name, key, src, dt, scratch)
            out.append((name, src, dt) if sent else None)
        return out

    def _piece(
        self,
        p: Transfer,
        src: torch.Tensor,
        dt: torch.dtype,
        dst: torch.Tensor,
        known: tuple[int, int] | None,
        patching: bool,
        scratch: torch.Tensor,
        shared: bool,
    ) -> tuple[tuple[int, int], int, int] | None:
        """Write piece ``p`` into ``dst`` (its whole room in the message): as a patch against
        its base when that is smaller, else raw. Returns (digest of the new bytes, kind,
        payload length), or None when the piece equals its base. A contiguous source in the
        wire dtype is compared and hashed where it lies; others are packed (cast) first, hashed
        from this rank's memory (``shared``: ``dst`` is a shared-memory window; ``wire.pack``)."""
        key = base_key(p)
        if not (patching and self.bases.has(key)):
            return wire.pack(src, dst, dt, known, scratch, shared=shared), wire.RAW, p.nbytes
        in_place = src.dtype == dt and src.is_contiguous() and src.device.type == "cpu"
        if in_place:
            new = src.reshape(-1).view(torch.uint8)
            d = known or wire.hash_tensor(src)
        else:
            new, d = dst, wire.pack(src, dst, dt, known, scratch, shared=shared)
        patch = self.bases.encode(key, new, dt.itemsize)
        if patch is not None and patch[0] == 0:
            return None
        if patch is None:  # raw is smaller
            if in_place:
                wire.pack(src, dst, dt, d)
            return d, wire.RAW, p.nbytes
        dst[: patch[1].size].copy_(torch.from_numpy(patch[1]))
        return d, patch[0], patch[1].size

    def _patching(self, sched: Schedule, bk: LinkBucket) -> bool:
        """Whether changed pieces of ``bk`` may go as patches: the link patches (``encode``)
        and the receivers committed this sender's last version."""
        return self.base_version is not None and bk.receiver in self.patch_links

    def _keeps_base(self, sched: Schedule, bk: LinkBucket, p: Transfer) -> bool:
        """Whether piece ``p`` needs a base: its link patches and its receiver holds the
        piece in the wire dtype (``Want.patch``)."""
        return bk.receiver in self.patch_links and sched.wanted[bk.receiver][p.want][0].patch


def _on_device(src: torch.Tensor, dt: torch.dtype, nbytes: int) -> torch.Tensor:
    """``src``'s bytes as ``dt``, flat uint8, where ``src`` lives: the tensor itself when it
    is contiguous in that dtype, else a cast copy there (kept alive by the caching allocator
    until the copies queued after it ran)."""
    if src.dtype == dt and src.is_contiguous():
        return src.reshape(-1).view(torch.uint8)
    out = torch.empty(nbytes, dtype=torch.uint8, device=src.device)
    wire.fill(out, src, dt)
    return out

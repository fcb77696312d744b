"""Moving one local snapshot from a rank's store into a peer's store, over the tier's gloo group.

One :func:`transfer` call per rank sends at most one snapshot (to ``dst``) and receives at most
one (from ``src``) at the same time, so a ring of replications (every rank sends to
``r + jump`` and receives from ``r - jump``) and a single fetch (a holder sends a rank's replica
back to it) are the same code. Three exchanges, each a length then the bytes, both directions
at once (``isend``/``irecv``, so a ring cannot deadlock):

1. **offer**: the sender's manifest (JSON, its own digest checked on receipt, then validated as
   any manifest read from disk), or nothing;
2. **wants**: the receiver answers with the digests its store lacks;
3. **chunks**: the sender sends those chunks' bytes in batches of at most ``BATCH_BYTES`` (both
   sides derive the same batches from the want list and the manifest's sizes).

The receiver checks every chunk (a local tier stores chunks raw, so its payload's xxh3-128 must
equal its digest), appends the good ones to a new pack of its store, and commits the manifest
(atomically, after the pack is fsynced) only when every wanted chunk arrived intact: a crash or
a damaged chunk leaves no manifest, so no half replica is ever visible; a leftover pack is swept
by the next gc. A chunk the sender cannot read whole goes as zeros, which the receiver refuses
(the receiver's check is the one that counts: the sender does not hash). Memory: one batch in
each direction.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch

from deltackpt.errors import DeltackptError, DistributedError, ManifestError
from deltackpt.format.hashing import digest
from deltackpt.format.manifest import ChunkRecord, Manifest
from deltackpt.format.validate import validate_manifest
from deltackpt.store.storage import PACKS
from deltackpt.store.store import Store
from deltackpt.tiers.config import TIER_KEY, local_name

BATCH_BYTES = 64 << 20


def _nothing(*_: Any) -> None:
    return None


@dataclass
class TierHooks:
    """Test points: ``before_replica_commit(src, name)`` runs on a receiver after every chunk
    of a snapshot is written and fsynced, right before its manifest is committed."""

    before_replica_commit: Callable[[int, str], None] = _nothing


hooks = TierHooks()


class ReplicaRefusedError(DeltackptError, ValueError):
    """A received snapshot failed a check (manifest, marker, chunk digest): not committed."""


@dataclass(frozen=True)
class Expect:
    """What the received snapshot must be: the rank whose state it is, its step, the world size
    and the layout digest of the live state (:mod:`deltackpt.tiers.localize`)."""

    rank: int
    step: int
    world: int
    layout: str | None = None  # None: any (a replica holder cannot know its peer's layout)


@dataclass
class Moved:
    """What one transfer did on this rank."""

    sent_bytes: int = 0
    received_bytes: int = 0
    committed: str | None = None  # the snapshot committed into the receiving store
    problems: list[str] = field(default_factory=list)


class Link:
    """Point-to-point bytes over a gloo group (ranks are ranks of that group)."""

    def __init__(self, group: Any) -> None:
        import torch.distributed as dist

        self.dist, self.group = dist, group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)

    def _glob(self, r: int) -> int:
        return int(self.dist.get_global_rank(self.group, r))

    def exchange(
        self,
        dst: int | None,
        data: bytes | np.ndarray | None,
        src: int | None,
        into: torch.Tensor | None = None,
    ) -> np.ndarray | None:
        """Send ``data`` to ``dst`` while receiving from ``src`` (either may be None); the
        received bytes as a uint8 array (no copy; a view of ``into`` when it is big enough),
        None when ``src`` is None."""
        n_in = torch.zeros(1, dtype=torch.int64)
        size_out = 0 if data is None else len(data)
        n_out = torch.tensor([size_out], dtype=torch.int64)
        self._both(n_out if dst is not None else None, dst, n_in if src is not None else None, src)
        out = None
        if size_out:
            arr = data if isinstance(data, np.ndarray) else np.frombuffer(data, dtype=np.uint8)
            out = torch.from_numpy(np.require(arr, dtype=np.uint8, requirements="CW"))
        size = int(n_in.item()) if src is not None else 0
        buf = None
        if size:
            fits = into is not None and into.numel() >= size
            buf = into[:size] if fits else torch.empty(size, dtype=torch.uint8)  # type: ignore[index]
        self._both(out if dst is not None else None, dst, buf, src)
        if src is None:
            return None
        return np.empty(0, dtype=np.uint8) if buf is None else buf.numpy()

    def isend(self, t: torch.Tensor, dst: int) -> Any:
        return self.dist.isend(t, self._glob(dst), group=self.group)

    def irecv(self, t: torch.Tensor, src: int) -> Any:
        return self.dist.irecv(t, self._glob(src), group=self.group)

    def _both(self, out: Any, dst: int | None, into: Any, src: int | None) -> None:
        reqs = []
        if out is not None and dst is not None:
            reqs.append(self.dist.isend(out, self._glob(dst), group=self.group))
        if into is not None and src is not None:
            reqs.append(self.dist.irecv(into, self._glob(src), group=self.group))
        for r in reqs:
            r.wait()

    def all_gather(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self.world
        try:
            self.dist.all_gather_object(out, obj, group=self.group)
        except RuntimeError as e:  # gloo's own error when a peer died or timed out
            raise self.lost("an all-gather", e) from e
        return out

    def lost(self, what: str, e: BaseException, peers: str = "a peer") -> DistributedError:
        """The typed error for a collective of the tiers' group that failed: a peer died or
        did not answer within the group's timeout."""
        return DistributedError(
            f"tiers: {what} on rank {self.rank} of {self.world} failed: {peers} died or did not "
            f"answer within the group's timeout ({type(e).__name__}: {e}). Committed snapshots "
            "in every tier are intact; restart the job and restore_latest() to resume"
        )


def _batches(wants: list[str], chunks: dict[str, ChunkRecord]) -> list[list[str]]:
    out: list[list[str]] = []
    cur: list[str] = []
    size = 0
    for d in wants:
        n = chunks[d].length
        if cur and size + n > BATCH_BYTES:
            out.append(cur)
            cur, size = [], 0
        cur.append(d)
        size += n
    if cur:
        out.append(cur)
    return out


def _offer(store: Store, name: str) -> tuple[Manifest, bytes]:
    m = store.manifest(name)
    bad = [d for d, r in m.chunks.items() if r.codec != "raw" or r.length != r.size]
    if bad:
        raise ReplicaRefusedError(
            f"snapshot {name!r} of {store.root} has {len(bad)} encoded chunk(s) (e.g. {bad[0]}, "
            f"codec {m.chunks[bad[0]].codec!r}); a local tier stores chunks raw "
            "(encoding='fast-restore') so every replica can be verified on receipt"
        )
    return m, m.to_json_bytes()


def _accept(raw: bytes, store: Store, expect: Expect) -> Manifest:
    """The offered manifest, checked as one read from disk, with the marker ``expect`` wants."""
    where = f"offered snapshot of rank {expect.rank}"
    m = Manifest.from_json_bytes(raw, where=where)
    validate_manifest(m, store.chunk_bytes, where)
    mark = m.metadata.get(TIER_KEY) if isinstance(m.metadata, dict) else None
    want = {"step": expect.step, "rank": expect.rank, "world": expect.world}
    layout = mark.get("layout") if isinstance(mark, dict) else None
    if expect.layout is not None and layout != expect.layout:
        layout = None  # not the layout the receiver will restore into
    if (
        m.name != local_name(expect.step)
        or not isinstance(layout, str)
        or mark != {**want, "layout": layout}
    ):
        raise ManifestError(
            f"{where}: name {m.name!r} and marker {mark!r}, expected name "
            f"{local_name(expect.step)!r} and marker {want!r} (a stale or foreign snapshot)"
        )
    for d, r in m.chunks.items():
        if r.codec != "raw" or r.length != r.size:
            raise ManifestError(f"{where}: chunk {d} is {r.codec!r}; a local tier sends raw")
    return m


def _intact(store: Store, have: dict[str, ChunkRecord]) -> dict[str, ChunkRecord]:
    """The records of ``have`` whose stored bytes are raw and hash to their digest."""
    out = {}
    with store.pack_readers() as packs:
        for d, rec in have.items():
            if rec.codec != "raw" or rec.length != rec.size:
                continue
            buf = np.empty(rec.length, dtype=np.uint8)
            try:
                if packs.read_into(rec.pack, rec.offset, buf) == rec.length and digest(buf) == d:
                    out[d] = rec
            except OSError:
                continue
    return out


def _read_chunks(store: Store, m: Manifest, batch: list[str], scratch: np.ndarray) -> np.ndarray:
    """One batch's chunks, back to back (in ``scratch``, reused: no page faults per batch); a
    chunk that cannot be read whole is sent as zeros. Not hashed here: the receiver checks
    every digest and refuses a damaged chunk."""
    buf = scratch[: sum(m.chunks[d].length for d in batch)]
    pos = 0
    with store.pack_readers() as packs:
        for d in batch:
            rec = m.chunks[d]
            piece = buf[pos : pos + rec.length]
            pos += rec.length
            try:
                n = packs.read_into(rec.pack, rec.offset, piece)
            except OSError:
                n = -1
            if n != rec.length:
                piece[:] = 0
    return buf


def transfer(
    link: Link,
    send: tuple[int, Store | None, str | None] | None,
    recv: tuple[int, Store | None, Expect] | None,
    *,
    recheck: bool = False,
) -> Moved:
    """:func:`_transfer`, with a peer's death raised as a typed DistributedError naming it."""
    try:
        return _transfer(link, send, recv, recheck=recheck)
    except DeltackptError:
        raise
    except RuntimeError as e:  # gloo: "Connection reset by peer", a timeout
        peers = " or ".join(f"rank {x[0]}" for x in (send, recv) if x is not None) or "a peer"
        raise link.lost("a tier transfer", e, peers) from e


def _transfer(
    link: Link,
    send: tuple[int, Store | None, str | None] | None,
    recv: tuple[int, Store | None, Expect] | None,
    *,
    recheck: bool = False,
) -> Moved:
    """Send snapshot ``name`` of ``store`` to rank ``dst`` (``send=(dst, store, name)``; store
    or name None: nothing to offer this time) while receiving one from rank ``src`` into ``store``
    (``recv=(src, store, expect)``; store None: take part, refuse whatever is offered: a rank
    whose store cannot be opened still answers, so its peer never waits for a timeout). Both
    peers must call this with matching arguments. Never raises for a refused or damaged offer:
    the reasons are in ``Moved.problems``.

    The receiver asks for the chunks its store lacks; with ``recheck`` also for those it holds
    but whose bytes no longer match their digest (a restore repairing a damaged local tier)."""
    moved = Moved()
    dst = send[0] if send else None
    src = recv[0] if recv else None
    mine: Manifest | None = None
    offer = b""
    if send is not None and send[1] is not None and send[2] is not None:
        try:
            mine, offer = _offer(send[1], send[2])
        except Exception as e:
            moved.problems.append(f"not sent to rank {dst}: {type(e).__name__}: {e}")
    got = link.exchange(dst, offer, src)
    theirs: Manifest | None = None
    wants: list[str] = []
    if recv is not None and recv[1] is None:
        moved.problems.append(f"refused from rank {src}: the receiving store could not be opened")
    elif recv is not None and got is not None and len(got):
        try:
            theirs = _accept(got.tobytes(), recv[1], recv[2])
            have = recv[1].chunk_index()
            if recheck:
                have = _intact(recv[1], {d: r for d, r in have.items() if d in theirs.chunks})
            wants = sorted(d for d in theirs.chunks if d not in have)
        except Exception as e:
            moved.problems.append(f"refused from rank {src}: {type(e).__name__}: {e}")
    asked = link.exchange(src, json.dumps(wants).encode(), dst)
    asked_for: list[str] = json.loads(asked.tobytes()) if asked is not None and len(asked) else []
    if mine is None or any(d not in mine.chunks for d in asked_for):
        asked_for = []  # nothing offered (a peer asking anyway gets nothing; it will refuse)
    out_batches = _batches(asked_for, mine.chunks) if mine is not None else []
    in_batches = _batches(wants, theirs.chunks) if theirs is not None else []
    writer = recv[1].pack_writer() if (recv is not None and recv[1] is not None and wants) else None
    new: dict[str, ChunkRecord] = {}
    ok = theirs is not None
    out_max = max((sum(mine.chunks[d].length for d in b) for b in out_batches), default=0)
    in_max = max((sum(theirs.chunks[d].length for d in b) for b in in_batches), default=0)
    # two buffers each way: batch k+1 is read and in flight while batch k is checked and written
    scratch = [np.empty(out_max, dtype=np.uint8) for _ in range(2 if out_batches else 0)]
    into = [torch.empty(in_max, dtype=torch.uint8) for _ in range(2 if in_batches else 0)]
    sends: list[Any] = []  # at most two in flight
    recvs: list[tuple[Any, torch.Tensor]] = []

    def post(k: int) -> None:
        if k < len(out_batches):
            assert send is not None and send[1] is not None and mine is not None
            if len(sends) == 2:
                sends.pop(0).wait()  # batch k-2, whose scratch buffer is this batch's
            data = _read_chunks(send[1], mine, out_batches[k], scratch[k % 2])
            moved.sent_bytes += len(data)
            sends.append(link.isend(torch.from_numpy(data), dst))  # type: ignore[arg-type]
        if k < len(in_batches):
            assert theirs is not None
            size = sum(theirs.chunks[d].length for d in in_batches[k])
            buf = into[k % 2][:size]
            recvs.append((link.irecv(buf, src), buf))  # type: ignore[arg-type]

    try:
        n = max(len(out_batches), len(in_batches))
        if n:
            post(0)
        for k in range(n):
            if k + 1 < n:
                post(k + 1)  # batch k's receive buffer is not batch k+1's
            if k >= len(in_batches):
                continue
            work, tbuf = recvs[k]
            work.wait()
            if not ok:
                continue  # still received: the sender sends every batch it was asked for
            assert theirs is not None and writer is not None
            moved.received_bytes += tbuf.numel()
            view, pos = memoryview(tbuf.numpy()), 0
            for d in in_batches[k]:
                rec = theirs.chunks[d]
                piece = view[pos : pos + rec.length]
                pos += rec.length
                if len(piece) != rec.length or digest(piece) != d:
                    moved.problems.append(
                        f"refused {theirs.name!r} from rank {src}: chunk {d} arrived damaged"
                    )
                    ok = False
                    break
                off, nb = writer.append(piece)
                new[d] = replace(rec, pack=writer.pack_id, offset=off, length=nb)
        for w in sends:  # the last two (a gloo work waited twice blocks for good)
            w.wait()
        if ok and recv is not None and recv[1] is not None and theirs is not None:
            moved.committed = _commit(recv[1], theirs, new, writer, recv[0])
    finally:
        if writer is not None and moved.committed is None:
            writer.discard()
    return moved


def _commit(store: Store, m: Manifest, new: dict[str, ChunkRecord], writer: Any, src: int) -> str:
    if writer is not None:
        writer.finish()
        store.storage.sync(PACKS)
    have = store.chunk_index()
    chunks = {d: new[d] if d in new else have[d] for d in m.chunks}  # have: as asked for
    hooks.before_replica_commit(src, m.name)
    store.write_manifest(replace(m, chunks=chunks), overwrite=True)
    return m.name

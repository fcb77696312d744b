"""Save step 4, write (every rank, any thread, no collectives): hash -> dedupe -> encode -> append.

Each chunk is one job on a thread pool; a job hashes its bytes (xxh3) unless step 2 already did,
skips the chunk if the store, this save or another rank holds that digest, otherwise encodes it
(codecs probe cheaply and fall back to raw; xor against the chunk's delta base) and appends it to
its thread's pack. xxhash, zstandard, numpy and os.writev release the GIL, so the pool really runs
on every core. Packs are fsynced here, before step 6 commits the manifest (saving/commit.py).
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass, field

import numpy as np

from deltackpt.errors import DeltackptError
from deltackpt.format import codecs
from deltackpt.format.changes import unpack_changes
from deltackpt.format.hashing import digest
from deltackpt.format.lindigest import changed_words, lin_digest, lin_shift, terms_at
from deltackpt.format.manifest import ChunkRecord
from deltackpt.format.policy import PATCH
from deltackpt.options import SaveOptions
from deltackpt.saving.plan import SavePlan, SourceArray, chunk_view
from deltackpt.saving.stage import DeltaRef
from deltackpt.store.packs import PackWriter
from deltackpt.store.storage import PACKS
from deltackpt.store.store import Store, store_io_error


@dataclass
class WriteResult:
    digests: list[str]
    records: dict[str, ChunkRecord]  # digest -> record, for every chunk the plan references
    chunks_new: int
    chunks_reused: int
    pack_bytes: int
    packs: tuple[str, ...] = ()  # ids of the packs this save wrote (removed if it fails)
    written: dict[str, ChunkRecord] = field(default_factory=dict)  # only the chunks written here


def write_chunks(
    store: Store,
    plan: SavePlan,
    source_array: SourceArray,
    opts: SaveOptions,
    pool: ThreadPoolExecutor,
    index: Mapping[str, ChunkRecord],
    refs: Mapping[str, DeltaRef] | None,
    *,
    digests: list[str] | None = None,
    owned: set[int] | None = None,
    group_bufs: dict[int, np.ndarray] | None = None,
    chunk_data: Mapping[int, np.ndarray] | None = None,
    name: str | None = None,
) -> WriteResult:
    """Hash, dedupe, encode and append every chunk of ``plan``; fsync the packs.

    Distributed saves pass the ``digests`` they already exchanged and the chunk indices this rank
    was ``owned`` (assigned) to write; every other chunk is left to its owner. ``records`` then
    holds only what this rank wrote: rank 0 builds the closure over all ranks. An OSError while
    writing (disk full, I/O error) removes this call's packs and raises StoreIOError; ``name``
    (the snapshot) only makes its message clearer.
    """
    n = len(plan.chunks)
    pre = digests is not None
    digests = list(digests) if digests is not None else [""] * n
    new_records: dict[str, ChunkRecord] = {}
    claimed: set[str] = set()
    lock = threading.Lock()
    writers: dict[int, PackWriter] = {}
    group_bufs = {} if group_bufs is None else group_bufs
    # chunks of a save that may write deltas carry a linear digest: what a catch-up checks a
    # patched chunk against at the cost of the patch (format/lindigest.py)
    deltas = opts.encoding.force in codecs.DELTAS or any(
        c in opts.encoding.codecs for c in codecs.DELTAS
    )

    def writer() -> PackWriter:
        tid = threading.get_ident()
        w = writers.get(tid)
        if w is None:
            w = store.pack_writer(fsync=opts.fsync)
            with lock:
                writers[tid] = w
        return w

    def bytes_of(ci: int) -> np.ndarray:
        if chunk_data is not None and ci in chunk_data:
            return chunk_data[ci]  # staged copy (or a device save's chunk, copied when asked)
        return chunk_view(plan.chunks[ci], source_array, group_bufs, ci, reuse=pre)

    def job(ci: int) -> None:
        spec = plan.chunks[ci]
        view = None  # a known digest: the bytes are needed only if this call writes the chunk
        if not pre:
            view = bytes_of(ci)
            digests[ci] = digest(view)
        d = digests[ci]
        ref = refs.get(spec.base_key) if (refs is not None and spec.base_key) else None
        with lock:
            if owned is not None:
                fresh = ci in owned and d not in claimed
            else:
                fresh = d not in index and d not in claimed
            claimed.add(d)
        if fresh:
            if view is None:
                view = bytes_of(ci)
            scan = np.zeros(5, np.uint64) if deltas else None
            enc = _encode(view, spec.itemsize, spec.size, ref, opts, index, new_records, scan)
            lin = _lin(view, enc, ref, index, new_records, scan) if deltas else None
            offset, length = writer().append(enc.payload)
            rec = ChunkRecord(
                pack=writer().pack_id,
                offset=offset,
                length=length,
                size=spec.size,
                codec=enc.codec,
                itemsize=enc.itemsize,
                base=ref.digest if enc.codec in codecs.DELTAS and ref is not None else None,
                lin=lin,
            )
            with lock:
                new_records[d] = rec

    futures = [pool.submit(job, ci) for ci in range(n)]
    try:
        for f in futures:
            f.result()
        pack_bytes = sum(pool.map(lambda w: w.finish(), list(writers.values())))
        if writers and opts.fsync:
            store.storage.sync(PACKS)  # the packs' names, once for all of them
    except BaseException as e:
        # Stop the other jobs before cleaning up: queued ones are cancelled, running ones are
        # waited for, so no job opens or appends to a pack after this save has failed.
        for f in futures:
            f.cancel()
        wait(futures)
        left = 0
        for w in writers.values():
            try:
                w.discard()
            except OSError:
                left += 1
        if isinstance(e, OSError) and not isinstance(e, DeltackptError):
            # ENOSPC, EIO, EACCES...: typed, errno kept, and saying what is still intact
            leftover = (
                f"; {left} could not be removed and the next `deltackpt gc` deletes them"
                if left
                else ""
            )
            raise store_io_error(
                e,
                f"writing pack data{f' of snapshot {name!r}' if name else ''} to store "
                f"{str(store.root)!r} failed: {e}. Committed snapshots are intact; this save "
                f"committed nothing and its partial pack files were removed{leftover}. Free "
                "space (e.g. `deltackpt gc --keep-last N`) or fix the disk, then save again",
            ) from e
        raise

    records = closure(set(digests), new_records, index) if owned is None else new_records
    return WriteResult(
        digests=digests,
        records=records,
        chunks_new=len(new_records),
        chunks_reused=len(set(digests)) - len(new_records),
        pack_bytes=pack_bytes,
        packs=tuple(w.pack_id for w in writers.values()),
        written=new_records,
    )


def _encode(
    view: np.ndarray,
    itemsize: int,
    size: int,
    ref: DeltaRef | None,
    opts: SaveOptions,
    index: Mapping[str, ChunkRecord],
    new_records: Mapping[str, ChunkRecord],
    lin_out: np.ndarray | None = None,
) -> codecs.Encoded:
    """Encode one changed chunk: a delta (xor or patch) against ``ref`` while its chain stays
    within the link cap (``keyframe_every``) and the byte budget (the chain's delta payloads,
    this one included, at most ``chain_budget`` x the chunk's raw size), else a keyframe (raw
    or zstd).
    A delta that would overflow the budget is re-encoded as a keyframe; a chain whose last delta
    already predicts an overflow is not tried (see :meth:`DeltaRef.due`)."""
    policy = opts.encoding
    if (
        ref is None
        or not any(c in policy.codecs for c in codecs.DELTAS)
        or ref.data.size != view.size
        or ref.due(size, opts.keyframe_every, opts.chain_budget)
        or not (ref.digest in index or ref.digest in new_records)
    ):
        return codecs.encode(view, itemsize, policy=policy)
    enc = codecs.encode(view, itemsize, base=ref.data, policy=policy, lin_out=lin_out)
    if enc.codec in codecs.DELTAS and ref.chain_bytes + len(enc.payload) > opts.chain_budget * size:
        return codecs.encode(view, itemsize, policy=policy)  # over budget: a keyframe
    return enc


def _lin(
    view: np.ndarray,
    enc: codecs.Encoded,
    ref: DeltaRef | None,
    index: Mapping[str, ChunkRecord],
    new_records: Mapping[str, ChunkRecord],
    scan: np.ndarray | None = None,
) -> str:
    """The linear digest of a chunk written as ``enc``: a patch against a base that has one is
    updated from the words the patch touched (work in proportion to the change: the terms were
    summed by the patch's own scan, ``scan``, where the C loop ran); anything else is one pass
    over the bytes (~27 GB/s per core with AVX-512, ~5.5 without: small beside a keyframe's zstd
    pass)."""
    base = None if ref is None else index.get(ref.digest) or new_records.get(ref.digest)
    if enc.codec == PATCH and ref is not None and base is not None and base.lin is not None:
        if scan is not None and scan[4] == 1:
            old, new = (int(scan[0]), int(scan[1])), (int(scan[2]), int(scan[3]))
            return lin_shift(base.lin, old, new)
        k = enc.itemsize
        idx, _ = unpack_changes(np.frombuffer(enc.payload, np.uint8), k, view.size // k)
        w = changed_words([idx], k)
        return lin_shift(base.lin, terms_at(ref.data, w), terms_at(view, w))
    return lin_digest(view)


def hash_chunks(
    plan: SavePlan,
    source_array: SourceArray,
    pool: ThreadPoolExecutor,
    group_bufs: dict[int, np.ndarray],
) -> list[str]:
    """Digest of every chunk of ``plan`` (the first pass of a distributed save)."""

    def one(ci: int) -> str:
        return digest(chunk_view(plan.chunks[ci], source_array, group_bufs, ci))

    return list(pool.map(one, range(len(plan.chunks))))


def closure(
    needed: set[str], new: Mapping[str, ChunkRecord], index: Mapping[str, ChunkRecord]
) -> dict[str, ChunkRecord]:
    """Records of ``needed`` plus, transitively, the bases their xor deltas decode against."""
    out: dict[str, ChunkRecord] = {}
    todo = list(needed)
    while todo:
        d = todo.pop()
        if d in out:
            continue
        rec = new.get(d) or index.get(d)
        if rec is None:
            raise DeltackptError(
                f"no record of where chunk {d} lives (no rank or earlier snapshot wrote it); the "
                "save is inconsistent and was not committed"
            )
        out[d] = rec
        if rec.base is not None:
            todo.append(rec.base)
    return dict(sorted(out.items()))

"""The save pipeline after planning: hash -> dedupe -> encode -> write -> commit.

Each chunk is one job on a thread pool; a job hashes its bytes (xxh3), skips the chunk if the store
or this save already holds that digest, otherwise encodes it (codecs probe cheaply and fall back to
raw) and appends it to its thread's pack. xxhash, zstandard, numpy and os.writev release the GIL,
so the pool really runs on every core. Packs are fsynced before the manifest is committed.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any

import numpy as np

from deltackpt.errors import DeltackptError, StoreIOError
from deltackpt.format import codecs
from deltackpt.format.hashing import digest
from deltackpt.format.manifest import (
    ChunkRecord,
    Manifest,
    Shard,
    Slice,
    Stats,
    StorageView,
    TensorEntry,
)
from deltackpt.options import SaveOptions
from deltackpt.saving.plan import ChunkSpec, SavePlan
from deltackpt.store.durable import fsync_dir
from deltackpt.store.packs import PackWriter
from deltackpt.store.store import SnapshotInfo, Store, store_io_error

SourceArray = Callable[[int], np.ndarray]  # source index -> its bytes as a uint8 numpy array


@dataclass
class DeltaRef:
    """The raw bytes of a chunk as last committed by this process: the base of an xor delta."""

    digest: str
    data: np.ndarray
    depth: int  # how many xor links lead from this chunk to a keyframe
    arena: int = 0  # which staging arena holds ``data`` (the next change goes to the other)


@dataclass
class WriteResult:
    digests: list[str]
    records: dict[str, ChunkRecord]  # digest -> record, for every chunk the plan references
    chunks_new: int
    chunks_reused: int
    pack_bytes: int
    packs: tuple[str, ...] = ()  # ids of the packs this save wrote (removed if it fails)


def chunk_view(
    spec: ChunkSpec,
    source_array: SourceArray,
    scratch: dict[int, np.ndarray],
    ci: int,
    reuse: bool = False,
) -> np.ndarray:
    """The chunk's raw bytes: a view of its source, or small sources gathered into a buffer."""
    if spec.ref_key is not None:
        si, start, length = spec.parts[0]
        return source_array(si)[start : start + length]
    buf = scratch.get(ci)
    if reuse and buf is not None and buf.size == spec.size:
        return buf  # gathered by the hash pass: a private copy already
    if buf is None or buf.size != spec.size:
        buf = np.zeros(spec.size, dtype=np.uint8)
        scratch[ci] = buf
    pos_end = 0
    for (si, start, length), off in zip(spec.parts, spec.offsets, strict=True):
        if off > pos_end:
            buf[pos_end:off] = 0  # alignment padding: keep it deterministic
        buf[off : off + length] = source_array(si)[start : start + length]
        pos_end = off + length
    return buf


def write_chunks(
    store: Store,
    plan: SavePlan,
    source_array: SourceArray,
    opts: SaveOptions,
    pool: ThreadPoolExecutor,
    index: dict[str, ChunkRecord],
    refs: dict[str, DeltaRef] | None,
    *,
    digests: list[str] | None = None,
    owned: set[int] | None = None,
    group_bufs: dict[int, np.ndarray] | None = None,
    chunk_data: dict[int, np.ndarray] | None = None,
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
    policy = opts.encoding

    def writer() -> PackWriter:
        tid = threading.get_ident()
        w = writers.get(tid)
        if w is None:
            w = PackWriter(store.packs_dir, fsync=opts.fsync)
            with lock:
                writers[tid] = w
        return w

    def job(ci: int) -> None:
        spec = plan.chunks[ci]
        if chunk_data is not None and ci in chunk_data:
            view = chunk_data[ci]  # staged copy
        elif pre and owned is not None and ci not in owned:
            view = None  # digest known and someone else (or the store) has it: no bytes needed
        else:
            view = chunk_view(spec, source_array, group_bufs, ci, reuse=pre)
        d = digests[ci] if pre else digest(view)
        digests[ci] = d
        ref = refs.get(spec.ref_key) if (refs is not None and spec.ref_key) else None
        with lock:
            if owned is not None:
                fresh = ci in owned and d not in claimed
            else:
                fresh = d not in index and d not in claimed
            claimed.add(d)
        if fresh:
            assert view is not None  # owned chunks always have bytes
            base = None
            if (
                ref is not None
                and codecs.XOR in policy.codecs
                and ref.depth + 1 < opts.keyframe_every
                and ref.data.size == view.size
                and (ref.digest in index or ref.digest in new_records)
            ):
                base = ref.data
            enc = codecs.encode(view, spec.itemsize, base=base, policy=policy)
            offset, length = writer().append(enc.payload)
            rec = ChunkRecord(
                pack=writer().pack_id,
                offset=offset,
                length=length,
                size=spec.size,
                codec=enc.codec,
                itemsize=enc.itemsize,
                base=ref.digest if enc.codec == codecs.XOR and ref is not None else None,
            )
            with lock:
                new_records[d] = rec

    futures = [pool.submit(job, ci) for ci in range(n)]
    try:
        for f in futures:
            f.result()
        pack_bytes = sum(pool.map(lambda w: w.finish(), list(writers.values())))
        if writers and opts.fsync:
            fsync_dir(store.packs_dir)
    except BaseException as e:
        # Stop the other jobs before cleaning up: queued ones are cancelled, running ones are
        # waited for, so no job opens or appends to a pack after this save has failed.
        for f in futures:
            f.cancel()
        wait(futures)
        left = 0
        for w in writers.values():
            w.abort()
            try:
                os.unlink(w.path)
            except FileNotFoundError:
                pass
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
    )


def chain_depth(d: str, records: dict[str, ChunkRecord]) -> int | None:
    """How many xor links lead from chunk ``d`` to its keyframe (None: not known here)."""
    n = 0
    while True:
        rec = records.get(d)
        if rec is None:
            return None
        if rec.base is None:
            return n
        d, n = rec.base, n + 1


def next_refs(
    plan: SavePlan,
    digests: list[str],
    refs: dict[str, DeltaRef],
    staged: dict[int, tuple[np.ndarray, int]],
    records: dict[str, ChunkRecord],
    keyframe_every: int,
) -> dict[str, DeltaRef]:
    """Delta bases for the next save: unchanged chunks keep their base where it is, changed ones
    point at their staged copy. Chunks whose chain depth is unknown here count as due for a
    keyframe."""
    out: dict[str, DeltaRef] = {}
    for ci, spec in enumerate(plan.chunks):
        key = spec.ref_key
        if key is None:
            continue
        d = digests[ci]
        prior = refs.get(key)
        if prior is not None and prior.digest == d:
            out[key] = prior
        elif ci in staged:
            view, arena = staged[ci]
            depth = chain_depth(d, records)
            out[key] = DeltaRef(d, view, keyframe_every if depth is None else depth, arena)
    return out


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
    needed: set[str], new: dict[str, ChunkRecord], index: dict[str, ChunkRecord]
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


def build_manifest(
    name: str,
    plan: SavePlan,
    wr: WriteResult,
    created_ns: int,
    stats: Stats,
    metadata: dict[str, Any],
) -> Manifest:
    def slices(si: int) -> tuple[Slice, ...]:
        return tuple(
            (wr.digests[ci], start, length) for ci, start, length in plan.source_slices[si]
        )

    tensors = []
    for e in plan.entries:
        tensors.append(
            TensorEntry(
                path=e.path,
                dtype=e.dtype,
                shape=e.shape,
                data=slices(e.source) if e.source is not None else None,
                shards=tuple(Shard(o, sh, slices(si)) for o, sh, si in e.shards)
                if e.shards is not None
                else None,
                storage=StorageView(*e.storage) if e.storage is not None else None,
                parameter=e.parameter,
                requires_grad=e.requires_grad,
            )
        )
    storages = tuple((plan.sources[si].nbytes, slices(si)) for si in plan.storage_sources)
    return Manifest(
        name=name,
        created_ns=created_ns,
        tree=plan.tree,
        tensors=tuple(tensors),
        storages=storages,
        chunks=wr.records,
        stats=stats,
        metadata=metadata,
    )


def commit(
    store: Store,
    name: str,
    plan: SavePlan,
    wr: WriteResult,
    opts: SaveOptions,
    metadata: dict[str, Any],
    t_start: float,
    blocked_seconds: float,
    waited_seconds: float,
) -> SnapshotInfo:
    stats = Stats(
        logical_bytes=plan.logical_bytes,
        pack_bytes=wr.pack_bytes,
        chunks_new=wr.chunks_new,
        chunks_reused=wr.chunks_reused,
        seconds=time.perf_counter() - t_start,
        blocked_seconds=blocked_seconds,
        waited_seconds=waited_seconds,
    )
    m = build_manifest(name, plan, wr, time.time_ns(), stats, metadata)
    try:
        size = store.write_manifest(m, overwrite=opts.overwrite)
    except OSError as e:
        if isinstance(e, DeltackptError):  # SnapshotExistsError: typed already
            raise
        raise commit_io_error(store, m, wr.packs, e) from e
    return SnapshotInfo.from_manifest(m, size)


def _published(store: Store, m: Manifest) -> bool | None:
    """After a failed commit: is ``m`` the visible manifest of its name? None: cannot tell."""
    path = store.manifest_path(m.name)
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return False
    except OSError:
        return None
    try:
        doc = json.loads(raw)
        return bool(doc["name"] == m.name and doc["created_ns"] == m.created_ns)
    except (ValueError, KeyError, TypeError):
        return None  # half-visible or damaged: leave the packs to gc


def commit_io_error(store: Store, m: Manifest, packs: tuple[str, ...], e: OSError) -> StoreIOError:
    """The error for an OSError while committing ``m``, after removing this save's packs when it
    certainly did not commit (nothing else can reference them: dedupe only trusts committed
    manifests, and gc is excluded by the shared lock the save holds)."""
    where = f"store {str(store.root)!r}"
    published = _published(store, m)
    if published is False:
        left = 0
        for pack in packs:
            try:
                os.unlink(store.pack_path(pack))
            except FileNotFoundError:
                pass
            except OSError:
                left += 1
        swept = (
            f"; {left} of its pack files could not be removed and the next `deltackpt gc` "
            "deletes them"
            if left
            else " and its pack files were removed"
        )
        state = (
            f"Committed snapshots are intact; {m.name!r} was not committed (nothing visible)"
            f"{swept}. Free space or fix the disk, then save again"
        )
    elif published:
        state = (
            f"The manifest of {m.name!r} was published but may not be durable (a crash could "
            "lose it); earlier snapshots are intact. Save again under a new name (or with "
            "overwrite=True) once the disk is fixed"
        )
    else:
        state = (
            f"It could not be checked whether {m.name!r} was committed (check with `deltackpt "
            "ls`); earlier snapshots are intact, and if it was not, the next `deltackpt gc` "
            "deletes its pack data"
        )
    return store_io_error(e, f"committing snapshot {m.name!r} to {where} failed: {e}. {state}")

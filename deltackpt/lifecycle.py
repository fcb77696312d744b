"""Snapshot lifecycle: list, delete, garbage-collect (with pack compaction) and verify.

gc holds the store lock exclusively, and every save holds it shared from planning to commit, so gc
never runs while a save could still reference a chunk it would delete: it waits for in-flight saves
(up to ``lock_timeout``) and saves wait for it. ``delete`` only unlinks a manifest (atomic); it
holds the lock shared, like a save, so that it waits for a running gc (whose compaction rewrites
manifests and would bring a snapshot deleted meanwhile back). The space comes back at the next gc.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace

import numpy as np

from deltackpt._fsutil import fsync_dir, store_lock
from deltackpt._read import ChunkReader
from deltackpt.errors import CorruptChunkError, SnapshotNotFoundError
from deltackpt.manifest import ChunkRecord, Manifest
from deltackpt.options import default_lock_timeout, default_threads
from deltackpt.pack import PackReaders, PackWriter
from deltackpt.store import LATEST, PACK_ALIGN, SnapshotInfo, Store, open_store


def snapshots(store: str | os.PathLike[str] | Store) -> list[SnapshotInfo]:
    """Committed snapshots of ``store``, oldest first.

    >>> [s.name for s in deltackpt.snapshots("ckpts")]   # doctest: +SKIP
    """
    st = open_store(store, create=False)
    out = []
    for m in st.manifests():
        with contextlib.suppress(FileNotFoundError):
            out.append(SnapshotInfo.from_manifest(m, st.manifest_path(m.name).stat().st_size))
    return out


def delete(store: str | os.PathLike[str] | Store, name: str) -> None:
    """Un-commit snapshot ``name`` (atomically); its unshared bytes are freed by the next gc."""
    st = open_store(store, create=False)
    if name == LATEST:
        raise SnapshotNotFoundError("delete() needs an explicit snapshot name, not 'latest'")
    with store_lock(
        st.lock_path, exclusive=False, timeout=default_lock_timeout(), what=f"deleting {name!r}"
    ):
        _delete(st, name)


def _delete(st: Store, name: str) -> None:
    st.manifest(name)  # raises a clear error when it does not exist
    path = st.manifest_path(name)
    os.unlink(path)
    fsync_dir(path.parent)
    shutil.rmtree(path.parent, ignore_errors=True)


@dataclass(frozen=True)
class GcReport:
    deleted: list[str] = field(default_factory=list)  # snapshots removed by retention
    packs_removed: int = 0
    packs_compacted: int = 0
    bytes_freed: int = 0
    leftovers_removed: int = 0  # tmp files and dirs of crashed saves
    seconds: float = 0.0


def gc(
    store: str | os.PathLike[str] | Store,
    keep_last: int | None = None,
    keep: list[str] | tuple[str, ...] = (),
    *,
    compact_below: float = 0.75,
    lock_timeout: float | None = None,
) -> GcReport:
    """Apply retention, then delete pack data no committed snapshot references.

    ``keep_last=N`` keeps the N newest snapshots plus those named in ``keep`` and deletes the
    rest; ``None`` deletes no snapshot and only collects garbage. A pack whose live bytes are below
    ``compact_below`` of its size is rewritten with only its live chunks (the manifests that point
    into it are rewritten atomically), so the space of dead chunks really comes back.

    >>> deltackpt.gc("ckpts", keep_last=3)        # doctest: +SKIP
    """
    t0 = time.perf_counter()
    st = open_store(store, create=False)
    if keep_last is not None and keep_last < 0:
        raise ValueError(f"keep_last must be >= 0 or None, got {keep_last}")
    timeout = default_lock_timeout() if lock_timeout is None else lock_timeout
    with store_lock(st.lock_path, exclusive=True, timeout=timeout, what="gc"):
        deleted: list[str] = []
        manifests = st.manifests()
        if keep_last is not None:
            keep_set = (
                set(keep) | {m.name for m in manifests[max(0, len(manifests) - keep_last) :]}
                if keep_last
                else set(keep)
            )
            for m in manifests:
                if m.name not in keep_set:
                    _delete(st, m.name)  # we hold the lock exclusively
                    deleted.append(m.name)
            manifests = st.manifests()
        leftovers = _sweep_leftovers(st)
        removed, compacted, freed = _collect_packs(st, manifests, compact_below)
    return GcReport(deleted, removed, compacted, freed, leftovers, time.perf_counter() - t0)


def _sweep_leftovers(st: Store) -> int:
    n = 0
    for p in list(st.tmp_dir.iterdir()) if st.tmp_dir.exists() else []:
        with contextlib.suppress(FileNotFoundError):
            shutil.rmtree(p) if p.is_dir() else p.unlink()
            n += 1
    for d in list(st.snapshots_dir.iterdir()) if st.snapshots_dir.exists() else []:
        if d.is_dir() and not (d / "MANIFEST.json").exists():
            shutil.rmtree(d, ignore_errors=True)
            n += 1
    return n


def _collect_packs(
    st: Store, manifests: list[Manifest], compact_below: float
) -> tuple[int, int, int]:
    live: dict[str, dict[str, ChunkRecord]] = {}  # pack -> digest -> record
    for m in manifests:
        for d, rec in m.chunks.items():
            live.setdefault(rec.pack, {})[d] = rec
    removed = compacted = freed = 0
    for path in sorted(st.packs_dir.glob("*.pack")):
        pack = path.stem
        size = path.stat().st_size
        chunks = live.get(pack)
        if not chunks:
            path.unlink()
            removed += 1
            freed += size
            continue
        # What a rewrite would occupy (header, aligned payloads): raw lengths would make a
        # fully live pack of small chunks look mostly dead and be rewritten on every gc.
        live_bytes = PACK_ALIGN + sum(
            -(-r.length // PACK_ALIGN) * PACK_ALIGN for r in chunks.values()
        )
        if live_bytes < compact_below * size:
            new_size = _compact(st, pack, chunks, manifests)
            if new_size is None:  # damaged: left as it is, for verify to report
                continue
            compacted += 1
            freed += size - new_size
    if removed or compacted:
        fsync_dir(st.packs_dir)
    return removed, compacted, freed


def _compact(
    st: Store, pack: str, chunks: dict[str, ChunkRecord], manifests: list[Manifest]
) -> int | None:
    """Copy the live chunks of ``pack`` into a new pack, repoint manifests, delete the old pack.

    Crash-safe in any order: until a manifest is rewritten it points at the old pack, which is
    deleted only after every manifest has been repointed at the new, already-fsynced pack.
    Returns the new pack's size, or None (nothing changed) when ``pack`` is shorter than its
    chunk records say: copying would replace the missing bytes with garbage and delete the rest.
    """
    w = PackWriter(st.packs_dir)
    moved: dict[str, ChunkRecord] = {}
    with PackReaders(st.packs_dir) as packs:
        for d, rec in sorted(chunks.items(), key=lambda kv: kv[1].offset):
            buf = np.empty(rec.length, dtype=np.uint8)
            if packs.read_into(pack, rec.offset, buf) != rec.length:
                w.abort()
                w.path.unlink()
                return None
            off, n = w.append(memoryview(buf))
            moved[d] = replace(rec, pack=w.pack_id, offset=off, length=n)
    new_size = w.finish()
    fsync_dir(st.packs_dir)
    for i, m in enumerate(manifests):
        if any(r.pack == pack for r in m.chunks.values()):
            new_chunks = {d: (moved[d] if r.pack == pack else r) for d, r in m.chunks.items()}
            manifests[i] = replace(m, chunks=new_chunks)  # a later compaction starts from this
            _rewrite_manifest(st, manifests[i])
    (st.packs_dir / f"{pack}.pack").unlink()
    return new_size


def _rewrite_manifest(st: Store, m: Manifest) -> None:
    st.write_manifest(m, overwrite=True)


@dataclass(frozen=True)
class VerifyProblem:
    snapshot: str
    key: str
    chunk: str
    reason: str


@dataclass(frozen=True)
class VerifyReport:
    snapshots: list[str]
    chunks_checked: int
    bytes_checked: int
    problems: list[VerifyProblem]
    seconds: float

    @property
    def ok(self) -> bool:
        return not self.problems

    def __bool__(self) -> bool:
        return self.ok


def verify(
    store: str | os.PathLike[str] | Store,
    names: list[str] | None = None,
    *,
    threads: int | None = None,
) -> VerifyReport:
    """Re-read and re-hash every chunk of every (or the named) snapshot. Never raises on damage:
    the report lists each problem with the snapshot, tensor key and chunk.

    >>> report = deltackpt.verify("ckpts"); report.ok     # doctest: +SKIP
    """
    t0 = time.perf_counter()
    st = open_store(store, create=False)
    ms = [st.manifest(n) for n in names] if names else st.manifests()
    users: dict[str, list[tuple[str, str]]] = {}  # digest -> [(snapshot, key)]
    records: dict[str, ChunkRecord] = {}
    for m in ms:
        for e in m.tensors:
            for d, _, _ in e.all_slices():
                users.setdefault(d, []).append((m.name, e.path))
        for _, data in m.storages:
            for d, _, _ in data:
                users.setdefault(d, []).append((m.name, "<shared storage>"))
        for d, r in m.chunks.items():
            records[d] = r
            if not any(snap == m.name for snap, _ in users.get(d, ())):
                users.setdefault(d, []).append((m.name, "<delta base>"))
    problems: list[VerifyProblem] = []
    checked = nbytes = 0
    # Decode every xor chain once, keyframe first, handing each chunk's raw bytes to its deltas:
    # decoding each chunk from scratch would redo its whole chain (K times the work).
    children: dict[str, list[str]] = {}
    roots = []
    for d, rec in records.items():
        if rec.base is not None and rec.base in records:
            children.setdefault(rec.base, []).append(d)
        else:
            roots.append(d)
    with PackReaders(st.packs_dir) as packs:
        reader = ChunkReader(packs, records, verify=True)

        def tree(root: str) -> list[tuple[str, int, str | None]]:
            out: list[tuple[str, int, str | None]] = []
            stack: list[tuple[str, np.ndarray | None]] = [(root, None)]
            while stack:
                d, base_raw = stack.pop()
                rec = records[d]
                raw = np.empty(rec.size, dtype=np.uint8)
                try:
                    reader.decode_into(d, raw, "verify", base_raw=base_raw)
                except CorruptChunkError as e:
                    out.append((d, rec.size, str(e)))
                    todo = list(children.get(d, ()))
                    while todo:  # deltas of a corrupt chunk cannot be checked: report them too
                        c = todo.pop()
                        out.append(
                            (c, records[c].size, f"chunk {c}: its xor base chain is corrupt ({d})")
                        )
                        todo.extend(children.get(c, ()))
                    continue
                out.append((d, rec.size, None))
                stack.extend((c, raw) for c in children.get(d, ()))
            return out

        with ThreadPoolExecutor(threads or default_threads()) as pool:
            walked = list(pool.map(tree, sorted(roots)))
        seen = {d for results in walked for d, _, _ in results}
        # A damaged manifest can make bases loop: such chunks hang off no keyframe.
        walked.append(
            [
                (
                    d,
                    records[d].size,
                    f"chunk {d}: its xor base chain never reaches a "
                    "keyframe (a cycle in the manifest)",
                )
                for d in sorted(set(records) - seen)
            ]
        )
    for results in walked:
        for d, size, err in results:
            checked += 1
            nbytes += size
            if err is not None:
                for snap, key in dict.fromkeys(users[d]):
                    problems.append(VerifyProblem(snap, key, d, err))
    return VerifyReport([m.name for m in ms], checked, nbytes, problems, time.perf_counter() - t0)

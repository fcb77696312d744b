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
import stat
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from deltackpt.errors import (
    CorruptChunkError,
    DamagedSnapshotWarning,
    InvalidArgumentError,
    ManifestError,
    SnapshotNotFoundError,
    StoreIOError,
    UnsafePathError,
)
from deltackpt.format.manifest import PACK_ID_RE, ChunkRecord, Manifest
from deltackpt.options import default_lock_timeout, default_threads
from deltackpt.store.chunks import ChunkReader
from deltackpt.store.chunks import _scratch as scratch
from deltackpt.store.durable import fsync_dir, open_dir, store_lock
from deltackpt.store.packs import PackReaders, PackWriter
from deltackpt.store.store import LATEST, PACK_ALIGN, SnapshotInfo, Store, check_dir, open_store


def snapshots(store: str | os.PathLike[str] | Store) -> list[SnapshotInfo]:
    """Committed snapshots of ``store``, oldest first.

    A snapshot whose manifest is damaged or unsafe is skipped with a
    :class:`~deltackpt.errors.DamagedSnapshotWarning` naming it; ``deltackpt verify`` reports it.

    >>> [s.name for s in deltackpt.snapshots("ckpts")]   # doctest: +SKIP
    """
    st = open_store(store, create=False)
    good, bad = st.scan()
    if bad:
        warnings.warn(
            f"store {str(st.root)!r}: skipped {len(bad)} damaged snapshot(s): "
            + "; ".join(f"{d.name}: {d.reason}" for d in bad[:3])
            + ". Run `deltackpt verify` for the details",
            DamagedSnapshotWarning,
            stacklevel=2,
        )
    return [SnapshotInfo.from_manifest(m, st.manifest_size(m.name)) for m in good]


def delete(store: str | os.PathLike[str] | Store, name: str) -> None:
    """Un-commit snapshot ``name`` (atomically); its unshared bytes are freed by the next gc.

    A damaged snapshot can be deleted too: its manifest is not read."""
    st = open_store(store, create=False)
    if name == LATEST:
        raise SnapshotNotFoundError("delete() needs an explicit snapshot name, not 'latest'")
    with store_lock(
        st.lock_path, exclusive=False, timeout=default_lock_timeout(), what=f"deleting {name!r}"
    ):
        _delete(st, name)


def _delete(st: Store, name: str) -> None:
    if not st.has(name):
        st.manifest(name)  # raises SnapshotNotFoundError naming what the store has
    st.remove_snapshot(name)


@dataclass(frozen=True)
class GcReport:
    deleted: list[str] = field(default_factory=list)  # snapshots removed by retention
    packs_removed: int = 0
    packs_compacted: int = 0
    bytes_freed: int = 0
    leftovers_removed: int = 0  # tmp files and dirs of crashed saves
    seconds: float = 0.0
    # snapshots whose manifests could not be read: while there are any, no pack is collected
    # (their chunks are unknown), so nothing they might need is ever deleted
    damaged: list[str] = field(default_factory=list)
    # entries gc left alone because they are not what a save writes (symlinks, odd names)
    refused: list[str] = field(default_factory=list)
    dry_run: bool = False


@dataclass
class _GcPlan:
    doomed: list[str]
    manifests: list[Manifest]  # the ones that stay
    damaged: list[str]
    refused: list[str]
    leftovers: list[tuple[str, str]]  # (directory: "tmp" or "snapshots", entry name)
    remove: list[tuple[str, int]]  # (pack id, size)
    compact: list[tuple[str, int, int]]  # (pack id, size, size after the rewrite)
    live: dict[str, dict[str, ChunkRecord]]  # pack -> digest -> record


def _check_gc_args(
    keep_last: Any, keep: Any, compact_below: Any, lock_timeout: Any, dry_run: Any
) -> None:
    """gc's argument checks, before it touches the store (a bad value must delete nothing)."""

    def real(v: Any) -> bool:
        return isinstance(v, (int, float)) and not isinstance(v, bool) and v == v  # not nan

    if keep_last is not None and (
        not isinstance(keep_last, int) or isinstance(keep_last, bool) or keep_last < 0
    ):
        raise InvalidArgumentError(
            f"gc(keep_last={keep_last!r}) is invalid: expected None or an int >= 0, got "
            f"{type(keep_last).__name__} {keep_last!r}. Pass e.g. keep_last=3 (0 deletes every "
            "snapshot not in keep; None deletes none and only collects garbage)"
        )
    if isinstance(keep, (str, bytes)):
        raise InvalidArgumentError(
            f"gc(keep={keep!r}) is a single string; expected a list of snapshot names (a string "
            f"would be read letter by letter). Pass keep=[{keep!r}]"
        )
    if keep is not None and (
        not isinstance(keep, (list, tuple, set, frozenset))
        or not all(isinstance(n, str) for n in keep)
    ):
        raise InvalidArgumentError(
            f"gc(keep={keep!r:.80}) is invalid: expected a list, tuple or set of snapshot names "
            f"(str), got {type(keep).__name__}. Pass e.g. keep=['best', 'step-100']"
        )
    if not real(compact_below) or not 0 <= compact_below <= 1:
        raise InvalidArgumentError(
            f"gc(compact_below={compact_below!r}) is invalid: expected a number in [0, 1] (the "
            "live fraction below which a pack is rewritten), got "
            f"{type(compact_below).__name__} {compact_below!r}. Pass e.g. compact_below=0.75, "
            "or 0 to never compact"
        )
    if lock_timeout is not None and (not real(lock_timeout) or lock_timeout < 0):
        raise InvalidArgumentError(
            f"gc(lock_timeout={lock_timeout!r}) is invalid: expected None or a number of "
            f"seconds >= 0, got {type(lock_timeout).__name__} {lock_timeout!r}. Pass e.g. "
            "lock_timeout=600, or 0 to fail at once when a save is in flight"
        )
    if not isinstance(dry_run, bool):
        raise InvalidArgumentError(
            f"gc(dry_run={dry_run!r}) is invalid: expected True or False, got "
            f"{type(dry_run).__name__}"
        )


def _check_keep_exists(st: Store, keep: Any) -> None:
    """A name in ``keep`` the store lacks is most likely a typo: refuse to run rather than
    delete the snapshot the caller meant to keep."""
    missing = sorted(n for n in (keep or ()) if not st.has(n))  # has() refuses invalid names
    if missing:
        have = st.names()
        raise SnapshotNotFoundError(
            f"gc(keep={missing!r}): store {str(st.root)!r} has no committed snapshot named "
            f"{', '.join(repr(n) for n in missing)}; it has "
            f"{have[-5:] if have else 'none'}{' (last 5)' if len(have) > 5 else ''}. gc deleted "
            "nothing: fix the name (see `deltackpt ls`) or drop it from keep"
        )


def gc(
    store: str | os.PathLike[str] | Store,
    keep_last: int | None = None,
    keep: list[str] | tuple[str, ...] = (),
    *,
    compact_below: float = 0.75,
    lock_timeout: float | None = None,
    dry_run: bool = False,
) -> GcReport:
    """Apply retention, then delete pack data no committed snapshot references.

    ``keep_last=N`` keeps the N newest snapshots plus those named in ``keep`` and deletes the
    rest; ``None`` deletes no snapshot and only collects garbage. A pack whose live bytes are below
    ``compact_below`` of its size is rewritten with only its live chunks (the manifests that point
    into it are rewritten atomically), so the space of dead chunks really comes back.

    gc only ever removes what a save writes: symlinks and foreign entries in the store are left
    alone and listed in ``GcReport.refused``; while any manifest is damaged no pack is removed
    (``GcReport.damaged``). ``dry_run=True`` reports what gc would do and changes nothing (it
    takes no lock, so a save in flight shows its new packs as garbage).

    Arguments are checked before anything is deleted: ``keep_last`` is None or an int >= 0,
    ``keep`` a list/tuple/set of snapshot names (a bare string is refused: ``keep=["s1"]``),
    ``compact_below`` in [0, 1], ``lock_timeout`` >= 0 (InvalidArgumentError). A name in ``keep``
    that the store does not have raises SnapshotNotFoundError and deletes nothing: a typo there
    must not delete the snapshot that was meant to be kept.

    >>> deltackpt.gc("ckpts", keep_last=3)        # doctest: +SKIP
    """
    t0 = time.perf_counter()
    _check_gc_args(keep_last, keep, compact_below, lock_timeout, dry_run)
    st = open_store(store, create=False)
    _check_keep_exists(st, keep)
    if dry_run:
        plan = _plan_gc(st, keep_last, keep, compact_below)
        return _report(plan, t0, dry_run=True)
    timeout = default_lock_timeout() if lock_timeout is None else lock_timeout
    with store_lock(st.lock_path, exclusive=True, timeout=timeout, what="gc"):
        plan = _plan_gc(st, keep_last, keep, compact_below)
        for name in plan.doomed:
            _delete(st, name)  # we hold the lock exclusively
        _sweep_leftovers(st, plan.leftovers)
        compacted: list[tuple[str, int, int]] = []
        for pack, size, _ in plan.compact:
            new_size = _compact(st, pack, plan.live[pack], plan.manifests)
            if new_size is not None:  # None: damaged, left as it is for verify to report
                compacted.append((pack, size, new_size))
        for pack, _ in plan.remove:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(st.pack_path(pack))
        if plan.remove or compacted:
            fsync_dir(st.packs_dir)
        plan.compact = compacted
    return _report(plan, t0, dry_run=False)


def _report(plan: _GcPlan, t0: float, dry_run: bool) -> GcReport:
    freed = sum(n for _, n in plan.remove) + sum(a - b for _, a, b in plan.compact)
    return GcReport(
        deleted=plan.doomed,
        packs_removed=len(plan.remove),
        packs_compacted=len(plan.compact),
        bytes_freed=freed,
        leftovers_removed=len(plan.leftovers),
        seconds=time.perf_counter() - t0,
        damaged=plan.damaged,
        refused=plan.refused,
        dry_run=dry_run,
    )


def _plan_gc(st: Store, keep_last: int | None, keep: Any, compact_below: float) -> _GcPlan:
    """What gc does, decided without changing anything (shared by gc and its dry run)."""
    manifests, damaged = st.scan()
    refused = [f"snapshots/{d.name}" for d in damaged if "symlink" in d.reason]
    doomed: list[str] = []
    if keep_last is not None:
        newest = (
            {m.name for m in manifests[max(0, len(manifests) - keep_last) :]}
            if keep_last
            else set()
        )
        keep_set = set(keep) | newest
        doomed = [m.name for m in manifests if m.name not in keep_set]
        manifests = [m for m in manifests if m.name not in doomed]
    leftovers: list[tuple[str, str]] = []
    for sub in ("tmp", "snapshots"):
        d = st.root / sub
        try:
            check_dir(d)
            entries = list(os.scandir(d))
        except FileNotFoundError:
            continue
        except UnsafePathError:
            refused.append(sub)
            continue
        for e in entries:
            if sub == "tmp":
                leftovers.append((sub, e.name))  # ours entirely; links are unlinked, not followed
            elif e.is_symlink():
                if f"snapshots/{e.name}" not in refused:
                    refused.append(f"snapshots/{e.name}")
            elif e.is_dir(follow_symlinks=False) and not os.path.lexists(
                os.path.join(e.path, "MANIFEST.json")
            ):
                leftovers.append((sub, e.name))
    live: dict[str, dict[str, ChunkRecord]] = {}
    for m in manifests:
        for dg, rec in m.chunks.items():
            live.setdefault(rec.pack, {})[dg] = rec
    remove: list[tuple[str, int]] = []
    compact: list[tuple[str, int, int]] = []
    try:
        check_dir(st.packs_dir)
        packs = sorted(os.scandir(st.packs_dir), key=lambda e: e.name)
    except FileNotFoundError:
        packs = []
    except UnsafePathError:
        refused.append("packs")
        packs = []
    for e in packs:
        pack = e.name.removesuffix(".pack")
        if not e.name.endswith(".pack") or not PACK_ID_RE.match(pack) or e.is_symlink():
            refused.append(f"packs/{e.name}")
            continue
        if not e.is_file(follow_symlinks=False):
            refused.append(f"packs/{e.name}")
            continue
        try:
            size = e.stat(follow_symlinks=False).st_size
        except FileNotFoundError:
            continue
        if damaged:
            continue  # a damaged manifest may need any pack: collect nothing
        chunks = live.get(pack)
        if not chunks:
            remove.append((pack, size))
            continue
        # What a rewrite would occupy (header, aligned payloads): raw lengths would make a
        # fully live pack of small chunks look mostly dead and be rewritten on every gc.
        live_bytes = PACK_ALIGN + sum(
            -(-r.length // PACK_ALIGN) * PACK_ALIGN for r in chunks.values()
        )
        if live_bytes < compact_below * size:
            compact.append((pack, size, live_bytes))
    return _GcPlan(
        doomed, manifests, [d.name for d in damaged], refused, leftovers, remove, compact, live
    )


def _sweep_leftovers(st: Store, leftovers: list[tuple[str, str]]) -> None:
    """Remove crashed saves' files, relative to directory descriptors, never following links."""
    for sub in ("tmp", "snapshots"):
        names = [n for s_, n in leftovers if s_ == sub]
        if not names:
            continue
        dfd = open_dir(st.root / sub)
        try:
            for name in names:
                with contextlib.suppress(FileNotFoundError):
                    if stat.S_ISDIR(os.lstat(name, dir_fd=dfd).st_mode):
                        if sub == "snapshots" and _has_manifest(dfd, name):
                            continue  # committed since the plan was made
                        shutil.rmtree(name, dir_fd=dfd, ignore_errors=True)
                    else:
                        os.unlink(name, dir_fd=dfd)  # a file or a link: the entry itself
            os.fsync(dfd)
        finally:
            os.close(dfd)


def _has_manifest(dfd: int, name: str) -> bool:
    try:
        fd = open_dir(name, dir_fd=dfd)
    except OSError:
        return False
    try:
        os.lstat("MANIFEST.json", dir_fd=fd)
        return True
    except FileNotFoundError:
        return False
    finally:
        os.close(fd)


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
    """One damaged thing, reported once, with every snapshot (and tensor key) it affects.

    ``chunk`` is the damaged chunk's digest, or ``""`` when the snapshot's manifest itself is
    damaged (then ``keys`` is ``("<manifest>",)``)."""

    chunk: str
    reason: str
    snapshots: tuple[str, ...]
    keys: tuple[str, ...]


@dataclass(frozen=True)
class VerifyReport:
    snapshots: list[str]  # the snapshots whose chunks were checked (readable manifests)
    chunks_checked: int
    bytes_checked: int
    problems: list[VerifyProblem]
    seconds: float
    # readable snapshots written before manifests had a digest (format version 1): their
    # manifests are validated but damage to them cannot be detected
    undigested: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    @property
    def damaged(self) -> list[str]:
        """Every snapshot some problem affects, sorted."""
        return sorted({s for p in self.problems for s in p.snapshots})

    def __bool__(self) -> bool:
        return self.ok


def verify(
    store: str | os.PathLike[str] | Store,
    names: list[str] | None = None,
    *,
    threads: int | None = None,
) -> VerifyReport:
    """Re-read and re-hash every chunk of every (or the named) snapshot, and check every
    manifest. Never raises on damage: the report lists each problem once, with the snapshots and
    tensor keys it affects. (An unknown name in ``names`` is a mistake, not damage, and raises
    :class:`SnapshotNotFoundError`.)

    >>> report = deltackpt.verify("ckpts"); report.ok     # doctest: +SKIP
    """
    t0 = time.perf_counter()
    st = open_store(store, create=False)
    problems: list[VerifyProblem] = []
    if names:
        ms = []
        for n in names:
            try:
                ms.append(st.manifest(n))
            except (ManifestError, UnsafePathError, StoreIOError) as e:
                problems.append(VerifyProblem("", str(e), (n,), ("<manifest>",)))
    else:
        ms, damaged = st.scan()
        problems += [VerifyProblem("", d.reason, (d.name,), ("<manifest>",)) for d in damaged]
    # A node is a chunk *at a place*: (digest, record). Manifests normally agree on where a
    # chunk lives; when two do not (a hostile manifest, or one gc has not repointed yet), each
    # place is checked and blamed on its own snapshots.
    Node = tuple[str, ChunkRecord]
    users: dict[Node, list[tuple[str, str]]] = {}  # node -> [(snapshot, key)]
    for m in ms:
        for e in m.tensors:
            for d, _, _ in e.all_slices():
                users.setdefault((d, m.chunks[d]), []).append((m.name, e.path))
        for _, data in m.storages:
            for d, _, _ in data:
                users.setdefault((d, m.chunks[d]), []).append((m.name, "<shared storage>"))
        for d, r in m.chunks.items():
            if not any(snap == m.name for snap, _ in users.get((d, r), ())):
                users.setdefault((d, r), []).append((m.name, "<delta base>"))
    # Decode every xor chain once, keyframe first, handing each chunk's raw bytes to its deltas:
    # decoding each chunk from scratch would redo its whole chain (K times the work).
    children: dict[Node, set[Node]] = {}
    roots: set[Node] = set()
    for m in ms:
        for d, r in m.chunks.items():
            if r.base is None:
                roots.add((d, r))
            else:  # validated: the base is in the same manifest
                children.setdefault((r.base, m.chunks[r.base]), set()).add((d, r))
    with PackReaders(st.packs_dir) as packs:

        def walk(root: Node) -> list[tuple[Node, str | None]]:
            out: list[tuple[Node, str | None]] = []
            stack: list[tuple[Node, np.ndarray | None]] = [(root, None)]
            while stack:
                node, base_raw = stack.pop()
                d, rec = node
                # A chunk no delta builds on is only hashed: a per-thread scratch buffer, reused
                # (fresh memory per chunk costs page faults on every chunk of the store).
                kids = children.get(node)
                raw = np.empty(rec.size, dtype=np.uint8) if kids else scratch("verify", rec.size)
                try:
                    ChunkReader(packs, {d: rec}, verify=True).decode_into(
                        d, raw, "verify", base_raw=base_raw
                    )
                except CorruptChunkError as e:
                    out.append((node, str(e)))
                    todo = list(children.get(node, ()))
                    while todo:  # deltas of a corrupt chunk cannot be checked: report them too
                        c = todo.pop()
                        out.append((c, f"chunk {c[0]}: its xor base chain is corrupt ({d})"))
                        todo.extend(children.get(c, ()))
                    continue
                out.append((node, None))
                stack.extend((c, raw) for c in children.get(node, ()))
            return out

        order = sorted(roots, key=lambda n: (n[0], n[1].pack, n[1].offset))
        with ThreadPoolExecutor(threads or default_threads()) as pool:
            walked = list(pool.map(walk, order))
    checked = nbytes = 0
    for results in walked:
        for node, err in results:
            checked += 1
            nbytes += node[1].size
            if err is not None:
                who = list(dict.fromkeys(users[node]))
                problems.append(
                    VerifyProblem(
                        node[0],
                        err,
                        tuple(sorted({snap for snap, _ in who})),
                        tuple(dict.fromkeys(key for _, key in who)),
                    )
                )
    return VerifyReport(
        [m.name for m in ms],
        checked,
        nbytes,
        problems,
        time.perf_counter() - t0,
        [m.name for m in ms if not m.has_digest],
    )

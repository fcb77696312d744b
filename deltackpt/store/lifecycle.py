"""Snapshot lifecycle: list, delete and garbage-collect (with pack compaction); verify is in
``verify.py`` (re-exported here).

gc holds the store lock exclusively, and every save holds it shared from planning to commit, so gc
never runs while a save could still reference a chunk it would delete: it waits for in-flight saves
(up to ``lock_timeout``) and saves wait for it. ``delete`` only unlinks a manifest (atomic); it
holds the lock shared, like a save, so that it waits for a running gc (whose compaction rewrites
manifests and would bring a snapshot deleted meanwhile back). The space comes back at the next gc.
"""

from __future__ import annotations

import contextlib
import os
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from deltackpt.errors import (
    DamagedSnapshotWarning,
    InvalidArgumentError,
    SnapshotNotFoundError,
    UnsafePathError,
)
from deltackpt.format.manifest import ChunkRecord, Manifest
from deltackpt.options import default_lock_timeout
from deltackpt.store.leases import LeaseScan, scan_leases, sweep_expired
from deltackpt.store.packs import PACK_ALIGN, pack_id_of, pack_key
from deltackpt.store.storage import PACKS, SNAPSHOTS, TMP, Entry, manifest_key
from deltackpt.store.store import LATEST, SnapshotInfo, Store, open_store
from deltackpt.store.verify import VerifyProblem, VerifyReport, verify

__all__ = [
    "GcReport",
    "VerifyProblem",
    "VerifyReport",
    "delete",
    "gc",
    "snapshots",
    "verify",
]


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
    with st.lock(exclusive=False, timeout=default_lock_timeout(), what=f"deleting {name!r}"):
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
    # object stores: unfinished multipart uploads of killed saves, aborted (keys in the store)
    uploads_aborted: list[str] = field(default_factory=list)
    seconds: float = 0.0
    # snapshots whose manifests could not be read: while there are any, no pack is collected
    # (their chunks are unknown), so nothing they might need is ever deleted
    damaged: list[str] = field(default_factory=list)
    # entries gc left alone because they are not what a save writes (symlinks, odd names)
    refused: list[str] = field(default_factory=list)
    dry_run: bool = False
    # followers' leases (deltackpt/store/leases.py): snapshots retention kept only because an
    # unexpired lease names them; holders whose expired lease gc removed (would remove, in a dry
    # run); bad lease objects, ignored and left in place ("leases/<name>: why")
    leased: list[str] = field(default_factory=list)
    leases_expired: list[str] = field(default_factory=list)
    bad_leases: list[str] = field(default_factory=list)


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
    leases: LeaseScan = field(default_factory=LeaseScan)
    leased: list[str] = field(default_factory=list)


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
    progress: Callable[[int], None] | None = None,
) -> GcReport:
    """Apply retention, then delete pack data no committed snapshot references.

    ``keep_last=N`` keeps the N newest snapshots plus those named in ``keep`` and those named
    by a follower's unexpired lease (``GcReport.leased``; see :mod:`deltackpt.store.leases`),
    and deletes the rest; ``None`` deletes no snapshot and only collects garbage. Expired leases
    are removed (``GcReport.leases_expired``); bad ones are reported (``GcReport.bad_leases``),
    ignored and left in place. A pack whose live bytes are below
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

    ``progress(n)`` is called with the bytes of each pack as it is compacted or removed.

    >>> deltackpt.gc("ckpts", keep_last=3)        # doctest: +SKIP
    """
    t0 = time.perf_counter()
    _check_gc_args(keep_last, keep, compact_below, lock_timeout, dry_run)
    st = open_store(store, create=False)
    _check_keep_exists(st, keep)
    if dry_run:
        plan = _plan_gc(st, keep_last, keep, compact_below)
        expired = [lease.holder for lease in plan.leases.expired]
        return _report(plan, t0, dry_run=True, uploads=_abandon(st, dry_run=True), expired=expired)
    timeout = default_lock_timeout() if lock_timeout is None else lock_timeout
    with st.lock(exclusive=True, timeout=timeout, what="gc"):
        plan = _plan_gc(st, keep_last, keep, compact_below)
        for name in plan.doomed:
            _delete(st, name)  # we hold the lock exclusively
        expired = sweep_expired(st.storage, plan.leases.expired)
        _sweep_leftovers(st, plan.leftovers)
        uploads = _abandon(st, dry_run=False)  # exclusive: no save is uploading
        compacted: list[tuple[str, int, int]] = []
        for pack, size, _ in plan.compact:
            new_size = _compact(st, pack, plan.live[pack], plan.manifests)
            if new_size is not None:  # None: damaged, left as it is for verify to report
                compacted.append((pack, size, new_size))
            if progress is not None:
                progress(size)
        for pack, n in plan.remove:
            with contextlib.suppress(FileNotFoundError):
                st.storage.delete(pack_key(pack))
            if progress is not None:
                progress(n)
        if plan.remove or compacted:
            st.storage.sync(PACKS)
        plan.compact = compacted
    return _report(plan, t0, dry_run=False, uploads=uploads, expired=expired)


def _abandon(st: Store, dry_run: bool) -> list[str]:
    """Unfinished uploads of killed saves. Under gc's exclusive lock no save runs, so every one of
    them is abandoned."""
    return list(st.storage.abandon_uploads(0.0, dry_run=dry_run))


def _report(
    plan: _GcPlan, t0: float, dry_run: bool, uploads: list[str], expired: list[str]
) -> GcReport:
    freed = sum(n for _, n in plan.remove) + sum(a - b for _, a, b in plan.compact)
    return GcReport(
        deleted=plan.doomed,
        packs_removed=len(plan.remove),
        packs_compacted=len(plan.compact),
        bytes_freed=freed,
        leftovers_removed=len(plan.leftovers),
        uploads_aborted=uploads,
        seconds=time.perf_counter() - t0,
        damaged=plan.damaged,
        refused=plan.refused,
        dry_run=dry_run,
        leased=plan.leased,
        leases_expired=expired,
        bad_leases=plan.leases.bad,
    )


def _plan_gc(st: Store, keep_last: int | None, keep: Any, compact_below: float) -> _GcPlan:
    """What gc does, decided without changing anything (shared by gc and its dry run)."""
    manifests, damaged = st.scan()
    refused = [f"snapshots/{d.name}" for d in damaged if "symlink" in d.reason]
    doomed: list[str] = []
    leases = scan_leases(st.storage)  # never raises on a bad lease: listed in leases.bad
    leased: list[str] = []
    if keep_last is not None:
        newest = (
            {m.name for m in manifests[max(0, len(manifests) - keep_last) :]}
            if keep_last
            else set()
        )
        keep_set = set(keep) | newest
        # an incomplete lease scan may hide a lease on any snapshot: delete none (fail closed)
        held = leases.leased() if leases.complete else {m.name for m in manifests}
        leased = [m.name for m in manifests if m.name not in keep_set and m.name in held]
        doomed = [m.name for m in manifests if m.name not in keep_set | held]
        manifests = [m for m in manifests if m.name not in doomed]
    leftovers: list[tuple[str, str]] = []
    for sub in (TMP, SNAPSHOTS):
        try:
            entries = st.storage.list(sub)  # [] when missing
        except UnsafePathError:
            refused.append(sub)
            continue
        for e in entries:
            if sub == TMP:
                leftovers.append((sub, e.name))  # ours entirely; links are unlinked, not followed
            elif e.kind == "link":
                if f"{SNAPSHOTS}/{e.name}" not in refused:
                    refused.append(f"{SNAPSHOTS}/{e.name}")
            elif e.kind == "dir" and not st.storage.exists(manifest_key(e.name)):
                leftovers.append((sub, e.name))
    live: dict[str, dict[str, ChunkRecord]] = {}
    for m in manifests:
        for dg, rec in m.chunks.items():
            live.setdefault(rec.pack, {})[dg] = rec
    remove: list[tuple[str, int]] = []
    compact: list[tuple[str, int, int]] = []
    packs: list[Entry]
    try:
        packs = sorted(st.storage.list(PACKS), key=lambda e: e.name)
    except UnsafePathError:
        refused.append(PACKS)
        packs = []
    for e in packs:
        pack = pack_id_of(e.name)
        if pack is None or e.kind != "file":  # links, directories, names no save writes
            refused.append(f"{PACKS}/{e.name}")
            continue
        size = e.size
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
        doomed,
        manifests,
        [d.name for d in damaged],
        refused,
        leftovers,
        remove,
        compact,
        live,
        leases,
        leased,
    )


def _sweep_leftovers(st: Store, leftovers: list[tuple[str, str]]) -> None:
    """Remove crashed saves' files; the storage never follows links (a link is removed itself)."""
    for sub in (TMP, SNAPSHOTS):
        names = [n for s_, n in leftovers if s_ == sub]
        if not names:
            continue
        for name in names:
            if sub == SNAPSHOTS and st.storage.exists(manifest_key(name)):
                continue  # committed since the plan was made
            with contextlib.suppress(FileNotFoundError):
                st.storage.delete(f"{sub}/{name}", recursive=True)
        st.storage.sync(sub)


def _compact(
    st: Store, pack: str, chunks: dict[str, ChunkRecord], manifests: list[Manifest]
) -> int | None:
    """Copy the live chunks of ``pack`` into a new pack, repoint manifests, delete the old pack.

    Crash-safe in any order: until a manifest is rewritten it points at the old pack, which is
    deleted only after every manifest has been repointed at the new, already-fsynced pack.
    Returns the new pack's size, or None (nothing changed) when ``pack`` is shorter than its
    chunk records say: copying would replace the missing bytes with garbage and delete the rest.
    """
    w = st.pack_writer()
    moved: dict[str, ChunkRecord] = {}
    with st.pack_readers() as packs:
        for d, rec in sorted(chunks.items(), key=lambda kv: kv[1].offset):
            buf = np.empty(rec.length, dtype=np.uint8)
            if packs.read_into(pack, rec.offset, buf) != rec.length:
                w.discard()
                return None
            off, n = w.append(memoryview(buf))
            moved[d] = replace(rec, pack=w.pack_id, offset=off, length=n)
    new_size = w.finish()
    st.storage.sync(PACKS)
    for i, m in enumerate(manifests):
        if any(r.pack == pack for r in m.chunks.values()):
            new_chunks = {d: (moved[d] if r.pack == pack else r) for d, r in m.chunks.items()}
            manifests[i] = replace(m, chunks=new_chunks)  # a later compaction starts from this
            _rewrite_manifest(st, manifests[i])
    st.storage.delete(pack_key(pack))
    return new_size


def _rewrite_manifest(st: Store, m: Manifest) -> None:
    st.write_manifest(m, overwrite=True)

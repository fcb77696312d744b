"""Save step 6, commit (the coordinator, rank 0): THE manifest builder, for every kind of save.

Local, distributed and DCP saves all end here. Each turns what it planned and wrote into
:class:`SnapshotParts`, plain data any writer can produce (tensor entries with their chunk slices,
shared storages, the chunk records this save wrote, pack bytes, metadata), and :func:`commit`
builds the :class:`~deltackpt.format.manifest.Manifest` with its
:class:`~deltackpt.format.manifest.Stats` and publishes it atomically (docs/format.md: durable
temporary file, then rename). Only rank 0 calls it, after every rank's packs are durable.

The stats follow from the parts, whoever wrote them: ``logical_bytes`` is the bytes the entries
and shared storages reference, ``chunks_new`` the chunks this save wrote, ``chunks_reused`` the
other chunks the snapshot references.

:func:`check_can_save` holds the preconditions every save checks (under the store lock) before
it writes anything, with the errors users see.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from deltackpt.errors import DeltackptError, SnapshotExistsError, StoreError, StoreIOError
from deltackpt.format.manifest import ChunkRecord, Manifest, Slice, Stats, TensorEntry
from deltackpt.saving.hooks import hooks
from deltackpt.saving.write import closure
from deltackpt.store.packs import pack_key
from deltackpt.store.storage import PACKS, manifest_key
from deltackpt.store.store import SnapshotInfo, Store, store_io_error


@dataclass(frozen=True)
class SnapshotParts:
    """A snapshot as plain data: what every writer (local, distributed, DCP) produces."""

    name: str
    tree: Any  # the state's structure as JSON (deltackpt.format.tree)
    tensors: tuple[TensorEntry, ...]
    storages: tuple[tuple[int, tuple[Slice, ...]], ...]  # (nbytes, slices) per shared storage
    written: Mapping[str, ChunkRecord]  # the chunks this save wrote, on every rank
    pack_bytes: int  # bytes this save appended to packs, on every rank
    metadata: dict[str, Any]
    dist: dict[str, Any] | None = None  # saves over a process group: world_size, plan_bytes


@dataclass(frozen=True)
class Timing:
    """When the save started (``time.perf_counter()``) and how long the caller was blocked or
    waited for the previous save of the store."""

    start: float
    blocked: float = 0.0
    waited: float = 0.0


def check_can_save(store: Store, name: str, *, overwrite: bool, check_name: bool = True) -> None:
    """Refuse a save that cannot commit: ``name`` taken (unless ``overwrite``; ``check_name``
    False skips that check, for ranks other than the coordinator) or a store without packs/.
    Call it with the store lock held (shared), before writing anything."""
    if check_name and not overwrite and store.has(name):
        raise SnapshotExistsError(
            f"store {str(store.root)!r} already has a committed snapshot {name!r}; pick a "
            "new name, or pass overwrite=True (the old one stays loadable until the new "
            "one commits)"
        )
    if not store.storage.exists(PACKS):
        raise StoreError(
            f"store {str(store.root)!r} has no packs/ directory; it is damaged or not a store"
        )


def needed_digests(parts: SnapshotParts) -> set[str]:
    """Every chunk the entries and shared storages reference (not the bases of deltas)."""
    needed = {d for t in parts.tensors for d, _, _ in t.all_slices()}
    needed.update(d for _, data in parts.storages for d, _, _ in data)
    return needed


def build_manifest(
    parts: SnapshotParts, known: Mapping[str, ChunkRecord], timing: Timing, created_ns: int
) -> Manifest:
    """The manifest of ``parts``. Chunk records come from ``parts.written`` or, for chunks this
    save reused, from ``known`` (the store's committed records), with every xor base they need."""
    needed = needed_digests(parts)
    chunks = closure(needed, parts.written, known)
    stats = Stats(
        logical_bytes=sum(t.nbytes for t in parts.tensors) + sum(n for n, _ in parts.storages),
        pack_bytes=parts.pack_bytes,
        chunks_new=len(parts.written),
        chunks_reused=len(needed) - len(parts.written),
        seconds=time.perf_counter() - timing.start,
        blocked_seconds=timing.blocked,
        waited_seconds=timing.waited,
    )
    return Manifest(
        name=parts.name,
        created_ns=created_ns,
        tree=parts.tree,
        tensors=parts.tensors,
        storages=parts.storages,
        chunks=chunks,
        stats=stats,
        metadata=parts.metadata,
        dist=parts.dist,
    )


def commit(
    store: Store,
    parts: SnapshotParts,
    known: Mapping[str, ChunkRecord],
    timing: Timing,
    *,
    overwrite: bool,
    packs: tuple[str, ...] = (),
) -> SnapshotInfo:
    """Build the manifest and publish it: the snapshot exists once this returns. ``packs`` are
    the pack ids this process wrote, removed if the commit certainly failed."""
    m = build_manifest(parts, known, timing, hooks.clock())
    try:
        hooks.before_commit(m.name)
        size = store.write_manifest(m, overwrite=overwrite)
    except OSError as e:
        if isinstance(e, DeltackptError):  # SnapshotExistsError: typed already
            raise
        raise commit_io_error(store, m, packs, e) from e
    return SnapshotInfo.from_manifest(m, size)


def _published(store: Store, m: Manifest) -> bool | None:
    """After a failed commit: is ``m`` the visible manifest of its name? None: cannot tell."""
    try:
        raw = store.storage.read(manifest_key(m.name)).data
    except FileNotFoundError:
        return False
    except (OSError, DeltackptError):  # EIO, a link planted at the name: cannot tell
        return None
    if raw is None:  # only for a version we passed (we passed none)
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
                store.storage.delete(pack_key(pack))
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

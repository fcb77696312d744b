"""Fold long delta chains of a snapshot into keyframes, in the store, without blocking saves.

A fresh reader of a snapshot decodes every chunk down its delta chain (docs/format.md, Codecs):
at the end of a 31-link chain that is ~46x a raw load. :func:`fold` bounds that walk after the
fact: for each chunk the snapshot uses whose chain has more than ``max_chain`` links, it decodes
the chain member ``keep_links`` below the chunk (``keep_links=1``: the chunk's base), writes its
bytes as a keyframe into a new pack, and repoints the snapshot's manifest at it. The snapshot's
chains then hold at most ``keep_links`` links above a keyframe, and the chain payloads only the
folded snapshot needed drop out of its chunk table.

Keeping one link (the default) is what keeps catch-ups cheap: a follower holding the previous
version still reaches its chunk through the snapshot's newest delta and patches it instead of
reading a whole chunk, and the writer's next delta (against this snapshot's chunk) builds on the
short chain. Saves keep writing deltas; the keyframes are written here, off their path.

Safety, as gc's pack compaction (lifecycle.py):

- The keyframes are written under the store lock held *shared*, as a save holds it: saves and
  loads run meanwhile, gc waits. Each keyframe is the chain's decoded bytes, whose digest is
  checked, and its payload is decoded again and hashed against the chunk's digest before it is
  written. A damaged chain raises :class:`~deltackpt.errors.CorruptChunkError` naming the chunk
  and the tensor; the new pack is removed and nothing is repointed.
- The repoint takes the lock *exclusively* for a manifest read and one atomic replace
  (``Storage.replace``): readers see the old manifest or the new one, both complete. Between the
  two locks a gc may have removed the (not yet referenced) new pack: fold then starts over. A
  snapshot deleted meanwhile is not brought back.
- fold never deletes a payload: the old chain stays in its packs for every other snapshot (and
  every follower's lease) that names it; gc frees what nothing names any more. A reader that
  opened the old manifest keeps reading the old chain; if a gc removed it meanwhile, the loader's
  retry (loading/assemble.py) re-reads the manifest.
"""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace

import numpy as np

from deltackpt.errors import (
    CodecError,
    CorruptChunkError,
    InvalidArgumentError,
    SnapshotNotFoundError,
)
from deltackpt.format import codecs
from deltackpt.format.hashing import digest
from deltackpt.format.manifest import ChunkRecord, Manifest
from deltackpt.format.policy import ENCODINGS, MAX_CHAIN
from deltackpt.format.validate import validate_manifest
from deltackpt.options import default_lock_timeout, default_threads
from deltackpt.store.chunks import ChunkReader
from deltackpt.store.packs import pack_key
from deltackpt.store.storage import PACKS
from deltackpt.store.store import Store, open_store

__all__ = [
    "DEFAULT_FOLD_CHAIN",
    "FoldReport",
    "chain_links",
    "deepest_chain",
    "fold",
    "used_chunks",
]

#: fold's default bound: a chunk whose chain has more links than this is folded. Measured in
#: docs/loading.md ("Fold"): 4 links of patch deltas still read at 5-6x a raw load, 20-24 at
#: 13-35x; only ``max_chain=1, keep_links=0`` (all keyframes) came within 1.5x.
DEFAULT_FOLD_CHAIN = 4

_ATTEMPTS = 3  # a gc between the shared and the exclusive lock removed the new pack: start over


@dataclass(frozen=True)
class FoldReport:
    """What :func:`fold` did. ``chunks_folded``: keyframes written (0: no chain was over the
    bound); ``bytes_written``: the new pack's size; ``deepest_before`` / ``deepest_after``: the
    most delta links any chunk of the snapshot had before and has after; ``pack``: the new pack's
    id (None when nothing was written); ``attempts``: 1, or more when a gc removed the new pack
    before it was referenced; ``lock_wait_s``: time spent waiting for the exclusive lock."""

    snapshot: str
    chunks_folded: int = 0
    bytes_written: int = 0
    deepest_before: int = 0
    deepest_after: int = 0
    pack: str | None = None
    attempts: int = 1
    seconds: float = 0.0
    lock_wait_s: float = 0.0


def used_chunks(m: Manifest) -> set[str]:
    """Digests the snapshot's tensors and storages slice (its chunk table adds their bases)."""
    out = {d for t in m.tensors for d, _, _ in t.all_slices()}
    out.update(d for _, data in m.storages for d, _, _ in data)
    return out


def chain_links(d: str, chunks: dict[str, ChunkRecord]) -> int:
    """Delta links from chunk ``d`` down to its keyframe in ``chunks`` (a validated manifest's
    table: every base is present and chains end within MAX_CHAIN links)."""
    n, rec = 0, chunks[d]
    while rec.base is not None:
        n += 1
        if n > MAX_CHAIN:  # validated tables never get here; refuse rather than loop
            raise CorruptChunkError(f"chunk {d} starts a delta chain longer than {MAX_CHAIN}")
        rec = chunks[rec.base]
    return n


def deepest_chain(m: Manifest) -> int:
    """The most delta links a fresh reader of ``m`` walks for one chunk."""
    return max((chain_links(d, m.chunks) for d in used_chunks(m)), default=0)


def _closure(roots: set[str], chunks: dict[str, ChunkRecord]) -> dict[str, ChunkRecord]:
    out: dict[str, ChunkRecord] = {}
    todo = list(roots)
    while todo:
        d = todo.pop()
        if d in out:
            continue
        rec = out[d] = chunks[d]
        if rec.base is not None:
            todo.append(rec.base)
    return dict(sorted(out.items()))


def _targets(m: Manifest, max_chain: int, keep_links: int) -> dict[str, str]:
    """Chain member -> the tensor path it serves (for messages): for each used chunk with more
    than ``max_chain`` links, the member ``keep_links`` links below it."""
    where: dict[str, str] = {}
    for t in m.tensors:
        for d, _, _ in t.all_slices():
            where.setdefault(d, t.path)
    for i, (_, data) in enumerate(m.storages):
        for d, _, _ in data:
            where.setdefault(d, f"storage {i}")
    out: dict[str, str] = {}
    for d in sorted(where):
        if chain_links(d, m.chunks) <= max_chain:
            continue
        member = d
        for _ in range(keep_links):
            base = m.chunks[member].base
            assert base is not None  # the chain is longer than max_chain >= keep_links
            member = base
        out.setdefault(member, where[d])
    return out


def _check_args(max_chain: object, keep_links: object, encoding: object) -> None:
    def small_int(v: object) -> bool:
        return isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= MAX_CHAIN

    if not small_int(max_chain):
        raise InvalidArgumentError(
            f"fold(max_chain={max_chain!r}) is invalid: expected an int between 0 and "
            f"{MAX_CHAIN} (the most delta links a chunk may keep). Pass e.g. "
            f"max_chain={DEFAULT_FOLD_CHAIN}"
        )
    if not small_int(keep_links) or keep_links > max_chain:  # type: ignore[operator]
        raise InvalidArgumentError(
            f"fold(keep_links={keep_links!r}) is invalid: expected an int between 0 and "
            f"max_chain={max_chain!r} (the links left above a folded chunk's new keyframe). "
            "Pass keep_links=1 (followers of the previous version keep patching), or 0"
        )
    if encoding not in ENCODINGS:
        raise InvalidArgumentError(
            f"fold(encoding={encoding!r}) is invalid: expected one of {sorted(ENCODINGS)}"
        )


def fold(
    store: str | os.PathLike[str] | Store,
    snapshot: str = "latest",
    *,
    max_chain: int = DEFAULT_FOLD_CHAIN,
    keep_links: int = 1,
    encoding: str = "auto",
    lock_timeout: float | None = None,
    threads: int | None = None,
) -> FoldReport:
    """Bound the delta chains a fresh reader of ``snapshot`` walks (module docstring).

    Every chunk of ``snapshot`` (default: the latest) whose chain has more than ``max_chain``
    links gets a keyframe ``keep_links`` links below it (``encoding``: how keyframes are encoded,
    as a save's; ``"auto"``: raw unless zstd halves it), so no chain of the snapshot keeps more
    than ``max_chain`` links. Runs beside saves and loads (the store lock shared; exclusive only
    for the manifest's replace, within ``lock_timeout``); never deletes anything.

    Raises :class:`~deltackpt.errors.CorruptChunkError` (a chain does not decode to its digest;
    nothing is repointed), :class:`~deltackpt.errors.SnapshotNotFoundError` (also when the
    snapshot is deleted while folding), :class:`~deltackpt.errors.StoreLockedError`.

    >>> deltackpt.fold("ckpts")                     # doctest: +SKIP
    FoldReport(snapshot='step-31', chunks_folded=250, ...)
    """
    t0 = time.perf_counter()
    _check_args(max_chain, keep_links, encoding)
    st = open_store(store, create=False)
    name = st.resolve(snapshot)
    timeout = default_lock_timeout() if lock_timeout is None else lock_timeout
    policy = ENCODINGS[encoding]
    for attempt in range(1, _ATTEMPTS + 1):
        with st.lock(exclusive=False, timeout=timeout, what=f"folding {name!r}"):
            m = st.manifest(name)
            before = deepest_chain(m)
            todo = _targets(m, max_chain, keep_links)
            if not todo:
                return FoldReport(name, deepest_before=before, deepest_after=before,
                                  seconds=time.perf_counter() - t0)  # fmt: skip
            pack, new, size = _write_keyframes(st, m, todo, policy, threads or default_threads())
        t1 = time.perf_counter()
        with st.lock(exclusive=True, timeout=timeout, what=f"repointing folded {name!r}"):
            waited = time.perf_counter() - t1
            if not st.storage.exists(pack_key(pack)):
                continue  # a gc ran between the locks and removed it as garbage
            after = _repoint(st, name, pack, new)
        return FoldReport(
            name, len(new), size, before, after, pack, attempt, time.perf_counter() - t0, waited
        )
    raise CorruptChunkError(
        f"fold of snapshot {name!r}: a gc removed the new keyframes' pack {_ATTEMPTS} times "
        "before it could be referenced; nothing was repointed. Run fold when gc is not running"
    )


def _write_keyframes(
    st: Store, m: Manifest, todo: dict[str, str], policy: codecs.EncodePolicy, threads: int
) -> tuple[str, dict[str, ChunkRecord], int]:
    """Decode each chunk of ``todo`` down its chain, encode it as a keyframe, check it, and append
    it to one new pack (fsynced, its name too). Returns (pack id, digest -> new record, size)."""
    w = st.pack_writer()
    lock = threading.Lock()
    new: dict[str, ChunkRecord] = {}
    packs = st.pack_readers()
    reader = ChunkReader(packs, m.chunks, verify=True)

    def one(d: str) -> None:
        rec = m.chunks[d]
        where = f"snapshot {m.name!r} ({todo[d]})"
        raw = np.empty(rec.size, dtype=np.uint8)
        reader.decode_into(d, raw, where)  # the chain's bytes, hashed against d
        enc = codecs.encode(raw, rec.itemsize, policy=policy)
        check = np.empty(rec.size, dtype=np.uint8)
        try:
            codecs.decode(enc.codec, enc.payload, rec.size, enc.itemsize, check)
        except CodecError as e:
            raise CorruptChunkError(f"fold: the keyframe of chunk {d} does not decode: {e}") from e
        if digest(check) != d:
            raise CorruptChunkError(
                f"fold: the keyframe of chunk {d} of {where} hashes to {digest(check)}, "
                "not its digest; nothing was repointed"
            )
        with lock:
            off, n = w.append(enc.payload)
            new[d] = replace(
                rec, pack=w.pack_id, offset=off, length=n, codec=enc.codec,
                itemsize=enc.itemsize, base=None,
            )  # fmt: skip

    try:
        with packs, ThreadPoolExecutor(max(1, threads)) as pool:
            for f in [pool.submit(one, d) for d in sorted(todo)]:
                f.result()
        size = w.finish()
        st.storage.sync(PACKS)
    except CorruptChunkError as e:
        w.discard()
        raise CorruptChunkError(
            f"fold of snapshot {m.name!r} stopped, nothing was repointed: {e}",
            missing_pack=e.missing_pack,
        ) from e
    except BaseException:
        w.discard()
        raise
    return w.pack_id, new, size


def _repoint(st: Store, name: str, pack: str, new: dict[str, ChunkRecord]) -> int:
    """Under the exclusive lock: point ``name``'s manifest, as it is now, at the keyframes of
    ``pack`` and drop the chain records it no longer needs; one atomic replace. Returns the
    deepest chain after. The manifest may have changed since the keyframes were written (an
    ``overwrite=True`` save, a gc compaction): only digests it still holds are repointed."""
    if not st.has(name):  # deleted meanwhile: do not bring it back; the pack is garbage
        st.storage.delete(pack_key(pack))
        st.storage.sync(PACKS)
        raise SnapshotNotFoundError(
            f"snapshot {name!r} was deleted while it was being folded; nothing was repointed"
        )
    m = st.manifest(name)
    chunks = dict(m.chunks)
    hits = {d: r for d, r in new.items() if d in chunks}
    chunks.update(hits)
    folded = replace(m, chunks=_closure(used_chunks(m), chunks))
    if not hits:  # rewritten meanwhile with other bytes: our keyframes are not needed
        st.storage.delete(pack_key(pack))
        st.storage.sync(PACKS)
        return deepest_chain(m)
    validate_manifest(folded, st.chunk_bytes, f"folded snapshot {name!r}")
    st.write_manifest(folded, overwrite=True)
    return deepest_chain(folded)

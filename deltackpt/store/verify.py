"""verify: re-read and re-hash every chunk of every (or the named) snapshot of a store.

Each chunk is checked once per place it lives, however many snapshots share it, and xor delta
chains are decoded keyframe first, handing each chunk's raw bytes to its deltas. Damage is
reported, never raised: one :class:`VerifyProblem` per damaged thing, with every snapshot and
tensor key it affects.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from deltackpt.errors import CorruptChunkError, StoreFormatError, StoreIOError
from deltackpt.format.manifest import ChunkRecord
from deltackpt.options import default_threads
from deltackpt.store.chunks import ChunkReader
from deltackpt.store.chunks import _scratch as scratch
from deltackpt.store.store import Store, open_store


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
    progress: Callable[[int], None] | None = None,
) -> VerifyReport:
    """Re-read and re-hash every chunk of every (or the named) snapshot, and check every
    manifest. Never raises on damage: the report lists each problem once, with the snapshots and
    tensor keys it affects. (An unknown name in ``names`` is a mistake, not damage, and raises
    :class:`SnapshotNotFoundError`.) ``progress(n)`` is called, on the calling thread, with the
    raw bytes of each chunk chain as it is checked (a bar's ``advance``).

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
            except (StoreFormatError, StoreIOError) as e:  # damaged, unsafe, or newer
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
        for entry in m.tensors:
            for d, _, _ in entry.all_slices():
                users.setdefault((d, m.chunks[d]), []).append((m.name, entry.path))
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
    with st.pack_readers() as packs:

        def walk(root: Node) -> list[tuple[Node, str | None]]:
            out: list[tuple[Node, str | None]] = []
            stack: list[tuple[Node, np.ndarray | None]] = [(root, None)]
            while stack:
                node, base_raw = stack.pop()
                d, rec = node
                # A chunk no delta builds on is only hashed: where it lies in a mapped local pack
                # (raw), else in a per-thread scratch buffer, reused (fresh memory per chunk
                # costs page faults on every chunk of the store).
                kids = children.get(node)
                reader = ChunkReader(packs, {d: rec}, verify=True)
                view = None if kids else reader.mapped(d)
                raw = None
                try:
                    if view is not None:
                        reader.check_mapped(d, view, _where(users[node]))
                    else:
                        raw = np.empty(rec.size, np.uint8) if kids else scratch("verify", rec.size)
                        reader.decode_into(d, raw, _where(users[node]), base_raw=base_raw)
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
            walked = []
            for results in pool.map(walk, order):
                walked.append(results)
                if progress is not None:
                    progress(sum(node[1].size for node, _ in results))
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


def _where(users: list[tuple[str, str]]) -> str:
    """Which snapshot and key a chunk belongs to, for its error message (the first user; a
    chunk deduped across snapshots names how many more)."""
    who = list(dict.fromkeys(users))
    snap, key = who[0]
    more = f" (and {len(who) - 1} more)" if len(who) > 1 else ""
    return f"snapshot {snap!r} key {key!r}{more}"

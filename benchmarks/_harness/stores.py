"""What a deltackpt store holds (xor chains, codecs of new chunks), and freeing what deltackpt
keeps in memory per store between benchmark phases.

The readers use the public manifest API (``open_store(...).manifest(name)``). Freeing memory has
no public API yet: :func:`release` and :func:`release_all` are the only places in the
benchmarks that touch deltackpt's per-store state (the save engine's ``close`` and the
``open_store`` registry), so a change there is fixed here once.
"""

from __future__ import annotations

import os
from collections import Counter
from typing import Any

# --------------------------------------------------------------------------- manifests


def top_chunks(m: Any) -> set[str]:
    """Digests the snapshot's tensors, shards and shared storages point at (not their bases)."""
    used: set[str] = set()
    for e in m.tensors:
        for d, _, _ in e.data or ():
            used.add(d)
        for sh in e.shards or ():
            for d, _, _ in sh.data:
                used.add(d)
    for _, data in m.storages:
        for d, _, _ in data:
            used.add(d)
    return used


def xor_chain(m: Any, d: str) -> list[str]:
    """``d``, then its xor base, its base's base, ... down to a chunk stored without one."""
    out = [d]
    while m.chunks[out[-1]].base is not None:
        out.append(m.chunks[out[-1]].base)
    return out


def chain_stats(store: str | os.PathLike[str]) -> dict[str, Any]:
    """xor delta chains of a store's latest snapshot: what a load has to read and decode."""
    import deltackpt

    m = deltackpt.open_store(store).manifest("latest")
    used = top_chunks(m)
    depths, read, raw = [], 0, 0
    for d in used:
        c = xor_chain(m, d)
        depths.append(len(c) - 1)
        read += sum(m.chunks[x].length for x in c)
        raw += m.chunks[d].size
    return {
        "chunks": len(used),
        "max_xor_depth": max(depths, default=0),
        "mean_xor_depth": round(sum(depths) / max(1, len(depths)), 2),
        "codecs": dict(Counter(m.chunks[d].codec for d in used)),
        "pack_bytes_read": read,
        "raw_bytes": raw,
    }


def depth_bytes(store: Any, name: str) -> Counter[int]:
    """Bytes of the snapshot's own chunks by xor-chain depth (0 = stored without a base)."""
    m = store.manifest(name)
    out: Counter[int] = Counter()
    for d in top_chunks(m):
        out[len(xor_chain(m, d)) - 1] += m.chunks[d].size
    return out


def max_chain_depth(store: Any, name: str) -> int:
    """Longest xor chain (links to a keyframe) among all chunks a snapshot references."""
    m = store.manifest(name)
    return max((len(xor_chain(m, d)) - 1 for d in m.chunks), default=0)


def new_chunks(store: Any, name: str, old: set[str]) -> dict[str, Any]:
    """{digest: record} of the chunks of snapshot ``name`` not in ``old``."""
    return {d: r for d, r in store.manifest(name).chunks.items() if d not in old}


# --------------------------------------------------------------------------- memory


def release(store: Any, forget: bool = True) -> None:
    """Free what deltackpt holds in memory for ``store`` (a Store): waits for its save in flight,
    then drops the staging arenas and delta bases; with ``forget``, also forgets the open Store
    (and its manifest cache), so the next ``open_store`` of that path starts as a fresh process
    would. Benchmark hygiene between phases; never inside a timed region."""
    from deltackpt.saving import engine
    from deltackpt.store import store as store_mod

    saver = engine.saver_for(store)
    if hasattr(saver, "close"):  # the per-store engine frees its own state
        saver.close()
    else:  # older engine: the arenas and delta bases hang off the Store
        saver.flush()
        for a in saver._arenas:
            a.buffers.clear()
        store.delta_refs = {}
        store._saver = None
    if forget:
        with store_mod._STORES_LOCK:
            if store_mod._STORES.get(store.root) is store:
                del store_mod._STORES[store.root]


def forget_open_stores() -> None:
    """Forget every Store ``open_store`` handed out, with their manifest caches (a restore
    usually runs in a fresh process); what the save engine holds is left alone."""
    from deltackpt.store import store as store_mod

    with store_mod._STORES_LOCK:
        store_mod._STORES.clear()


def release_all() -> None:
    """:func:`release` every store this process opened (before a load phase that must not find
    staging buffers or cached manifests of the save phase)."""
    from deltackpt.store import store as store_mod

    with store_mod._STORES_LOCK:
        stores = list(store_mod._STORES.values())
    for st in stores:
        release(st)
    with store_mod._STORES_LOCK:
        store_mod._STORES.clear()

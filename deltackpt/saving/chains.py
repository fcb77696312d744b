"""The write side's chain policy beyond the per-chunk rule in saving/write.py: retention-aware
chain budgets for ``Checkpointer`` (the byte budget that keeps the ``keep_last`` retained
snapshots within a stated multiple of the state on disk), staggered keyframes (each chunk
position has its own keyframe slot, so no version pays every keyframe), and delta bases that
follow a fold (store/fold.py) instead of counting links the store no longer has."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import fields, replace
from typing import Any

import xxhash

from deltackpt.format.manifest import ChunkRecord
from deltackpt.options import SaveOptions
from deltackpt.saving.stage import DeltaRef, chain_cost

__all__ = [
    "RETAINED_SLACK",
    "bounded_chains",
    "retained_bound",
    "slot_offset",
    "stagger",
]

#: keep_last=K keeps at most K x (1 + RETAINED_SLACK) states on disk when the Checkpointer chose
#: the chain budget (see :func:`bounded_chains`).
RETAINED_SLACK = 0.25


def retained_bound(keep_last: int, chain_budget: float) -> float:
    """The most bytes, in states, that ``keep_last`` retained snapshots can hold in chunk
    payloads when chains are cut at ``chain_budget`` (proof in :func:`bounded_chains`)."""
    return keep_last + chain_budget


def bounded_chains(save_options: dict[str, Any], keep_last: int | None) -> dict[str, Any]:
    """Choose the xor chain byte budget so that the ``keep_last`` newest snapshots never hold
    more than ``keep_last + chain_budget`` states on disk, and lower the budget to
    ``(keep_last - 1) * RETAINED_SLACK`` so that this is at most ``keep_last x 1.25`` states
    (``keep_last=1``: no deltas, exactly one state). A ``chain_budget`` the caller set is kept
    (the bound is then ``keep_last + chain_budget``); ``keyframe_every`` never matters to it.

    Proof, per chunk position (a chunk of ``S`` raw bytes; the state is the sum of them, and
    dedupe between positions only lowers the total). Retention runs gc with pack compaction
    after every deletion (``RETENTION_COMPACT_BELOW``), so what stays on disk is the payloads
    the retained snapshots reach: each retained version's own payload, plus, through xor
    bases, its chain down to the keyframe. Every payload is at most ``S``: a keyframe is raw
    (``S``) or zstd only where smaller; a delta is written only if its chain's xor payloads,
    its own included, stay within ``chain_budget * S`` (saving/write.py re-encodes it as a
    keyframe otherwise). Let the retained versions be ``v_a .. v_{a+K-1}``. Every chain that
    starts at or after ``v_a`` holds only retained versions, so all payloads not themselves
    retained belong to the chain of ``v_a``: its keyframe and the deltas below ``v_a``. Hence
    the total is at most (that chain's keyframe, ``S``) + (that chain's deltas, the retained
    ones among them included, ``<= chain_budget * S``) + (the other retained versions, at most
    ``K - 1`` payloads of ``<= S``) ``= (K + chain_budget) * S``. If ``v_a`` is a keyframe the
    middle terms vanish and the total is ``<= K * S``. Summed over positions:
    ``(K + chain_budget) x state``. The bound is tight only when ``K - 1`` keyframes follow a
    full chain (big changes after small ones); steady RL-like steps stay near ``K`` states, and
    manifests come on top."""
    if keep_last is None or "chain_budget" in save_options:
        return save_options
    known = {f.name for f in fields(SaveOptions)}
    base = save_options.get("options")
    opts = SaveOptions.from_kwargs(
        base if isinstance(base, SaveOptions) else None,
        {k: v for k, v in save_options.items() if k in known},
    )
    # not conditioned on the encoding: "auto" turns xor on where the store is remote
    budget = min(opts.chain_budget, (keep_last - 1) * RETAINED_SLACK)
    if budget == opts.chain_budget:
        return save_options
    return {**save_options, "chain_budget": budget}


def slot_offset(key: str, keyframe_every: int) -> int:
    """Chunk position ``key``'s keyframe offset, in ``[0, keyframe_every // 2]``: its slots are
    the saves ``n > 0`` with ``(n + offset) % keyframe_every == 0``. Half the cap at most, so the
    first chain of a process runs at least ``keyframe_every / 2`` saves before its slot."""
    return xxhash.xxh3_64_intdigest(key.encode()) % (keyframe_every // 2 + 1)


def stagger(
    refs: Mapping[str, DeltaRef],
    index: Mapping[str, ChunkRecord],
    save_no: int,
    keyframe_every: int,
) -> dict[str, DeltaRef]:
    """The delta bases of save number ``save_no`` (0: this process's first save of the store),
    from the last save's ``refs`` and the store's chunk ``index``.

    Staggered keyframes: without them every chunk that changes each save keyframes on the same
    saves (multiples of ``keyframe_every`` after the first), and those saves write the whole
    state. Here a position's chain is also cut at its slot (:func:`slot_offset`), once it holds a
    delta; at the cap a chain is ``keyframe_every`` versions long, so from its first slot on a
    position keyframes on its own slots and each save pays about ``2 / keyframe_every`` of the
    keyframes. A chain cut early (the byte budget, a pretraining-like step that keyframes every
    chunk at once) is staggered again at the position's next slot, at the cost of one shorter
    chain.

    Fold: a base whose chain in ``index`` is shorter than the links the ref counts was folded
    (store/fold.py repointed the newest snapshot at a keyframe); its links and bytes are taken
    from ``index``, so the next deltas build on the short chain instead of keyframing early."""
    k = keyframe_every
    out: dict[str, DeltaRef] = {}
    for key, ref in refs.items():
        if ref.depth:
            cost = chain_cost(ref.digest, index)
            if cost is not None and cost[0] < ref.depth:
                ref = replace(ref, depth=cost[0], chain_bytes=cost[1], last_delta=cost[2])
        slot = k > 1 and save_no > 0 and (save_no + slot_offset(key, k)) % k == 0
        out[key] = replace(ref, slot=slot) if ref.slot != slot else ref
    return out

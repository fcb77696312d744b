"""Retention-aware xor chains for ``Checkpointer``: the longest delta chain and the delta gain
that keep ``keep_last`` retained snapshots within ``keep_last`` times the state on disk."""

from __future__ import annotations

from dataclasses import fields, replace
from typing import Any

from deltackpt.format.codecs import XOR
from deltackpt.options import SaveOptions

__all__ = ["bounded_chains"]


def bounded_chains(save_options: dict[str, Any], keep_last: int | None) -> dict[str, Any]:
    """Choose the xor chain length and gain so that the ``keep_last`` newest snapshots never
    hold more than ``keep_last`` times the state on disk.

    A kept delta keeps its chain alive back to the keyframe, so the snapshots retained cost, per
    key, one keyframe per chain they touch plus every delta up to the newest one kept; each delta
    is at most ``min_gain`` of a chunk (the encoder stores raw otherwise). :func:`_worst` is that
    cost for the worst window; the longest chain (up to ``keyframe_every``) whose affordable
    ``min_gain`` still admits typical bf16 deltas (<= 0.25) is chosen, and ``min_gain`` is
    lowered to what it affords. keep_last 1 or 2 then means no deltas (a kept delta plus the
    next keyframe already costs more than two states); 3 means chains of 4 with deltas of at most
    a quarter of a chunk. An explicit ``keyframe_every`` is left as the caller chose it."""
    if keep_last is None or "keyframe_every" in save_options:
        return save_options
    known = {f.name for f in fields(SaveOptions)}
    base = save_options.get("options")
    opts = SaveOptions.from_kwargs(
        base if isinstance(base, SaveOptions) else None,
        {k: v for k, v in save_options.items() if k in known},
    )
    policy = opts.encoding
    if XOR not in policy.codecs or policy.force is not None:
        return save_options
    for chain in range(opts.keyframe_every, 1, -1):
        gain = min(policy.min_gain, _affordable_gain(chain, keep_last))
        if gain >= min(policy.min_gain, 0.25):
            return {
                **save_options,
                "keyframe_every": chain,
                "encoding": replace(policy, min_gain=gain),
            }
    return {**save_options, "keyframe_every": 1}


def _worst(chain: int, keep: int) -> list[tuple[int, int]]:
    """Per window start: (keyframes, deltas) that ``keep`` consecutive snapshots keep alive."""
    out = []
    for start in range(chain):
        last = start + keep - 1
        frames = deltas = 0
        for c0 in range(0, last + 1, chain):
            if c0 + chain - 1 < start:
                continue  # a chain that ends before the window: not needed
            frames += 1
            deltas += min(last, c0 + chain - 1) - c0
        out.append((frames, deltas))
    return out


def _affordable_gain(chain: int, keep: int) -> float:
    """The largest delta ratio r with frames + deltas * r <= keep for every window."""
    r = float("inf")
    for frames, deltas in _worst(chain, keep):
        if frames > keep or (frames == keep and deltas):
            return 0.0
        if deltas:
            r = min(r, (keep - frames) / deltas)
    return r

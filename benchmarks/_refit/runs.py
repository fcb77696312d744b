"""One store per policy, all fed the same versions; loads measured at the end of each phase."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

import deltackpt
from deltackpt import LoadStats

from .trainer import state_digest


@dataclass
class Policy:
    name: str
    kwargs: dict[str, Any]  # save options
    fold: int | None = None  # deltackpt.fold(max_chain=fold) after every save
    keep_links: int = 1  # fold's keep_links


def policies(spec: str) -> list[Policy]:
    """``name=chain_budget/keyframe_every[/fold[:keep]]`` items (``fold``: fold the new
    version's chains over that many links after each save, keeping ``keep`` links above the
    keyframes, default 1); ``raw`` (no encoding, dedupe only) first."""
    out = [Policy("raw", {"encoding": "fast-restore"})]
    for item in spec.split(","):
        name, _, cfg = item.partition("=")
        if name == "default":
            out.append(Policy("default", {"encoding": "smallest"}))
            continue
        budget, every, *fold = cfg.split("/")
        out.append(
            Policy(
                name,
                {
                    "encoding": "smallest",
                    "chain_budget": float(budget),
                    "keyframe_every": int(every),
                },
                int(fold[0].partition(":")[0]) if fold else None,
                int(fold[0].partition(":")[2] or 1) if fold else 1,
            )
        )
    return out


@dataclass
class Run:
    policy: Policy
    store: Any
    written: list[int] = field(default_factory=list)  # bytes_written per version
    save_s: list[float] = field(default_factory=list)
    fold_written: list[int] = field(default_factory=list)  # bytes fold wrote per version
    fold_s: list[float] = field(default_factory=list)

    def save(self, weights: dict[str, torch.Tensor], name: str, keep: int | None = None) -> None:
        """Save one version; ``keep``: then delete all but the ``keep`` newest (the raw store
        rewrites the whole state every version: without that it fills the disk)."""
        t0 = time.perf_counter()
        info = deltackpt.save(weights, self.store, name, **self.policy.kwargs)
        self.save_s.append(time.perf_counter() - t0)
        self.written.append(info.bytes_written)
        if self.policy.fold is not None:  # as a background fold would, right after the save
            t0 = time.perf_counter()
            r = deltackpt.fold(
                self.store, name, max_chain=self.policy.fold, keep_links=self.policy.keep_links
            )
            self.fold_s.append(time.perf_counter() - t0)
            self.fold_written.append(r.bytes_written)
        if keep is not None:
            deltackpt.gc(self.store, keep_last=keep, compact_below=0)


def empty_like(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: torch.empty_like(v) for k, v in weights.items()}


def timed_load(
    store: Any,
    name: str,
    into: dict[str, torch.Tensor],
    digest: str,
    since: str | None = None,
    verify: bool | str = True,
) -> tuple[float, int]:
    """Seconds and bytes read of one load of ``name`` into ``into`` (checked bit-exact)."""
    stats = LoadStats()
    kw: dict[str, Any] = {"since": since} if since is not None else {}
    if verify is not True:
        kw["verify"] = verify
    t0 = time.perf_counter()
    deltackpt.load(store, name, into=into, stats=stats, **kw)
    dt = time.perf_counter() - t0
    if state_digest(into) != digest:
        raise AssertionError(f"load of {name} (since={since}) is not bit-exact")
    return dt, stats.bytes_read


def links(store: Any, name: str) -> tuple[int, int]:
    """(the deepest xor chain, xor links summed over the chunks) of snapshot ``name``."""
    m = store.manifest(name)
    deepest = total = 0
    for rec in m.chunks.values():
        n, cur = 0, rec
        while cur.base is not None:
            n, cur = n + 1, m.chunks[cur.base]
        deepest, total = max(deepest, n), total + n
    return deepest, total


def measure_point(
    run: Run,
    raw: Run,
    names: list[str],
    digests: list[str],
    buf: dict[str, torch.Tensor],
    k: int,
    first: int,
) -> dict[str, float]:
    """At version ``names[-1]``: a fresh reader's full load, catch-up from the version before and
    from ``k`` versions before (``into`` first filled with that version from the raw store); and
    the fresh reader's load of the phase's version with the most xor links (end of a chain),
    compared with the raw store's load of the latest version (all raw: the same bytes and work
    for any version; the raw store keeps only the newest k+1 versions)."""
    last, d_last = names[-1], digests[-1]
    out: dict[str, float] = {}
    full_s = min(timed_load(run.store, last, buf, d_last)[0] for _ in range(2))
    _, full_b = timed_load(run.store, last, buf, d_last)
    out["full_s"], out["full_bytes"] = full_s, full_b
    out["links"] = links(run.store, last)[0]
    out["worst_links"], out["worst_s"] = out["links"], full_s
    if run is not raw:  # (the raw store keeps only the newest versions; it has no chains)
        worst = max(range(first, len(names)), key=lambda i: links(run.store, names[i])[1])
        out["worst_links"] = links(run.store, names[worst])[0]
        out["worst_s"] = min(
            timed_load(run.store, names[worst], buf, digests[worst])[0] for _ in range(2)
        )
    for back in (1, k):
        if back >= len(names):
            continue
        held, d_held = names[-1 - back], digests[-1 - back]
        secs, nbytes = [], 0
        for _ in range(2):
            timed_load(raw.store, held, buf, d_held)  # the follower holds `held`
            s, nbytes = timed_load(run.store, last, buf, d_last, since=held)
            secs.append(s)
        out[f"catch{back}_s"], out[f"catch{back}_bytes"] = min(secs), nbytes
    if len(names) > 1 and run is not raw:  # catch-up 1 with the two full hashing passes
        held, d_held = names[-2], digests[-2]
        secs = []
        for _ in range(2):
            timed_load(raw.store, held, buf, d_held)
            secs.append(timed_load(run.store, last, buf, d_last, since=held, verify="full")[0])
        out["catch1_full_s"] = min(secs)
    return out

"""The wire protocol of a sync round, built on a transport's control collectives.

Every message is a collective that every rank of the job performs in the same order; a decision
taken from an all-reduced value is therefore taken identically everywhere, which is how failures
before or inside a round turn into the same error on every rank instead of a hang.

1. ``begin``  all_reduce_max int64[8]: protocol version (twice, negated), round version (twice,
   negated; receivers send INT64_MIN), need_plan, need_full, failed sender rank + 1.
2. ``plan``   only if need_plan: each sender, in rank order, broadcasts its manifest (canonical
   JSON, length first). Everyone runs :func:`deltackpt.sync.plan.build_plan` on them.
3. ``changed`` only in delta rounds: all_reduce_max int64[n_tensors + 1]: each sender sets 1 for
   the tensors whose part it sends has a digest different from the last committed round; last
   slot: failed rank + 1. Everyone then lays out the changed tensors: ``plan.layout(changed)``.
4. per bucket of the round: ``header`` broadcast int64[4] from the owner: status (1 ok,
   2 abort), bucket index, bucket digest (:func:`combine` of its pieces' xxh3-128) as two int64;
   then the payload.
5. ``vote`` all_reduce_max int64[1]: 0, or the rank + 1 of a rank that rejects the round.
   All zero: everyone commits. Otherwise nobody does.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from deltackpt.format.hashing import digest
from deltackpt.sync.errors import PlanError, RoundAbortedError, SyncError
from deltackpt.sync.plan import Plan
from deltackpt.sync.sender_manifest import SenderManifest
from deltackpt.sync.transport import Transport, broadcast_bytes

PROTO = 1
OK, ABORT = 1, 2
_I64_MIN = -(1 << 63)


@dataclass(frozen=True)
class RoundStats:
    """What one round did, as seen from this rank.

    ``bytes_sent`` counts the bucket payloads of the round (all senders; control messages are a
    few hundred bytes per bucket and are not counted); ``bytes_total`` is what a full round sends.
    """

    version: int
    full: bool
    plan_sent: bool
    buckets_sent: int
    buckets_total: int
    bytes_sent: int
    bytes_total: int
    seconds: float

    @classmethod
    def of(
        cls, version: int, send: Any, plan: Plan, moved: Sequence[Any], plan_sent: bool, t0: float
    ) -> RoundStats:
        """The stats of a round that sent ``send`` (None: every tensor) in the buckets ``moved``
        (anything with ``nbytes``), started at ``t0`` (perf_counter)."""
        return cls(
            version,
            send is None or len(send) == len(plan.tensors),
            plan_sent,
            len(moved),
            len(plan.buckets),
            sum(b.nbytes for b in moved),
            plan.total_bytes,
            time.perf_counter() - t0,
        )


@dataclass(frozen=True)
class Begin:
    version: int
    need_plan: bool
    need_full: bool


def begin(
    t: Transport, *, version: int | None, need_plan: bool, need_full: bool, failed: bool
) -> Begin:
    v = torch.tensor(
        [
            PROTO,
            -PROTO,
            _I64_MIN,
            _I64_MIN,
            int(need_plan),
            int(need_full),
            t.rank + 1 if failed else 0,
            0,
        ],
        dtype=torch.int64,
    )
    if version is not None:
        v[2], v[3] = version, -version
    t.all_reduce_max(v)
    p = v.tolist()
    if p[0] != PROTO or -p[1] != PROTO:
        raise PlanError(
            f"ranks speak sync protocol versions {-p[1]}..{p[0]}, this rank speaks "
            f"{PROTO}; run the same deltackpt on every rank"
        )
    if p[6]:
        raise RoundAbortedError(
            f"sender rank {p[6] - 1} failed before the round started (its own "
            "error is raised there); nothing was sent or committed"
        )
    if p[2] == _I64_MIN:
        raise SyncError(
            "no sender took part in the round (only receivers called begin); every "
            "rank listed in senders must call push()"
        )
    if p[2] != -p[3]:
        raise SyncError(
            f"senders pushed different versions in one round (min {-p[3]}, max "
            f"{p[2]}); every sender rank must call push() with the same version"
        )
    return Begin(p[2], bool(p[4]), bool(p[5]))


def exchange_plan(t: Transport, manifest: bytes | None) -> list[SenderManifest]:
    out = []
    for s in t.senders:
        data = broadcast_bytes(t, manifest if t.rank == s else None, s)
        m = SenderManifest.from_json(data)
        if m.rank != s:
            raise PlanError(f"manifest from rank {s} claims rank {m.rank}")
        out.append(m)
    return out


def exchange_changed(
    t: Transport, plan: Plan, changed: Iterable[int], failed: bool, version: int
) -> list[int]:
    """Combine every sender's changed tensors; returns the indices of all of them."""
    n = len(plan.tensors)
    v = torch.zeros(n + 1, dtype=torch.int64)
    v[list(changed)] = 1
    if failed:
        v[n] = t.rank + 1
    t.all_reduce_max(v)
    flags = v.numpy()
    if flags[n]:
        raise RoundAbortedError(
            f"round {version}: sender rank {int(flags[n]) - 1} failed while "
            "hashing its tensors (its own error is raised there)"
        )
    return [int(i) for i in np.flatnonzero(flags[:n])]


def combine(piece_digests: Iterable[str]) -> str:
    """Digest of a bucket or of a part: xxh3-128 over the hex digests of its pieces, in order.

    Each piece is hashed once (fused with its copy on the sender, once on the receiver) and the
    same piece digests serve both to verify buckets and to detect changed tensors.
    """
    return digest("".join(piece_digests).encode())


def _digest_to_i64(hexdigest: str) -> tuple[int, int]:
    raw = bytes.fromhex(hexdigest)
    return (
        int.from_bytes(raw[:8], "big", signed=True),
        int.from_bytes(raw[8:], "big", signed=True),
    )


def _i64_to_digest(hi: int, lo: int) -> str:
    return (hi.to_bytes(8, "big", signed=True) + lo.to_bytes(8, "big", signed=True)).hex()


def header(
    t: Transport, src: int, index: int, status: int = OK, digest: str | None = None
) -> tuple[int, str]:
    hi, lo = _digest_to_i64(digest) if digest else (0, 0)
    v = torch.tensor([status, index, hi, lo], dtype=torch.int64)
    t.broadcast(v, src)
    st, idx, hi, lo = v.tolist()
    if idx != index:
        raise SyncError(
            f"protocol out of step: expected the header of bucket {index}, got "
            f"{idx} from rank {src}; the ranks disagree about the plan"
        )
    return st, _i64_to_digest(hi, lo)


def vote(t: Transport, reject: bool) -> int:
    """0 if every rank accepts the round, else (rank + 1) of the highest rank rejecting it."""
    v = torch.tensor([t.rank + 1 if reject else 0], dtype=torch.int64)
    t.all_reduce_max(v)
    return int(v.item())

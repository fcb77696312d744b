"""What senders and receivers share: the setup exchange and the round statistics."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from deltackpt.sync.dtypes import DtypeSpec
from deltackpt.sync.errors import PeerLostError, PlanError, RoundAbortedError, SyncTimeoutError
from deltackpt.sync.group import SyncGroup
from deltackpt.sync.schedule import Link, LinkBucket, Schedule, build_schedule
from deltackpt.sync.schedule_decl import Decl, decl_from_json, decl_to_json, expand_every
from deltackpt.sync.wire import header_words

__all__ = ["RoundStats", "link_slots", "message_bytes", "payload_start", "setup_schedule"]


@dataclass(frozen=True)
class RoundStats:
    """One round as this rank saw it. ``payload_bytes``: piece bytes this rank sent (trainer)
    or received (receiver), the sum of ``per_link`` (peer rank -> bytes); ``wire_bytes`` adds
    headers and alignment gaps. ``full``: every planned piece was sent/received.
    ``zero_copy_bytes``: the part of ``payload_bytes`` sent straight from the trainers' tensors
    (no packing copy; see ``WeightSender(zero_copy_min=)``). ``patched``: pieces a receiver
    got as patches against the version it held (receivers only). ``mirrored_bytes``: bytes a
    trainer copied from its device tensors into its host mirror this round (``host_mirror.py``;
    only the chunks that changed since the last commit, all of them in a full round)."""

    version: int
    full: bool
    seconds: float
    buckets: int
    payload_bytes: int
    wire_bytes: int
    per_link: dict[int, int] = field(default_factory=dict)
    zero_copy_bytes: int = 0
    patched: int = 0
    mirrored_bytes: int = 0


def payload_start(bk: LinkBucket, align: int) -> int:
    """Where the payload of ``bk``'s message starts (after the header, aligned)."""
    return -(-header_words(len(bk.pieces)) * 8 // align) * align


def message_bytes(bk: LinkBucket, align: int) -> int:
    """The room a message of ``bk`` may take: header, every piece present, and ``align``
    bytes of slack for the zero-copy pieces' place at the end (``wire.layout``)."""
    return payload_start(bk, align) + bk.capacity + align


def setup_schedule(
    group: SyncGroup,
    declare: Callable[[], Decl],
    bucket_bytes: int,
    align: int,
    dtype: DtypeSpec = None,
    prepare: Callable[[Schedule], None] | None = None,
) -> Schedule:
    """Collective: every rank posts its declaration (``declare()``), every rank builds the
    same schedule, runs its local ``prepare(schedule)`` (checks of its own tensors against it,
    its link windows) and then waits until every rank got that far. A rank that fails any of
    these steps raises its own error and tells the others, which raise
    :class:`RoundAbortedError` at once instead of waiting for the group timeout (a trainer
    would otherwise wait in the first round for a receiver that never comes); every rank then
    plans again on its next ``push``/``pull``."""
    group.begin_setup()
    try:
        sched = _plan(group, declare, bucket_bytes, align, dtype)
        if prepare is not None:
            prepare(sched)
    except (RoundAbortedError, PeerLostError, SyncTimeoutError):
        raise  # another rank's failure, or the group is broken: nothing to tell
    except Exception as e:
        group.fail_setup(f"rank {group.rank}: {e}")
        raise
    group.exchange("ready", b"")
    return sched


def _plan(
    group: SyncGroup,
    declare: Callable[[], Decl],
    bucket_bytes: int,
    align: int,
    dtype: DtypeSpec,
) -> Schedule:
    """The exchanges of :func:`setup_schedule`. A receiver that wants every tensor whole
    (``decl.every``) learns the trainers' tensors from the first exchange and posts its
    expanded declaration (wire dtypes from ``dtype``) in a second one, which every rank joins
    when any declaration of the first is such a wildcard."""
    decl = declare()
    opts = f"{bucket_bytes}/{align}".encode()
    decls = _exchange(group, "decl", opts, decl)
    if any(d.every for d in decls):
        trainers = [d for d in decls if d.trainer]
        mine = expand_every(decl, trainers, dtype) if decl.every else decl
        decls = _exchange(group, "decl-every", opts, mine)
        if any(d.every for d in decls):
            raise PlanError(
                "a receiver posted a wildcard declaration twice; run the same deltackpt"
            )
    return build_schedule(decls, bucket_bytes=bucket_bytes, align=align)


def _exchange(group: SyncGroup, key: str, opts: bytes, decl: Decl) -> list[Decl]:
    got = group.exchange(key, opts + b"\n" + decl_to_json(decl))
    decls = []
    for r, data in enumerate(got):
        o, _, body = data.partition(b"\n")
        if o != opts:
            raise PlanError(
                f"rank {r} uses bucket_bytes/align {o.decode(errors='replace')}, rank "
                f"{group.rank} {opts.decode()}; pass the same values on every rank"
            )
        d = decl_from_json(body)
        if d.rank != r or d.trainer != (r in group.trainers):
            raise PlanError(
                f"declaration posted by rank {r} claims rank {d.rank} (trainer={d.trainer}); "
                f"the group's trainers are {list(group.trainers)}"
            )
        decls.append(d)
    return decls


def link_slots(links: list[Link], align: int) -> dict[tuple[int, int], tuple[int, int]]:
    """(sender, receiver) -> (buckets, largest message rounded up to 64 bytes): the window
    layout of shared-memory links, the same at both ends."""
    return {
        (lk.sender, lk.receiver): (
            len(lk.buckets),
            -(-max(message_bytes(b, align) for b in lk.buckets) // 64) * 64,
        )
        for lk in links
    }

"""``TieredCheckpointer``: every save to a node-local tier, replicas on peers, durable versions.

The calls of :class:`~deltackpt.Checkpointer` (``maybe_save``, ``save``, ``restore_latest``,
``wait``, ``close``), over :class:`~deltackpt.tiers.Tiers`:

* **local**: each rank saves its own state (its shards: plain tensors, DTensor local boxes,
  plain values) as a snapshot of a world of one in ``<local>/rank-<r>`` (an async save: the call
  blocks while the state is staged; chunks are stored raw, and a chunk the store already holds
  is not written again);
* **replicas**: after that save commits, a background thread sends its manifest to each replica
  holder (``Tiers.peers``), which answers with the chunks it lacks, receives them, checks every
  digest and commits its replica atomically (:mod:`deltackpt.tiers.transfer`), over a gloo group
  of its own, so nothing interleaves with training collectives;
* **durable**: after steps ``persist_every - 1``, ``2 * persist_every - 1``, ... (and on
  :meth:`flush`) a normal distributed snapshot goes to the durable store through a
  :class:`~deltackpt.Checkpointer` (same ``name_format``, so a plain Checkpointer of any world
  size restores it), writing only chunks the durable store lacks;
* **restore**: :mod:`deltackpt.tiers.restore`; :attr:`last_restore` says what it did.

Back-pressure: a save waits for the previous save's local commit, replication and retention
(one save in flight, as ``Checkpointer``). Errors of the background work are raised once, from
the next call; a replica refused by its holder only warns (it is never committed, and restore
does not count on it).
"""

from __future__ import annotations

import datetime
import signal
import socket
import warnings
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from deltackpt.api import async_save, save
from deltackpt.checkpointer import (
    RETENTION_COMPACT_BELOW,
    TIERED,
    Checkpointer,
    peft_metadata,
    restore_into,
    to_saveable,
)
from deltackpt.distributed.collectives import Group, group_timeout
from deltackpt.errors import InvalidArgumentError, PartialRestoreError
from deltackpt.resume import restore_state
from deltackpt.store.lifecycle import gc
from deltackpt.store.store import Store, open_store
from deltackpt.tiers.config import TIER_KEY, Tiers, local_name
from deltackpt.tiers.localize import (
    Box,
    delocalize,
    dtensor_boxes,
    localize,
    moments_as_dtensors,
    optimizer_keys,
)
from deltackpt.tiers.persist import persist_local
from deltackpt.tiers.restore import DURABLE, RestoreReport, restore
from deltackpt.tiers.transfer import Expect, Link, transfer

if TYPE_CHECKING:
    from deltackpt.saving.engine import SaveHandle


@dataclass
class TierStats:
    """Counters of this rank since the checkpointer was made (bytes are chunk payload bytes)."""

    local_saves: int = 0
    local_bytes_written: int = 0
    replicated_bytes_sent: int = 0
    replicated_bytes_received: int = 0
    replicas_committed: int = 0
    persisted: int = 0
    refused: list[str] = field(default_factory=list)


class TieredCheckpointer:
    """Save every ``every`` steps to the local tier, replicate, persist; restore the newest
    step every rank can assemble. Every rank of the default process group constructs it (it
    makes two gloo groups of ``process_group``'s ranks: one for the background replication,
    one for restore and the SIGTERM agreement).

    >>> tiers = Tiers(local="/dev/shm/run", durable="s3://bucket/run", replicas=1,
    ...               persist_every=1000, ranks_per_node=8)               # doctest: +SKIP
    >>> ckpt = TieredCheckpointer(tiers, every=10, process_group=pg)     # doctest: +SKIP
    >>> start = ckpt.restore_latest(state)                               # doctest: +SKIP
    >>> for step in range(start, total):                                 # doctest: +SKIP
    ...     train_step(); ckpt.maybe_save(step, state)
    ...     if ckpt.stopped: break    # SIGTERM: flushed to the durable tier
    >>> ckpt.close()                                                     # doctest: +SKIP

    ``handle_sigterm=True`` installs a SIGTERM handler (main thread) that only sets a flag;
    every ``maybe_save`` then agrees on it across ranks (one tiny gloo all-reduce) and, once any
    rank got the signal, every rank :meth:`flush`-es that step to the durable tier and
    :attr:`stopped` turns true.
    """

    def __init__(
        self,
        tiers: Tiers,
        every: int = 1,
        *,
        process_group: Any = None,
        async_: bool = True,
        name_format: str = "step-{step:08d}",
        handle_sigterm: bool = False,
    ) -> None:
        if not isinstance(tiers, Tiers):
            raise InvalidArgumentError(
                f"TieredCheckpointer(tiers={tiers!r}) is invalid: expected a deltackpt.tiers."
                "Tiers, e.g. Tiers(local='/dev/shm/run', durable='ckpts', replicas=1)"
            )
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise InvalidArgumentError(
                f"TieredCheckpointer(every={every!r}) is invalid: expected an int >= 1, e.g. 10"
            )
        self.tiers, self.every, self.async_ = tiers, every, async_
        self.pg = process_group
        g = Group(process_group)
        self.rank, self.world = g.rank, g.world
        if tiers.replicas and process_group is None:
            raise InvalidArgumentError(
                f"Tiers(replicas={tiers.replicas}) needs a process_group (peers to hold the "
                "replicas); pass process_group=, or Tiers(replicas=0)"
            )
        self._bg = self._fg = None
        if process_group is not None:
            self._bg = Link(self._gloo_group(process_group))
            self._fg = Link(self._gloo_group(process_group))
        self.jump = tiers.ranks_per_node or self._ranks_per_node()
        if tiers.replicas:
            tiers.check_world(self.world, self.jump)
        tiers.root.mkdir(parents=True, exist_ok=True)
        self.own: Store = open_store(tiers.own_dir(self.rank))
        # the durable tier: its names, ownership marker and retention; its saves are the
        # background persists, synchronous distributed saves on the tiers' own gloo group
        self.durable: Checkpointer | None = None
        if tiers.durable is not None:
            self.durable = Checkpointer(
                tiers.durable, every=1, keep_last=tiers.durable_keep_last, async_=False,
                rng=False, name_format=name_format, storage_options=tiers.storage_options,
                process_group=None if self._bg is None else self._bg.group,
            )  # fmt: skip
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="deltackpt-tiers")
        self._job: Future[None] | None = None
        self.stats = TierStats()
        self.last_restore: RestoreReport | None = None
        self.stopped = False
        self._sigterm = False
        self._handle_sigterm = handle_sigterm  # the same on every rank (one all-reduce a call)
        self._old_sigterm: Any = None
        if handle_sigterm:  # restored by close()
            self._old_sigterm = signal.signal(signal.SIGTERM, self._on_sigterm)

    @staticmethod
    def _gloo_group(pg: Any) -> Any:
        import torch.distributed as dist

        ranks = None if pg is dist.group.WORLD else dist.get_process_group_ranks(pg)
        timeout = datetime.timedelta(seconds=group_timeout(pg))
        return dist.new_group(ranks=ranks, backend="gloo", timeout=timeout)

    def _ranks_per_node(self) -> int:
        """Ranks per node from the ranks' host names; they must be numbered node by node."""
        if self._fg is None:
            return 1
        hosts = self._fg.all_gather(socket.gethostname())
        n = hosts.count(hosts[0])
        if any(hosts[r] != hosts[r - r % n] for r in range(len(hosts))) or len(hosts) % n:
            raise InvalidArgumentError(
                f"TieredCheckpointer: the ranks' host names {hosts[:16]} do not number the "
                "ranks node by node with the same count per node, so replicas could not be "
                "placed on other nodes. Pass Tiers(ranks_per_node=...)"
            )
        return n

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        self._sigterm = True

    # ------------------------------------------------------------------------ save

    def maybe_save(self, step: int, state: dict[str, Any]) -> SaveHandle | None:
        """Save to the local tier if ``step`` is due (every ``every`` steps, counting from
        ``every - 1``); persist if due; with ``handle_sigterm``, flush on a SIGTERM."""
        if self._agree_sigterm():
            self.flush(step, state)
            self.stopped = True
            return None
        pe = self.tiers.persist_every
        persist = pe is not None and (step + 1) % pe == 0
        if persist or (step + 1) % self.every == 0:
            return self.save(step, state, persist=persist)
        return None

    def _agree_sigterm(self) -> bool:
        if self._fg is None or not self._handle_sigterm:
            return self._sigterm

        flag = torch.tensor([1 if self._sigterm else 0], dtype=torch.int32)
        try:
            self._fg.dist.all_reduce(flag, op=self._fg.dist.ReduceOp.MAX, group=self._fg.group)
        except RuntimeError as e:  # gloo's own error when a peer died or timed out
            raise self._fg.lost("the SIGTERM agreement of maybe_save", e) from e
        return bool(flag.item())

    def save(
        self,
        step: int,
        state: dict[str, Any],
        *,
        metadata: dict[str, Any] | None = None,
        persist: bool = False,
    ) -> SaveHandle | None:
        """Save ``state`` to this rank's local tier now (async unless ``async_=False``), then
        replicate it in the background; the async save's handle (None with ``async_=False``,
        which returns once the replicas are committed too). Every rank calls it for the same
        steps. ``metadata``: extra JSON kept in the local snapshot's manifest. ``persist``:
        then also persist that local snapshot to the durable tier, in the background
        (:meth:`persist`)."""
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise InvalidArgumentError(
                f"TieredCheckpointer.save(step={step!r}) is invalid: expected an int >= 0"
            )
        if not isinstance(state, dict):
            raise InvalidArgumentError(
                f"TieredCheckpointer.save(state=...) needs a dict, got {type(state).__name__}"
            )
        if persist and self.durable is None:
            raise InvalidArgumentError(
                "TieredCheckpointer: persisting needs a durable tier; Tiers(durable=None) has "
                "none. Pass Tiers(durable=<dir or s3://...>)"
            )
        self._collect()
        name = local_name(step)
        saveable = to_saveable(state)
        boxes = dtensor_boxes(saveable) if persist else None
        sd, layout, _ = localize(saveable, _moment_paths(state))
        mark = {"step": step, "rank": self.rank, "world": self.world, "layout": layout}
        meta = {**peft_metadata(state), **(metadata or {}), TIER_KEY: mark}  # as Checkpointer
        opts: dict[str, Any] = dict(metadata=meta, overwrite=True)
        opts["encoding"] = "fast-restore"  # raw chunks: a replica checks each one on receipt
        h: Any
        if self.async_:
            h = async_save(sd, self.own, name, **opts)
            h.detach()  # errors come back through the job below
        else:
            fut: Future[Any] = Future()
            try:
                fut.set_result(save(sd, self.own, name, **opts))
            except Exception as e:
                fut.set_exception(e)
            h = fut
        self._job = self._pool.submit(self._after_local, step, name, h, boxes)
        if not self.async_:
            self._collect()
            return None
        return h

    def persist(self, step: int, state: dict[str, Any]) -> None:
        """Save ``state`` as step ``step`` to the local tier (blocking only while staging, as
        :meth:`save`) and, in the background once it is committed and replicated, persist that
        local snapshot to the durable tier: a distributed save of its pieces over the tiers'
        own gloo group, writing only chunks the durable store lacks. Every rank calls it."""
        self.save(step, state, persist=True)

    def flush(self, step: int, state: dict[str, Any]) -> None:
        """Persist ``state`` as step ``step`` now and wait until the durable tier committed it
        (the SIGTERM path; every rank calls it). Without a durable tier: save it to the local
        tier (and its replicas) and wait for that."""
        self._collect()
        self.save(step, state, persist=self.durable is not None)
        self._collect()

    def _after_local(
        self, step: int, name: str, h: Any, persist: dict[str, Box] | None = None
    ) -> None:
        err: BaseException | None = None
        try:
            info = h.result()
            self.stats.local_saves += 1
            self.stats.local_bytes_written += int(getattr(info, "bytes_written", 0))
        except BaseException as e:
            err = e
        if self._bg is not None and self.tiers.replicas:
            self._replicate(step, None if err else name)
        if persist is not None:
            assert self.durable is not None
            if persist_local(self._bg, self.own, step, persist, err is None, self.durable):
                self.stats.persisted += 1
        keep = self.tiers.keep_last
        gc(self.own, keep_last=keep, compact_below=RETENTION_COMPACT_BELOW)
        if err is not None:
            raise err

    def _replicate(self, step: int, name: str | None) -> None:
        link = self._bg
        assert link is not None
        for i, dst in enumerate(self.tiers.peers(self.rank, self.world, self.jump), start=1):
            src = (self.rank - i * self.jump) % self.world
            held = open_store(self.tiers.replica_dir(src, self.rank))
            moved = transfer(
                link, (dst, self.own, name), (src, held, Expect(src, step, self.world))
            )
            self.stats.replicated_bytes_sent += moved.sent_bytes
            self.stats.replicated_bytes_received += moved.received_bytes
            if moved.committed is not None:
                self.stats.replicas_committed += 1
                gc(held, keep_last=self.tiers.keep_last, compact_below=RETENTION_COMPACT_BELOW)
            for p in moved.problems:
                self.stats.refused.append(f"step {step}: {p}")
                warnings.warn(f"deltackpt tiers, rank {self.rank}: {p}", RuntimeWarning, 2)

    def _collect(self) -> None:
        job, self._job = self._job, None
        if job is not None:
            job.result()

    # ------------------------------------------------------------------------ restore

    def restore_latest(self, state: dict[str, Any]) -> int:
        """Restore the newest step every rank can assemble from some tier into ``state`` (in
        place, as ``Checkpointer.restore_latest``) and return the step to resume from (0:
        nothing saved yet). :attr:`last_restore` is the :class:`RestoreReport`. Every rank
        calls it; with another world size than the saves', only the durable tier is used."""
        if not isinstance(state, dict):
            raise InvalidArgumentError(
                f"TieredCheckpointer.restore_latest(state=...) needs a dict, got "
                f"{type(state).__name__}"
            )
        self._collect()
        durable_steps = self.durable_steps() if self.rank == 0 else []
        local_sd, layout, back = localize(to_saveable(state), _moment_paths(state))
        # Every rank's snapshot of a step is made whole and verified (restore_local) before any
        # rank loads it in place, so damage is refused with the state untouched on every rank
        # (never a mix of steps and zeros), at the cost of one hashing pass and no copy of the
        # state. A load can still fail after that (an I/O or device error): the choice is made
        # again and loads over it; if nothing does, PartialRestoreError says so.
        wrote: list[str] = []

        def load_local(store: Store, name: str) -> None:
            wrote.append(name)
            loaded = delocalize(restore_state(store, name, state, local_sd, None), back)
            moments_as_dtensors(state, loaded)
            restore_into(state, loaded)

        def load_durable(step: int) -> None:
            assert self.durable is not None
            name, st = self.durable.name(step), self.durable.store
            restore_into(state, restore_state(st, name, state, to_saveable(state), self.pg))

        report = restore(self._fg, self.tiers, durable_steps, load_local, load_durable, layout)
        self.last_restore = report
        if report.step is None and wrote:
            raise PartialRestoreError(
                f"TieredCheckpointer.restore_latest: loading {wrote} into the live state failed "
                f"after it was verified, and no tier could restore a step over it: the state "
                f"holds part of {wrote[-1]!r}. Attempts: {list(report.refused)}. Restart the "
                "process (the tiers are unchanged)"
            )
        return 0 if report.step is None else report.step + 1

    def durable_steps(self) -> list[int]:
        """The steps of the durable tier's versions, oldest first ([] without one)."""
        d = self.durable
        if d is None:
            return []
        return sorted(s for m in d.store.manifests() if (s := d._owned_step(m)) is not None)

    def _restore_durable_only(
        self, durable: list[int], load: Callable[[int], None]
    ) -> RestoreReport:
        """Restore the newest durable version on every rank (rank 0's list decides)."""
        steps = self._fg.all_gather(durable)[0] if self._fg is not None else durable
        if not steps:
            return RestoreReport(None, ())
        load(max(steps))
        return RestoreReport(max(steps), (DURABLE,) * self.world)

    def stop_requested(self) -> bool:
        """With ``handle_sigterm=True``: whether any rank got SIGTERM (every rank calls it at
        the same point; one tiny all-reduce). For loops that save through the DCP plug-in:
        ``dcp.save(..., storage_writer=TieredWriter(ckpt, step, persist=True))``, then stop."""
        return self._agree_sigterm()

    # ------------------------------------------------------------------------ lifetime

    def wait(self) -> None:
        """Block until the pending local save, its replication and its persist are done
        (raising their error, once)."""
        self._collect()

    def close(self) -> None:
        try:
            self.wait()
        finally:
            self._pool.shutdown(wait=True)
            if self._old_sigterm is not None:
                signal.signal(signal.SIGTERM, self._old_sigterm)
                self._old_sigterm = None

    def __enter__(self) -> TieredCheckpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _moment_paths(state: dict[str, Any]) -> tuple[str, ...]:
    return tuple(f"/{k}/state/" for k in optimizer_keys(state))


def from_checkpointer(
    tiers: Tiers,
    every: int = 100,
    keep_last: int | None = None,
    async_: bool = True,
    *,
    process_group: Any = None,
    name_format: str = "step-{step:08d}",
    handle_sigterm: bool = False,
    rng: bool | None = None,
    **other: Any,
) -> TieredCheckpointer:
    """``deltackpt.Checkpointer(Tiers(...), ...)``: the Checkpointer's arguments that apply."""
    if keep_last is not None:
        raise InvalidArgumentError(
            f"Checkpointer(Tiers(...), keep_last={keep_last!r}): a tiered checkpointer keeps "
            "what its Tiers say; pass Tiers(keep_last=..., durable_keep_last=...) instead"
        )
    if rng:
        raise InvalidArgumentError(
            "Checkpointer(Tiers(...), rng=True): a tiered checkpointer does not save RNG state "
            "(each rank has its own generators); pass rng=False or leave it out"
        )
    if other:
        raise InvalidArgumentError(
            f"Checkpointer(Tiers(...)) does not take {sorted(other)}: a tiered checkpointer "
            "takes every, async_, process_group, name_format and handle_sigterm "
            "(storage_options go in Tiers(storage_options=...))"
        )
    return TieredCheckpointer(
        tiers, every, process_group=process_group, async_=async_, name_format=name_format,
        handle_sigterm=handle_sigterm,
    )  # fmt: skip


TIERED[Tiers] = from_checkpointer

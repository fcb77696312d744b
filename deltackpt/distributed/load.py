"""``deltackpt.load``: the load modes of a process group (``all_ranks``, ``broadcast``, ``auto``).

``all_ranks`` (the default) is :func:`deltackpt.loading.assemble.load` on every rank: each rank
reads exactly the chunks its own shards need. ``broadcast`` reads once and sends:

1. plan (rank 0 of the group, the reading rank): read the manifest, apply ``keys=``, cut the
   wanted tensors into pieces (rows of a tensor, byte ranges of a shared storage) packed into
   buckets of ``bucket_bytes``; ONE ``broadcast_object_list`` gives every rank the plan (the
   manifest without its chunk index) or the reader's failure;
2. check (every rank): strict checks of its own ``into=`` against the plan, new tensors allocated;
   one ``all_gather_object`` of the outcome, so that every rank raises if any rank must;
3. stream: the reading rank reads and verifies bucket k+1 on a thread while bucket k is
   broadcast; every rank copies out of each bucket only the rows its targets hold (a DTensor's
   local box, a plain tensor whole); each bucket carries a status byte, so a read failure reaches
   every rank as the same :class:`~deltackpt.errors.DistributedError`;
4. finish: one ``all_gather_object`` of the copy-out outcome, then non-tensor values.

Only the reading rank touches the store (manifest and packs). A collective that fails (a peer
died, or the group's timeout passed) raises :class:`~deltackpt.errors.DistributedError` on each
rank still alive, saying its state may be partly loaded.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from deltackpt.cuda import host_buffer
from deltackpt.distributed.collectives import Failed, Group
from deltackpt.distributed.load_plan import Piece, Plan, make_plan, row_data, rows_of, rows_shape
from deltackpt.errors import DistributedError, InvalidArgumentError, RankFailure
from deltackpt.format.dcp_values import decode_byte_values
from deltackpt.format.dtensor import is_dtensor, local_box, local_tensor
from deltackpt.format.dtypes import dtype_from_name
from deltackpt.format.manifest import Manifest
from deltackpt.format.tree import flatten, unflatten
from deltackpt.loading import assemble
from deltackpt.loading.plan import Reads, np_bytes, storage_view
from deltackpt.loading.reshard import intersect, sub_slices
from deltackpt.loading.select import KeySelection, Select, key_filter
from deltackpt.loading.since import catch_up
from deltackpt.loading.stats import LoadStats
from deltackpt.options import LoadOptions
from deltackpt.store.chunks import fresh_u8
from deltackpt.store.local import LocalStorage
from deltackpt.store.store import LATEST, Store, open_store

MODES = ("all_ranks", "broadcast", "auto")


def load(
    store: str | os.PathLike[str] | Store,
    name: str = LATEST,
    *,
    into: Any = None,
    options: LoadOptions | None = None,
    process_group: Any = None,
    mode: str = "all_ranks",
    keys: KeySelection = None,
    since: str | None = None,
    stats: LoadStats | None = None,
    **kwargs: Any,
) -> Any:
    """Load snapshot ``name`` (default: the latest committed one).

    Without ``into`` it returns the state with new CPU tensors, bit-exact, nesting and tied
    storages restored; ``device="cuda:0"`` (``map_location`` of one device) makes them there,
    whole tensors read straight into device memory through two reused pinned host buckets (no
    host copy of the state), the rest moved with their ties kept (every rank of a group passes
    the same ``device``). With ``into`` it copies the snapshot into the existing tensors of ``into``
    (matched by key path, in place, any device; DTensors of any placement and mesh receive their
    own shards, whatever world size saved them) and sets its non-tensor values; with
    ``strict=True`` (default) the keys, shapes and dtypes must match exactly. Every chunk is
    checked against its digest unless ``verify=False``.

    ``keys`` (key paths or prefixes such as ``["model/layers.0"]``, or a predicate on the key
    path) loads only those keys: the others are never planned or read (see
    :mod:`deltackpt.loading.select`).

    With ``process_group`` every rank of the group calls ``load``, and every rank raises the same
    :class:`~deltackpt.errors.DistributedError` if any rank fails. ``mode`` says who reads:

    * ``"all_ranks"`` (default): every rank reads exactly the chunks its own targets need.
      Fastest on parallel file systems and object stores, and the only sensible choice when
      ranks need different pieces (sharded DTensors, experts filtered with ``keys=``);
    * ``"broadcast"``: rank 0 of the group reads and verifies, and broadcasts buckets of
      ``bucket_bytes`` (default 64 MiB; the next bucket is read while one is on the wire); each
      rank keeps the rows its targets need. One reader: kind to shared file systems that dislike
      many readers of the same bytes;
    * ``"auto"``: ``broadcast`` when the group has more than one rank, the store is a local or
      shared file system (not an object store: there parallel ranged reads are the fast path)
      and every rank needs every byte (no ``into``, or ``into`` holding only plain tensors and
      fully replicated DTensors, on every rank); ``all_ranks`` otherwise.

    ``since`` (with ``into``) is an incremental load: ``into`` holds snapshot ``since`` and is
    brought to ``name`` reading only what differs. A chunk with the same digest at the same bytes
    of the same key in both is not read; an xor chunk whose delta chain reaches the chunk
    ``into`` holds there is applied in place from its payloads; anything else (and tied storages,
    saved shards, GPU targets, DTensors not sharded by whole leading rows) is read whole. A
    DTensor of whole leading rows (``Shard(0)``, ``Replicate``) is incremental inside its rows
    (the chunks straddling their edges are read whole). ``open_snapshot(...).load(into=...,
    since=...)`` is the same load; :class:`deltackpt.Follower` applies it as a trainer publishes. It fails closed:
    every patched result is checked (by its linear digest where the save recorded one: work in
    proportion to the change; ``verify="full"`` also hashes every chunk of ``since`` the load
    relies on, rebuilt from ``into``), and new bytes are staged and written only once
    all checks passed, so :class:`~deltackpt.errors.HeldVersionMismatchError` (``into`` does not
    hold ``since``; it names the key) or any read error leaves ``into`` unchanged. The staging
    costs memory the size of the changed chunks. A missing ``since`` raises
    :class:`~deltackpt.errors.SnapshotNotFoundError`; only its manifest is read, never its packs.
    With ``process_group`` use ``mode="all_ranks"`` (``"auto"`` picks it): every rank stages
    its own part, and no rank writes unless every rank's checks passed.

    ``stats`` (a :class:`~deltackpt.LoadStats`, filled in place) counts the bytes read from the
    store and the chunks read, left unchanged or patched (``all_ranks`` loads: this rank's).

    >>> state = deltackpt.load("ckpts")                                            # doctest: +SKIP
    >>> deltackpt.load("ckpts", into=sd, process_group=pg, mode="broadcast")        # doctest: +SKIP
    >>> deltackpt.load("ckpts", keys=lambda k: ".experts.3." in k)                 # doctest: +SKIP
    >>> deltackpt.load("ckpts", "step-200", into=sd, since="step-100")              # doctest: +SKIP
    """
    opts = LoadOptions.from_kwargs(options, kwargs)
    if mode not in MODES:
        raise InvalidArgumentError(
            f"load(mode={mode!r}) is invalid: expected one of {list(MODES)}. Pass "
            "mode='all_ranks' (every rank reads its own bytes), 'broadcast' (one rank reads and "
            "sends) or 'auto'"
        )
    select = key_filter(keys)  # a bad keys= fails here, on every rank, before any collective
    assemble.check_into(into, "load")
    if opts.device is not None and (into is not None or since is not None or mode == "broadcast"):
        raise InvalidArgumentError(
            f"load(device={opts.device!r}) makes the new tensors of a load without into= on that "
            "device; with into= (or since=) the tensors land where the targets are, and "
            "mode='broadcast' sends host tensors. Leave device out, or load without into= with "
            "mode='all_ranks'"
        )
    if since is not None:
        if mode == "broadcast":
            raise InvalidArgumentError(
                f"load(since={since!r}, mode='broadcast') is not supported: an incremental load "
                "reads on every rank what that rank's into= lacks. Pass mode='all_ranks' (or "
                "'auto')"
            )
        return catch_up(store, name, since, into, opts, select, process_group, stats)
    if process_group is not None and mode != "all_ranks":
        group = Group(process_group)
        if mode == "broadcast" or (opts.device is None and _auto_broadcasts(group, store, into)):
            return BroadcastLoad(group, name, opts, select).run(store, into)
    return assemble.load(
        store, name, into=into, options=opts, process_group=process_group, keys=keys, stats=stats
    )


def _object_store(store: str | os.PathLike[str] | Store) -> bool:
    if isinstance(store, Store):
        return not isinstance(store.storage, LocalStorage)
    s = os.fspath(store)
    return "://" in s and not s.startswith("file://")


def needs_every_byte(into: Any) -> bool:
    """This rank wants whole tensors: no ``into``, or only plain tensors and DTensors whose
    every placement is ``Replicate``."""
    if into is None:
        return True
    _, leaves = flatten(into, allow_pickle=True, check_tensors=False)
    for leaf in leaves:
        t = leaf.tensor
        if is_dtensor(t) and not all(p.is_replicate() for p in t.placements):
            return False
    return True


def _auto_broadcasts(group: Group, store: Any, into: Any) -> bool:
    """``mode="auto"``'s rule (see :func:`load`), agreed by every rank in one collective."""
    mine = needs_every_byte(into) and not _object_store(store)
    votes = _collective(group, "auto", lambda: _all_gather(group, mine))
    return group.world > 1 and all(votes)


def _all_gather(group: Group, value: Any) -> list[Any]:
    import torch.distributed as dist

    out: list[Any] = [None] * group.world
    dist.all_gather_object(out, value, group=group.pg)
    return out


def _broadcast(group: Group, value: Any) -> Any:
    """Rank 0 of the group's ``value`` on every rank (``group_src``: any subgroup works)."""
    import torch.distributed as dist

    box = [value]
    dist.broadcast_object_list(box, group=group.pg, group_src=0)
    return box[0]


def _collective(group: Group, what: str, fn: Callable[[], Any]) -> Any:
    """Run a collective; a failure of the collective itself (a peer died or timed out) becomes
    this rank's DistributedError."""
    try:
        return fn()
    except DistributedError:
        raise
    except Exception as e:
        raise DistributedError(
            f"broadcast load: the {what} collective failed on rank {group.rank} of "
            f"{group.world} ({type(e).__name__}: {e}); a peer rank died or timed out. This "
            "rank's state may be partly loaded: load again once every rank is up"
        ) from e


class BroadcastLoad:
    """One ``mode="broadcast"`` load on one rank (see the module docstring for the steps)."""

    def __init__(self, group: Group, name: str, opts: LoadOptions, select: Select | None) -> None:
        self.group, self.name, self.opts, self.select = group, name, opts, select

    def run(self, store: Any, into: Any) -> Any:
        g = self.group
        full: Manifest | None = None
        msg: Plan | Failed | None = None
        cause: BaseException | None = None
        st: Store | None = None
        if g.coordinator:
            try:
                st = open_store(store, create=False)
                full = st.manifest(self.name)
                msg = make_plan(full, self.select, self.opts.bucket_bytes)
            except Exception as e:
                msg, cause = Failed((RankFailure.of(g.rank, "plan", e),)), e
        msg = _collective(g, "plan", lambda: _broadcast(g, msg))
        if isinstance(msg, Failed):
            g.raise_failed(f"broadcast load of {self.name!r}", msg, cause, "Nothing was loaded")
        plan = msg
        self._agree("check", lambda: self._prepare(plan, into), "Nothing was loaded")
        self._stream(plan, st, full)
        after = "This rank's state may be partly loaded"
        return self._agree("finish", lambda: self._finish(plan, into), after)

    def _agree(self, step: str, fn: Callable[[], Any], after: str) -> Any:
        g = self.group
        try:
            result, mine, cause = fn(), None, None
        except Exception as e:
            result, mine, cause = None, RankFailure.of(g.rank, step, e), e
        found = _collective(g, step, lambda: _all_gather(g, mine))
        failures = tuple(f for f in found if f is not None)
        if failures:
            g.raise_failed(f"broadcast load of {self.name!r}", Failed(failures), cause, after)
        return result

    # ---------------------------------------------------------------- step 2: destinations
    def _prepare(self, plan: Plan, into: Any) -> None:
        """Where each piece goes on this rank: ``self.dest[i]`` = (tensor, its box in the
        global tensor) per wanted entry; ``self.bufs[sid]`` a new buffer per shared storage."""
        m, sel = plan.manifest, self.select
        self.targets: dict[str, torch.Tensor] = {}
        if into is not None:
            _, leaves = flatten(into, allow_pickle=True, check_tensors=False)
            self.targets = {x.path: x.tensor for x in leaves if sel is None or sel(x.path)}
            saved = {m.tensors[i].path: i for i in plan.wanted}
            assemble._check_into(m, into, self.targets, saved, self.opts, sel)
        self.dest: dict[int, tuple[torch.Tensor, tuple[tuple[int, ...], tuple[int, ...]]]] = {}
        self.bufs: dict[int, torch.Tensor] = {}
        for i in plan.wanted:
            e = m.tensors[i]
            if into is not None and e.path not in self.targets:
                continue
            if e.storage is not None:
                if e.storage.id not in self.bufs:
                    self.bufs[e.storage.id] = fresh_u8(m.storages[e.storage.id][0])
                continue
            t = self.targets.get(e.path)
            if t is None:
                t = torch.empty(e.shape, dtype=dtype_from_name(e.dtype))
                self.dest[i] = (t, ((0,) * len(e.shape), e.shape))
            elif is_dtensor(t):
                self.dest[i] = (local_tensor(t), local_box(t, e.path))
            else:
                self.dest[i] = (t, ((0,) * len(e.shape), e.shape))

    # --------------------------------------------------------------------- step 3: stream
    def _stream(self, plan: Plan, st: Store | None, full: Manifest | None) -> None:
        g, m = self.group, plan.manifest
        if not plan.buckets:
            return
        most = max(plan.sizes) + 1  # + the status byte
        import torch.distributed as dist

        # the buckets travel where the group's backend carries tensors: host memory for gloo,
        # the rank's GPU for an NCCL-only group (the reading rank copies each one there)
        wire = g.wire_device
        on_wire = torch.empty(most, dtype=torch.uint8, device=wire) if wire.type != "cpu" else None

        def send(v: torch.Tensor) -> None:
            if on_wire is not None and v.device.type == "cpu":
                v = on_wire[: v.numel()].copy_(v)
            _collective(g, "bucket", lambda: dist.broadcast(v, group=g.pg, group_src=0))

        self.copy_error: BaseException | None = None
        if not g.coordinator:
            buf = torch.empty(most, dtype=torch.uint8, device=wire)
            for k, size in enumerate(plan.sizes):
                view = buf[: size + 1]
                send(view)
                if int(view[size]) != 1:
                    self._reader_failed(None)
                self._copy_out(m, plan.buckets[k], view)
            return
        assert st is not None and full is not None
        # pinned where the buckets go on to a GPU: each one's copy there runs at the link's
        # speed (a pageable copy runs at ~1.3 GB/s)
        bufs = [host_buffer(most, on_wire is not None) for _ in range(min(2, len(plan.sizes)))]
        self._carry: dict[str, tuple[int, np.ndarray]] = {}
        with st.pack_readers() as packs, ThreadPoolExecutor(1, "deltackpt-prefetch") as pool:

            def read(k: int) -> Future[None]:
                return pool.submit(self._read_bucket, packs, full, plan.buckets[k], bufs[k % 2])

            fut = read(0)
            for k, size in enumerate(plan.sizes):
                view = bufs[k % 2][: size + 1]
                try:
                    fut.result()
                    view[size] = 1
                    err = None
                except Exception as e:
                    view[size], err = 0, e
                if err is None and k + 1 < len(plan.sizes):
                    fut = read(k + 1)  # read the next bucket while this one is on the wire
                send(view)
                if err is not None:
                    self._reader_failed(err)
                self._copy_out(m, plan.buckets[k], view)

    def _read_bucket(
        self, packs: Any, full: Manifest, pieces: list[Piece], buf: torch.Tensor
    ) -> None:
        """Reading rank, prefetch thread: read and verify the pieces of one bucket into ``buf``.

        A chunk cut by the bucket's end is read once: its verified tail is kept (``_carry``)
        and the next bucket takes its head bytes from there."""
        r = Reads(full)
        carry_in, carry_out = self._carry, {}
        for j, p in enumerate(pieces):
            dst = buf[p.offset : p.offset + p.nbytes]
            e = full.tensors[p.index] if p.kind == "rows" else None
            data = row_data(e) if e is not None else full.storages[p.index][1]
            if data is not None:  # the piece is one byte range of the saved bytes
                _, rb = rows_of(e) if e is not None else (0, 1)
                span = sub_slices(data, p.start * rb, (p.start + p.count) * rb)
                path = e.path if e is not None else f"<storage {p.index}>"
                pos = 0
                for d, start, n in span:
                    part = np_bytes(dst)[pos : pos + n]
                    pos += n
                    have = carry_in.get(d)
                    if (
                        have is not None
                        and have[0] <= start
                        and start + n <= have[0] + have[1].size
                    ):
                        part[:] = have[1][start - have[0] : start - have[0] + n]
                        continue
                    r.want(path, ((d, start, n),), part)
                    size = full.chunks[d].size
                    if j == len(pieces) - 1 and start + n < size and (d, start, n) == span[-1]:
                        tail = np.empty(size - start - n, dtype=np.uint8)
                        r.want(path, ((d, start + n, tail.size),), tail)
                        carry_out[d] = (start + n, tail)
            else:  # saved shards: assembled into the piece's rows
                rows = rows_shape(e, p.count)
                box = ((p.start, *([0] * (len(rows) - 1))), rows) if rows else ((), ())
                r.box(e, dst.view(dtype_from_name(e.dtype)).reshape(rows), box)
        r.run(packs, self.opts.verify, self.opts.threads, "deltackpt-bcast")
        self._carry = carry_out

    def _reader_failed(self, err: BaseException | None) -> None:
        """The reading rank could not read a bucket: it sends why, every rank raises it."""
        g = self.group
        why = Failed((RankFailure.of(g.rank, "read", err),)) if err is not None else None
        why = _collective(g, "failure", lambda: _broadcast(g, why))
        g.raise_failed(
            f"broadcast load of {self.name!r}", why, err, "This rank's state may be partly loaded"
        )

    def _copy_out(self, m: Manifest, pieces: list[Piece], bucket: torch.Tensor) -> None:
        """Every rank: copy the parts of this bucket its own destinations hold. A failure is
        kept for the finish step: the stream goes on, so no peer waits for a bucket in vain."""
        if self.copy_error is not None:
            return
        try:
            self._copy_pieces(m, pieces, bucket)
        except Exception as e:
            self.copy_error = e

    def _copy_pieces(self, m: Manifest, pieces: list[Piece], bucket: torch.Tensor) -> None:
        with torch.no_grad():
            for p in pieces:
                raw = bucket[p.offset : p.offset + p.nbytes]
                if p.kind == "storage":
                    if p.index in self.bufs:
                        self.bufs[p.index][p.start : p.start + p.count].copy_(raw)
                    continue
                if p.index not in self.dest:
                    continue
                e = m.tensors[p.index]
                rows = raw.view(dtype_from_name(e.dtype)).reshape(rows_shape(e, p.count))
                dst, (off, shape) = self.dest[p.index]
                if not e.shape:
                    dst.copy_(rows)
                    continue
                piece_box = ((p.start, *([0] * (len(e.shape) - 1))), (p.count, *e.shape[1:]))
                ov = intersect(piece_box, (off, shape))
                if ov is None:
                    continue
                lo, size = ov
                for d, (o, n) in enumerate(zip(lo, size, strict=True)):
                    rows = rows.narrow(d, o - piece_box[0][d], n)
                    dst = dst.narrow(d, o - off[d], n)
                dst.copy_(rows)

    # --------------------------------------------------------------------- step 4: finish
    def _finish(self, plan: Plan, into: Any) -> Any:
        m, opts = plan.manifest, self.opts
        if getattr(self, "copy_error", None) is not None:
            raise self.copy_error  # type: ignore[misc]
        views = {
            i: storage_view(e, self.bufs[e.storage.id])
            for i in plan.wanted
            if (e := m.tensors[i]).storage is not None and e.storage.id in self.bufs
        }
        if into is not None:
            with torch.no_grad():
                for i, v in views.items():
                    t = self.targets[m.tensors[i].path]
                    if is_dtensor(t):
                        offsets, shape = local_box(t, m.tensors[i].path)
                        for d, (o, n) in enumerate(zip(offsets, shape, strict=True)):
                            v = v.narrow(d, o, n)
                        local_tensor(t).copy_(v)
                    else:
                        t.copy_(v)
            assemble._assign_values(m.tree, into, opts, self.select)
            return into
        tensors: list[Any] = [None] * len(m.tensors)
        for i in plan.wanted:
            t = views[i] if i in views else self.dest[i][0]
            tensors[i] = assemble._finish(t, m.tensors[i])
        decode_byte_values(m, tensors, opts.allow_pickle)
        return unflatten(plan.tree, tensors.__getitem__, allow_pickle=opts.allow_pickle)

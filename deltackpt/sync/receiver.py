"""Inference side of weight sync: :class:`WeightReceiver` receives exactly the boxes it declared, from
the trainer ranks that hold them, and writes them into its own tensors at commit.

Called on every inference rank of the :class:`~deltackpt.sync.group.SyncGroup`, once per
round::

    wants = [Want("q.weight", box=shard_box(shape, 0, tp_rank, tp), into=param), ...]
    receiver = WeightReceiver(group, wants)   # or WeightReceiver(group): every tensor, whole
    receiver.pull()                     # direct into the parameters (``into``)
    receiver.pull(model.load_weights)   # or (name, tensor) pairs of the tensors without ``into``

Every message of a round is posted for receiving up front, into a private staging arena (one
slot per planned bucket, reused every round): no sender ever waits for this rank to get to a
bucket, and gloo moves the bytes while earlier buckets are verified here. A bucket is verified
piece by piece against the digests in its header; the round is applied only after every rank
voted to commit (transactional: a failed round never touches the model), then ``version``
names it. ``staging="ring"`` trades that for memory where the targets are the receiver's own
tensors: two slots, each verified bucket written at once, the round taken back if the vote
fails (:class:`WeightReceiver`).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from deltackpt import cuda
from deltackpt.sync import patches, wire
from deltackpt.sync.apply import Staged, Undo, Views, apply_round, revert
from deltackpt.sync.device_delta import patched_digest_rows, read_patch_lazy
from deltackpt.sync.device_digest import message_digest_rows, piece_digest
from deltackpt.sync.dtypes import (
    DtypeSpec,
    dtype_spec,
    named_dtype,
    resolve_dtype,
    wire_dtype,
    wire_name,
)
from deltackpt.sync.errors import (
    DigestMismatchError,
    PeerLostError,
    PlanError,
    RoundAbortedError,
    SyncError,
)
from deltackpt.sync.group import SyncGroup, cause_line, default_bucket_bytes
from deltackpt.sync.rounds import (
    RoundStats,
    link_slots,
    message_bytes,
    payload_start,
    setup_schedule,
)
from deltackpt.sync.schedule import LinkBucket, Schedule, Transfer, check_sizes, is_integer
from deltackpt.sync.schedule_decl import Box, Decl, Wanted, decl_from_json
from deltackpt.sync.spill import UndoSpill, open_spill

__all__ = ["Want", "WeightReceiver"]

#: ``load_weights(weights)``: a list of ``(name, tensor)``; the return value is ignored.
LoadWeights = Callable[[list[tuple[str, torch.Tensor]]], Any]

# a verified bucket: its slot, piece offsets and flags


@dataclass
class Want:
    """A tensor this inference rank holds: ``box`` of trainer tensor ``source`` (default:
    ``name``; None box: the whole tensor), as ``dtype`` (default: ``into``'s dtype, else the
    trainer's). ``into``: the parameter to write into directly (shape = the box's size);
    without it the tensor is handed to ``load_weights``."""

    name: str
    box: Box | None = None
    dtype: torch.dtype | None = None
    source: str | None = None
    into: torch.Tensor | None = None

    def __post_init__(self) -> None:
        def bad(what: str, expected: str) -> PlanError:
            value = getattr(self, what)
            return PlanError(
                f"Want({self.name!r}, {what}={value!r}): expected {expected}, got "
                f"{type(value).__name__}"
            )

        if not isinstance(self.name, str) or not self.name:
            raise PlanError(f"Want(name={self.name!r}): expected the tensor's name (a str)")
        if self.source is not None and (not isinstance(self.source, str) or not self.source):
            raise bad("source", "None or a trainer tensor's name (a str)")
        if self.box is not None and not isinstance(self.box, Box):
            raise bad("box", "None (the whole tensor) or a Box (sync.shard_box)")
        if isinstance(self.dtype, str):  # its name, as torch or vLLM spell it
            self.dtype = named_dtype(self.dtype) or self.dtype
        if self.dtype is not None and not isinstance(self.dtype, torch.dtype):
            raise bad("dtype", "None, a torch dtype or its name ('bfloat16')")
        if self.into is not None and not isinstance(self.into, torch.Tensor):
            raise bad("into", "None or the tensor (a parameter) to write into")


class WeightReceiver:
    """Receives this inference rank's layout from the trainers of ``group`` (see module doc).

    ``wants=None``: every trainer tensor, whole, under its trainer name (1 -> N broadcast),
    as the dtype ``dtype`` picks (a dtype for floating tensors or ``f(name, dtype) -> dtype |
    None``; default: the trainer's), handed to ``load_weights``; ``wants`` lists them after the
    first round. ``apply_threads``: threads copying the committed pieces into the targets and
    hashing a bucket's pieces (default: up to 4, one per core); ``bucket_bytes`` (default: 64 MiB, 256 MiB on an ipc link) and ``align``
    must be the same on every rank of the group.

    ``boxes`` (with ``wants=None``): ``boxes(name, shape) -> Box | None | False`` picks, per
    trainer tensor, the box this rank wants (None: whole; False: none of it, an expert another
    rank holds), once the trainers' declarations are known (a tensor-parallel rank that learns
    the names and shapes from the trainers: the vLLM backend's ``tp_boxes``); its tensors are
    then boxes, handed to ``load_weights`` as such.

    ``verify``: ``"sent"`` (default) checks every piece a round brings against the digest of
    its new bytes; pieces a delta round does not send are kept as they are, unchecked, so a
    hand edit of an ``into=`` target survives until the next full round. ``"all"`` also
    re-hashes every kept piece against the digest it was committed with, before voting: an
    edit fails the round on every rank (nothing applied) and the next round, full, heals it;
    the cost is one xxh3 pass over the whole held state per round (docs/sync.md).

    ``staging``: ``"round"`` (default) stages a whole round before the vote (one slot per
    bucket, all posted up front: the arena is a round's wire bytes). ``"ring"``: two slots of
    the largest message, reused (where they take less than a round's slots; otherwise as
    ``"round"``); each verified bucket is written into the targets at once,
    keeping the bytes it overwrote (for a patch only the changed elements), and the round is
    taken back if the vote fails: memory is the targets + 2 messages + what a round changed.
    Only for wants without ``into`` (the model must not see a round before its vote).

    ``undo_dir``: where the bytes a round overwrites whole are kept for taking it back (the
    vote, ``pull(undo=True)``): None (default) keeps them in memory, a second copy of every
    target a round sends whole; a directory keeps them in an unlinked file there
    (:mod:`deltackpt.sync.spill`: the page cache, not this process's memory; read back only
    if the round is taken back). A patch's changed elements stay in memory either way.

    ``device``: where the staging slots and this rank's own tensors (wants without ``into``)
    live. Default: on an ipc link whose ``into`` targets all live on one CUDA device, that
    device; else the CPU. A device round (``SyncGroup(links="ipc", ipc_device="cuda:N")``)
    then goes from the trainer's tensors to the targets device to device, verified with device
    digests (``device_digest.py``), changed elements applied there (device patches,
    ``device_delta.py``). The cost: the staging in device memory (a round's messages, or two
    with ``staging="ring"``).

    ``pin``: ``True``: host staging and this rank's own tensors in pinned (page-locked) memory,
    so that copies between them and a GPU (the ``into`` parameters, a CUDA bucket, a
    ``load_weights`` that copies to the device) run at the link's speed instead of through
    pageable memory; torch's pinned allocator rounds each block up to a power of two (up to 2x
    the host memory), and the gain for the own tensors is not measured yet. ``"auto"`` (the
    default): only the host staging, page-locked where it lies (``cuda.HostLock``: its exact
    bytes, no rounding) on an ipc link once this process uses a GPU (CUDA initialised, or a
    device round's check copying a message to it): there every message crosses to or from the
    GPU (a CUDA bucket copied out, a device round's digests checked on the device), as in a
    vLLM worker on a GPU; unlocked when a re-plan replaces the staging or the receiver is
    collected. ``False``: nothing locked. Where the pinned allocation or the lock fails (a
    locked-memory limit), ordinary memory is used."""

    def __init__(
        self,
        group: SyncGroup,
        wants: Sequence[Want] | None = None,
        *,
        dtype: DtypeSpec = None,
        bucket_bytes: int | None = None,
        align: int = 64,
        apply_threads: int | None = None,
        verify: str = "sent",
        boxes: Callable[[str, tuple[int, ...]], Box | bool | None] | None = None,
        staging: str = "round",
        undo_dir: str | os.PathLike[str] | None = None,
        device: str | torch.device | None = None,
        pin: bool | str = "auto",
    ) -> None:
        if group.rank in group.trainers:
            raise PlanError(f"rank {group.rank} is a trainer of the group; use WeightSender")
        check_sizes("WeightReceiver", bucket_bytes, align)
        if apply_threads is not None and (not is_integer(apply_threads) or apply_threads < 1):
            raise PlanError(
                f"WeightReceiver(apply_threads={apply_threads!r}): expected None (up to 4, one "
                "per core) or an int >= 1"
            )
        if verify not in ("sent", "all"):
            raise PlanError(f"WeightReceiver(verify={verify!r}): expected 'sent' or 'all'")
        if not (isinstance(pin, bool) or pin == "auto"):
            raise PlanError(f"WeightReceiver(pin={pin!r}): expected True, False or 'auto'")
        if staging not in ("round", "ring"):
            raise PlanError(f"WeightReceiver(staging={staging!r}): expected 'round' or 'ring'")
        if staging == "ring" and wants is not None and any(w.into is not None for w in wants):
            raise PlanError(
                "WeightReceiver(staging='ring') writes verified buckets into its targets before "
                "the commit vote (taken back if the round fails): only for wants without into "
                "(the receiver's own tensors); a model's parameters need staging='round'"
            )
        self.verify, self.staging = verify, staging
        self.device = _staging_device(group, wants, device)
        # host staging and own tensors in pinned memory: copies to a GPU at the link's speed
        self.pin = pin is True and self.device.type == "cpu"
        # pin="auto": the host staging page-locked where it lies once this process uses a GPU
        # on an ipc link (_lock_staging); the lock, None until tried (its .locked: taken)
        self._pin_auto = pin == "auto" and self.device.type == "cpu"
        self._lock: cuda.HostLock | None = None
        self._arena: torch.Tensor | None = None
        # (bucket index, sender, piece) -> the digest its committed bytes had (verify="all")
        self._kept: dict[tuple[int, int, int], tuple[int, int]] = {}
        self.group, self.align = group, int(align)
        self._bucket_bytes = None if bucket_bytes is None else int(bucket_bytes)
        self.every = wants is None
        if boxes is not None and not self.every:
            raise PlanError("WeightReceiver(boxes=...) picks boxes of every tensor: pass no wants")
        self.boxes = boxes
        self.wants = [] if wants is None else list(wants)
        self.dtype = dtype_spec("WeightReceiver", dtype)
        self.version: int | None = None
        self.schedule: Schedule | None = None
        self._epoch = -1
        self._buckets: list[LinkBucket] = []
        self._slots: list[torch.Tensor] = []
        self._targets: list[torch.Tensor] = []
        self._views: Views = {}  # the pieces' views of their targets (apply_round)
        self._empty: set[int] = set()
        n = min(4, os.cpu_count() or 1) if apply_threads is None else int(apply_threads)
        self._pool = ThreadPoolExecutor(n, thread_name_prefix="sync-apply") if n > 1 else None
        # pull(undo=True): what the last round overwrote, the version and digests before it,
        # and the wants it changed
        self._undo: tuple[Undo, int | None, dict[tuple[int, int, int], tuple[int, int]]] | None
        self._undo = None
        self._changed: list[int] = []
        # the last applied round's undo list (None: not kept) and the wants it changed
        self._round: tuple[Undo | None, list[int]] = (None, [])
        self._ring = False  # staging="ring" and two slots take less than a round's (_setup)
        # undo_dir: two spill files, the live undo's and the one a new round writes
        self.undo_dir = None if undo_dir is None else str(undo_dir)
        self._spills: list[UndoSpill] = []
        self._undo_spill: UndoSpill | None = None  # the file self._undo's bytes are in

    @property
    def bucket_bytes(self) -> int:
        """The one given, else the default of the group's links now (they may change at a
        reconnect: ``links="auto"``)."""
        given = self._bucket_bytes
        return default_bucket_bytes(self.group.links) if given is None else given

    def _decl(self) -> Decl:
        if self.every and self.boxes is not None:
            return self._boxed_decl()
        if self.every:
            return Decl(self.group.rank, False, every=True)
        out = []
        for w in self.wants:
            dt = w.dtype or (w.into.dtype if w.into is not None else None)
            # a target in another dtype than the wire's cannot be patched: it lacks the bytes
            patch = w.into is None or w.dtype is None or w.into.dtype == w.dtype
            out.append(
                Wanted(
                    w.name,
                    w.source or w.name,
                    None if dt is None else wire_name(dt, w.name),
                    w.box,
                    patch,
                )
            )
        return Decl(self.group.rank, False, wanted=tuple(out))

    def _boxed_decl(self) -> Decl:
        """``boxes``: the trainers' declarations of this setup attempt, read from the group's
        store (trainers post theirs without waiting for any receiver), expanded as
        ``expand_every`` does, each tensor with the box ``boxes`` picks."""
        g, boxes = self.group, self.boxes
        assert boxes is not None
        pre = f"x/{g.setups}"  # the attempt setup_schedule began (group.exchange's keys)
        keys = [f"{pre}/decl/{r}" for r in g.trainers]
        fail = f"{pre}/fail"
        g.wait_until(
            lambda: bool(g.store.check(keys)) or bool(g.store.check([fail])),
            "waiting for the trainers' declarations",
            None,
        )
        if not g.store.check(keys):  # the attempt failed: the exchange raises it
            return Decl(g.rank, False, every=True)
        trainers = [
            decl_from_json(
                bytes(g.guard("store get", lambda k=k: g.store.get(k))).partition(b"\n")[2]
            )
            for k in keys
        ]
        seen: dict[str, Wanted | None] = {}  # None: not wanted
        for t in trainers:
            for h in t.held:
                if h.name not in seen:
                    dt = resolve_dtype(self.dtype, h.name, wire_dtype(h.dtype))
                    box = boxes(h.name, tuple(h.shape))
                    if box is False:  # none of it (it is not even seen: asked once)
                        seen[h.name] = None
                        continue
                    seen[h.name] = Wanted(h.name, h.name, wire_name(dt, h.name), box)
        return Decl(g.rank, False, wanted=tuple(w for w in seen.values() if w is not None))

    def _setup(self) -> Schedule:
        g = self.group
        if self.schedule is not None and self._epoch == g.epoch:
            return self.schedule
        wants: list[Want] = []
        targets: list[torch.Tensor] = []

        def prepare(sched: Schedule) -> None:
            # checked before every rank leaves the setup: a bad ``into`` fails it everywhere
            mine = sched.wanted[g.rank]
            wants[:] = self.wants
            if self.every:
                wanted = [w for w, _, _ in mine]  # expand_every names every dtype
                wants[:] = [
                    Want(w.name, box=w.box, dtype=wire_dtype(w.dtype))  # type: ignore[arg-type]
                    for w in wanted
                ]
            for w, (decl, ti, box) in zip(wants, mine, strict=True):
                dt = wire_dtype(decl.dtype or sched.tensors[ti].dtype)
                if w.into is not None:
                    if tuple(w.into.shape) != box.size:
                        raise PlanError(
                            f"want {w.name!r}: into has shape {list(w.into.shape)} but its box "
                            f"{box} needs {list(box.size)}; pass the local shard of the "
                            "parameter"
                        )
                    targets.append(w.into)
                else:
                    targets.append(_alloc(box.size, dt, self.device, self.pin))
            g.open_links(link_slots(sched.links_of(g.rank), self.align))

        sched = setup_schedule(
            g, self._decl, self.bucket_bytes, self.align, self.dtype, prepare=prepare
        )
        self.wants, self._targets = wants, targets
        self._views.clear()  # the pieces' views of the last schedule's targets
        # zero-element wants have no piece on any link: handed over in every full round
        self._empty = {i for i, (_, _, box) in enumerate(sched.wanted[g.rank]) if not box.numel}
        links = sched.links_of(g.rank)
        self._buckets = sorted(
            (b for lk in links for b in lk.buckets), key=lambda b: (b.index, b.sender)
        )
        sizes = [-(-message_bytes(b, self.align) // 64) * 64 for b in self._buckets]
        big = max(sizes, default=0)
        # two slots of the largest message, reused (class doc), where they take less than a
        # round's slots
        self._ring = self.staging == "ring" and 2 * big < sum(sizes)
        if self._ring:
            if any(t is w.into for t, w in zip(targets, wants, strict=True)):
                raise PlanError("WeightReceiver(staging='ring') needs wants without into")
            arena = _alloc((2 * big,), torch.uint8, self.device, self.pin, zero=False)
            self._slots = [arena[:big], arena[big:]]
        else:
            arena = _alloc((sum(sizes),), torch.uint8, self.device, self.pin, zero=False)
            self._slots, pos = [], 0
            for b, n in zip(self._buckets, sizes, strict=True):
                self._slots.append(arena[pos : pos + message_bytes(b, self.align)])
                pos += n
        if self._lock is not None:  # the last staging's page-lock, before it can be freed
            self._lock.release()
        self._arena, self._lock = arena, None
        self.schedule, self._epoch = sched, g.epoch
        return sched

    def pull(self, load_weights: LoadWeights | None = None, *, undo: bool = False) -> RoundStats:
        """Take part in one round; on commit write the received boxes into the ``into``
        tensors and hand the others (whole local tensors, those that changed) to
        ``load_weights``; in a full round every one, zero-element tensors included (they have
        no bytes on the wire, so only a full round can say they exist). Raises :class:`SyncError` subclasses when the round fails (nothing is
        applied; ``version`` unchanged); after :class:`PeerLostError`,
        ``group.reconnect(port)`` first.

        ``undo=True`` keeps what the round overwrites (for a patch only the changed elements,
        for a piece sent whole its old bytes; nothing in the first round, which has no previous
        version): if ``load_weights`` raises, the targets and
        ``version`` are put back before the error propagates, and after a committed round
        :meth:`revert` puts the previous version back until the next ``pull`` or
        :meth:`drop_undo`. Without it a
        ``load_weights`` that raises leaves the targets on the new round and ``version`` on the
        old one (the next round's patches then fail their digests and it is resent whole)."""
        t0 = time.perf_counter()
        g = self.group
        sched = self._setup()
        self._lock_staging()
        seq = g.next_round()
        st = _Round(seq, deferred=None if self._ring else [])
        # ring staging: what the buckets written before the vote overwrote, and their wants
        early: Undo = []
        touched: set[int] = set()
        spill = self._round_spill()
        if self._ring:
            try:
                self._receive_ring(st, sched, early, touched, spill)
            except BaseException:  # a lost peer: what was written goes back first
                revert(early)
                raise
        else:
            self._receive_round(st)
        g.settle_receives()  # ipc copies not waited for one by one: landed, acknowledged
        if st.deferred and st.failure is None:  # the device digests: one copy to the host
            bad = self._compare(st.deferred)
            if bad is not None:
                st.fail(bad)
                st.mismatch = st.failure
        if len(st.versions) > 1:
            st.fail(f"senders sent different versions {sorted(st.versions)} in one round")
        if self.verify == "all" and st.failure is None:
            bad = self._check_kept(st)
            if bad is not None:
                st.fail(bad)
                st.mismatch = st.failure
        mine = None if st.failure is None else f"rank {g.rank}: {st.failure}"
        reason = g.vote(seq, mine)
        if reason is not None and early:
            revert(early)  # ring staging: the targets go back before anything is raised
        if reason is not None:
            if reason.startswith("lost: "):
                raise g.lost_error(f"round failed: {reason[6:]}; version stays {self.version}")
            if st.mismatch is not None:
                raise DigestMismatchError(
                    f"rank {g.rank}: {st.mismatch}; nothing was applied, version stays {self.version}"
                )
            # this rank's own finding, whoever aborted first (a stub only echoes a sender's)
            why = reason if mine is None or st.echo else mine
            raise RoundAbortedError(
                f"rank {g.rank}: round not committed: {why}; version stays {self.version}"
            )
        self._undo = None
        self._drop_spill()  # the previous round's (this round's bytes are in the other file)
        # nothing to go back to before the first round
        kept: Undo | None = [] if undo and self.version is not None else None
        before = (self.version, dict(self._kept)) if undo else (self.version, {})
        if self._ring:  # applied bucket by bucket already
            changed = touched
            if kept is not None:
                kept.extend(early)
        else:
            changed = apply_round(
                self._targets,
                sched.wanted[g.rank],
                st.staged,
                self._pool,
                kept,
                spill,
                self._views,
            )
        self._round = (kept, sorted(changed))
        if self.verify == "all":
            for bk, _, offs, _, _ in st.staged:
                for k, d in enumerate(st.digests[(bk.index, bk.sender)]):
                    if offs[k] is not None and d is not None:
                        self._kept[(bk.index, bk.sender, k)] = d
        npieces = sum(len(b.pieces) for b in self._buckets)
        present = sum(sum(o is not None for o in offs) for _, _, offs, _, _ in st.staged)
        if present == npieces:  # a full round hands over every want, those without bytes too
            changed |= self._empty
        if load_weights is not None:
            out = [
                (self.wants[i].name, self._targets[i])
                for i in sorted(changed)
                if self.wants[i].into is None
            ]
            if out:
                try:
                    load_weights(out)
                except BaseException:
                    if kept is not None:  # the targets go back with the version
                        revert(kept)
                        self._kept = before[1]
                    raise
        if st.versions:
            self.version = st.versions.pop()
        self._changed = sorted(changed)
        if kept is not None:
            self._undo = (kept, before[0], before[1])
            self._undo_spill = spill
        payload = sum(st.per_link.values())
        zero_copy = sum(
            p.nbytes
            for bk, _, offs, flags, _ in st.staged
            for p, o, f in zip(bk.pieces, offs, flags, strict=True)
            if o is not None and f == wire.DIRECT
        )
        return RoundStats(
            self.version if self.version is not None else -1,
            present == npieces,
            time.perf_counter() - t0,
            len(self._buckets),
            payload,
            st.wire_bytes,
            st.per_link,
            zero_copy,
            st.patched,
        )

    def _lock_staging(self, now: bool = False) -> None:
        """``pin="auto"``: page-lock the host staging, once per staging, when this process
        uses a GPU (CUDA initialised; ``now``: it is about to)."""
        ipc = getattr(self.group, "links", None) == "ipc"  # (links="auto": this connection's)
        if not (self._pin_auto and ipc) or self._lock is not None or self._arena is None:
            return
        if not torch.cuda.is_available() or not (now or torch.cuda.is_initialized()):
            return
        self._lock = cuda.HostLock(self._arena)

    @property
    def staging_locked(self) -> bool:
        """Whether the host staging is page-locked (``pin``: pinned, or locked by ``"auto"``)."""
        if self._lock is not None and self._lock.locked:
            return True
        return (
            bool(self._slots)
            and self._slots[0].device.type == "cpu"
            and self.pin
            and (self._slots[0].is_pinned())
        )

    @property
    def staging_bytes(self) -> int:
        """Bytes of the staging arena: one slot per planned bucket (a full round's messages),
        or with ``staging="ring"`` two slots of the largest message."""
        return sum(int(s.numel()) for s in self._slots)

    @property
    def undo_bytes(self) -> int:
        """Bytes ``pull(undo=True)`` keeps in memory for :meth:`revert` now (old values and
        indices; what ``undo_dir``'s file keeps is :attr:`spilled_bytes`)."""
        if self._undo is None:
            return 0
        return sum(
            o.numel() * o.element_size() + (0 if at is None else at.numel() * at.element_size())
            for _, at, o in self._undo[0]
            if isinstance(o, torch.Tensor)  # not what is kept in undo_dir's file
        )

    def changed_elements(self) -> dict[str, torch.Tensor | None]:
        """Per want without ``into`` that the last applied round changed (from inside
        ``load_weights`` on, until the next ``pull`` or a :meth:`revert`): the flat indices
        (int64, into the target tensor) of the elements it changed, or None where a piece was
        copied whole or nothing was kept to tell (``pull(undo=True)`` keeps it; a first round
        keeps nothing). A target the round wrote only by patches changed only there."""
        kept, wants = self._round
        names = {i: self.wants[i].name for i in wants if self.wants[i].into is None}
        out: dict[str, torch.Tensor | None] = {}
        if kept is None:
            return dict.fromkeys(names.values())
        where = {self._targets[i].untyped_storage().data_ptr(): i for i in names}
        parts: dict[int, list[torch.Tensor]] = {}
        whole: set[int] = set()
        for dst, at, _ in kept:
            i = where.get(dst.untyped_storage().data_ptr())
            if i is None:
                continue
            if at is None or not self._targets[i].is_contiguous():
                whole.add(i)
            else:  # a contiguous box of the target: its flat offset, then the box's indices
                off = dst.storage_offset() - self._targets[i].storage_offset()
                parts.setdefault(i, []).append(at + off if off else at)
        for i, name in names.items():
            got = parts.get(i)
            out[name] = None if i in whole or not got else torch.cat(got)
        return out

    @property
    def reverts_to(self) -> int | None:
        """The version :meth:`revert` would go back to (None: nothing is kept to revert)."""
        return None if self._undo is None else self._undo[1]

    def drop_undo(self) -> None:
        """Free what ``pull(undo=True)`` kept (once the round is final): for a round sent
        whole that is a second copy of every changed target (in memory, or in ``undo_dir``)."""
        self._undo = None
        self._round = (None, self._round[1])
        self._drop_spill()

    def revert(self) -> list[tuple[str, torch.Tensor]]:
        """Put the round before the last one back: its bytes into every target the last round
        changed, its ``version`` (needs ``pull(undo=True)``; once per round). Returns the
        ``(name, tensor)`` pairs of the wants without ``into`` that changed, now holding the
        previous bytes: hand them to ``load_weights`` to put a model back. A
        :class:`~deltackpt.sync.WeightSender` that committed the round still bases its next
        patches on it, so send the next round whole (``push(..., full=True)``)."""
        if self._undo is None:
            raise SyncError(
                "revert(): nothing to revert; pull(undo=True) keeps the previous version for "
                "one revert after a committed round"
            )
        kept, self.version, self._kept = self._undo
        self._undo = None
        self._round = (None, self._round[1])
        revert(kept)
        self._drop_spill()
        return [
            (self.wants[i].name, self._targets[i])
            for i in self._changed
            if self.wants[i].into is None
        ]

    def _receive_round(self, st: _Round) -> None:
        """Every message posted up front into its own slot; bucket i's zero-copy pieces are
        posted as soon as its header is read, and bucket i-1 is verified while they arrive."""
        g = self.group
        works = [
            g.irecv(slot, b.sender, b.index)
            for b, slot in zip(self._buckets, self._slots, strict=True)
        ]
        pending: _Arrived | None = None
        for bk, slot, work in zip(self._buckets, self._slots, works, strict=True):
            got = self._arrive(st, bk, slot, work)
            if pending is not None:
                self._settle(st, pending)
            pending = got
        if pending is not None:
            self._settle(st, pending)

    def _round_spill(self) -> UndoSpill | None:
        """The spill file this round keeps overwritten bytes in (``undo_dir``): not the one the
        live undo uses (a failed round leaves that one revertible), emptied first."""
        if self.undo_dir is None:
            return None
        free = [s for s in self._spills if s is not self._undo_spill]
        if not free:
            made = open_spill(self.undo_dir)
            if made is None:  # warned: in memory from now on
                self.undo_dir = None
                return None
            free.append(made)
            self._spills.append(made)
        free[0].clear()
        return free[0]

    @property
    def spilled_bytes(self) -> int:
        """Bytes kept for taking rounds back in ``undo_dir``'s files now (not in memory)."""
        return sum(s.nbytes for s in self._spills)

    def _drop_spill(self) -> None:
        if self._undo_spill is not None:
            self._undo_spill.clear()
            self._undo_spill = None

    def _receive_ring(
        self,
        st: _Round,
        sched: Schedule,
        early: Undo,
        touched: set[int],
        spill: UndoSpill | None = None,
    ) -> None:
        """Two slots, reused: bucket i+1 is posted into the slot bucket i-1 leaves once that
        one is verified and written into the targets (its old bytes kept in ``early``)."""
        g, bks = self.group, self._buckets
        wanted = sched.wanted[g.rank]

        def post(i: int) -> tuple[torch.Tensor, Any]:
            slot = self._slots[i % 2][: message_bytes(bks[i], self.align)]
            return slot, g.irecv(slot, bks[i].sender, bks[i].index)

        # before the first round nothing depends on the targets (no version, nothing handed
        # out): a failed first round leaves them as it leaves them, without a copy of them
        keep = early if self.version is not None else None

        def settle(got: _Arrived) -> None:
            n = len(st.staged)
            self._settle(st, got)
            if len(st.staged) > n and st.failure is None:  # verified: into the targets now
                staged = st.staged[n:]
                touched.update(
                    apply_round(self._targets, wanted, staged, self._pool, keep, spill, self._views)
                )

        posted = {i: post(i) for i in range(min(2, len(bks)))}
        pending: _Arrived | None = None
        for i, bk in enumerate(bks):
            slot, work = posted.pop(i)
            got = self._arrive(st, bk, slot, work)
            if pending is not None:
                settle(pending)
                if i + 1 < len(bks):  # the slot bucket i-1 used is free
                    posted[i + 1] = post(i + 1)
            pending = got
        if pending is not None:
            settle(pending)

    def _lost(self, st: _Round, bk: LinkBucket, e: SyncError) -> PeerLostError:
        why = f"receiving from rank {bk.sender} failed ({cause_line(e)})"
        self.group.abort(st.seq, "lost: " + why)
        return PeerLostError(
            f"rank {self.group.rank}: {why}; call group.reconnect(new_port) on the survivors "
            f"and restart rank {bk.sender}; version stays {self.version}"
        )

    def _arrive(self, st: _Round, bk: LinkBucket, slot: torch.Tensor, work: Any) -> _Arrived:
        """Wait for a bucket's message, read its header (even when the round already failed:
        its zero-copy pieces must still be received) and post the receives of its zero-copy
        pieces into their places in ``slot``."""
        g = self.group
        try:
            g.guard("gloo recv", work.wait)
        except SyncError as e:
            raise self._lost(st, bk, e) from e
        got = _Arrived(bk, slot)
        start = payload_start(bk, self.align)
        cell = g.inline_header(bk.sender, bk.index)  # a device round's header, in the cell
        inline, alone = (None, False) if cell is None else cell
        try:
            want = wire.header_words(len(bk.pieces)) * 8
            if inline is not None and inline.numel() != want:
                raise SyncError(
                    f"bucket {bk.index} of round {st.seq} from rank {bk.sender}: the header in "
                    f"the link's cell holds {inline.numel()} bytes, one of {len(bk.pieces)} "
                    f"pieces {want}"
                )
            got.header = wire.read_header(
                slot if inline is None else inline,
                st.seq,
                bk.index,
                [p.nbytes for p in bk.pieces],
                slot.numel() - start,
            )
            if alone and (got.header.payload or any(p is not None for p in got.header.pieces)):
                raise SyncError(
                    f"bucket {bk.index} from rank {bk.sender}: a header-only message in the "
                    f"link's cell names {got.header.payload} payload bytes"
                )
        except SyncError as e:
            st.fail(str(e))
            got.header = None
            return got
        if got.header.status != wire.OK:
            return got
        flags = got.header.flags
        got.offsets, _, end = wire.layout(got.header.lengths, flags, start, self.align)
        bad = None
        if wire.DIRECT in flags and g.links != "gloo":
            bad = f"zero-copy pieces on a {g.links} link"
        elif end != start + got.header.payload or end > slot.numel():
            bad = f"header claims {got.header.payload} payload bytes, its pieces take {end - start}"
        if bad is not None:
            st.fail(f"bucket {bk.index} of round {st.seq} from rank {bk.sender}: {bad}")
            got.header = None
            return got
        if inline is not None:  # the bucket's copy left to this rank, which knows its pieces
            ks = [k for k, o in enumerate(got.offsets) if o is not None]
            spans = [(got.offsets[k], got.header.lengths[k]) for k in ks]
            fps = g.copy_received(bk.sender, bk.index, spans)  # type: ignore[misc]
            if fps is not None:  # copied and fingerprinted in one pass: verified from these
                # where the piece's span is the one its check reads (a whole piece: a patch's
                # payload is shorter, and its check is of the patched piece)
                got.known = {
                    k: f
                    for k, f in zip(ks, fps, strict=True)
                    if got.header.lengths[k] == bk.pieces[k].nbytes
                }
        direct = [
            (p, o)
            for p, o, f in zip(bk.pieces, got.offsets, flags, strict=True)
            if f == wire.DIRECT and o is not None
        ]
        try:
            got.works = [
                g.irecv(slot[o : o + p.nbytes], bk.sender, wire.direct_tag(bk.index, j))
                for j, (p, o) in enumerate(direct)
            ]
        except SyncError as e:
            raise self._lost(st, bk, e) from e
        return got

    def _settle(self, st: _Round, got: _Arrived) -> None:
        """Wait for a bucket's zero-copy pieces, then verify and stage it (unless the round
        already failed: then it was only drained)."""
        bk = got.bk
        for w in got.works:
            try:
                self.group.guard("gloo recv", w.wait)
            except SyncError as e:
                raise self._lost(st, bk, e) from e
        if st.failure is not None or got.header is None:
            return
        h = got.header
        if h.status != wire.OK:
            st.echo = st.failure is None
            st.fail(f"rank {bk.sender} aborted the round (its error is raised there)")
            return
        st.versions.add(h.version)
        offsets = got.offsets
        changes: dict[int, patches.Changes] = {}
        left: dict[int, Any] = {}  # patched pieces not assembled in the slot: their bases
        patch_ok: list[tuple[int, torch.Tensor]] = []
        if h.base is not None:  # patches against the version this rank holds
            if h.base != self.version:
                st.fail(
                    f"round {h.version} patches version {h.base} but this rank holds version "
                    f"{self.version}; the next round sends whole pieces"
                )
                st.mismatch = st.failure
                return
            try:
                if h.device:  # device patches: read where the slot is, applied after the vote
                    changes, patch_ok = self._device_patches(bk, got.slot, h, offsets)
                elif got.slot.device.type != "cpu":
                    raise SyncError(
                        "host patches cannot be expanded in device staging; send with "
                        "encode='auto' (no patches on ipc links) or stage on the host "
                        "(WeightReceiver(device='cpu'))"
                    )
                else:
                    offsets, changes, left = patches.expand(
                        bk,
                        got.slot,
                        h,
                        offsets,
                        payload_start(bk, self.align),
                        self.align,
                        lambda k: self._target_box(bk.pieces[k]),
                    )
            except SyncError as e:
                st.fail(f"round {h.version}: bucket {bk.index} from rank {bk.sender}: {e}")
                st.mismatch = st.failure
                return
            st.patched += sum(p is not None and p.kind != wire.RAW for p in h.pieces)
        present = [None if p is None else p.digest for p in h.pieces]
        st.digests[(bk.index, bk.sender)] = present
        bad = self._verify(
            bk,
            got.slot,
            present,
            offsets,
            h.device,
            changes,
            st.deferred,
            h.version,
            patch_ok,
            got.known,
            left,
        )
        if bad is not None:
            st.fail(f"round {h.version}: bucket {bk.index} from rank {bk.sender}: {bad}")
            st.mismatch = st.failure
            return
        st.staged.append((bk, got.slot, offsets, h.flags, changes))
        st.per_link[bk.sender] = st.per_link.get(bk.sender, 0) + sum(h.lengths)
        st.wire_bytes += payload_start(bk, self.align) + h.payload

    def _device_patches(
        self, bk: LinkBucket, slot: torch.Tensor, h: wire.Header, offsets: list[int | None]
    ) -> tuple[dict[int, tuple[torch.Tensor, torch.Tensor]], list[tuple[int, torch.Tensor]]]:
        """The device patches of a device round's message (``device_delta.py``): per piece,
        its element indices (clamped into the piece) and values, read where the slot lives,
        and the flags that say whether each patch's count and indices are what they must be,
        not waited for (read with the round's digests, before the vote: :meth:`_compare`);
        :class:`SyncError` when a length fits no count or this rank's target cannot take a
        patch element by element."""
        out: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        oks: list[tuple[int, torch.Tensor]] = []
        for k, (piece, off) in enumerate(zip(h.pieces, offsets, strict=True)):
            if piece is None or piece.kind != wire.DEVICE_PATCH or off is None:
                continue
            p = bk.pieces[k]
            dt = wire_dtype(p.dtype)
            dst = self._target_box(p)
            if not dst.is_contiguous() or dst.dtype != dt or p.nbytes % 8:
                raise SyncError(
                    f"piece {k} came as a device patch but this rank's target for it is "
                    f"{'not contiguous' if not dst.is_contiguous() else dst.dtype}; the next "
                    "round sends it whole"
                )
            if off + piece.length > slot.numel():
                raise SyncError(f"piece {k}: its device patch does not fit in the message")
            try:
                idx, vals, ok = read_patch_lazy(
                    slot[off : off + piece.length], piece.length, dt.itemsize, dst.numel()
                )
            except ValueError as e:
                raise SyncError(f"piece {k}: {e}") from e
            out[k] = (idx, vals)
            oks.append((k, ok))
        return out, oks

    def _check_kept(self, st: _Round) -> str | None:
        """verify="all": every piece this round does not bring, re-hashed in its target against
        the digest it was committed with."""
        assert self.schedule is not None
        sent = {
            (bk.index, bk.sender, k)
            for bk, _, offs, _, _ in st.staged
            for k, o in enumerate(offs)
            if o is not None
        }
        for bk in self._buckets:
            for k, p in enumerate(bk.pieces):
                key = (bk.index, bk.sender, k)
                want = self._kept.get(key)
                if key in sent or want is None:
                    continue
                held = self._target_box(p).to(wire_dtype(p.dtype)).contiguous()
                raw = held.view(-1).view(torch.uint8)
                # committed by a device round (device digest) or a host round (xxh3)
                first, second = (piece_digest, wire.verify)
                if raw.device.type == "cpu":
                    first, second = second, first
                got = first(raw)
                if got != want and second(raw) == want:
                    got = want
                if got != want:
                    name = self.schedule.tensors[p.tensor].name
                    return (
                        f"the kept piece {name} box {p.box} (not sent this round) has digest "
                        f"{got} but was committed as {want}: this rank's copy changed since "
                        "(edited by hand, or memory corrupted); the next round sends it whole"
                    )
        return None

    def _target_box(self, p: Transfer) -> torch.Tensor:
        """The bytes this rank holds of piece ``p`` (the base a patch applies to)."""
        assert self.schedule is not None
        box = self.schedule.wanted[self.group.rank][p.want][2]
        return self._targets[p.want][p.box.within(box)]

    def _verify(
        self,
        bk: LinkBucket,
        slot: torch.Tensor,
        present: list[tuple[int, int] | None],
        offsets: list[int | None],
        device: bool = False,
        changes: dict[int, Any] | None = None,
        defer: list[_DeviceCheck] | None = None,
        version: int = 0,
        patch_ok: list[tuple[int, torch.Tensor]] | None = None,
        known: dict[int, torch.Tensor] | None = None,
        left: dict[int, Any] | None = None,
    ) -> str | None:
        """Each present piece at its offset in ``slot`` hashed against its digest (``left``:
        host patches not assembled in ``slot``, hashed from their base and ``changes``: the
        changed elements, :func:`patches.patched_digest`; ``device``:
        device digests, all of the message's at once where the slot lives; a device patch's
        piece is this rank's base with the patch, digested without being written; ``defer``:
        the device digests appended there, compared with the round's others by
        :meth:`_compare` before the vote, not waited for here; ``known``: piece -> the chunk
        fingerprints of its bytes in ``slot``, taken as they were written there: folded, not
        read again)."""
        patched = changes if device and changes else {}
        ks = [
            k
            for k, (d, o) in enumerate(zip(present, offsets, strict=True))
            if d and o is not None and k not in patched
        ]
        for k in ks:
            if offsets[k] + bk.pieces[k].nbytes > slot.numel():  # type: ignore[operator]
                return f"piece {k} does not fit in the message"
        if device:
            spans = [(offsets[k], bk.pieces[k].nbytes) for k in ks]
            where = slot
            if slot.device.type == "cpu" and spans and torch.cuda.is_available():
                # host staging of a device round: its private copy checked on the device
                # (fingerprints run at ~0.3 GB/s on a core, ~117 GB/s on an H200)
                end = max(o + n for o, n in spans)  # type: ignore[operator]
                self._lock_staging(now=True)  # (the copy at the link's speed)
                where = slot[:end].to(torch.device("cuda", torch.cuda.current_device()))
            have = {i: known[k] for i, k in enumerate(ks) if k in known} if known else {}
            if where is not slot:  # the fingerprints were taken where the slot is
                have = {}
            rows = [message_digest_rows(where, spans, have)]  # type: ignore[arg-type]
            if patched:
                items = [
                    (
                        self._target_box(bk.pieces[k]).reshape(-1).view(torch.uint8),
                        idx,
                        vals,
                        vals.element_size(),
                    )
                    for k, (idx, vals) in patched.items()
                ]
                rows.append(patched_digest_rows(items).to(rows[0].device))
                ks += list(patched)
            found = _DeviceCheck(bk, ks, present, torch.cat(rows), version, patch_ok or [])
            if defer is not None:  # compared with the round's others, before the vote
                defer.append(found)
                return None
            return self._compare([found], where=False)

        def digest(k: int) -> tuple[int, int]:
            off = offsets[k]
            assert off is not None
            if left and k in left:
                return patches.patched_digest(left[k], *changes[k])  # type: ignore[index]
            return wire.verify(slot[off : off + bk.pieces[k].nbytes])

        # several pieces: hashed on the apply threads at once (xxh3 releases the GIL: 2x on two
        # free cores here; apply_threads=1 hashes them one after the other)
        pool = self._pool if len(ks) > 1 else None
        got = list(pool.map(digest, ks)) if pool is not None else map(digest, ks)
        for k, g in zip(ks, got, strict=True):
            if g != present[k]:
                return self._mismatch(bk, k, g, present[k])
        return None

    def _mismatch(self, bk: LinkBucket, k: int, got: object, d: object) -> str:
        p = bk.pieces[k]
        name = self.schedule.tensors[p.tensor].name if self.schedule else "?"
        return (
            f"piece {k} ({name} box {p.box}) has digest {got}, the sender announced {d}; "
            "check the network / memory of both hosts"
        )

    def _compare(self, checks: list[_DeviceCheck], where: bool = True) -> str | None:
        """Device digests against the announced ones: one copy to the host for all of
        ``checks``; the first mismatch, named (``where``: with its round, bucket and
        sender), or None."""
        if not checks:
            return None
        oks = [(c, k, ok) for c in checks for k, ok in c.patch_ok]
        if oks:  # a patch whose count or indices do not fit: refused before its digest counts
            fine = torch.stack([ok.to(checks[0].rows.device) for _, _, ok in oks]).cpu().tolist()
            for (c, k, _), good in zip(oks, fine, strict=True):
                if not good:
                    p = c.bk.pieces[k]
                    name = self.schedule.tensors[p.tensor].name if self.schedule else "?"
                    why = (
                        f"piece {k} ({name} box {p.box}): its device patch's count or indices "
                        "do not fit the piece (the count its length holds; indices rising "
                        "strictly, inside the piece)"
                    )
                    if not where:
                        return why
                    return f"round {c.version}: bucket {c.bk.index} from rank {c.bk.sender}: {why}"
        host = torch.cat([c.rows.to(checks[0].rows.device) for c in checks]).cpu().tolist()
        at = 0
        for c in checks:
            for k in c.ks:
                got = (int(host[at][0]), int(host[at][1]))
                at += 1
                if got != c.present[k]:
                    why = self._mismatch(c.bk, k, got, c.present[k])
                    if not where:
                        return why
                    return f"round {c.version}: bucket {c.bk.index} from rank {c.bk.sender}: {why}"
        return None


@dataclass
class _DeviceCheck:
    """A message's device digests, computed and not yet read: piece ``ks[j]`` of ``bk`` got
    ``rows[j]``, its header announced ``present[ks[j]]``."""

    bk: LinkBucket
    ks: list[int]
    present: list[tuple[int, int] | None]
    rows: torch.Tensor
    version: int = 0
    # device patches: (piece, whether its count and indices fit: read_patch_lazy)
    patch_ok: list[tuple[int, torch.Tensor]] = field(default_factory=list)


@dataclass
class _Round:
    """What a receiver learned so far in round ``seq``: the first failure (a digest mismatch
    is also kept as ``mismatch``), the senders' versions, and the verified buckets."""

    seq: int
    # a device round's digests not yet compared (None: each message's compared as it comes,
    # as ring staging writes a verified message into the targets before the vote)
    deferred: list[_DeviceCheck] | None = None
    failure: str | None = None
    echo: bool = False  # the failure is a sender's abort stub, not this rank's own finding
    mismatch: str | None = None
    wire_bytes: int = 0
    patched: int = 0
    versions: set[int] = field(default_factory=set)
    staged: list[Staged] = field(default_factory=list)
    # (bucket index, sender) -> the digests its header announced (None: piece not sent)
    digests: dict[tuple[int, int], list[tuple[int, int] | None]] = field(default_factory=dict)
    per_link: dict[int, int] = field(default_factory=dict)

    def fail(self, why: str) -> None:
        if self.failure is None:
            self.failure = why


@dataclass
class _Arrived:
    """A bucket message that arrived: its header (None when unreadable or not to be used),
    piece offsets and the receives posted for its zero-copy pieces."""

    bk: LinkBucket
    slot: torch.Tensor
    header: wire.Header | None = None
    offsets: list[int | None] = field(default_factory=list)
    works: list[Any] = field(default_factory=list)
    # piece -> its chunk fingerprints, taken as it was copied out of the link's bucket
    known: dict[int, torch.Tensor] = field(default_factory=dict)


def _staging_device(
    group: SyncGroup, wants: Sequence[Want] | None, device: str | torch.device | None
) -> torch.device:
    """``WeightReceiver(device=)``: as given; by default the CUDA device every ``into`` target
    lives on, on an ipc link; else the CPU."""
    if device is not None:
        try:
            return torch.device(device)
        except (RuntimeError, TypeError) as e:
            raise PlanError(f"WeightReceiver(device={device!r}): not a device ({e})") from e
    if getattr(group, "links", None) != "ipc" or not wants:
        return torch.device("cpu")
    found = {w.into.device for w in wants if w.into is not None}
    if (
        len(found) == 1
        and next(iter(found)).type == "cuda"
        and all(w.into is not None for w in wants)
    ):
        return next(iter(found))
    return torch.device("cpu")


def _alloc(
    shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, pin: bool, zero: bool = True
) -> torch.Tensor:
    """A tensor on ``device`` (zeroed, or not: staging); on the host pinned when ``pin`` and
    CUDA is present (an ordinary one where pinning fails: a locked-memory limit)."""
    make = torch.zeros if zero else torch.empty
    if pin and device.type == "cpu" and torch.cuda.is_available():
        try:
            return make(shape, dtype=dtype, pin_memory=True)
        except RuntimeError:
            pass
    return make(shape, dtype=dtype, device=device)

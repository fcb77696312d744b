"""Trainer side of weight sync: :class:`WeightSender` sends each receiver only its boxes, point to
point, in the receiver's dtype.

Called on every trainer rank of the :class:`~deltackpt.sync.group.SyncGroup`, once per
round, with the same ``version``::

    sender = WeightSender(group)  # buckets of 64 MiB (256 MiB on an ipc link)
    stats = sender.push(model.state_dict(), version=step)   # DTensor shards as they are

The first push declares this rank's shards (``schedule_decl.held_from``) and, with every other
rank, builds the schedule (once; later pushes must hold the same shards). A round walks this
rank's link buckets interleaved over its receivers (bucket 0 of every link, then bucket 1, ...):
two packing threads fill buckets i+1 and i+2 (gather the piece boxes from the local shard,
cast, hash each chunk right after copying it; ``DELTACKPT_PACK_THREADS``, one in device rounds)
while bucket i is on the wire (gloo ``send``, async), from a ring of three buffers. Delta rounds (the default after a committed round) hash each local tensor
once, in place, and pack and send the pieces of the tensors whose digest changed since the last
committed round (``detect="version"``: tensors whose storage and in-place version counter did
not change since that round are skipped unread, the others sent unhashed; see docs/sync.md). On shared-memory links the
packing threads write straight into the link's slot; a piece that needs a cast or a gather is
cast chunk by chunk into a private scratch and hashed there before it is copied into the slot,
which any process that opens the link file can write. Local tensors on CUDA are first brought
to a pinned host mirror (``host_mirror.py``): only the chunks whose device fingerprint moved
since the last committed round are copied, in one batch of non-blocking copies, and the rest of
the round runs on the mirror as on host tensors (``DELTACKPT_DEVICE_PATCH``: a tensor with a
device copy of its committed bytes brings only its changed elements, and its pieces' patches
are packed from that list, ``device_patches.py``). Then the commit vote (store keys, see
``group.py``): it carries each trainer's version, so trainers that disagree fail the round on
every rank, and a failed round still waits for every vote, so no rank publishes the next round
into a slot a slower receiver still reads.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial

import torch

from deltackpt import cuda
from deltackpt.format.fingerprint import fuses
from deltackpt.format.fingerprint_kernel import whole_words
from deltackpt.options import (
    default_device_scan,
    default_pack_threads,
    fingerprint_kernel,
    fused_copies,
)
from deltackpt.sync import delta_codec, wire
from deltackpt.sync.detect import DETECTS, Detector
from deltackpt.sync.device_digest import CHUNK, rows_on_host
from deltackpt.sync.device_patches import DeviceBases, piece_finder
from deltackpt.sync.dtypes import DtypeSpec, dtype_spec, wire_dtype
from deltackpt.sync.errors import PlanError, RoundAbortedError, SyncError
from deltackpt.sync.group import SyncGroup, cause_line, default_bucket_bytes
from deltackpt.sync.host_mirror import HostMirror, mirrored_names, wire_casts
from deltackpt.sync.packer import DeviceDigests, Packed, Packer
from deltackpt.sync.replicas import REPLICAS, replica_digests, replica_names
from deltackpt.sync.rounds import (
    RoundStats,
    link_slots,
    message_bytes,
    setup_schedule,
)
from deltackpt.sync.schedule import LinkBucket, Schedule, check_sizes, is_integer
from deltackpt.sync.schedule_decl import Decl, Held, held_from

__all__ = ["WeightSender"]

# Host rounds pack options.default_pack_threads() buckets at once (DELTACKPT_PACK_THREADS, 2),
# each on its own thread (the diff, zstd, xxh3 and copies release the GIL: the encode of an RL
# step's delta ran 1.7-1.8x faster on 2 threads than on one here); on a ring of ipc buckets
# at most ``ipc_buckets`` (packing further ahead would wait for the copy of a bucket not sent
# yet). One at a time: a device round (its copies share the GPU). The ring of this rank's
# buckets holds those packed ahead and the one being sent, at least 3: a slot is packed again
# once the send before the last completed (no bucket more: when packing waits for sends, the
# link is the bottleneck anyway).
_RING = 3
# encode= -> (the link kinds whose changed pieces go as patches, what a patch may be: kinds
# and the share of changed elements up to which the list of changes is tried). "auto" patches
# gloo and ipc links (the links a links="auto" group takes) with the list of changes only when
# at most 1/16 of a piece changed (measured: encoding more costs more time than the link saves
# on this machine; into a vLLM engine over ipc links an RL step's round whole took 0.73x the
# file round trip's time, patched 1.06x: the worker's check and commit shrink with the bytes)
# and sends whole pieces on shm links; "patch" patches every link with the smallest payload
# (zstd planes included); "dense" never patches. docs/sync.md, "Which links patch".
_FAST = (frozenset({delta_codec.PACKED, delta_codec.SPARSE}), 1 / 16)
_SMALL = (delta_codec.ALL, delta_codec.PACKED_BELOW)
ENCODES = {
    "auto": (frozenset({"gloo", "ipc"}), _FAST),
    "patch": (frozenset({"gloo", "shm", "ipc"}), _SMALL),
    "dense": (frozenset(), _SMALL),
}
_ABORT_CHECK = 0.05  # seconds between looks at the abort key while sending
# a device round publishes its packed buckets in groups of about this many bytes: one wait for
# the device and one copy of the digests to the host per group, not per bucket (on one GPU the
# sender's and the receiver's copies share its memory bandwidth: overlapping them gains little)
_DEVICE_GROUP_BYTES = 256 << 20


class WeightSender:
    """Sends this trainer rank's shards to the inference ranks of ``group`` (see module doc).

    ``bucket_bytes`` (default: 64 MiB, 256 MiB on an ipc link, ``group.BUCKET_BYTES``) and
    ``align`` must be the same on every rank of the group. ``zero_copy_min``
    (gloo links): pieces of at least this many bytes that are contiguous in the local tensor
    and need no cast are sent from the tensor itself, not copied into a bucket first (None:
    never); the tensors must not change until ``push`` returns. ``dtype``: the dtype the
    tensors are declared as (a dtype for floating tensors, e.g. bf16 from fp32 master weights, or
    ``f(name, dtype) -> dtype | None``): receivers that ask for no dtype get it, cast while
    packing. ``replicas``: ``"check"`` (default) compares, at every full round, the bytes of the
    tensors several trainer ranks hold (replicas) and fails the round when they differ;
    ``"trust"`` skips it (see ``replicas.py``).
    """

    def __init__(
        self,
        group: SyncGroup,
        *,
        bucket_bytes: int | None = None,
        align: int = 64,
        detect: str = "hash",
        zero_copy_min: int | None = 256 << 10,
        dtype: DtypeSpec = None,
        encode: str = "auto",
        full_every: int | None = None,
        replicas: str = "check",
    ) -> None:
        if group.rank not in group.trainers:
            raise PlanError(f"rank {group.rank} is not a trainer of the group; use WeightReceiver")
        if detect not in DETECTS:
            raise PlanError(f"detect={detect!r}: choose 'hash' or 'version'")
        if encode not in ENCODES:
            raise PlanError(f"encode={encode!r}: choose one of {sorted(ENCODES)}")
        check_sizes("WeightSender", bucket_bytes, align)
        if zero_copy_min is not None and not is_integer(zero_copy_min):
            raise PlanError(
                f"WeightSender(zero_copy_min={zero_copy_min!r}): expected None (never) or an int "
                "of bytes (pieces at least that large go zero-copy on gloo)"
            )
        if replicas not in REPLICAS:
            raise PlanError(
                f"WeightSender(replicas={replicas!r}): choose 'check' (the default: replicas "
                "compared at full rounds) or 'trust'"
            )
        if full_every is not None and int(full_every) < 1:
            raise PlanError(f"full_every={full_every!r}: pass a number of rounds >= 1, or None")
        self._detector = Detector(detect)
        self.dtype = dtype_spec("WeightSender", dtype)
        self.encode = encode
        self.full_every = None if full_every is None else int(full_every)
        self.replicas = replicas
        self._replicated: dict[str, str] = {}  # tensors other trainers hold too (_setup)
        self._checker: ThreadPoolExecutor | None = None  # digests them (made on first use)
        self._since_full = 0
        self._bases = DeviceBases()  # patches from changed elements found on the device too
        self.zero_copy_min = None if zero_copy_min is None else max(0, int(zero_copy_min))
        self.group, self.align = group, int(align)
        self._bucket_bytes = None if bucket_bytes is None else int(bucket_bytes)
        self.version: int | None = None
        self.schedule: Schedule | None = None
        self._epoch = -1
        self._held: tuple[Held, ...] = ()
        self._local: dict[str, torch.Tensor] = {}
        # the plain tensors the last checked push got, as (tensor, shape, dtype, address,
        # strides) by name: a push of the very same tensors skips the check (_same_tensors)
        self._seen: dict[str, tuple[torch.Tensor, torch.Size, torch.dtype, int, tuple]] = {}
        self._casts: dict[str, torch.dtype] = {}  # mirrored in their wire dtype (_setup)
        self._boxes: dict[str, Held] = {}
        self._whole: frozenset[str] = frozenset()  # carried whole by a bucket (_setup)
        self._buckets: list[LinkBucket] = []
        self._ring: list[torch.Tensor] = []
        self._dirty = True
        self.pack_threads = default_pack_threads()
        self._pool = ThreadPoolExecutor(self.pack_threads, thread_name_prefix="sync-pack")
        self._packer = Packer(group, self.align, self.zero_copy_min, self._detector, self._bases)
        #: the host copy of CUDA local tensors (see host_mirror.py); allocated on first use
        self.mirror = HostMirror()
        self._device = False  # the last round was a device round (SyncGroup.device_rounds)
        # name -> (data_ptr, _version, tensor) at the last commit (detect="version": the tensor
        # is held so its memory cannot be reused by another at the same address)
        self._vers: dict[str, tuple[int, int, torch.Tensor]] = {}

    @property
    def bucket_bytes(self) -> int:
        """The one given, else the default of the group's links now (they may change at a
        reconnect: ``links="auto"``)."""
        given = self._bucket_bytes
        return default_bucket_bytes(self.group.links) if given is None else given

    @property
    def detect(self) -> str:
        """``"hash"`` or ``"version"`` (see :mod:`deltackpt.sync.detect`); may change between
        rounds."""
        return self._detector.mode

    @detect.setter
    def detect(self, mode: str) -> None:
        if mode not in DETECTS:
            raise PlanError(f"detect={mode!r}: choose 'hash' or 'version'")
        self._detector.mode = mode

    def _setup(self, named_tensors: Mapping[str, torch.Tensor] | Iterable) -> None:
        if self.schedule is not None and self._epoch == self.group.epoch:
            if self._same_tensors(named_tensors):  # the last push's: checked then
                return
            # refused before any round, on this rank only: the others wait for the next push
            held, local = held_from(named_tensors, self.dtype)
            if tuple(held) != self._held:
                raise PlanError(
                    "push() got different tensors (names, dtypes, shapes or shard boxes) than "
                    "the schedule was built for; build a new SyncGroup/WeightSender/WeightReceiver "
                    "on every rank to re-plan"
                )
            self._local = local
            self._remember(named_tensors)
            return
        g = self.group
        got: list[tuple[list[Held], dict[str, torch.Tensor]]] = []

        def declare() -> Decl:  # inside the setup: bad input fails it on every rank
            got.append(held_from(named_tensors, self.dtype))
            return Decl(g.rank, True, held=tuple(got[0][0]))

        def prepare(sched: Schedule) -> None:
            g.open_links(link_slots(sched.links_of(g.rank), self.align))

        sched = setup_schedule(g, declare, self.bucket_bytes, self.align, prepare=prepare)
        held, local = got[0]
        self.schedule = sched
        self._held, self._local = tuple(held), local
        self._remember(named_tensors)
        self._boxes = {h.name: h for h in held}
        self._replicated = replica_names(sched, g.rank)
        links = sched.links_of(g.rank)
        self._buckets = sorted(
            (b for lk in links for b in lk.buckets), key=lambda b: (b.index, b.receiver)
        )
        size = max((message_bytes(b, self.align) for b in self._buckets), default=0)
        ring = max(_RING, self.pack_threads + 1)
        self._ring = [torch.empty(size, dtype=torch.uint8) for _ in range(ring)]
        # tensors the host mirror keeps in their wire dtype (an fp32 master sent as bf16)
        self._casts = wire_casts(
            (
                (sched.tensors[p.tensor].name, wire_dtype(p.dtype))
                for b in self._buckets
                for p in b.pieces
            ),
            local,
        )
        # tensors a bucket carries whole (not cut into boxes): a full device round's pack can
        # fingerprint them as it copies them (_fusable)
        self._whole = frozenset(
            name
            for b in self._buckets
            for p in b.pieces
            if p.box == self._boxes[(name := sched.tensors[p.tensor].name)].box
        )
        self._detector.clear()
        self._bases.clear()
        self.mirror.clear()
        self._packer.forget()
        self._vers = {}
        self._dirty = True
        self._epoch = g.epoch

    def _remember(self, named_tensors: object) -> None:
        """Keep what :meth:`_same_tensors` compares the next push with: the tensors of a
        mapping of plain tensors (a DTensor, a LocalShard or pairs: nothing kept, checked
        every push)."""
        self._seen = {}
        if not isinstance(named_tensors, Mapping):
            return
        seen = {}
        for name, t in named_tensors.items():
            if type(t) not in (torch.Tensor, torch.nn.Parameter):
                return
            seen[name] = (t, t.shape, t.dtype, t.data_ptr(), t.stride())
        self._seen = seen

    def _same_tensors(self, named_tensors: object) -> bool:
        """Whether this push got the very tensors of the last checked one, each still where
        it was with the same shape, dtype and strides (a ``param.data = ...`` moves it): then
        the declaration and the local views are those checked (the per-tensor work of a
        check, ~15 us a tensor, is a round's host time when the round is short)."""
        seen = self._seen
        if not seen or not isinstance(named_tensors, Mapping) or len(named_tensors) != len(seen):
            return False
        for name, t in named_tensors.items():
            got = seen.get(name)
            if (
                got is None
                or got[0] is not t
                or t.data_ptr() != got[3]
                or t.shape != got[1]
                or t.dtype != got[2]
                or t.stride() != got[4]
            ):
                return False
        return True

    def push(
        self,
        named_tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
        version: int,
        *,
        full: bool = False,
    ) -> RoundStats:
        """Run one round: send the changed pieces (every piece if ``full``, on the first round
        and after a failure) and wait for the commit vote. Raises :class:`SyncError` subclasses
        when the round fails; after :class:`PeerLostError`, ``group.reconnect(port)`` first."""
        t0 = time.perf_counter()
        g = self.group
        self._setup(named_tensors)
        sched = self.schedule
        assert sched is not None
        seq = g.next_round()
        anchor = self.full_every is not None and self._since_full + 1 >= self.full_every
        # a device round (an ipc link on CUDA) packs from the tensors where they live and
        # leaves the host mirror behind: a switch either way starts over with a full round
        device = g.device_rounds(self._local.values()) and self.align % 8 == 0
        if device != self._device:
            full, self._device = True, device
            self.mirror.clear()
        full = full or self._dirty or anchor
        self._dirty = True
        self._bases.start_round()
        kind, (self._bases.allow, self._bases.packed_below) = ENCODES[self.encode]
        patch_links = {r for r in sched.receivers if g.links in kind}
        if patch_links != self._packer.patch_links:  # bases of links that stopped patching
            self._bases.clear()  # go stale
            self._packer.patch_links = patch_links
        local: dict[str, torch.Tensor] = self._local
        # detect="version": each tensor's storage and in-place version now, before any read (a
        # write after this shows next round); a device round skips the untouched ones' scan
        vers = {n: (t.data_ptr(), t._version, t) for n, t in local.items()}
        unchanged: frozenset[str] = frozenset()
        staged: tuple[str, BaseException] | None = None
        mirrored = 0
        scanned: frozenset[str] = frozenset()
        defer: frozenset[str] = frozenset()
        scan = default_device_scan()
        if device:  # the change found on the device; nothing crosses to the host
            try:
                # every tensor fingerprinted where it lives (a host one too: its digests in
                # a device round are device digests, so xxh3 cannot tell its change)
                how = "off" if scan == "off" else "always"
                skip = self._untouched_tensors(vers) if not full else frozenset()
                defer = self._fusable(local) if full and scan != "off" else frozenset()
                local, scanned, unchanged = self.mirror.scan(
                    local, full, how, cast=self._casts, skip=skip, defer=defer
                )
            except Exception as e:
                staged = (f"rank {g.rank} failed scanning its tensors on the device: {e!r}", e)
                local = {}
        elif mirrored_names(local, scan):  # CUDA tensors (or the stand-in): packed from the mirror
            try:
                local, unchanged = self.mirror.stage(local, full, scan, cast=self._casts)
                mirrored = self.mirror.last.copied_bytes + self.mirror.last.patched_bytes
                found = self.mirror.device.found  # changed elements found on the device
                self._bases.finder = piece_finder(sched, self._boxes, local, found)
            except Exception as e:  # told to every rank by the vote, as a packing failure
                staged = (f"rank {g.rank} failed copying its tensors to the host mirror: {e!r}", e)
                local = {}
        self._packer.local, self._packer.boxes = local, self._boxes
        # a whole scanned tensor's digest is the fold of its scan (the same chunks)
        folds = device and self.mirror.chunk_bytes == CHUNK
        self._packer.fingerprints = self.mirror.fingerprints if folds else {}
        self._packer.device_changes = self.mirror.device.on_device if folds else {}
        self._packer.fuse = defer if folds else frozenset()
        self._packer.provide = self.mirror.provide
        self._packer.base_version = self.version
        digests: dict[tuple[int, int, int], tuple[int, int]] = {}
        per_link: dict[int, int] = {}
        # at a full round, this rank's replicas are digested beside the sending (replicas.py)
        rep: Future[dict[str, str]] | None = None
        if full and self.replicas == "check" and self._replicated and staged is None:
            if self._checker is None:
                self._checker = ThreadPoolExecutor(1, thread_name_prefix="sync-replicas")
            # on the caller's streams: after its writes to the tensors (a thread starts on the
            # default stream)
            devs = [t.device for t in self._local.values() if cuda.is_device(t)]
            rep = self._checker.submit(
                cuda.on_streams,
                cuda.current_streams(devs),
                replica_digests,
                self._local,
                self._replicated,
            )
        self._detector.start_round(local, unchanged, scanned)
        failure, cause, lost, wire_bytes, sent, zero_copy = self._send_all(
            sched, seq, int(version), full, digests, per_link, staged, device
        )
        mine: dict[str, str] | None = None  # ride on this rank's vote
        if rep is not None:
            try:
                mine = rep.result()
            except Exception as e:  # (a tensor it could not read): told by the vote
                if failure is None:
                    failure, cause = f"rank {g.rank} failed digesting its replicas: {e!r}", e
        if lost is not None:
            self.mirror.abandon()
            g.abort(seq, "lost: " + lost)
            raise g.lost_error(f"round {version}: {lost}") from cause
        reason = g.vote(seq, failure, int(version), mine)
        if reason is None and failure is not None:  # the abort key could not be written
            reason = failure
        if reason is not None:
            self.mirror.abandon()  # the next round compares with the last committed one
            if reason.startswith("lost: "):
                raise g.lost_error(f"round {version} failed: {reason[6:]}") from cause
            if failure is not None:  # this rank's own step failed: its cause, whoever aborted first
                raise SyncError(
                    f"rank {g.rank}: round {version} was not committed: {failure}; the "
                    f"receivers keep version {self.version}, the next push is a full round"
                ) from cause
            raise RoundAbortedError(
                f"rank {g.rank}: round {version} was not committed: {reason}; the receivers "
                f"keep version {self.version}, the next push is a full round"
            )
        self._bases.commit()
        self.mirror.commit()
        self._vers = vers
        self._since_full = 0 if full else self._since_full + 1
        self._detector.commit(full, digests)
        self._dirty = False
        self.version = int(version)
        payload = sum(per_link.values())
        return RoundStats(
            int(version),
            full,
            time.perf_counter() - t0,
            sent,
            payload,
            wire_bytes,
            per_link,
            zero_copy,
            mirrored_bytes=mirrored,
        )

    # ---- sending --------------------------------------------------------------------------

    def _send_all(
        self,
        sched: Schedule,
        seq: int,
        version: int,
        full: bool,
        digests: dict[tuple[int, int, int], tuple[int, int]],
        per_link: dict[int, int],
        staged: tuple[str, BaseException] | None = None,
        device: bool = False,
    ) -> tuple[str | None, BaseException | None, str | None, int, int, int]:
        """Send every bucket (or a stub once the round failed); returns (this rank's own
        failure and its exception, lost peer, wire bytes, buckets sent, bytes sent zero-copy).
        Another rank's abort seen while sending only turns the rest into stubs: the vote
        reports it. ``staged``: this rank failed before packing (the host mirror): every
        message is a stub. ``device``: a device round, packed into the ipc buckets
        themselves (``Packer.device_message``)."""
        g = self.group
        gpu = next((t.device for t in self._local.values() if cuda.is_device(t)), None)
        from_gpu = device and gpu is not None
        # the packing thread queues its device work on the caller's streams (a thread starts on
        # the default stream): after the caller's writes, before this thread's reads of it;
        # those of the tensors' GPU and of the CUDA buckets (host tensors into CUDA buckets too:
        # the publish waits on the caller's stream of the buckets' device)
        streams = cuda.current_streams([d for d in (g.ipc_device, gpu) if d is not None])
        nring = len(self._ring)
        works: list[tuple[int, object] | None] = [None] * nring
        bufs: list[torch.Tensor] = list(self._ring)
        stubs: list[tuple[int, object, torch.Tensor]] = []
        directs: list[tuple[int, object]] = []  # zero-copy sends: (receiver, work)
        zero_copy_bytes = 0
        on_device: list[tuple[LinkBucket, DeviceDigests]] = []  # digests not yet read
        failure: str | None = None  # this rank's own: the error it raises
        cause: BaseException | None = None
        if staged is not None:
            failure, cause = staged
        aborted: str | None = None  # another rank's, seen while sending
        lost: str | None = None
        dead: set[int] = set()
        wire_bytes = 0
        next_check = time.monotonic() + _ABORT_CHECK
        group: list[tuple[LinkBucket, int, DeviceDigests]] = []  # packed, not yet published
        group_bytes = 0
        ring = g.reuses_buckets()  # a ring of ipc buckets smaller than a link's round

        def flush() -> None:
            nonlocal lost, group_bytes
            if group:
                for dst, work in self._publish_device(group, digests):
                    if isinstance(work, SyncError):
                        dead.add(dst)
                        lost = lost or f"sending to rank {dst} failed ({cause_line(work)})"
                group.clear()
                group_bytes = 0

        def settle(slot: int) -> None:
            nonlocal lost
            w = works[slot]
            works[slot] = None
            if w is not None:
                dst, work = w
                try:
                    g.guard("gloo send", work.wait)  # type: ignore[attr-defined]
                except SyncError as e:
                    dead.add(dst)
                    lost = lost or f"sending to rank {dst} failed ({cause_line(e)})"

        def submit(i: int) -> Future[Packed] | None:
            nonlocal lost
            if i >= len(self._buckets) or failure or aborted or lost:
                return None
            settle(i % nring)
            bk = self._buckets[i]
            try:  # a ring of ipc buckets (ipc_buckets) waits here for the receiver's copy
                if device:  # a host bucket the GPU copies into: page-locked
                    win: torch.Tensor | None = g.device_window(bk.receiver, bk.index, lock=from_gpu)
                else:  # shm: pack straight into the link's slot
                    win = g.window(bk.receiver, bk.index)
            except SyncError as e:
                dead.add(bk.receiver)
                lost = lost or f"sending to rank {bk.receiver} failed ({cause_line(e)})"
                return None
            bufs[i % nring] = self._ring[i % nring] if win is None else win
            args = (sched, bk, bufs[i % nring], seq, version, full)
            pack = partial(
                cuda.on_streams,
                streams,
                self._packer.device_message if device else self._packer.message,
            )
            if not full and self._untouched(sched, bk):  # a header only: no thread hand-off
                done: Future[Packed] = Future()
                try:
                    done.set_result(pack(*args))
                except Exception as e:
                    done.set_exception(e)
                return done
            return self._pool.submit(pack, *args)

        # buckets packed ahead (the ring of private buffers holds one more). On a ring of ipc
        # buckets a bucket is packed into the memory of the one ``ipc_buckets`` before it on
        # its link, once the receiver copied that one out (window() waits for it), so no more
        # than ``ipc_buckets`` ahead, and with as many ahead as the ring has buckets, the next
        # is submitted only once the last one was published (``late``: window() would not wait
        # for a bucket not published yet, and would let it be overwritten)
        depth = 1 if device else self.pack_threads
        if ring and not device:
            depth = min(depth, g.ipc_buckets or depth)
        late = ring and not device and depth > 1
        ahead: deque[Future[Packed] | None] = deque(submit(j) for j in range(depth))
        try:
            for i, bk in enumerate(self._buckets):
                if late and i > 0:  # bucket i - 1 was published: its successor on the ring may go
                    ahead.append(submit(i - 1 + depth))
                packed: Packed | None = None
                fut = ahead.popleft()
                if fut is not None:
                    try:
                        packed = fut.result()
                    except Exception as e:  # told to every rank by the vote; stubs from here on
                        failure = (
                            f"rank {g.rank} failed packing bucket {bk.index} for rank "
                            f"{bk.receiver}: {e!r}"
                        )
                        cause = e
                if time.monotonic() >= next_check and not (failure or aborted or lost):
                    next_check = time.monotonic() + _ABORT_CHECK
                    try:
                        why = g.aborted(seq)
                    except SyncError as e:
                        why = f"lost: store unreachable ({e})"
                    if why is not None:
                        aborted = why
                        if why.startswith("lost: "):
                            lost = why[6:]
                if not late:
                    ahead.append(submit(i + depth))
                if bk.receiver in dead:
                    continue
                ok = packed is not None and not (failure or aborted or lost)
                if group and (not ok or group_bytes >= _DEVICE_GROUP_BYTES):
                    flush()
                if ok:
                    assert packed is not None
                    nbytes, present, payload, zero_copy = packed
                    if isinstance(present, DeviceDigests):  # read at the publish or the round's end
                        if present.inline is None:
                            on_device.append((bk, present))
                    else:
                        for k, d in enumerate(present):
                            if d is not None:
                                digests[(bk.receiver, bk.index, k)] = d
                    per_link[bk.receiver] = per_link.get(bk.receiver, 0) + payload
                    buf = bufs[i % nring][:nbytes]
                    if device:  # packed in the bucket, on its device: published with its group
                        assert isinstance(present, DeviceDigests)
                        group.append((bk, nbytes, present))
                        group_bytes += nbytes
                        wire_bytes += nbytes
                        if ring:  # the receiver copies it out before its memory is packed again
                            flush()
                        continue
                    try:
                        if g.window(bk.receiver, bk.index) is not None:  # packed in place
                            works[i % nring] = (
                                bk.receiver,
                                g.publish(bk.receiver, bk.index, nbytes),
                            )
                        else:
                            works[i % nring] = (bk.receiver, g.isend(buf, bk.receiver, bk.index))
                            # after the header: the receiver reads it first
                            for t, tag in zero_copy:
                                directs.append((bk.receiver, g.isend(t, bk.receiver, tag)))
                                wire_bytes += t.numel()
                                zero_copy_bytes += t.numel()
                    except SyncError as e:
                        dead.add(bk.receiver)
                        lost = lost or f"sending to rank {bk.receiver} failed ({cause_line(e)})"
                        continue
                    wire_bytes += nbytes
                else:  # the round failed: a header-only message so the receiver's recv completes
                    stub = torch.empty(wire.header_words(len(bk.pieces)) * 8, dtype=torch.uint8)
                    wire.write_header(
                        stub, seq, version, bk.index, wire.ABORT, [None] * len(bk.pieces), 0
                    )
                    try:
                        stubs.append((bk.receiver, g.isend(stub, bk.receiver, bk.index), stub))
                    except SyncError as e:  # (on a ring, the wait for the receiver's copy too)
                        dead.add(bk.receiver)
                        lost = lost or f"sending to rank {bk.receiver} failed ({cause_line(e)})"
        finally:  # packed past a failure, or an error raised here: never left writing the ring
            for fut in ahead:
                if fut is not None:
                    fut.exception()
        flush()
        for slot in range(nring):
            settle(slot)
        if on_device:  # a device round's digests: one copy to the host per device they lie on
            for (bk, d), host in zip(
                on_device, rows_on_host([d.rows for _, d in on_device]), strict=True
            ):
                for k, dg in enumerate(d.resolve(host, len(bk.pieces))):
                    if dg is not None:
                        digests[(bk.receiver, bk.index, k)] = dg
        rest = [(d, w) for d, w in [*directs, *((d, w) for d, w, _ in stubs)] if d not in dead]
        drained = g.drain_sends(seq, rest)  # always waited for, even after a loss
        lost = lost or drained
        return failure, cause, lost, wire_bytes, len(self._buckets), zero_copy_bytes

    def _publish_device(
        self,
        group: list[tuple[LinkBucket, int, DeviceDigests]],
        digests: dict[tuple[int, int, int], tuple[int, int]],
    ) -> list[tuple[int, object]]:
        """A group of a device round's packed buckets (``bucket, message bytes, digests``)
        published (``ipc_links.py``) after one wait for the device: the digests of those whose
        header goes in the link's cell read in one copy and written into their headers (a
        bucket with nothing packed is its header alone); the others' digests are read with the
        round's last. Returns (receiver, work or the SyncError its publish raised) per bucket."""
        g = self.group
        inline = [p for _, _, p in group if p.inline is not None and p.present]
        host = iter(rows_on_host([p.rows for p in inline]))
        # the group has landed: waited for where its digests were taken (a CUDA bucket's
        # device, or the GPU whose tensors were copied into host buckets) and where its buckets
        # lie (a header copied into a CUDA bucket on another GPU); a group of header-only
        # messages in the cells queued nothing on a device, and waits for none
        queued = [(bk, p) for bk, _, p in group if p.present or p.inline is None]
        landed = {p.rows.device: p.rows for _, p in queued}
        for bk, _ in queued:
            w = g.device_window(bk.receiver, bk.index)
            landed.setdefault(w.device, w)
        for t in landed.values():
            cuda.wait_for(t)
        out: list[tuple[int, object]] = []
        for bk, nbytes, packed in group:
            try:
                if packed.inline is None:
                    work = g.publish(bk.receiver, bk.index, nbytes, device=True, landed=True)
                elif not packed.present:
                    work = g.publish_inline(bk.receiver, bk.index, packed.inline)
                else:
                    mine = next(host)
                    for k, d in enumerate(packed.resolve(mine, len(bk.pieces))):
                        if d is not None:
                            digests[(bk.receiver, bk.index, k)] = d
                    header = packed.header(mine)
                    work = g.publish(
                        bk.receiver, bk.index, nbytes, device=True, header=header, landed=True
                    )
            except SyncError as e:
                work = e
            out.append((bk.receiver, work))
        return out

    def _fusable(self, local: Mapping[str, torch.Tensor]) -> frozenset[str]:
        """A full device round: the tensors its pack copies and fingerprints in one pass (the
        scan's read of them saved; ``fingerprint.pack_fingerprinted``), where the fused kernel
        runs on the buckets' device: those a bucket carries whole, on that device, read in
        place as whole words (cast ones: the cast copy's). One the pack cannot fuse after all
        has no fingerprints committed and goes whole next round (``HostMirror.scan``)."""
        dev = self.group.ipc_device
        if dev is None or self.mirror.chunk_bytes != CHUNK or not fused_copies():
            return frozenset()
        if dev.type == "cuda" and dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        if not fuses(dev, fingerprint_kernel()):
            return frozenset()
        out = []
        for n in self._whole:
            t = local.get(n)
            if t is None or t.device != dev or not t.numel():
                continue
            cast = self._casts.get(n)
            if cast is not None and cast != t.dtype:  # a new tensor of the wire dtype
                fits = t.numel() * cast.itemsize % 8 == 0
            else:
                fits = t.is_contiguous() and whole_words(t)
            if fits:
                out.append(n)
        return frozenset(out)

    def _untouched_tensors(self, vers: dict[str, tuple[int, int, torch.Tensor]]) -> frozenset[str]:
        """``detect="version"``: the local tensors whose storage and in-place version counter
        (this round's readings, ``vers``) did not move since the last committed round (a device
        round neither casts nor fingerprints them); none with ``"hash"``."""
        if self.detect != "version":
            return frozenset()
        return frozenset(
            n
            for n, (ptr, ver, _) in vers.items()
            if n in self._vers and self._vers[n][:2] == (ptr, ver)
        )

    def _untouched(self, sched: Schedule, bk: LinkBucket) -> bool:
        """``detect="version"``: no tensor of this bucket was written since the last commit,
        so its message is a header only (packed on the calling thread: handing such a bucket to
        the packing thread cost more than packing it, with both threads wanting the GIL)."""
        return all(
            self._detector.moved(sched.tensors[p.tensor].name, (bk.receiver, bk.index, k)) is False
            for k, p in enumerate(bk.pieces)
        )

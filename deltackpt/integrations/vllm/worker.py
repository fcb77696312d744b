"""Worker side of the ``deltackpt`` vLLM backend: one :class:`~deltackpt.sync.WeightReceiver`
round per ``update_weights`` call, loaded through the model's own ``load_weights``.

Why the model's ``load_weights`` and vLLM's layerwise reload, not writes into the parameters:
vLLM fuses and reorders checkpoint tensors (``q/k/v_proj`` into ``qkv_proj``, ``gate/up_proj``
into ``gate_up_proj``), shards them under tensor parallelism, and on CPUs with the kernels for it (AVX-512, AMX)
repacks every linear weight into a kernel layout after loading and drops the parameter
(``remove_weight=True``; on AVX2 it keeps the parameter). So
every tensor goes the checkpoint path: ``initialize_layerwise_reload``, ``model.load_weights``,
``finalize_layerwise_reload`` (what vLLM's own nccl engine runs), and the kernels are rebuilt.

Why all of that happens inside ``receive_weights`` and ``start_weight_update`` /
``finish_weight_update`` are no-ops: the layerwise reload takes every layer off its storage
until it is finalized, and a round that fails makes vLLM drop the update session without
calling ``finish_weight_update``. Here the reload starts only after every rank voted to commit,
and is finalized in the same call, so a failed round never touches the model (transactional:
weights and ``version`` stay those of the last committed round).

**Staged rounds: prepared while the engine serves, committed in a short pause.** With
``update_weights({"version": v, "stage": True})`` the call only starts the round on a
background thread and returns, so the engine goes on generating while the round is received,
verified and applied to the receiver's own copies (the model is not touched); the
``finish_weight_update`` that follows is the **commit**: it waits for the staged round and runs
the model's reload of the changed layers, the only part that needs the engine paused (vLLM runs a
worker RPC between engine steps). A plain ``update_weights`` (no ``stage``) does both in one call,
as before.

**A commit that fails is rolled back, on every worker.** Each worker reloads, then the workers
vote through the group's store (a dead worker is seen by its heartbeat); if any reload failed
(an exception in ``load_weights``, at any layer) every worker takes the round back: the
receiver puts the previous bytes back into its copies (``WeightReceiver.pull(undo=True)``
kept what the round overwrote: for a patch only the changed elements) and the touched layers
are reloaded from them, so every worker ends bit-exact on the previous version and says so in
the error. The trainer sends the next round whole. The RPCs never raise for a commit taken back (a
failing RPC on one of several workers desynchronizes vLLM 0.32's executor): the trainer reads
the workers' vote. A reload that fails again during the rollback cannot be undone: the worker
must be restarted (``broken``).

Why a delta round loads whole decoder layers: a layer whose reload loads some of its tensors
is rebuilt from those alone, so every tensor of a decoder layer (the names sharing the
outermost index, ``model.layers.<i>.``) that had a changed tensor is handed over again, from
the receiver's committed copies; the tensors outside the layers (embeddings, final norm,
``lm_head``) form one more group. The wire still carries only the changed elements.

**Two routes into one model.** An engine can take versions from a trainer (this backend) and
from a store (the worker extension's ``deltackpt_follow``); each route keeps its own complete
copy and hands the model only what changed since *its* last version. So each marks the model
as its own when it writes (:func:`mark_written`), and a route that finds the other's mark hands
over every tensor of its copy once (:func:`whole_if_overwritten`), never a delta onto the other
route's weights (which would leave the untouched layers on another version).
"""

from __future__ import annotations

import ctypes
import logging
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from deltackpt import cuda
from deltackpt.integrations.vllm import feed, fp8_layout, inplace, joins, tp_boxes
from deltackpt.integrations.vllm.feed import layer_key, model_device, reload_batch
from deltackpt.options import vllm_staging, vllm_undo_dir
from deltackpt.sync import RoundAbortedError, RoundStats, SyncError, SyncGroup, WeightReceiver
from deltackpt.sync.schedule_decl import Box
from deltackpt.sync.spill import ram_filesystem

__all__ = [
    "DeltackptInitInfo",
    "DeltackptUpdateInfo",
    "DeltackptWeightTransferEngine",
    "allow_cpu_tiles",
    "commit_layers",
    "commit_verdict",
    "first_workers",
    "layer_key",
    "mark_store_step",
    "mark_written",
    "new_writer",
    "reload_layers",
    "wait_staged",
    "whole_if_overwritten",
    "written_by_other",
]

log = logging.getLogger(__name__)
#: the workers' default for ``DeltackptInitInfo.staging``
STAGING_ENV = "DELTACKPT_VLLM_STAGING"
#: the workers' default for ``DeltackptInitInfo.undo_dir`` ("memory": keep it in memory)
UNDO_DIR_ENV = "DELTACKPT_VLLM_UNDO_DIR"
#: ``0`` leaves a staged round's element writes to its commit (inplace.prepare off)
PREPARE_ENV = "DELTACKPT_VLLM_PREPARE"
#: seconds between a worker's looks at its trainers while the engine serves (SyncGroup.lost)
WATCH_S = 1.0
# groups this worker left (a new trainer, a lost one): kept referenced, never destroyed, since
# tearing down a gloo group with receives still posted (a round its trainer died in) blocks
# until the group timeout
_RETIRED: list[SyncGroup] = []


@dataclass
class DeltackptInitInfo(WeightTransferInitInfo):
    """What a worker needs to join the trainer's :class:`~deltackpt.sync.SyncGroup` (sent by
    the trainer engine at ``init_weight_transfer_engine``). A worker's rank in the group is
    ``rank_offset`` + its global vLLM worker rank (data-parallel index x world size + rank)."""

    master_addr: str
    master_port: int
    world_size: int
    trainers: list[int] = field(default_factory=lambda: [0])
    rank_offset: int = 1
    links: str = "auto"
    timeout: float = 60.0
    bucket_bytes: int = 64 << 20
    # receive only this worker's tensor-parallel boxes (None: the DELTACKPT_VLLM_TP_BOXES
    # environment variable of the workers decides; docs/sync.md, "Memory")
    tp_boxes: bool | None = None
    # write commits into the parameters seen to hold the tensors as they are (None: the
    # DELTACKPT_VLLM_INPLACE environment variable of the workers decides, on by default)
    inplace: bool | None = None
    # WeightReceiver(staging=): "round" or "ring" (None: DELTACKPT_VLLM_STAGING, else "ring")
    staging: str | None = None
    # WeightReceiver(undo_dir=): a directory, or "memory" (None: DELTACKPT_VLLM_UNDO_DIR, else
    # with staging "ring" the temporary directory unless it is kept in memory; undo_dir_for)
    undo_dir: str | None = None


def undo_dir_for(value: str | None, staging: str) -> str | None:
    """Where a worker keeps the bytes a round sent whole overwrote, for taking it back (None:
    in memory). Explicit: ``value``, else ``DELTACKPT_VLLM_UNDO_DIR``; ``"memory"`` keeps them
    in memory. Default: with ``staging="ring"`` (whose point is a bounded host memory) the
    temporary directory, unless that is a RAM filesystem (tmpfs: no memory saved there)."""
    chosen = value or vllm_undo_dir()
    if chosen:
        return None if chosen == "memory" else chosen
    if staging != "ring":
        return None
    tmp = tempfile.gettempdir()
    return None if ram_filesystem(tmp) else tmp


@dataclass
class DeltackptUpdateInfo(WeightTransferUpdateInfo):
    """One round: ``version`` is the trainer's (checked against the committed round);
    ``stage``: receive it in the background and load it at ``finish_weight_update``."""

    version: int | None = None
    stage: bool = False
    commit: int | None = None  # names the workers' commit vote (the trainer's count)


def _libc() -> Any:
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.malloc_trim.argtypes = [ctypes.c_size_t]
        return libc
    except (OSError, AttributeError):  # not glibc
        return None


_LIBC = _libc()


def _wire(dtype: str) -> torch.dtype:
    from deltackpt.sync.dtypes import wire_dtype

    return wire_dtype(dtype)


#: what a staged round moved to the device before its commit: element writes for a commit in
#: place (:func:`.inplace.prepare`), the reload's tensors for one through ``load_weights``
#: (:func:`.feed.ahead`)
Prepared = inplace.Prepared | feed.Ahead


def reload_layers(
    model: Any,
    model_config: Any,
    held: dict[str, torch.Tensor],
    changed: list[tuple[str, torch.Tensor]],
    fail_at: str | None = None,
    expand: Callable[[str, torch.Tensor], torch.Tensor] | None = None,
    device: torch.device | None = None,
    ahead: feed.Ahead | None = None,
) -> None:
    """Load ``changed`` into a vLLM ``model`` through its own ``load_weights``, inside vLLM's
    layerwise reload, widened to whole layers from ``held`` (every tensor last loaded, by
    checkpoint name; updated here with ``changed``): see the module doc for why. ``expand``
    turns a held tensor into what ``load_weights`` takes (a tensor-parallel box into its
    full-shape view, :func:`~deltackpt.integrations.vllm.tp_boxes.full_view`), one tensor at a
    time as the model consumes them. ``device``: where the parameters live, when that is a
    GPU: the tensors cross to it before ``load_weights`` gets them (:func:`.feed.feed`; those
    of ``ahead`` crossed already)."""
    batch = reload_batch(held, changed)
    held.update(changed)
    from vllm.model_executor.model_loader.reload import (
        finalize_layerwise_reload,
        initialize_layerwise_reload,
    )

    initialize_layerwise_reload(model)
    try:
        model.load_weights(_failing_at(feed.feed(batch, device, expand, prepared=ahead), fail_at))
    finally:  # layers that got nothing get their old kernels back
        finalize_layerwise_reload(model, model_config)
        if device is None or device.type == "cpu":  # the model runs on the host's kernels
            allow_cpu_tiles()
    if fail_at == "end":
        raise RuntimeError("deltackpt test hook: the commit fails after the last layer")


def allow_cpu_tiles() -> bool:
    """Ask Linux for this process's use of the AMX tile registers, on a processor that has
    them; True when allowed (or when there are none to ask for). vLLM's CPU build (0.32)
    chooses AMX attention kernels at start, but the request for the registers (per process,
    ``arch_prctl``) is made by the first forward's own matrix products: after a reload that
    precedes the first forward (an RL trainer's first push), nothing has made it, and the
    next forward dies of SIGILL in ``cpu_attention_with_kv_cache`` (vLLM's own layerwise
    reload does the same, without deltackpt). Asking twice is harmless."""
    cpu = getattr(torch, "cpu", None)
    if cpu is None or not getattr(cpu, "_is_amx_tile_supported", lambda: False)():
        return True
    return bool(cpu._init_amx())


def commit_layers(
    model: Any,
    model_config: Any,
    held: dict[str, torch.Tensor],
    changed: list[tuple[str, torch.Tensor]],
    slots: dict[str, inplace.Slot] | None,
    fail_at: str | None = None,
    expand: Callable[[str, torch.Tensor], torch.Tensor] | None = None,
    shapes: dict[str, tuple[int, ...]] | None = None,
    boxes: dict[str, Box | None] | None = None,
    elements: dict[str, torch.Tensor | None] | None = None,
    prepared: Prepared | None = None,
) -> str:
    """Bring ``model`` to ``held`` updated with ``changed``: written into the parameters when
    every changed tensor has a current slot (``slots``; None: never, :mod:`.inplace`), else
    :func:`reload_layers` and the reloaded tensors' slots learned again. ``fail_at`` is the test
    hook of :func:`reload_layers` (a layer, or ``"end"``); ``elements``: the changed elements
    per tensor, written alone where few (:func:`.inplace.write`); ``prepared``: what a staged
    round moved to the device ahead (:data:`Prepared`). Returns ``"in place"`` or
    ``"reload"``."""
    names = [n for n, _ in changed]
    # ordered with the engine on its GPU whichever thread commits (vLLM's Ray compiled-graph
    # executor runs its steps on another thread, on another stream): a step still running
    # reads the weights about to be written; the next one must see every byte
    devices = {p.device for p in model.parameters()}
    cuda.synchronize(devices)
    device = model_device(model)
    try:
        if slots is not None and names and inplace.usable(model, slots, names):

            def hook(name: str) -> None:
                if fail_at is not None and layer_key(name) == fail_at:
                    raise RuntimeError(
                        f"deltackpt test hook: the commit fails at layer {fail_at!r}"
                    )

            writes = prepared if isinstance(prepared, inplace.Prepared) else None
            inplace.write(slots, held, changed, hook, elements, writes)
            if fail_at == "end":
                raise RuntimeError("deltackpt test hook: the commit fails after the last layer")
            return "in place"
        touched = {layer_key(n) for n in names}
        try:
            ahead = prepared if isinstance(prepared, feed.Ahead) else None
            reload_layers(model, model_config, held, changed, fail_at, expand, device, ahead)
        finally:  # a failed reload may have replaced parameters: what is seen now counts
            if slots is not None:
                again = [n for n in held if layer_key(n) in touched]
                inplace.learn(model, held, again, shapes or {}, boxes or {}, slots)
        return "reload"
    finally:
        cuda.synchronize(devices)


#: the model attribute naming the route that last wrote its weights (:func:`mark_written`)
WRITER_ATTR = "_deltackpt_writer"


def new_writer(route: str) -> str:
    """A token naming one route's instance (a weight-transfer engine, a follower) for
    :func:`mark_written`: unique in the process, never reused."""
    return f"{route}-{uuid.uuid4().hex}"


def mark_written(model: Any, writer: str) -> None:
    """``writer`` is about to write ``model``'s weights: the next commit of any other route hands
    over every tensor (:func:`whole_if_overwritten`). Marked before the write: a failed write
    leaves the weights to this route's rollback or resend, never to the other route's delta."""
    model.__dict__[WRITER_ATTR] = writer


#: the model attribute holding the step of the store snapshot the store route wrote last
STEP_ATTR = "_deltackpt_store_step"


def mark_store_step(model: Any, step: int | None) -> None:
    """The store route wrote ``model`` with a snapshot of training step ``step`` (None: one
    without a step): what a trainer that joins is told the engine serves
    (:meth:`DeltackptWeightTransferEngine.serving`)."""
    model.__dict__[STEP_ATTR] = step


def written_by_other(model: Any, writer: str) -> bool:
    """A route other than ``writer`` (or a load outside both) wrote ``model`` last; False when
    nothing marked it yet (the engine's own load)."""
    last = model.__dict__.get(WRITER_ATTR)
    return last is not None and last != writer


def whole_if_overwritten(
    model: Any, writer: str, held: dict[str, torch.Tensor], changed: list[tuple[str, torch.Tensor]]
) -> list[tuple[str, torch.Tensor]] | None:
    """Every tensor of ``held`` (updated with ``changed``) when another route than ``writer``
    wrote ``model`` last: its weights are not ``held``'s previous version, so loading
    ``changed`` alone would leave the rest on the other route's. None when ``writer`` wrote it
    last, nothing marked it yet (the engine's own load: each route's first version is whole
    anyway) or ``held`` is empty (a first, whole version)."""
    if not held or not written_by_other(model, writer):
        return None
    view = dict(held)
    view.update(changed)
    return list(view.items())


def first_workers(value: str | None) -> str | None:
    """The first worker's ``value`` on every worker of this engine: called by all of them at
    once, inside one ``collective_rpc`` (or the engine's model load), so that they act on one
    snapshot name where each picking its own could differ (a trainer committing a newer one
    between their looks). Within the engine's own workers only: its tensor-parallel group (from
    its first rank), then its pipeline-parallel group (whose first rank holds the first
    worker's value by then), over their CPU groups; never vLLM's world group, which spans the
    workers of every data-parallel engine (an RPC that reaches one of them would wait for the
    others)."""
    import torch.distributed as dist
    from vllm.distributed.parallel_state import get_pp_group, get_tp_group

    for g in (get_tp_group(), get_pp_group()):
        if g.world_size > 1:
            box = [value]
            dist.broadcast_object_list(box, src=g.ranks[0], group=g.cpu_group)
            value = None if box[0] is None else str(box[0])
    return value


def _failing_at(
    batch: Iterator[tuple[str, torch.Tensor]], fail_at: str | None
) -> Iterator[tuple[str, torch.Tensor]]:
    """``batch``, raising at the first tensor of layer ``fail_at`` (a test hook: the
    extension's ``deltackpt_fail_next_commit``)."""
    for n, t in batch:
        if fail_at is not None and layer_key(n) == fail_at:
            raise RuntimeError(f"deltackpt test hook: the commit fails at layer {fail_at!r}")
        yield n, t


@dataclass
class _Staged:
    """A round received in the background (``update_weights`` with ``stage``)."""

    version: int | None
    key: str
    changed: list[tuple[str, torch.Tensor]] = field(default_factory=list)
    # what it moved to the device ahead of the commit (element writes or the reload's tensors)
    prepared: Prepared | None = None
    error: BaseException | None = None
    thread: threading.Thread = field(default_factory=threading.Thread)


def _staged_base(group: SyncGroup, key: str) -> str:
    return f"vllm/staged/{group.epoch}/{key}"


def wait_staged(group: SyncGroup, key: str, what: str) -> None:
    """Wait until every worker applied the staged round ``key`` to its copies."""
    base = _staged_base(group, key)
    keys = [f"{base}/{r}" for r in range(group.world_size) if r not in group.trainers]
    group.wait_until(lambda: bool(group.store.check(keys)), what, None)


def commit_keys(group: SyncGroup, key: str) -> list[str]:
    """The store keys of the workers' votes on commit ``key`` (one per worker rank)."""
    base = f"vllm/commit/{group.epoch}/{key}"
    return [f"{base}/{r}" for r in range(group.world_size) if r not in group.trainers]


def commit_verdict(group: SyncGroup, key: str, what: str) -> str | None:
    """Wait for every worker's vote on commit ``key``: None when every reload succeeded, else
    the first failure (a dead worker: :class:`~deltackpt.sync.PeerLostError`, by heartbeat)."""
    keys = commit_keys(group, key)
    group.wait_until(lambda: bool(group.store.check(keys)), what, None)
    vals = group.guard("store multi_get", lambda: group.store.multi_get(keys))
    bad = [bytes(v).decode(errors="replace") for v in vals if v]
    return None if not bad else f"{bad[0]} ({len(bad)} of {len(keys)} workers failed)"


def commit_vote(group: SyncGroup, key: str, mine: str | None) -> str | None:
    """Vote on commit ``key`` (``mine``: this worker's failure) and wait for the verdict."""
    me = f"vllm/commit/{group.epoch}/{key}/{group.rank}"
    group.guard("store set", lambda: group.store.set(me, mine or ""))
    return commit_verdict(group, key, f"commit {key}: waiting for every worker's reload")


class DeltackptWeightTransferEngine(WeightTransferEngine[DeltackptInitInfo, DeltackptUpdateInfo]):
    """``WeightTransferConfig(backend="deltackpt")`` on the workers (see module doc)."""

    init_info_cls = DeltackptInitInfo
    update_info_cls = DeltackptUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config: Any, vllm_config: Any, device: torch.device, model: Any) -> None:
        super().__init__(config, vllm_config, device, model)
        self.group: SyncGroup | None = None
        self.receiver: WeightReceiver | None = None
        self._served: int | None = None  # the version served when the last link was released
        self.last_stats: RoundStats | None = None
        # the receiver's committed copies, by trainer name: the same buffers every round of a
        # schedule (refreshed by each full round, which hands over every tensor)
        self._held: dict[str, torch.Tensor] = {}
        self._plain = 0  # update_weights calls on this group: name votes without a commit id
        self._staged: _Staged | None = None
        self._rollback: list[tuple[str, torch.Tensor]] | None = None
        self._voted = False
        self.last_commit: dict[str, Any] | None = None
        self.broken: str | None = None  # a rollback failed: the model is mixed, restart
        self.fail_next: str | None = None  # test hook (the extension's deltackpt_fail_next_commit)
        # the engine's block-FP8 weights (fp8_layout.engine_layout; None: it holds none)
        self.fp8: dict[str, Any] | None = None
        # tp_boxes: per trainer tensor, its full shape and the box this worker holds (None:
        # whole); empty when every tensor is received whole
        self.tp_boxes = False
        self._shapes: dict[str, tuple[int, ...]] = {}
        self._boxes: dict[str, Box | None] = {}
        self._rules: dict[str, tp_boxes.BoxRule] = {}
        self._rule: Callable[[str, tuple[int, ...]], tp_boxes.BoxRule] | None = None
        # in-place commits: where each held tensor was seen in the parameters (inplace.py)
        self.inplace = inplace.enabled()
        self.prepare = True
        self._slots: dict[str, inplace.Slot] = {}
        self.last_path: str | None = None  # "in place" or "reload": the last commit's path
        self._elements: dict[str, torch.Tensor | None] | None = None  # the commit's changes
        # why the last trainer's link was released without its shutdown (it died while the
        # engine served: _watch), None otherwise
        self.lost: str | None = None
        # the calls that use or replace the link (the trainer's RPCs) against _watch's release
        self._lock = threading.RLock()
        self._watching: threading.Event | None = None  # set: the watch of the last link ends
        # this route's mark on the model (mark_written: a store follow writes it too)
        self._writer = new_writer("trainer")

    def _rank(self, info: DeltackptInitInfo) -> int:
        from vllm.distributed.parallel_state import get_world_group

        pc = self.parallel_config
        dp = int(getattr(pc, "data_parallel_index", 0) or 0)
        return info.rank_offset + dp * pc.world_size + get_world_group().rank_in_group

    def init_transfer_engine(self, init_info: DeltackptInitInfo) -> None:
        with self._lock:
            self._init(init_info)

    def _init(self, init_info: DeltackptInitInfo) -> None:
        self.shutdown()
        self.lost = None
        self.group = SyncGroup(
            init_info.master_addr,
            init_info.master_port,
            self._rank(init_info),
            init_info.world_size,
            init_info.trainers,
            timeout=init_info.timeout,
            links=init_info.links,
        )
        # the wire carries the engine's dtype (the cast runs on the trainer); FP8 weights and
        # their scales keep theirs (resolve_dtype), as the trainer quantized them for this
        # engine's layout, published here
        self.fp8 = fp8_layout.engine_layout(self.model)
        dtype = self.model_config.dtype
        fp8_layout.publish(self.group, self.fp8)
        # the trainer's versions continue after this one; it leaves out what the model ignores
        ignores = joins.ignored_names(self.model, self.model_config.hf_config)
        joins.publish(self.group, self.serving(), ignores)
        self.tp_boxes = tp_boxes.enabled(init_info.tp_boxes)
        self.inplace = inplace.enabled(init_info.inplace)
        # a staged round moves its commit's device copies ahead (read here: a malformed value
        # fails the init, not a round)
        self.prepare = inplace.enabled(None, PREPARE_ENV)
        self._shapes, self._boxes, self._rules = {}, {}, {}
        # two message slots unless told otherwise: the same round times as a round's arena,
        # measured, at a fraction of its memory (docs/sync.md, "Memory")
        staging = init_info.staging or vllm_staging()
        self.receiver = WeightReceiver(
            self.group,
            dtype=dtype,
            bucket_bytes=init_info.bucket_bytes,
            boxes=self._box_of if self.tp_boxes else None,
            staging=staging,
            undo_dir=undo_dir_for(init_info.undo_dir, staging),
        )
        self._plain = 0
        self._staged = None
        self._watching = threading.Event()
        threading.Thread(
            target=self._watch, args=(self.group, self._watching), name="deltackpt-watch",
            daemon=True,
        ).start()  # fmt: skip

    def _watch(self, g: SyncGroup, stop: threading.Event) -> None:
        """While the engine serves: release this link's side once its trainer is gone (the
        group's store stopped answering, a trainer's process died or stopped beating, or a
        round failed on a lost peer and broke the group), instead of holding its staging,
        committed copies and link buffers (on a GPU link, the dead trainer's memory through
        its handles) until the next trainer's init. The next trainer's first round is whole
        either way; the model and the version it serves stay."""
        while not stop.wait(WATCH_S):
            if not self._lock.acquire(blocking=False):
                continue  # a call of the trainer's is running: it sees a loss by itself
            try:
                if self.group is not g or stop.is_set():
                    return
                staged = self._staged
                if staged is not None and staged.thread.is_alive():
                    continue  # its pull sees a loss by itself: released after
                # a trainer between rounds may hold the GIL for seconds (its heartbeat is a
                # thread): silent for the group's timeout, not dead_after, before it counts
                why = g.lost(g.trainers, silent=g.timeout)
                if why is None:
                    continue
                self.shutdown()
                self.lost = why
                log.warning(
                    "deltackpt: the trainer's link was released (%s); the engine serves "
                    "version %s until a trainer's init_weight_transfer_engine",
                    why,
                    self._served,
                )
                return
            finally:
                self._lock.release()

    def _box_of(self, name: str, shape: tuple[int, ...]) -> Box | bool | None:
        """The box of trainer tensor ``name`` (of ``shape``) this worker's model loads (None:
        the whole tensor; False: none of it, another worker's expert): ``tp_boxes``' rules,
        asked by the receiver at its setup."""
        if self._rule is None:
            self._rule = tp_boxes.box_rules(self.model)
        rule = self._rule(name, shape)
        self._rules[name] = rule
        self._shapes[name], self._boxes[name] = tuple(shape), rule.box
        return False if rule.skip else rule.box

    def _trim(self, always: bool = False) -> None:
        """With ``tp_boxes`` (or ``always``): hand the heap pages the round freed (the
        rollback's old bytes, the commit's full-shape views) back to the system (glibc's
        ``malloc_trim``), so the worker's resident memory follows what it holds (docs/sync.md,
        "Memory")."""
        if (always or self.tp_boxes) and _LIBC is not None:
            _LIBC.malloc_trim(0)

    def _expand(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """What ``load_weights`` takes for held tensor ``name``: its full-shape view."""
        box = self._boxes.get(name)
        if box is None:
            return t
        return tp_boxes.full_view(t, box, self._shapes[name])

    def start_weight_update(self) -> None:
        """Nothing: the reload runs at the commit (module doc)."""

    def finish_weight_update(self) -> None:
        """The commit of a staged round (module doc); nothing after a plain round, which is
        already loaded and finalized. Never raises (a failing RPC on one of several workers
        desynchronizes vLLM 0.32's executor): the outcome is the workers' vote in the group's
        store, which the trainer reads, and ``last_commit`` here."""
        with self._lock:
            self._finish()

    def _finish(self) -> None:
        staged, self._staged = self._staged, None
        if staged is None:
            return
        staged.thread.join()
        if staged.error is not None:  # the round itself failed: the model was never touched
            self.last_commit = {"version": staged.version, "ok": False, "why": str(staged.error)}
            return
        assert self.receiver is not None
        t0 = time.perf_counter()
        # device bytes the round moved ahead of its pause, and those its commit did not use
        early = staged.prepared
        moved = {"prepared_bytes": 0 if early is None else early.device_bytes}
        try:
            self._commit(
                staged.changed, staged.version, staged.key, undo=self.receiver.revert,
                prepared=early,
            )  # fmt: skip
        except Exception as e:
            self.last_commit = {"version": staged.version, "ok": False, "why": str(e), **moved}
            log.error("%s", e)
            return
        moved["prepared_unused"] = 0 if early is None else early.device_bytes
        self.last_commit = {
            "version": staged.version, "ok": True, "why": "", "seconds": time.perf_counter() - t0,
            **moved,
        }  # fmt: skip

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self.receive_weights(self.parse_update_info(update_info))
        cuda.synchronize([self.device])  # the base class's sync, on the worker's device

    def receive_weights(self, update_info: DeltackptUpdateInfo) -> None:
        with self._lock:
            self._receive(update_info)

    def _receive(self, update_info: DeltackptUpdateInfo) -> None:
        if self.receiver is None and self.lost is not None:
            raise RuntimeError(
                f"deltackpt: update_weights after the trainer's link was released ({self.lost}); "
                "a trainer's trainer_init sends init_weight_transfer_engine first"
            )
        if self.receiver is None:
            raise RuntimeError(
                "deltackpt: update_weights before init_weight_transfer_engine; the trainer "
                "engine's trainer_init sends the init info"
            )
        if self.broken is not None:
            raise RuntimeError(f"deltackpt: {self.broken}")
        if self._staged is not None:
            raise RuntimeError(
                "deltackpt: update_weights while a staged round waits for its commit; call "
                "finish_weight_update first"
            )
        want = update_info.version
        self._plain += 1
        key = f"c{update_info.commit}" if update_info.commit is not None else f"p{self._plain}"
        if update_info.stage:  # prepare while the engine serves (module doc)
            staged = self._staged = _Staged(want, key)
            staged.thread = threading.Thread(
                target=self._stage, args=(staged,), name="deltackpt-stage", daemon=True
            )
            staged.thread.start()
            return
        prev = self.receiver.version
        self._voted = False
        try:
            self.last_stats = self.receiver.pull(
                lambda ws: self._commit(list(ws), want, key, undo=None, prev=prev), undo=True
            )
        except SyncError as e:  # vLLM hands the driver str(e) only: name the type in it
            back, self._rollback = self._rollback, None
            if back is not None:  # pull put the receiver's copies back: now the model
                self._reload_back(back)
            if self._voted:  # a commit every worker took back: an outcome, read from the vote
                self.last_commit = {"version": want, "ok": False, "why": str(e)}
                log.error("deltackpt: %s", e)
                return
            raise type(e)(f"deltackpt {type(e).__name__}: {e}") from e
        if not self._voted:  # nothing to reload here: vote all the same (the trainer waits)
            commit_vote(self.group, key, None)
        self.receiver.drop_undo()  # the round is final: free the old bytes kept for it
        self._trim()
        self.last_commit = {"version": want, "ok": True, "why": ""}
        self._announced(want)

    def _announced(self, want: int | None) -> None:
        assert self.receiver is not None
        if want is not None and self.receiver.version != int(want):
            log.warning(
                "deltackpt: the trainer announced version %s but the round committed %s",
                want,
                self.receiver.version,
            )

    def _stage(self, staged: _Staged) -> None:
        """The background half of a staged round: receive, verify, vote, apply to the
        receiver's copies, keep the changed tensors for the commit."""
        assert self.receiver is not None and self.group is not None
        g = self.group
        if self.device.type == "cuda":  # a thread starts on GPU 0, not the worker's
            torch.cuda.set_device(self.device)
        try:
            self.last_stats = self.receiver.pull(staged.changed.extend, undo=True)
            staged.prepared = self._prepare(staged.changed)
            # applied to the copies: the trainer's send_weights(stage=True) returns once every
            # worker is here, so the commit is the reload alone
            me = f"{_staged_base(g, staged.key)}/{g.rank}"
            g.guard("store set", lambda: g.store.set(me, ""))
        except SyncError as e:
            staged.error = type(e)(f"deltackpt {type(e).__name__}: {e}")
        except BaseException as e:  # reported by finish_weight_update
            staged.error = e

    def _commit(
        self,
        changed: list[tuple[str, torch.Tensor]],
        version: int | None,
        key: str,
        undo: Any,
        prev: int | None = None,
        prepared: Prepared | None = None,
    ) -> None:
        """Reload ``changed`` (widened to whole layers) into the model, vote with the other
        workers, and on any failure anywhere take the round back (module doc). ``undo``: puts
        the receiver's previous bytes back and returns the tensors to reload (a staged round);
        None inside ``pull``, which puts them back itself once this raises. ``prepared``: what a
        staged round moved to the device already (:meth:`_prepare`)."""
        assert self.group is not None and self.receiver is not None
        old = prev if undo is None else self.receiver.reverts_to
        # the model was written by another route (a store follow) since this route's last
        # commit: every held tensor goes, not the delta alone (module doc)
        whole = whole_if_overwritten(self.model, self._writer, self._held, changed)
        if whole is not None:
            log.info("deltackpt: the model was written by another route; this commit is whole")
            changed, prepared = whole, None
        names = sorted({layer_key(n) for n, _ in changed})
        fail, self.fail_next = self.fail_next, None
        mine: str | None = None
        direct = self._direct([n for n, _ in changed])
        # which elements the round changed (its rollback writes back the same ones)
        self._elements = self.receiver.changed_elements() if direct and whole is None else None
        refused = fp8_layout.refusal(self.model, self.fp8, changed)
        try:
            if refused is None:
                mark_written(self.model, self._writer)
                self._load(changed, fail, prepared)
        except Exception as e:  # voted on, then raised below
            what = "in-place write" if direct else "reload"
            mine = f"rank {self.group.rank}: the model's {what} failed ({type(e).__name__}: {e})"
        if refused is not None:  # nothing was loaded
            mine = f"rank {self.group.rank}: {refused}"
        self.last_path = "in place" if direct else "reload"
        why = commit_vote(self.group, key, mine)
        self._voted = True
        if why is None:
            self._elements = None
            if undo is not None:  # a staged round: final now (pull(undo=True) kept its undo)
                self._announced(version)
                self.receiver.drop_undo()
                self._trim()
            # a plain round: receive_weights checks the version once pull has set it
            return
        if undo is not None:
            undo()
        # put the touched layers back from the receiver's copies, which hold the previous bytes
        # again (revert() just did; inside pull, pull does it once this error leaves it); an
        # in-place commit writes back the tensors it wrote
        if direct:
            back = [(n, self._held[n]) for n, _ in changed]
        else:
            back = [(n, t) for n, t in self._held.items() if layer_key(n) in names]
        if undo is None:
            self._rollback = back
        else:
            self._reload_back(back)
        raise RoundAbortedError(
            f"the commit of version {version} failed: {why}; every worker reloaded the layers "
            f"it touched with their previous bytes and serves "
            f"{'the weights it started with' if old is None else f'version {old}'} (nothing needs a "
            "restart); the trainer sends the next round whole"
        )

    def _reload_back(self, back: list[tuple[str, torch.Tensor]]) -> None:
        try:
            self._load(back, None)  # an in-place commit's rollback: the same elements
            self._elements = None
        except Exception as e:
            self.broken = (
                f"a rollback reload failed ({type(e).__name__}: {e}): this worker's model "
                "may mix versions; restart the engine"
            )
            raise RuntimeError(f"deltackpt: {self.broken}") from e

    def _direct(self, names: list[str]) -> bool:
        """A commit of ``names`` writes into the parameters (every one has a current slot)."""
        return self.inplace and bool(names) and inplace.usable(self.model, self._slots, names)

    def _prepare(self, changed: list[tuple[str, torch.Tensor]]) -> Prepared | None:
        """A staged round, applied to the copies: what its commit moves to a GPU moved there
        now, while the engine serves: the element writes of a commit in place, so the pause
        only scatters them (:func:`.inplace.prepare`), or the tensors a reload hands
        ``load_weights`` (:func:`.feed.ahead`: where the device has room for all of them). None
        where nothing crosses (parameters on the host) or the move failed: the commit then
        does it."""
        assert self.receiver is not None
        if not self.prepare:
            return None
        try:
            if self._direct([n for n, _ in changed]):
                return inplace.prepare(self._slots, changed, self.receiver.changed_elements())
            batch = [(n, t) for n, t in reload_batch(self._held, changed) if self._whole(n, t)]
            moved = feed.ahead(batch, model_device(self.model))
            return moved if moved.moved else None
        except Exception as e:  # (device memory taken meanwhile): done at the commit instead
            log.warning("deltackpt: the commit's device copies not prepared ahead: %r", e)
            return None

    def _whole(self, name: str, t: torch.Tensor) -> bool:
        """Held tensor ``name`` is what ``load_weights`` takes (not a box it widens)."""
        box = self._boxes.get(name)
        return box is None or tuple(t.shape) == tuple(self._shapes[name])

    def _load(
        self,
        changed: list[tuple[str, torch.Tensor]],
        fail: str | None,
        prepared: Prepared | None = None,
    ) -> str:
        slots = self._slots if self.inplace else None
        return commit_layers(self.model, self.model_config, self._held, changed, slots, fail,
                             self._expand, self._shapes, self._boxes, self._elements,
                             prepared)  # fmt: skip

    # ---- helpers for collective_rpc (tests, monitoring) -----------------------------------

    @property
    def version(self) -> int | None:
        """The version the model serves: the last committed round's (None before the first;
        while a round is staged, the one before it; after a trainer released its link, the
        version then served until a round of the next trainer commits)."""
        if self.receiver is None or self.receiver.version is None:
            return self._served
        st = self._staged
        back = self.receiver.reverts_to  # None for a first round: nothing to go back to
        if st is not None and st.error is None and not st.thread.is_alive() and back is not None:
            return back
        return self.receiver.version

    def serving(self) -> int | None:
        """The version a trainer that joins is told the engine serves: this route's
        :attr:`version`, or, where the store route wrote the model since (a follow, or the
        engine's start from a store), that snapshot's training step
        (``joins.snapshot_step``), so a trainer's versions continue after the checkpoint the
        engine serves (a snapshot without a step: this route's version)."""
        step = self.model.__dict__.get(STEP_ATTR)
        if step is not None and written_by_other(self.model, self._writer):
            return int(step)
        return self.version

    def committed(self) -> dict[str, torch.Tensor]:
        """Copies of the tensors of the last committed round, by trainer name (with
        ``tp_boxes``, this worker's box of each: :meth:`held_boxes` says where)."""
        return {n: t.detach().clone() for n, t in self._held.items()}

    def held_boxes(self) -> dict[str, tuple[tuple[int, ...], tuple[int, ...]] | None]:
        """Per trainer tensor, the box this worker holds as ``(offset, size)`` (None: whole)."""
        return {
            n: None if (b := self._boxes.get(n)) is None else (b.offset, b.size) for n in self._held
        }

    def memory(self) -> dict[str, int | bool]:
        """Host bytes this worker's receiver holds: ``held`` (its committed copies: the boxes
        with ``tp_boxes``), ``staging`` (its arena: one full round's wire bytes of its boxes),
        ``undo`` (old bytes kept in memory for a rollback until the round is final),
        ``spilled`` (those kept in ``undo_dir``'s file instead: not memory), beside ``model``
        (every trainer tensor whole, in the wire dtype) and ``share`` (what this worker's
        boxes take: ``held`` when every box is held)."""
        rc = self.receiver
        sched = None if rc is None else rc.schedule
        model = share = 0
        if sched is not None and rc is not None:
            for w, ti, box in sched.wanted[rc.group.rank]:
                t = sched.tensors[ti]
                item = torch.empty(0, dtype=_wire(w.dtype or t.dtype)).element_size()
                model += int(torch.Size(t.shape).numel()) * item
                share += box.numel * item
        return {
            "tp_boxes": self.tp_boxes,
            "held": sum(t.numel() * t.element_size() for t in self._held.values()),
            "staging": 0 if rc is None else rc.staging_bytes,
            "undo": 0 if rc is None else rc.undo_bytes,
            "spilled": 0 if rc is None else rc.spilled_bytes,
            "model": model,
            "share": share,
        }

    def param_paths(self) -> dict[str, dict[str, str]]:
        """How each tensor of the last committed round reaches this worker's model, by trainer
        name: ``param`` (the vLLM parameter it lands in), ``path`` (``in place``: a commit
        writes it into the parameter where it was seen, :mod:`.inplace`; ``load_weights``: the
        model's own loader, inside vLLM's layerwise reload) and ``layout``: ``fused into
        <param> as <part>`` (qkv, gate_up), ``tensor-parallel shard <shape> of <shape>`` or
        ``whole`` (for a parameter vLLM emptied: its module's kind, shard or whole), with
        ``, then repacked into a CPU kernel`` where vLLM empties the parameter after loading.
        """
        params = dict(self.model.named_parameters())
        packed: dict[str, list[str]] = getattr(self.model, "packed_modules_mapping", {}) or {}
        tp = int(self.parallel_config.tensor_parallel_size)
        out: dict[str, dict[str, str]] = {}
        for name, t in self._held.items():
            full = self._shapes.get(name, tuple(t.shape))
            parts = name.split(".")
            target, layout = name, ""
            for fused, subs in packed.items():
                if len(parts) >= 2 and parts[-2] in subs:
                    target = ".".join([*parts[:-2], fused, parts[-1]])
                    layout = f"fused into {fused} as {parts[-2]}"
                    if tp > 1:
                        layout += ", its tensor-parallel shard"
                    break
            p = params.get(target)
            if p is None:
                layout = layout or "no parameter of that name (tied or skipped by the model)"
            elif not layout and p.numel():
                shape = tuple(p.shape)
                layout = "whole" if shape == full else (
                    f"tensor-parallel shard {list(shape)} of {list(full)}"
                )  # fmt: skip
            elif not layout:  # emptied: the module's kind says whether it is split
                kind = type(self.model.get_submodule(target.rpartition(".")[0])).__name__
                split = tp > 1 and "Parallel" in kind and kind != "ReplicatedLinear"
                layout = f"{kind}, its tensor-parallel shard" if split else f"{kind}, whole"
            if p is not None and not p.numel():
                layout += ", then repacked into a CPU kernel (the parameter is left empty)"
            if self._boxes.get(name) is not None:
                b = self._boxes[name]
                assert b is not None
                layout += f"; received as box {list(b.size)} at {list(b.offset)} of {list(full)}"
            direct = inplace.usable(self.model, self._slots, [name]) and self.inplace
            out[name] = {
                "param": target, "path": "in place" if direct else "load_weights", "layout": layout
            }  # fmt: skip
        return out

    def shutdown(self) -> None:
        """Release the trainer's link (vLLM's ``shutdown_weight_transfer_engine``, also at the
        next ``init_transfer_engine``): the group, its heartbeat and links, the receiver and its
        staging, and the committed copies (the bases of that trainer's next rounds: the next
        trainer's first round is whole), their heap pages handed back to the system. The model
        stays, and so does the version it serves."""
        with self._lock:
            self._shutdown()

    def _shutdown(self) -> None:
        if self._watching is not None:
            self._watching.set()
        self._served = self.version
        self._staged = None  # a round staged on this link can no longer be committed
        if self.group is not None:
            self.group.close()
            _RETIRED.append(self.group)
        self.group, self.receiver = None, None
        freed = bool(self._held)
        self._held, self._slots = {}, {}  # (init_transfer_engine starts from them empty)
        if freed:
            self._trim(always=True)

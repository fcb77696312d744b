"""Trainer side of the ``deltackpt`` vLLM backend: a ``TrainerWeightTransferEngine`` around a
:class:`~deltackpt.sync.WeightSender`, driven through any ``VLLMWeightSyncClient`` (vLLM's
HTTP and Ray clients, or :class:`LocalLLMClient` for an ``LLM`` in this process).

Every trainer rank calls :meth:`DeltackptTrainerEngine.trainer_init` and ``send_weights`` (each
pushes its own shards, DTensor shards as they are: no gather, also from vLLM's ``ModuleSource``
and ``DTensorModuleSource``: :func:`source_tensors`); trainer rank 0 also drives the engine's
RPCs. With several trainer ranks, every ``send_weights`` first agrees through the group's store
that every rank accepts its tensors, so a refusal anywhere fails every rank before a round. Why the RPCs run beside the push: ``init_weight_transfer_engine`` and
``update_weights`` block until the workers have joined the group / finished the round, which
needs the trainers at the same time, so rank 0 issues them from a helper thread.

Importing this module registers the backend with vLLM's factories (the trainer process has no
vLLM engine to load the plugin for it).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from vllm.distributed.weight_transfer.base import (
    ModuleSource,
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    WeightSource,
)

from deltackpt.integrations.vllm import BACKEND, fp8_layout, joins, register
from deltackpt.integrations.vllm.fairlock import FairLock
from deltackpt.integrations.vllm.init_args import check_trainer_init
from deltackpt.sync import PlanError, RoundStats, SyncGroup, WeightSender
from deltackpt.sync.fp8 import Fp8Blocks
from deltackpt.sync.schedule_decl import Held, held_from

# the end of a refusal of the tensors (send_weights)
REPLAN = (
    "nothing was sent and the engine keeps its weights. Pass the tensors the schedule was "
    "built for, or start a new trainer engine (trainer_init) to re-plan"
)

log = logging.getLogger(__name__)

__all__ = [
    "DeltackptTrainerEngine",
    "DeltackptTrainerInitInfo",
    "LocalLLMClient",
    "source_tensors",
]


def _module_sources() -> tuple[type, ...]:
    """vLLM's sources over ``module.named_parameters()`` (``DTensorModuleSource``: nccl_m2n's)."""
    try:
        from vllm.distributed.weight_transfer.m2n_source import DTensorModuleSource
    except ImportError:  # a vLLM without nccl_m2n
        return (ModuleSource,)
    return (ModuleSource, DTensorModuleSource)


def source_tensors(source: WeightSource) -> dict[str, torch.Tensor]:
    """This rank's tensors of ``source``, by name.

    ``ModuleSource`` / ``DTensorModuleSource``: the module's parameters as they are (DTensor
    shards stay shards: no ``full_tensor()`` gather, the schedule sends each rank's boxes),
    limited to ``held_names()``. Any other ``WeightSource``: its iteration (materialized
    tensors), without the ``None`` of names another rank holds."""
    module = getattr(source, "_module", None) if isinstance(source, _module_sources()) else None
    if isinstance(module, torch.nn.Module):
        held = source.held_names()
        keep = None if held is None else set(held)
        return {n: p.detach() for n, p in module.named_parameters() if keep is None or n in keep}
    return {name: t for name, t in source if t is not None}


@dataclass
class DeltackptTrainerInitInfo(TrainerInitInfo):
    """``rank``: this trainer rank (0 drives the RPCs and hosts the group's store at
    ``master_addr:master_port``); ``links``: the group's links (``SyncGroup(links=)``; the
    default ``"auto"`` takes ipc links where the engine's workers share this host's memory,
    else gloo); ``num_trainers`` trainer ranks, ``num_workers`` vLLM workers
    (all data-parallel replicas x tensor/pipeline ranks). ``dtype``: the dtype floating tensors
    are declared as (cast on the trainer; the workers ask for the engine's dtype anyway);
    ``full_every``: every n-th round is full. ``end_stale_update``: when vLLM refuses
    ``start_weight_update`` and there is one worker, end the update session a dead trainer
    left open and start again, once (:meth:`DeltackptTrainerEngine._start`). ``tp_boxes``:
    each worker receives and holds only the boxes of its tensor-parallel shards (None: the
    workers' ``DELTACKPT_VLLM_TP_BOXES`` decides; docs/sync.md, "Memory"). ``inplace``: a
    commit writes what changed straight into the parameters that are seen to hold the tensors
    as they are, and reloads the rest (None: the workers' ``DELTACKPT_VLLM_INPLACE`` decides,
    on by default; docs/sync.md, "The pause"). ``staging``: how a worker stages a round
    (``WeightReceiver(staging=)``: ``"round"``, a round's wire bytes posted up front, or
    ``"ring"``, two messages, each verified bucket written into the worker's copies before the
    vote and taken back if it fails; None: the workers' ``DELTACKPT_VLLM_STAGING`` decides,
    default ``"ring"``; docs/sync.md, "Memory"). ``undo_dir``: where a worker keeps the bytes a
    round sent whole overwrites, to take the round back (``WeightReceiver(undo_dir=)``: a
    directory, or ``"memory"``; None: the workers' ``DELTACKPT_VLLM_UNDO_DIR`` decides, default
    with ``"ring"`` the temporary directory unless it is a RAM filesystem). ``quantize``:
    ``"auto"`` (the default) sends the weights the engine holds as block FP8 quantized in its
    blocks, each with its scales (``X.weight_scale_inv``), and the rest as they are (an engine
    without FP8 weights: everything as it is); ``"none"`` sends every tensor as it is
    (quantize them yourself; the workers refuse a weight that is not FP8 for an FP8
    parameter). docs/sync.md, "FP8 engines"."""

    backend: ClassVar[str] = BACKEND

    master_port: int = 0
    master_addr: str = "127.0.0.1"
    num_trainers: int = 1
    num_workers: int = 1
    links: str = "auto"
    timeout: float = 60.0
    bucket_bytes: int = 64 << 20
    dtype: str | None = None
    full_every: int | None = None
    end_stale_update: bool = True
    tp_boxes: bool | None = None
    inplace: bool | None = None
    staging: str | None = None
    undo_dir: str | None = None
    quantize: str = "auto"


class LocalLLMClient:
    """A ``VLLMWeightSyncClient`` for a ``vllm.LLM`` in this process (whose methods take the
    request dicts of the HTTP routes).

    ``vllm.LLM`` is not thread-safe (two threads in its engine client at once can abort the
    process in ZeroMQ), and the trainer engine calls it from a thread of its own during a
    round. So every call here holds :attr:`lock` (a :class:`FairLock`, taken in turn;
    ``lock=``: share one you already have); to generate from another thread while updates run
    (prepare while serving), hold the same lock around each ``llm.generate``: a staged round is
    prepared by the workers during those calls, its commit waits for the current one to
    return."""

    def __init__(self, llm: Any, lock: Any = None) -> None:
        self.llm = llm
        self.lock = lock if lock is not None else FairLock()

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        with self.lock:
            self.llm.init_weight_transfer_engine({"init_info": init_info})

    def shutdown_weight_transfer_engine(self) -> None:
        with self.lock:
            self.llm.shutdown_weight_transfer_engine()

    def start_weight_update(self) -> None:
        with self.lock:
            self.llm.start_weight_update()

    def update_weights(self, update_info: Any) -> None:
        with self.lock:
            self.llm.update_weights({"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        with self.lock:
            self.llm.finish_weight_update(weight_version)

    def reset_prefix_cache(self) -> None:
        """Drop the KV blocks the old weights computed (after a commit)."""
        with self.lock:
            self.llm.reset_prefix_cache()


class DeltackptTrainerEngine(TrainerWeightTransferEngine[DeltackptTrainerInitInfo]):
    """Pushes versioned, transactional rounds (full, then element-sparse deltas) to the vLLM
    workers (see module doc)."""

    init_info_cls = DeltackptTrainerInitInfo

    def __init__(self, *, client: Any, source: WeightSource | None = None, is_sender: bool = True):
        super().__init__(client=client, source=source, is_sender=is_sender)
        self.group: SyncGroup | None = None
        self.sender: WeightSender | None = None
        # what the schedule was built for (names, dtypes, shapes, boxes): checked before the
        # engine is asked into a round (see send_weights)
        self._declared: tuple[Held, ...] | None = None
        self._rpc = ThreadPoolExecutor(1, thread_name_prefix="deltackpt-vllm-rpc")
        self.num_trainers = 1
        self._end_stale = False
        self._checks = 0  # send_weights calls on this group: names their agreement keys
        self._commits = 0  # rounds sent to the engine: names the workers' commit votes
        self._staged: int | None = None  # the version of a staged round awaiting commit()
        self._full_next = False  # a round the workers took back: the next one goes whole
        self._serving: int | None = None  # the version the engine serves, as far as we know
        # what the engine holds as block FP8, quantized so on every send (quantize="auto")
        self.fp8: Fp8Blocks | None = None
        self._layout: dict[str, Any] | None = None  # the engine's FP8 layout (fp8_layout.py)
        # checkpoint names every worker's model ignores (an LM head tied to the embedding):
        # never sent (joins.py)
        self.ignores: frozenset[str] = frozenset()

    @classmethod
    def trainer_init(
        cls,
        init_info: DeltackptTrainerInitInfo,
        *,
        client: Any,
        source: WeightSource | None = None,
    ) -> DeltackptTrainerEngine:
        dtype = check_trainer_init(init_info)  # before anything is sent (init_args.py)
        eng = cls(client=client, source=source, is_sender=init_info.is_sender)
        n = eng.num_trainers = int(init_info.num_trainers)
        eng._end_stale = init_info.end_stale_update and int(init_info.num_workers) == 1
        worker_info = {
            "master_addr": init_info.master_addr,
            "master_port": int(init_info.master_port),
            "world_size": n + int(init_info.num_workers),
            "trainers": list(range(n)),
            "rank_offset": n,
            "links": init_info.links,
            "timeout": float(init_info.timeout),
            "bucket_bytes": int(init_info.bucket_bytes),
        }
        if init_info.tp_boxes is not None:
            worker_info["tp_boxes"] = bool(init_info.tp_boxes)
        if init_info.inplace is not None:
            worker_info["inplace"] = bool(init_info.inplace)
        if init_info.staging is not None:
            worker_info["staging"] = str(init_info.staging)
        if init_info.undo_dir is not None:
            worker_info["undo_dir"] = str(init_info.undo_dir)
        joined: Future[None] | None = None
        if eng.is_sender:
            joined = eng._rpc.submit(client.init_weight_transfer_engine, worker_info)
        eng.group = SyncGroup(
            init_info.master_addr,
            int(init_info.master_port),
            int(init_info.rank),
            n + int(init_info.num_workers),
            range(n),
            timeout=init_info.timeout,
            links=init_info.links,
        )
        if joined is not None:
            joined.result()
        try:  # what the engine serves (this trainer's versions follow it), what it ignores
            joined = joins.read(eng.group, range(n, n + int(init_info.num_workers)))
            eng._serving, eng.ignores = joined.serving, joined.ignores
        except BaseException:
            eng.shutdown()
            raise
        if init_info.quantize == "auto":  # the first worker's layout (the same on every one)
            try:
                eng._layout = fp8_layout.read(eng.group, n)
                eng.fp8 = fp8_layout.blocks_for(eng._layout)
            except BaseException:  # (an FP8 form we do not quantize): release the workers
                eng.shutdown()
                raise
        eng.sender = WeightSender(
            eng.group,
            dtype=dtype,  # (FP8 bytes and their scales keep their dtypes: resolve_dtype)
            bucket_bytes=init_info.bucket_bytes,
            full_every=init_info.full_every,
        )
        return eng

    @property
    def version(self) -> int | None:
        """The last version every rank committed."""
        return None if self.sender is None else self.sender.version

    @property
    def serving(self) -> int | None:
        """The version the engine serves, as far as this trainer knows: what its workers
        served when it joined (the last trainer's, after a restart; None: none since the
        engine started), then each round's it committed."""
        return self._serving

    def send_weights(
        self,
        tensors: Mapping[str, torch.Tensor] | None = None,
        *,
        version: int | None = None,
        full: bool = False,
        stage: bool = False,
        rewind: bool = False,
    ) -> RoundStats:
        """One round of ``tensors`` (default: the ``source`` given at ``trainer_init``) as
        ``version`` (default: one after the last this trainer sent and the one the engine
        serves, which a new trainer engine reads from the workers when it joins: versions
        continue across a trainer's restart); every rank the same version. Rank 0 runs
        ``start_weight_update``, ``update_weights`` (beside the push) and, once the round
        committed, ``finish_weight_update(str(version))``, then drops the engine's prefix
        cache (its KV blocks were computed with the old weights) where the client can. A failed
        round raises the push's :class:`~deltackpt.sync.SyncError`; the workers keep their
        weights and version. Returns the push's :class:`~deltackpt.sync.RoundStats`.

        ``stage=True``: the workers receive, verify and apply the round to their own copies in
        the background while the engine keeps serving; the model changes only at
        :meth:`commit`, in a short pause (the reload of the changed layers).

        ``full=True``: every tensor is sent and written, as the first round is; needed after
        vLLM's ``sleep(level=2)`` and ``wake_up()``, which discard the engine's weights while
        the workers keep the last version (a delta would write only what changed).

        Tensors every worker's model ignores (:attr:`ignores`: an ``lm_head.weight`` tied to the
        embedding) are left out.

        A ``version`` at or below the one the engine serves is refused (:class:`PlanError`,
        nothing sent): the label would name two different sets of weights. ``rewind=True``
        allows it, after the training run was restored to an earlier checkpoint and the
        engine's later versions are to be replaced."""
        if self.sender is None:
            raise RuntimeError("send_weights before trainer_init")
        if self._staged is not None:
            raise RuntimeError(f"send_weights: version {self._staged} is staged; commit() it first")
        if tensors is None:
            if self.source is None:
                raise ValueError("send_weights: pass the tensors or a source at trainer_init")
            tensors = source_tensors(self.source)
        try:
            version = joins.next_version(version, self.sender.version, self._serving, rewind)
            wrong_version = None
        except PlanError as e:  # on every rank through the agreement (ranks may differ)
            version, wrong_version = 0, str(e)
        if not isinstance(tensors, Mapping):
            tensors = dict(tensors)
        if self.ignores and any(n in self.ignores for n in tensors):  # (tied embeddings)
            tensors = {n: t for n, t in tensors.items() if n not in self.ignores}
        refusal = None
        if self.fp8 is not None and wrong_version is None:  # what the engine holds as FP8
            try:
                # each cast to the sender's dtype= first (what it would travel as)
                cast = self.sender.dtype if isinstance(self.sender.dtype, torch.dtype) else None
                # (transformers 5's fused experts split per expert, as vLLM loads them)
                tensors = self.fp8.apply(fp8_layout.unfused(tensors, self._layout), cast=cast)
            except PlanError as e:  # (a shard of a quantized weight): refused on every rank
                refusal = str(e)
        refusal = refusal or self._check_declared(tensors)
        self._agree(wrong_version or (refusal and f"{refusal}; {REPLAN}"))
        full, self._full_next = full or self._full_next, False
        self._commits += 1
        if not self.is_sender:  # rank 0 drives the engine; every rank reads the verdict
            stats = self._push(tensors, version, full)
            if stage:
                self._wait_staged(version)
                self._staged = int(version)
            else:
                self._verdict(version)
            return stats
        self._start()
        info = {"version": int(version), "commit": self._commits}
        if stage:
            info["stage"] = True
        rpc = self._rpc.submit(self.client.update_weights, info)
        try:
            stats = self._push(tensors, version, full)
        except BaseException:
            rpc.exception()  # the workers fail the same round; wait for their answer
            if stage:  # end the session: the workers' staged round failed with this one
                self.client.finish_weight_update(None)
            raise
        rpc.result()
        if stage:
            self._wait_staged(version)
            self._staged = int(version)
            return stats
        try:
            self._verdict(version)  # the workers reloaded inside update_weights
        except BaseException:
            self.client.finish_weight_update(None)  # end vLLM's session; no version set
            raise
        self.client.finish_weight_update(str(version))
        self._fresh_cache()
        return stats

    def _wait_staged(self, version: int) -> None:
        """Until every worker applied the staged round to its copies (after the vote they
        still copy it in: that belongs to the preparation, not to the commit's pause)."""
        from deltackpt.integrations.vllm.worker import wait_staged

        assert self.group is not None
        wait_staged(self.group, f"c{self._commits}", f"staging of version {version}")

    def _verdict(self, version: int) -> None:
        """Raise :class:`~deltackpt.sync.RoundAbortedError` when the workers took round
        ``version`` back (a reload failed on any of them: module doc of the worker)."""
        from deltackpt.integrations.vllm.worker import commit_verdict
        from deltackpt.sync import RoundAbortedError

        g = self.group
        assert g is not None
        why = commit_verdict(g, f"c{self._commits}", f"commit of version {version}")
        if why is not None:
            self._full_next = True
            serving = "the weights it started with" if self._serving is None else None
            raise RoundAbortedError(
                f"the commit of version {version} failed: {why}; every worker took it back "
                f"and serves {serving or f'version {self._serving}'} (the next round is sent "
                "whole)"
            )
        self._serving = int(version)

    def commit(self) -> int:
        """Load the staged round into the engine (its pause: the model's reload of the changed
        layers) and return its version. Every worker reloads, then they vote; if any reload
        failed they all take the round back, bit-exact on the previous version, and this raises
        :class:`~deltackpt.sync.RoundAbortedError` (the next round is sent whole). Every
        trainer rank calls it (rank 0 drives the engine, the others read the verdict)."""
        if self._staged is None:
            raise RuntimeError("commit(): nothing is staged; send_weights(..., stage=True) first")
        version, self._staged = self._staged, None
        if not self.is_sender:
            self._verdict(version)
            return version
        self.client.finish_weight_update(None)  # the workers commit, vote, never raise
        self._verdict(version)
        # an empty session to set the engine's version, now that every worker serves it
        self.client.start_weight_update()
        self.client.finish_weight_update(str(version))
        self._fresh_cache()
        return version

    def _fresh_cache(self) -> None:
        """Drop the prefix cache's KV blocks, computed with the old weights: else a request
        whose prefix was cached before the update is served with them (logprobs that differ
        from a fresh engine's). Clients without ``reset_prefix_cache`` (vLLM's HTTP route:
        ``POST /reset_prefix_cache``): docs/sync.md says to call it."""
        reset = getattr(self.client, "reset_prefix_cache", None)
        if reset is not None:
            reset()

    def _start(self) -> None:
        """``start_weight_update``; when vLLM refuses it because a trainer that died between
        ``start_weight_update`` and its ``update_weights`` left the session open ("a weight
        update is already active": only a failed ``update_weights`` or a
        ``finish_weight_update`` ends one), end that session and start again, once. Safe for
        this backend: its ``finish_weight_update`` applies nothing, and no version is set.

        Only with one worker: with several, vLLM 0.32's multiprocessing executor raises on the
        first worker's error reply and leaves the others' queued, so every later RPC reads the
        previous call's reply. There, end a stale session with the worker extension's
        ``collective_rpc("deltackpt_end_stale_update")``, which never fails."""
        try:
            self.client.start_weight_update()
            return
        except Exception as e:
            if not self._end_stale:
                raise
            refused = e
        try:
            self.client.finish_weight_update(None)
        except Exception:  # no session was open: start failed for another reason
            raise refused from None
        log.warning("deltackpt: ended a weight update a dead trainer left open (%s)", refused)
        self.client.start_weight_update()

    def _check_declared(self, tensors: Mapping[str, torch.Tensor]) -> str | None:
        """Why this rank refuses ``tensors`` (None: it accepts them): not what the schedule
        was built for. The sender would refuse them on this rank alone, before the round,
        and the workers would wait in ``update_weights`` until the group timeout."""
        if self._declared is None:
            return None  # the first round: a setup failure fails every rank at once
        assert self.sender is not None
        held, _ = held_from(tensors, self.sender.dtype)
        if tuple(held) == self._declared:
            return None
        mine = {h.name: h for h in self._declared}
        diff = sorted({h.name for h in held} ^ set(mine)) or [
            h.name for h in held if mine.get(h.name) != h
        ]
        return (
            "send_weights got different tensors (names, dtypes, shapes or shard boxes) than "
            f"the schedule was built for (first: {diff[:3]})"
        )

    def _agree(self, refusal: str | None) -> None:
        """Raise :class:`PlanError` on every trainer rank when any of them refuses the round
        (``refusal``: why, and the fix), before rank 0 asks the engine into it: with several
        trainer ranks each writes its answer to the group's store and waits for the others' (a
        dead rank fails this wait within the group's ``dead_after``, a hung one at its
        timeout)."""
        g = self.group
        assert g is not None
        if self.num_trainers <= 1:
            if refusal:
                raise PlanError(refusal)
            return
        self._checks += 1
        base = f"vllm/check/{g.epoch}/{self._checks}"
        g.guard("store set", lambda: g.store.set(f"{base}/{g.rank}", refusal or ""))
        keys = [f"{base}/{r}" for r in range(self.num_trainers)]
        g.wait_until(
            lambda: bool(g.store.check(keys)),
            f"send_weights call {self._checks}: waiting for every trainer rank's answer",
            None,
        )
        vals = g.guard("store multi_get", lambda: g.store.multi_get(keys))
        refused = [(r, bytes(v).decode()) for r, v in enumerate(vals) if v]
        if refused:
            r, why = refused[0]
            raise PlanError(
                f"trainer rank {r} refused the round ({len(refused)} of "
                f"{self.num_trainers} ranks refused): {why}"
            )

    def _push(self, tensors: Mapping[str, torch.Tensor], version: int, full: bool) -> RoundStats:
        assert self.sender is not None
        try:
            return self.sender.push(tensors, version=version, full=full)
        finally:
            if self._declared is None and self.sender.schedule is not None:
                self._declared = tuple(held_from(tensors, self.sender.dtype)[0])

    def shutdown(self) -> None:
        """Release the link: on the sender rank the workers' side first (vLLM's
        ``shutdown_weight_transfer_engine``, "release a trainer connection without shutting
        down inference": their receivers' staging, committed copies and the links' buckets are
        freed and their heartbeats stop while this group's store still answers; left alone, they
        held them until the next ``init_weight_transfer_engine`` and each heartbeat met a closed
        store), then this rank's. Best effort within the group's timeout: an engine that cannot be
        reached, or in the middle of an update, keeps its side until the next init."""
        if self.is_sender and self.group is not None:
            try:
                self._rpc.submit(self.client.shutdown_weight_transfer_engine).result(
                    timeout=self.group.timeout
                )
            except Exception as e:  # (the engine's own error, or the wait's TimeoutError)
                log.warning("deltackpt: the engine kept its side of the link (%s)", e)
        if self.group is not None:
            self.group.close()
        self.group, self.sender = None, None
        self._rpc.shutdown(wait=False)


register()

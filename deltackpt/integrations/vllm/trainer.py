"""Trainer side of the ``deltackpt`` vLLM backend: a ``TrainerWeightTransferEngine`` around a
:class:`~deltackpt.sync.WeightSender`, driven through any ``VLLMWeightSyncClient`` (vLLM's
HTTP and Ray clients, or :class:`LocalLLMClient` for an ``LLM`` in this process).

Every trainer rank calls :meth:`DeltackptTrainerEngine.trainer_init` and ``send_weights`` (each
pushes its own shards, DTensor shards as they are: no gather); trainer rank 0 also drives the
engine's RPCs. Why the RPCs run beside the push: ``init_weight_transfer_engine`` and
``update_weights`` block until the workers have joined the group / finished the round, which
needs the trainers at the same time, so rank 0 issues them from a helper thread.

Importing this module registers the backend with vLLM's factories (the trainer process has no
vLLM engine to load the plugin for it).
"""

from __future__ import annotations

from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from vllm.distributed.weight_transfer.base import (
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    WeightSource,
)

from deltackpt.integrations.vllm import BACKEND, register
from deltackpt.sync import PlanError, RoundStats, SyncGroup, WeightSender
from deltackpt.sync.schedule_decl import Held, held_from

__all__ = ["DeltackptTrainerEngine", "DeltackptTrainerInitInfo", "LocalLLMClient"]


@dataclass
class DeltackptTrainerInitInfo(TrainerInitInfo):
    """``rank``: this trainer rank (0 drives the RPCs and hosts the group's store at
    ``master_addr:master_port``); ``num_trainers`` trainer ranks, ``num_workers`` vLLM workers
    (all data-parallel replicas x tensor/pipeline ranks). ``dtype``: the dtype floating tensors
    are declared as (cast on the trainer; the workers ask for the engine's dtype anyway);
    ``full_every``: every n-th round is full."""

    backend: ClassVar[str] = BACKEND

    master_port: int = 0
    master_addr: str = "127.0.0.1"
    num_trainers: int = 1
    num_workers: int = 1
    links: str = "gloo"
    timeout: float = 60.0
    bucket_bytes: int = 64 << 20
    dtype: str | None = None
    full_every: int | None = None


class LocalLLMClient:
    """A ``VLLMWeightSyncClient`` for a ``vllm.LLM`` in this process (whose methods take the
    request dicts of the HTTP routes)."""

    def __init__(self, llm: Any) -> None:
        self.llm = llm

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.llm.init_weight_transfer_engine({"init_info": init_info})

    def shutdown_weight_transfer_engine(self) -> None:
        self.llm.shutdown_weight_transfer_engine()

    def start_weight_update(self) -> None:
        self.llm.start_weight_update()

    def update_weights(self, update_info: Any) -> None:
        self.llm.update_weights({"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.llm.finish_weight_update(weight_version)


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

    @classmethod
    def trainer_init(
        cls,
        init_info: DeltackptTrainerInitInfo,
        *,
        client: Any,
        source: WeightSource | None = None,
    ) -> DeltackptTrainerEngine:
        if not init_info.master_port:
            raise ValueError("DeltackptTrainerInitInfo: pass master_port (a free TCP port)")
        eng = cls(client=client, source=source, is_sender=init_info.is_sender)
        n = int(init_info.num_trainers)
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
        dtype = None if init_info.dtype is None else getattr(torch, init_info.dtype)
        eng.sender = WeightSender(
            eng.group,
            dtype=dtype,
            bucket_bytes=init_info.bucket_bytes,
            full_every=init_info.full_every,
        )
        return eng

    @property
    def version(self) -> int | None:
        """The last version every rank committed."""
        return None if self.sender is None else self.sender.version

    def send_weights(
        self,
        tensors: Mapping[str, torch.Tensor] | None = None,
        *,
        version: int | None = None,
        full: bool = False,
    ) -> RoundStats:
        """One round of ``tensors`` (default: the ``source`` given at ``trainer_init``) as
        ``version`` (default: the last one + 1); every rank the same version. Rank 0 runs
        ``start_weight_update``, ``update_weights`` (beside the push) and, once the round
        committed, ``finish_weight_update(str(version))``. A failed round raises the push's
        :class:`~deltackpt.sync.SyncError`; the workers keep their weights and version."""
        if self.sender is None:
            raise RuntimeError("send_weights before trainer_init")
        if tensors is None:
            if self.source is None:
                raise ValueError("send_weights: pass the tensors or a source at trainer_init")
            tensors = dict(iter(self.source))
        if version is None:
            version = (self.sender.version or 0) + 1
        if not isinstance(tensors, Mapping):
            tensors = dict(tensors)
        self._check_declared(tensors)
        if not self.is_sender:
            return self._push(tensors, version, full)
        self.client.start_weight_update()
        rpc = self._rpc.submit(self.client.update_weights, {"version": int(version)})
        try:
            stats = self._push(tensors, version, full)
        except BaseException:
            rpc.exception()  # the workers fail the same round; wait for their answer
            raise
        rpc.result()
        self.client.finish_weight_update(str(version))
        return stats

    def _check_declared(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Refuse tensors the schedule was not built for before ``start_weight_update``: the
        sender would refuse them on this rank alone, before the round, and the workers would
        wait in ``update_weights`` until the group timeout. (With several trainer ranks, a
        rank other than 0 that refuses still leaves them waiting.)"""
        if self._declared is None:
            return  # the first round: a setup failure fails every rank at once
        assert self.sender is not None
        held, _ = held_from(tensors, self.sender.dtype)
        if tuple(held) != self._declared:
            mine = {h.name: h for h in self._declared}
            diff = sorted({h.name for h in held} ^ set(mine)) or [
                h.name for h in held if mine.get(h.name) != h
            ]
            raise PlanError(
                "send_weights got different tensors (names, dtypes, shapes or shard boxes) "
                f"than the schedule was built for (first: {diff[:3]}); nothing was sent and "
                "the engine keeps its weights. Start a new trainer engine (trainer_init) to "
                "re-plan"
            )

    def _push(self, tensors: Mapping[str, torch.Tensor], version: int, full: bool) -> RoundStats:
        assert self.sender is not None
        try:
            return self.sender.push(tensors, version=version, full=full)
        finally:
            if self._declared is None and self.sender.schedule is not None:
                self._declared = tuple(held_from(tensors, self.sender.dtype)[0])

    def shutdown(self) -> None:
        if self.group is not None:
            self.group.close()
        self.group, self.sender = None, None
        self._rpc.shutdown(wait=False)


register()

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

Why a delta round loads whole decoder layers: a layer whose reload loads some of its tensors
is rebuilt from those alone, so every tensor of a decoder layer (the names sharing the
outermost index, ``model.layers.<i>.``) that had a changed tensor is handed over again, from
the receiver's committed copies; the tensors outside the layers (embeddings, final norm,
``lm_head``) form one more group. The wire still carries only the changed elements.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from deltackpt.sync import RoundStats, SyncError, SyncGroup, WeightReceiver

__all__ = [
    "DeltackptInitInfo",
    "DeltackptUpdateInfo",
    "DeltackptWeightTransferEngine",
    "layer_key",
    "reload_layers",
]

log = logging.getLogger(__name__)
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
    links: str = "gloo"
    timeout: float = 60.0
    bucket_bytes: int = 64 << 20


@dataclass
class DeltackptUpdateInfo(WeightTransferUpdateInfo):
    """One round: ``version`` is the trainer's (checked against the committed round)."""

    version: int | None = None


def layer_key(name: str) -> str:
    """The group a checkpoint tensor reloads with: the name up to and including its outermost
    integer segment (``model.layers.3``), or ``""`` for tensors outside the layer stacks."""
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[: i + 1])
    return ""


def reload_layers(
    model: Any,
    model_config: Any,
    held: dict[str, torch.Tensor],
    changed: list[tuple[str, torch.Tensor]],
) -> None:
    """Load ``changed`` into a vLLM ``model`` through its own ``load_weights``, inside vLLM's
    layerwise reload, widened to whole layers from ``held`` (every tensor last loaded, by
    checkpoint name; updated here with ``changed``): see the module doc for why."""
    held.update(changed)
    touched = {layer_key(n) for n, _ in changed}
    batch = [(n, t) for n, t in held.items() if layer_key(n) in touched]
    from vllm.model_executor.model_loader.reload import (
        finalize_layerwise_reload,
        initialize_layerwise_reload,
    )

    initialize_layerwise_reload(model)
    try:
        model.load_weights(iter(batch))
    finally:  # layers that got nothing get their old kernels back
        finalize_layerwise_reload(model, model_config)


class DeltackptWeightTransferEngine(WeightTransferEngine[DeltackptInitInfo, DeltackptUpdateInfo]):
    """``WeightTransferConfig(backend="deltackpt")`` on the workers (see module doc)."""

    init_info_cls = DeltackptInitInfo
    update_info_cls = DeltackptUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config: Any, vllm_config: Any, device: torch.device, model: Any) -> None:
        super().__init__(config, vllm_config, device, model)
        self.group: SyncGroup | None = None
        self.receiver: WeightReceiver | None = None
        self.last_stats: RoundStats | None = None
        # the receiver's committed copies, by trainer name: the same buffers every round of a
        # schedule (refreshed by each full round, which hands over every tensor)
        self._held: dict[str, torch.Tensor] = {}

    def _rank(self, info: DeltackptInitInfo) -> int:
        from vllm.distributed.parallel_state import get_world_group

        pc = self.parallel_config
        dp = int(getattr(pc, "data_parallel_index", 0) or 0)
        return info.rank_offset + dp * pc.world_size + get_world_group().rank_in_group

    def init_transfer_engine(self, init_info: DeltackptInitInfo) -> None:
        self.shutdown()
        self.group = SyncGroup(
            init_info.master_addr,
            init_info.master_port,
            self._rank(init_info),
            init_info.world_size,
            init_info.trainers,
            timeout=init_info.timeout,
            links=init_info.links,
        )
        # the wire carries the engine's dtype: the cast runs on the trainer
        dtype = self.model_config.dtype
        self.receiver = WeightReceiver(self.group, dtype=dtype, bucket_bytes=init_info.bucket_bytes)
        self._held = {}

    def start_weight_update(self) -> None:
        """Nothing: the reload runs inside the round, after its commit (module doc)."""

    def finish_weight_update(self) -> None:
        """Nothing: a committed round is already loaded and finalized."""

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self.receive_weights(self.parse_update_info(update_info))
        if self.device.type != "cpu":  # the base class's sync, where there is a device
            torch.accelerator.synchronize()

    def receive_weights(self, update_info: DeltackptUpdateInfo) -> None:
        if self.receiver is None:
            raise RuntimeError(
                "deltackpt: update_weights before init_weight_transfer_engine; the trainer "
                "engine's trainer_init sends the init info"
            )
        try:
            self.last_stats = self.receiver.pull(self._load)
        except SyncError as e:  # vLLM hands the driver str(e) only: name the type in it
            raise type(e)(f"deltackpt {type(e).__name__}: {e}") from e
        want = update_info.version
        if want is not None and self.receiver.version != int(want):
            log.warning(
                "deltackpt: the trainer announced version %s but the round committed %s",
                want,
                self.receiver.version,
            )

    def _load(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """The committed round's changed tensors, widened to whole layers, into the model."""
        reload_layers(self.model, self.model_config, self._held, list(weights))

    # ---- helpers for collective_rpc (tests, monitoring) -----------------------------------

    @property
    def version(self) -> int | None:
        """The last committed round's version (None before the first)."""
        return None if self.receiver is None else self.receiver.version

    def committed(self) -> dict[str, torch.Tensor]:
        """Copies of the tensors of the last committed round, by trainer name."""
        return {n: t.detach().clone() for n, t in self._held.items()}

    def param_paths(self) -> dict[str, dict[str, str]]:
        """How each tensor of the last committed round reaches this worker's model, by trainer
        name: ``param`` (the vLLM parameter it lands in), ``path`` (always ``load_weights``:
        the model's own loader, inside vLLM's layerwise reload) and ``layout``: ``fused into
        <param> as <part>`` (qkv, gate_up), ``tensor-parallel shard <shape> of <shape>`` or
        ``whole`` (for a parameter vLLM emptied: its module's kind, shard or whole), with
        ``, then repacked into a CPU kernel`` where vLLM empties the parameter after loading.
        Why no direct writes into the shards: see docs/sync.md, "Into vLLM"."""
        params = dict(self.model.named_parameters())
        packed: dict[str, list[str]] = getattr(self.model, "packed_modules_mapping", {}) or {}
        tp = int(self.parallel_config.tensor_parallel_size)
        out: dict[str, dict[str, str]] = {}
        for name, t in self._held.items():
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
                shape, full = tuple(p.shape), tuple(t.shape)
                layout = "whole" if shape == full else (
                    f"tensor-parallel shard {list(shape)} of {list(full)}"
                )  # fmt: skip
            elif not layout:  # emptied: the module's kind says whether it is split
                kind = type(self.model.get_submodule(target.rpartition(".")[0])).__name__
                split = tp > 1 and "Parallel" in kind and kind != "ReplicatedLinear"
                layout = f"{kind}, its tensor-parallel shard" if split else f"{kind}, whole"
            if p is not None and not p.numel():
                layout += ", then repacked into a CPU kernel (the parameter is left empty)"
            out[name] = {"param": target, "path": "load_weights", "layout": layout}
        return out

    def shutdown(self) -> None:
        if self.group is not None:
            self.group.close()
            _RETIRED.append(self.group)
        self.group, self.receiver = None, None

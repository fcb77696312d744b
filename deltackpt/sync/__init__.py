"""Weight sync: stream a trainer's weights to inference workers, in versioned, transactional
rounds, straight into the layout each inference rank holds.

Every rank (trainer or inference) joins one :class:`SyncGroup`; trainers push, inference ranks
pull, once per round::

    from deltackpt import sync
    group = sync.SyncGroup(addr, port, rank, world_size, trainers=[0])  # links="auto"

    # trainer rank: plain tensors, DTensor Shard/Replicate shards, or sync.LocalShard
    sender = sync.WeightSender(group)
    sender.push(model.state_dict(), version=step)

    # inference rank: every tensor whole (1 -> N broadcast) ...
    receiver = sync.WeightReceiver(group, dtype=torch.bfloat16)
    receiver.pull(model.load_weights)        # vLLM / SGLang style, or sync.ModuleAdapter(model)
    # ... or exactly the shards it holds (tensor parallel), written in place
    wants = [sync.Want("q.weight", box=sync.shard_box(shape, 1, tp_rank, tp), into=q_shard)]
    receiver = sync.WeightReceiver(group, wants)
    receiver.pull()

``__all__`` lists what a user needs: the group, sender and receiver (and the
:class:`RoundStats` they return), :class:`Want` with :class:`Box` / :func:`shard_box` /
:class:`LocalShard`, the adapters and the errors. Modules, bottom up: ``errors``, ``dtypes``,
``schedule_decl`` and ``schedule`` (pure: who sends what to whom), ``wire`` (one bucket
message), ``peers``, ``shm_links`` and ``group`` (links, store, vote, liveness), ``rounds``,
``sender``, ``receiver``, ``adapters``.

See docs/sync.md for the protocol and the failure semantics.
"""

from __future__ import annotations

from deltackpt.sync.adapters import Coverage, ModuleAdapter
from deltackpt.sync.checkpoint_patches import CheckpointPatch, CheckpointPatcher, CheckpointPatches
from deltackpt.sync.engine_check import EngineCheck
from deltackpt.sync.errors import (
    DigestMismatchError,
    PeerLostError,
    PlanError,
    RoundAbortedError,
    SyncError,
    SyncTimeoutError,
)
from deltackpt.sync.group import SyncGroup
from deltackpt.sync.receiver import Want, WeightReceiver
from deltackpt.sync.rounds import RoundStats
from deltackpt.sync.schedule import Schedule as Schedule  # plumbing: the `X as X` form re-exports
from deltackpt.sync.schedule import build_schedule as build_schedule
from deltackpt.sync.schedule_decl import Box, LocalShard, shard_box
from deltackpt.sync.sender import WeightSender

__all__ = [
    "Box",
    "CheckpointPatch",
    "CheckpointPatcher",
    "CheckpointPatches",
    "Coverage",
    "DigestMismatchError",
    "EngineCheck",
    "LocalShard",
    "ModuleAdapter",
    "PeerLostError",
    "PlanError",
    "RoundAbortedError",
    "RoundStats",
    "SyncError",
    "SyncGroup",
    "SyncTimeoutError",
    "Want",
    "WeightReceiver",
    "WeightSender",
    "shard_box",
]

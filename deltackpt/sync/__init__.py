"""Weight sync: stream a trainer's weights to inference workers, in versioned rounds.

Trainer side, on every sender rank::

    from deltackpt import sync
    transport = sync.DistTransport(group=None, senders=[0])      # or sync.ShmTransport(...)
    sender = sync.WeightSender(transport, bucket_bytes=256 << 20)
    sender.push(model.state_dict(), version=step)                # DTensor shards are fine

Inference side, on every receiver rank::

    receiver = sync.WeightReceiver(transport)
    receiver.pull(model.load_weights)        # vLLM / SGLang style, or sync.ModuleAdapter(model)
    receiver.version                         # last committed version

``__all__`` lists what a user needs: the sender and receiver (and the :class:`RoundStats` they
return), the transports (:class:`DistTransport` with :func:`init_group`, which creates and, after
a failure, re-creates its group; :class:`ShmTransport`), the adapters and the errors.

Also importable here, as plumbing: :class:`Transport` and :class:`Channel` (the interfaces a new
transport implements, see ``transport.py``), :class:`Plan` and :func:`build_plan` (the bucket
layout every rank derives; ``WeightReceiver.plan`` returns it). Modules, bottom up: ``errors``,
``sender_manifest`` and ``plan`` (pure), ``transport``, ``shm`` / ``shm_window``, ``_protocol``
(the messages of a round), ``packing`` and ``sender``, ``assemble`` and ``receiver``,
``adapters``.

See docs/sync.md for the protocol and the failure semantics.
"""

from __future__ import annotations

from deltackpt.sync._protocol import RoundStats
from deltackpt.sync.adapters import Coverage, ModuleAdapter
from deltackpt.sync.errors import (
    DigestMismatchError,
    PeerLostError,
    PlanError,
    RoundAbortedError,
    SyncError,
    SyncTimeoutError,
)
from deltackpt.sync.mxn_group import MxNGroup
from deltackpt.sync.mxn_receiver import MxNReceiver, Want
from deltackpt.sync.mxn_round import MxNStats
from deltackpt.sync.mxn_sender import MxNSender
from deltackpt.sync.plan import Plan as Plan  # plumbing: the `X as X` form re-exports
from deltackpt.sync.plan import build_plan as build_plan
from deltackpt.sync.receiver import WeightReceiver
from deltackpt.sync.schedule import Schedule as Schedule
from deltackpt.sync.schedule import build_schedule as build_schedule
from deltackpt.sync.schedule_decl import Box, LocalShard, shard_box
from deltackpt.sync.sender import WeightSender
from deltackpt.sync.shm import ShmTransport
from deltackpt.sync.transport import Channel as Channel
from deltackpt.sync.transport import DistTransport, init_group
from deltackpt.sync.transport import Transport as Transport

__all__ = [
    "Box",
    "Coverage",
    "DigestMismatchError",
    "DistTransport",
    "LocalShard",
    "ModuleAdapter",
    "MxNGroup",
    "MxNReceiver",
    "MxNSender",
    "MxNStats",
    "PeerLostError",
    "PlanError",
    "RoundAbortedError",
    "RoundStats",
    "ShmTransport",
    "SyncError",
    "SyncTimeoutError",
    "Want",
    "WeightReceiver",
    "WeightSender",
    "init_group",
    "shard_box",
]

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
from deltackpt.sync.plan import Plan, build_plan
from deltackpt.sync.receiver import WeightReceiver
from deltackpt.sync.sender import WeightSender
from deltackpt.sync.shm import ShmTransport
from deltackpt.sync.transport import Channel, DistTransport, Transport, init_group

__all__ = [
    "Channel",
    "Coverage",
    "DigestMismatchError",
    "DistTransport",
    "ModuleAdapter",
    "PeerLostError",
    "Plan",
    "PlanError",
    "RoundAbortedError",
    "RoundStats",
    "ShmTransport",
    "SyncError",
    "SyncTimeoutError",
    "Transport",
    "WeightReceiver",
    "WeightSender",
    "build_plan",
    "init_group",
]

"""deltackpt: incremental, checksummed, crash-safe checkpoints and weight sync for PyTorch.

>>> import deltackpt
>>> info = deltackpt.save({"model": model.state_dict(), "step": 100}, "ckpts", "step-100")  # doctest: +SKIP
>>> state = deltackpt.load("ckpts")                      # the latest committed snapshot  # doctest: +SKIP
"""

from __future__ import annotations

from deltackpt import errors
from deltackpt.api import async_save, save
from deltackpt.checkpointer import Checkpointer
from deltackpt.loading.assemble import load
from deltackpt.options import LoadOptions, SaveOptions
from deltackpt.rng import capture as get_rng_state
from deltackpt.rng import restore as set_rng_state
from deltackpt.saving.engine import SaveHandle
from deltackpt.store.lifecycle import GcReport, VerifyReport, delete, gc, snapshots, verify
from deltackpt.store.store import SnapshotInfo, Store, open_store

__version__ = "0.1.0"

__all__ = [
    "Checkpointer",
    "GcReport",
    "LoadOptions",
    "SaveHandle",
    "SaveOptions",
    "SnapshotInfo",
    "Store",
    "VerifyReport",
    "async_save",
    "delete",
    "errors",
    "gc",
    "get_rng_state",
    "load",
    "open_store",
    "save",
    "set_rng_state",
    "snapshots",
    "verify",
]

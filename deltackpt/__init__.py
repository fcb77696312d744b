"""deltackpt: incremental, checksummed, crash-safe checkpoints and weight sync for PyTorch.

>>> import deltackpt
>>> info = deltackpt.save({"model": model.state_dict(), "step": 100}, "ckpts", "step-100")  # doctest: +SKIP
>>> state = deltackpt.load("ckpts")                      # the latest committed snapshot  # doctest: +SKIP
"""

from __future__ import annotations

from deltackpt import errors
from deltackpt.api import async_save, save
from deltackpt.checkpointer import Checkpointer
from deltackpt.distributed.load import load
from deltackpt.follow import Follower, FollowStats
from deltackpt.interop import ExportReport, export_hf, import_checkpoint
from deltackpt.interop.peft import export_peft
from deltackpt.loading.lazy import SnapshotReader, open_snapshot
from deltackpt.loading.stats import LoadStats
from deltackpt.options import LoadOptions, SaveOptions
from deltackpt.rng import capture as get_rng_state
from deltackpt.rng import restore as set_rng_state
from deltackpt.saving.engine import SaveHandle
from deltackpt.store.fold import FoldReport, fold
from deltackpt.store.lifecycle import GcReport, VerifyReport, delete, gc, snapshots, verify
from deltackpt.store.store import SnapshotInfo, Store, open_store

__version__ = "0.1.0"

__all__ = [
    "Checkpointer",
    "ExportReport",
    "FoldReport",
    "FollowStats",
    "Follower",
    "GcReport",
    "LoadOptions",
    "LoadStats",
    "SaveHandle",
    "SaveOptions",
    "SnapshotInfo",
    "SnapshotReader",
    "Store",
    "VerifyReport",
    "async_save",
    "delete",
    "errors",
    "export_hf",
    "export_peft",
    "fold",
    "gc",
    "get_rng_state",
    "import_checkpoint",
    "load",
    "open_snapshot",
    "open_store",
    "save",
    "set_rng_state",
    "snapshots",
    "verify",
]

"""The trainer's ``DeltackptTrainerInitInfo`` checked before anything is sent to the engine.

``trainer_init`` asks every vLLM worker to join the group, then joins it itself and builds its
sender. A field that only the sender or a worker reads used to fail late: ``dtype="bf16"`` raised
an ``AttributeError`` after the workers had joined, ``staging="arena"`` failed each worker's
init. :func:`check_trainer_init` refuses such a field first, with a
:class:`~deltackpt.sync.PlanError` (an ``InvalidArgumentError``) naming it, what it takes and
the fix. No vLLM import: the checks run (and are tested) without it.
"""

from __future__ import annotations

from typing import Any

import torch

from deltackpt.options import VLLM_STAGINGS
from deltackpt.sync import PlanError
from deltackpt.sync.dtypes import dtype_spec
from deltackpt.sync.group import LINKS, check_group_args
from deltackpt.sync.schedule import check_sizes, is_integer

__all__ = ["QUANTIZE", "check_trainer_init"]

#: ``DeltackptTrainerInitInfo(quantize=)``: what the engine holds as block FP8, or nothing
QUANTIZE = ("auto", "none")


def _bad(field: str, value: Any, expected: str) -> PlanError:
    return PlanError(
        f"DeltackptTrainerInitInfo({field}={value!r}): expected {expected}; nothing was sent to "
        "the engine"
    )


def _count(value: Any) -> bool:
    return is_integer(value) and value >= 1


def check_trainer_init(info: Any) -> torch.dtype | None:
    """Every field of ``info`` (a ``DeltackptTrainerInitInfo``) that can be checked on the
    trainer; returns the dtype floating tensors are declared as (None: their own)."""
    if not info.master_port:
        raise _bad("master_port", info.master_port, "the free TCP port rank 0's store takes")
    for field in ("num_trainers", "num_workers"):
        if not _count(getattr(info, field)):
            raise _bad(field, getattr(info, field), "an int >= 1")
    n = int(info.num_trainers)
    rank = info.rank
    if not is_integer(rank) or not 0 <= rank < n:
        raise _bad("rank", rank, f"this trainer's rank, an int in 0..{n - 1} (num_trainers={n})")
    if info.links not in LINKS:
        raise _bad("links", info.links, f"one of {LINKS}")
    check_group_args(info.master_addr, info.master_port, rank, n + int(info.num_workers),
                     info.timeout, None, 0.2, 3.0)  # fmt: skip
    check_sizes(
        "DeltackptTrainerInitInfo", info.bucket_bytes, 64
    )  # the sender's and workers' align
    if info.full_every is not None and not _count(info.full_every):
        raise _bad("full_every", info.full_every, "None or a number of rounds >= 1")
    if info.staging is not None and info.staging not in VLLM_STAGINGS:
        raise _bad("staging", info.staging, f"None or one of {VLLM_STAGINGS}")
    if info.undo_dir is not None and (not isinstance(info.undo_dir, str) or not info.undo_dir):
        raise _bad("undo_dir", info.undo_dir, "None, a directory or 'memory'")
    if info.quantize not in QUANTIZE:
        raise _bad("quantize", info.quantize, f"one of {QUANTIZE}")
    for field in ("tp_boxes", "inplace"):
        if getattr(info, field) not in (None, True, False):
            raise _bad(field, getattr(info, field), "None (the workers' variable), True or False")
    return dtype_spec("DeltackptTrainerInitInfo", info.dtype)  # type: ignore[return-value]

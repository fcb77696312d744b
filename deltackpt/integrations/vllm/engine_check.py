"""Whether a vLLM engine holds given weights: every worker's parameters against a state dict,
tensor by tensor, whatever route wrote them (vLLM's sparse or NCCL backends, ``reload_weights``,
the store link, deltackpt's rounds)::

    from deltackpt.integrations.vllm import engine_check
    got = engine_check.check(llm, model.state_dict(), dtype=torch.bfloat16)
    got.ok, got.mismatched, got.unchecked

The engine needs the deltackpt worker extension (``worker_extension_cls=EXTENSION``); each worker
digests, where its parameters live, the region that holds its box of each tensor
(:func:`~deltackpt.integrations.vllm.inplace.region_digests`), and the same boxes of ``state``
are digested here (:mod:`deltackpt.sync.engine_check`). vLLM's own ``/weight_checker`` compares
an engine with another engine's SHA-256 of its parameters; this compares it with the trainer's
tensors, on the device, every round if wanted. Importing this module never imports vLLM.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from deltackpt.errors import InvalidArgumentError
from deltackpt.sync.engine_check import EngineCheck, check_spec, compare

__all__ = ["check"]


def check(
    llm: Any, state: Mapping[str, torch.Tensor], dtype: torch.dtype | None = None
) -> EngineCheck:
    """Every worker of ``llm`` against ``state`` (checkpoint names to tensors, each floating one
    cast to ``dtype`` first when given: the engine's dtype for fp32 masters). Costs a pass over
    ``state`` here and over the parameters on every worker (the device digest: ~100 GB/s on a
    GPU, ~3.5 GB/s on one CPU thread)."""
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise InvalidArgumentError(
            f"engine_check.check(dtype={dtype!r}): expected a floating torch.dtype (the "
            "engine's) or None"
        )
    want = {
        k: (v.detach().to(dtype) if dtype is not None and v.is_floating_point() else v.detach())
        for k, v in state.items()
    }
    reports = llm.collective_rpc("deltackpt_checkpoint_digests", args=(check_spec(want),))
    return compare(want, reports)

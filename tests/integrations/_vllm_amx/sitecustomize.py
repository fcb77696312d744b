"""Put on PYTHONPATH by the FP8 and LoRA engine tests for every vLLM process: what vLLM 0.32's
CPU build needs around AMX, so those tests run on any x86 processor.

* **With AMX tiles**: ask Linux for AMX tile state (``arch_prctl(ARCH_REQ_XCOMP_PERM,
  XFEATURE_XTILEDATA)``). vLLM's CPU attention kernel uses AMX on processors that have it
  without asking, and dies of SIGILL when nothing in the process asked first (oneDNN's matmuls
  do, unless LoRA layers replace them). Elsewhere the call fails with EINVAL and nothing changes.
* **Without them**: vLLM's CPU build has block-FP8 kernels for AMX only (the linear one and the
  MoE experts', both on AMX BRGEMM), so an FP8 engine cannot start. Test-only stand-ins take
  their place when those modules are imported: the same kernel classes, told they run here, that
  keep the weights as loaded (no VNNI prepack) and compute by dequantizing the weight blocks
  (``w * scale`` per 128 x 128 block, in float32) and multiplying in torch. Weight loading, the
  parameters and their scales are vLLM's own; only the matrix products are emulated, the same
  for deltackpt's load and vLLM's in one engine. ``DELTACKPT_TEST_FP8_EMULATION=0`` turns them
  off.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import platform
import sys
from pathlib import Path
from typing import Any

if sys.platform == "linux" and platform.machine() == "x86_64":
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).syscall(158, 0x1023, 18)  # SYS_arch_prctl


def _has_amx() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            return " amx_tile" in f.read()
    except OSError:
        return True  # unknown: leave vLLM as it is


LINEAR = "vllm.model_executor.kernels.linear.scaled_mm.cpu"
MOE = "vllm.model_executor.layers.fused_moe.experts.cpu_moe"


def _dequant(w: Any, scale: Any, block: Any) -> Any:
    """Float32 ``w`` (``[..., N, K]`` FP8) times its block scales (``[..., ceil(N/bn),
    ceil(K/bk)]``)."""
    bn, bk = int(block[0]), int(block[1])
    n, k = w.shape[-2], w.shape[-1]
    s = scale.float().repeat_interleave(bn, dim=-2)[..., :n, :]
    s = s.repeat_interleave(bk, dim=-1)[..., :k]
    return w.float() * s


def _patch_linear(mod: Any) -> None:
    import torch.nn.functional as F

    kernel = mod.CPUFp8BlockScaledMMKernel

    def is_supported(cls: Any, compute_capability: Any = None) -> tuple[bool, str | None]:
        if not mod.current_platform.is_cpu():
            return False, "requires CPU platform."
        return True, None

    def process_weights_after_loading(self: Any, layer: Any) -> None:
        # vLLM's own, less the VNNI prepack: the weight stays [N, K] as loaded
        params = self._get_layer_params(layer)
        attr = (
            params.WEIGHT_SCALE_INV if params.weight_scale_inv is not None else params.WEIGHT_SCALE
        )
        scale = (
            params.weight_scale_inv if params.weight_scale_inv is not None else params.weight_scale
        )
        if scale.dtype in (mod.torch.float8_e8m0fnu, mod.torch.uint8):
            scale = mod._upcast_e8m0_to_fp32(scale.data)
        mod.replace_parameter(
            layer, attr, mod.torch.nn.Parameter(scale.data.contiguous(), requires_grad=False)
        )

    def apply_weights(self: Any, layer: Any, x: Any, bias: Any = None, **kwargs: Any) -> Any:
        params = self._get_layer_params(layer)
        scale = (
            params.weight_scale_inv if params.weight_scale_inv is not None else params.weight_scale
        )
        w = _dequant(params.weight, scale, self.weight_group_shape).to(x.dtype)
        return F.linear(x, w, bias)

    kernel.is_supported = classmethod(is_supported)
    kernel.process_weights_after_loading = process_weights_after_loading
    kernel.apply_weights = apply_weights


def _patch_moe(mod: Any) -> None:
    import torch
    import torch.nn.functional as F

    experts = mod.CPUExpertsFp8
    experts._supports_current_device = staticmethod(lambda: mod.current_platform.is_cpu())
    mod.prepare_fp8_moe_layer_for_cpu = lambda w13, w2: (w13, w2)  # no VNNI prepack

    def apply(self: Any, output: Any, hidden_states: Any, w1: Any, w2: Any, topk_weights: Any,
              topk_ids: Any, activation: Any, global_num_experts: int, expert_map: Any,
              *rest: Any, **kw: Any) -> None:  # fmt: skip
        qc = self.quant_config
        block = list(qc.block_shape) if qc.block_shape else [qc._w1.shape.row, qc._w1.shape.col]
        x = hidden_states.float()
        out = torch.zeros(x.shape[0], w2.shape[-2], dtype=torch.float32)
        for e in torch.unique(topk_ids).tolist():
            local = e if expert_map is None else int(expert_map[e])
            if local < 0:
                continue
            rows, slot = (topk_ids == e).nonzero(as_tuple=True)
            g = x[rows] @ _dequant(w1[local], self.w1_scale[local], block).T
            half = g.shape[-1] // 2
            a = F.silu(g[:, :half]) * g[:, half:]
            y = a @ _dequant(w2[local], self.w2_scale[local], block).T
            out.index_add_(0, rows, y * topk_weights[rows, slot].float()[:, None])
        output.copy_(out.to(output.dtype))

    experts.apply = apply


PATCHES = {LINEAR: _patch_linear, MOE: _patch_moe}


if os.environ.get("DELTACKPT_TEST_FP8_EMULATION", "1") != "0" and not _has_amx():
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # for the import alone
    from _import_hook import patch_on_import

    del sys.path[0]
    patch_on_import(PATCHES)

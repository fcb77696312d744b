"""The trained state: fp32 Qwen2-shaped parameters + fused AdamW, exported as bf16 weights or as
the train state (params + optimizer state), and the warm-copy reference timed before each save."""

from __future__ import annotations

import gc
import time
from typing import Any

import _common as C
import torch


class Master:
    """fp32 Qwen2-shaped parameters + fused AdamW; exports the bf16 or the train state."""

    def __init__(self, scale: float, seed: int = 0) -> None:
        t0 = time.perf_counter()
        g = torch.Generator().manual_seed(seed)
        self.names: list[str] = []
        self.params: list[torch.nn.Parameter] = []
        for name, shape in C.qwen2_shapes(scale):
            if name.endswith("norm.weight"):
                t = torch.ones(shape)
            else:
                t = torch.empty(shape).normal_(0, 0.02, generator=g)
            self.names.append(name)
            self.params.append(torch.nn.Parameter(t))
        self.numel = sum(p.numel() for p in self.params)
        self.opt = torch.optim.AdamW(self.params, lr=1e-5, weight_decay=0.01, fused=True)
        biggest = max(p.numel() for p in self.params)
        self.pool = torch.empty(biggest + (1 << 20)).normal_(0, 1e-3, generator=g)
        self.rng = torch.Generator().manual_seed(seed + 1)
        self.bf16: dict[str, torch.Tensor] | None = None
        self.wc_buf: torch.Tensor | None = None
        self.steps = 0
        self.step_seconds: list[float] = []
        self.step()  # creates the optimizer state (exp_avg, exp_avg_sq)
        self.build_seconds = time.perf_counter() - t0
        self.scale = scale

    def step(self) -> None:
        t0 = time.perf_counter()
        span = self.pool.numel()
        for p in self.params:
            n = p.numel()
            off = int(torch.randint(0, span - n + 1, (1,), generator=self.rng))
            p.grad = self.pool[off : off + n].view(p.shape)
        self.opt.step()
        for p in self.params:
            p.grad = None
        self.steps += 1
        if self.bf16 is not None:
            self.export_bf16()
        self.step_seconds.append(time.perf_counter() - t0)

    def warm_copy(self, kind: str) -> float:
        """Time one copy of the state into an already-touched buffer. The buffer holds the whole
        state up to 1 GiB; a larger state wraps around in it (1 GiB is far beyond the caches, so
        the DRAM traffic is that of distinct buffers without a second copy of a 6 GB state).
        Taken right before every save, so each save has a reference measured under the same
        background load."""
        src = [
            t.detach().reshape(-1).view(torch.uint8)
            for t in state_tensors(self.state(kind))
            if t.numel()
        ]
        n = min(sum(s.numel() for s in src), max(1 << 30, max(s.numel() for s in src)))
        if self.wc_buf is None or self.wc_buf.numel() != n:
            self.wc_buf = None
            self.wc_buf = torch.empty(n, dtype=torch.uint8).fill_(1)
        buf = self.wc_buf
        gc.collect()
        t0 = time.perf_counter()
        pos = 0
        for s in src:
            k = s.numel()
            if pos + k > n:
                pos = 0
            buf[pos : pos + k].copy_(s)
            pos += k
        return time.perf_counter() - t0

    def export_bf16(self) -> None:
        with torch.no_grad():
            if self.bf16 is None:
                self.bf16 = {
                    n: p.detach().to(torch.bfloat16)
                    for n, p in zip(self.names, self.params, strict=True)
                }
                self.bf16["lm_head.weight"] = self.bf16["model.embed_tokens.weight"]
            else:
                for n, p in zip(self.names, self.params, strict=True):
                    self.bf16[n].copy_(p)

    def state(self, kind: str) -> dict[str, Any]:
        if kind == "bf16":
            if self.bf16 is None:
                self.export_bf16()
            assert self.bf16 is not None
            return self.bf16
        # what model.state_dict() gives: detached views of the parameters
        model: dict[str, torch.Tensor] = {
            n: p.detach() for n, p in zip(self.names, self.params, strict=True)
        }
        model["lm_head.weight"] = model["model.embed_tokens.weight"]
        return {"model": model, "optim": self.opt.state_dict()}


def state_tensors(state: Any) -> list[torch.Tensor]:
    return [t for _, t in C.unique_tensors(state)]


def state_bytes(state: Any) -> int:
    return C.logical_bytes(state)

"""A simulated trainer that publishes bf16 weights: an fp32 master copy updated by AdamW with
random gradients, cast to bf16 after every step (what an RL trainer ships to its rollout
engine). ``lr`` 1e-6 / 1e-5 are RL-like steps (a few percent of the bf16 elements change); a
``pretrain`` step (lr 1e-3) changes nearly every element."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
import xxhash

from deltackpt.format import codecs
from deltackpt.format.codecs import XOR, EncodePolicy

_XOR1 = EncodePolicy(force=XOR, level=1)  # xor against the previous version, grouped, zstd-1


class Trainer:
    def __init__(self, weights: dict[str, torch.Tensor], seed: int = 0) -> None:
        self.master = {k: v.float().clone().requires_grad_(True) for k, v in weights.items()}
        self.opt = torch.optim.AdamW(self.master.values(), lr=1e-6, weight_decay=0.0)
        self.g = torch.Generator().manual_seed(seed)
        self.weights = {k: v.to(torch.bfloat16) for k, v in self.master.items()}

    def step(self, lr: float) -> None:
        for group in self.opt.param_groups:
            group["lr"] = lr
        for p in self.master.values():
            if p.grad is None:
                p.grad = torch.empty_like(p)
            torch.randn(p.shape, generator=self.g, out=p.grad).mul_(1e-3)  # reuses the buffer
        self.opt.step()
        with torch.no_grad():
            for k, p in self.master.items():
                self.weights[k].copy_(p)


def snapshot(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in weights.items()}


def state_digest(weights: dict[str, torch.Tensor]) -> str:
    h = xxhash.xxh3_128()
    for k in sorted(weights):
        h.update(k.encode())
        h.update(weights[k].contiguous().view(torch.uint8).numpy())
    return h.hexdigest()


def _u8(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy()


def change_stats(
    prev: dict[str, torch.Tensor],
    cur: dict[str, torch.Tensor],
    chunk: int,
    pool: ThreadPoolExecutor,
) -> tuple[int, float]:
    """(bytes of xor+zstd-1 of the change, per chunk like the store cuts it; fraction of bf16
    elements that changed)."""
    jobs = []
    changed = total = 0
    for k in cur:
        a, b = _u8(prev[k]), _u8(cur[k])
        changed += int((prev[k].view(torch.int16) != cur[k].view(torch.int16)).sum())
        total += cur[k].numel()
        for i in range(0, a.size, chunk):
            jobs.append((b[i : i + chunk], a[i : i + chunk]))

    def one(job: tuple[np.ndarray, np.ndarray]) -> int:
        new, old = job
        if np.array_equal(new, old):
            return 0
        return len(codecs.encode(new, 2, base=old, policy=_XOR1).payload)

    return sum(pool.map(one, jobs)), changed / max(total, 1)

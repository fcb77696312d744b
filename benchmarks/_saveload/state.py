"""The state every system saves (bf16 weights, or fp32 weights + AdamW state) and the mutations
between saves (nothing, 10% of the tensors, one optimizer step)."""

from __future__ import annotations

import time
from typing import Any

import _common as C
import torch


class BenchState:
    """The state every system saves, and the mutations between saves."""

    def __init__(self, kind: str, scale: float, seed: int = 0) -> None:
        self.kind = kind
        self.rng = torch.Generator().manual_seed(seed + 1)
        t0 = time.perf_counter()
        if kind == "weights":
            self.state: Any = C.qwen2_weights(torch.bfloat16, scale, seed)
            self.opt = None
        else:
            sd = C.qwen2_weights(torch.float32, scale, seed)
            params: list[torch.Tensor] = []
            seen: set[int] = set()
            for t in sd.values():
                if t.data_ptr() not in seen:
                    seen.add(t.data_ptr())
                    t.requires_grad_(True)
                    params.append(t)
            self.params = params
            self.model = sd
            self.opt = torch.optim.AdamW(params, lr=1e-5, weight_decay=0.01, foreach=False)
            for p in params:  # fixed random gradients, reused for every step
                p.grad = torch.randn(p.shape, generator=self.rng).mul_(1e-3)
            self.opt.step()
            self.steps = 1
            self.refresh()
        self.build_seconds = time.perf_counter() - t0

    def refresh(self) -> None:
        if self.kind == "train":
            model = {k: v.detach() for k, v in self.model.items()}
            self.state = {"model": model, "optim": self.opt.state_dict(), "step": self.steps}

    def drop_grads(self) -> None:
        if self.kind == "train":
            for p in self.params:
                p.grad = None

    # ----------------------------------------------------------------- mutations
    def mutate(self, scenario: str) -> dict[str, Any]:
        if scenario in ("full", "unchanged"):
            return {}
        if scenario == "10pct":
            return self._mutate_some(0.10)
        return self._step()

    def _mutate_some(self, frac: float) -> dict[str, Any]:
        cands = [(k, t) for k, t in C.unique_tensors(self.state) if t.numel() > 1]
        k = max(1, round(frac * len(cands)))
        idx = torch.randperm(len(cands), generator=self.rng)[:k].tolist()
        changed = 0
        with torch.no_grad():
            for i in idx:
                t = cands[i][1]
                t.mul_(0.99)
                changed += t.numel() * t.element_size()
        return {
            "tensors_changed": k,
            "tensors": len(cands),
            "bytes_changed": changed,
            "frac_bytes_changed": changed / C.logical_bytes(self.state),
        }

    def _sign_pool(self, n: int, dtype: torch.dtype) -> torch.Tensor:
        pool = getattr(self, "_pool", None)
        if pool is None or pool.dtype != dtype:
            pool = torch.randn(n + (1 << 24), generator=self.rng).sign_().to(dtype)
            self._pool = pool
        return pool

    def _step(self) -> dict[str, Any]:
        weights = [
            t
            for _, t in C.unique_tensors(
                self.state if self.kind == "weights" else self.state["model"]
            )
        ]
        # Count changed elements on the first 1M elements of every weight (cheap, representative).
        sample = 1 << 20
        before = [w.detach().reshape(-1)[:sample].clone() for w in weights]
        t0 = time.perf_counter()
        with torch.no_grad():
            if self.kind == "weights":
                pool = self._sign_pool(max(w.numel() for w in weights), weights[0].dtype)
                for w in weights:
                    # sign(randn) taken at a random offset of a pre-drawn pool of signs: drawing
                    # 494M fresh normals per step costs 10-20 s on this loaded 2-core machine.
                    off = int(
                        torch.randint(0, pool.numel() - w.numel() + 1, (1,), generator=self.rng)
                    )
                    w.add_(pool[off : off + w.numel()].view(w.shape), alpha=-1e-5)
            else:
                self.opt.step()
                self.steps += 1
        secs = time.perf_counter() - t0
        n = sum(b.numel() for b in before)
        ch = sum(
            int((w.detach().reshape(-1)[: b.numel()] != b).sum())
            for w, b in zip(weights, before, strict=True)
        )
        del before
        self.refresh()
        return {
            "step_seconds": secs,
            "frac_weight_elems_changed": round(ch / n, 4),
            "how": "w.add_(sign(randn), alpha=-1e-5) in bf16 (signs drawn once, random offsets)"
            if self.kind == "weights"
            else "torch.optim.AdamW(lr=1e-5, wd=0.01).step(), fixed random grads",
        }

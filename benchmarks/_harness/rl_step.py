"""Weights before/after an optimizer step, as an RL trainer publishes them to inference workers.

An RL trainer keeps fp32 master weights, updates them with AdamW at a tiny learning rate
(~1e-6) and publishes bf16 copies. Most bf16 elements do not move between two steps: the
update is far below one bf16 ulp (2**-8 relative) except for small-magnitude weights and those
sitting next to a rounding boundary. How many elements change is what a delta codec lives on,
so the benchmarks derive it from the real recipe (torch.optim.AdamW on random gradients) rather
than from a guessed change fraction.

Measured with this module (``python benchmarks/_harness/rl_step.py``, 4M params, N(0, 0.02)
weights, gradients N(0, 1e-3), weight_decay 0):

* lr 1e-6 -> 4.2% of bf16 elements change on the first step (Adam's first update is
  ``lr * sign(g)``), 1.7% after 5 warm-up steps, 1.1% after 20 (``warmup=``): the moments
  settle and ``|m| / sqrt(v)`` drops below 1 for noise-like gradients;
* lr 1e-5 -> 25% (first step); lr 1e-4 -> 87%;
* ``pretrain_like`` (lr 5e-6, first step) -> 15%: every weight moves by a fraction of an ulp,
  one in seven across a rounding boundary.

No RL data set is involved: the gradient distribution does not matter much here, because Adam
normalises the update to about ``lr`` per element whatever the gradient scale.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["PRETRAIN_LR", "changed_fraction", "pretrain_like", "rl_like_versions"]

PRETRAIN_LR = 5e-6  # measured: gives ~15% changed bf16 elements on a first AdamW step


def _grads(params: list[torch.Tensor], gen: torch.Generator) -> None:
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen).mul_(1e-3)


def _snapshot(params: list[torch.Tensor], dtype: torch.dtype) -> list[torch.Tensor]:
    return [p.detach().to(dtype, copy=True) for p in params]  # copy: fp32 must not alias


def rl_like_versions(
    shapes: Sequence[tuple[int, ...]],
    lr: float = 1e-6,
    steps: int = 1,
    seed: int = 0,
    dtype: torch.dtype = torch.bfloat16,
    *,
    warmup: int = 0,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(v0, v1): ``dtype`` copies of fp32 master weights before and after ``steps`` AdamW steps.

    Masters are ``randn * 0.02``; each step draws gradients ``randn * 1e-3`` (weight_decay 0).
    ``warmup`` steps run before ``v0`` is taken, so the Adam moments are at steady state when
    the measured steps run (the first step of a fresh optimizer moves every weight by ``lr``).
    """
    gen = torch.Generator().manual_seed(seed)
    params = [torch.randn(s, generator=gen).mul_(0.02).requires_grad_(True) for s in shapes]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    with torch.no_grad():
        for _ in range(warmup):
            _grads(params, gen)
            opt.step()
        v0 = _snapshot(params, dtype)
        for _ in range(steps):
            _grads(params, gen)
            opt.step()
        v1 = _snapshot(params, dtype)
    return v0, v1


def pretrain_like(
    shapes: Sequence[tuple[int, ...]], seed: int = 0, dtype: torch.dtype = torch.bfloat16
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Same recipe at :data:`PRETRAIN_LR`: ~15% of the bf16 elements change."""
    return rl_like_versions(shapes, lr=PRETRAIN_LR, seed=seed, dtype=dtype)


def changed_fraction(v0: Sequence[torch.Tensor], v1: Sequence[torch.Tensor]) -> float:
    """Fraction of elements whose bytes differ (bitwise, so -0.0 vs 0.0 counts as a change)."""
    width = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    changed = total = 0
    for a, b in zip(v0, v1, strict=True):
        bits = width[a.element_size()]
        changed += int((a.view(bits) != b.view(bits)).sum())
        total += a.numel()
    return changed / max(total, 1)


def _main() -> None:
    shapes = [(1024, 1024), (4096, 512), (512,)] + [(2048, 512)] * 2
    for label, lr, warmup in [
        ("lr 1e-6", 1e-6, 0),
        ("lr 1e-6, warmed up", 1e-6, 20),
        ("lr 1e-5", 1e-5, 0),
        (f"pretrain_like (lr {PRETRAIN_LR:g})", PRETRAIN_LR, 0),
    ]:
        v0, v1 = rl_like_versions(shapes, lr=lr, warmup=warmup)
        print(f"{label:32s} changed {100 * changed_fraction(v0, v1):6.2f}% of bf16 elements")


if __name__ == "__main__":
    _main()

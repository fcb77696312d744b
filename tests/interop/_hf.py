"""Tiny transformers models built from configs (nothing is downloaded) and trained a few steps,
shared by the export / import tests."""

from __future__ import annotations

from typing import Any

import torch


def tiny(kind: str) -> Any:
    """A 2-layer causal LM with hidden size 32, 4 heads and a 128-token vocabulary:
    ``"llama"`` (untied lm_head) or ``"qwen2"`` (``tie_word_embeddings=True``)."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    common: dict[str, Any] = dict(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    cfg = (
        LlamaConfig(**common)
        if kind == "llama"
        else Qwen2Config(**common, tie_word_embeddings=True)
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg)


def batch() -> torch.Tensor:
    return torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1))


def train(model: Any, steps: int = 3) -> torch.optim.Optimizer:
    """A few AdamW steps (so every weight differs from its initialisation)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x = batch()
    for _ in range(steps):
        model(x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad()
    return opt


def logits(model: Any) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(batch()).logits

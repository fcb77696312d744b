"""The Qwen2-0.5B state every benchmark uses: parameter shapes, random weights."""

from __future__ import annotations

import math

import torch


def qwen2_shapes(scale: float = 1.0) -> list[tuple[str, tuple[int, ...]]]:
    """Qwen2-0.5B parameter shapes (hidden 896, MLP 4864, 14 q heads / 2 kv heads of dim 64,
    vocab 151936, 24 layers, q/k/v biases, tied lm_head). ``scale`` shrinks layers and vocab."""
    hidden, inter, head_dim, n_kv = 896, 4864, 64, 2
    layers = max(1, round(24 * scale))
    vocab = max(1024, round(151936 * scale))
    kv = n_kv * head_dim
    out: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (vocab, hidden))]
    for i in range(layers):
        p = f"model.layers.{i}."
        out += [
            (p + "self_attn.q_proj.weight", (hidden, hidden)),
            (p + "self_attn.q_proj.bias", (hidden,)),
            (p + "self_attn.k_proj.weight", (kv, hidden)),
            (p + "self_attn.k_proj.bias", (kv,)),
            (p + "self_attn.v_proj.weight", (kv, hidden)),
            (p + "self_attn.v_proj.bias", (kv,)),
            (p + "self_attn.o_proj.weight", (hidden, hidden)),
            (p + "mlp.gate_proj.weight", (inter, hidden)),
            (p + "mlp.up_proj.weight", (inter, hidden)),
            (p + "mlp.down_proj.weight", (hidden, inter)),
            (p + "input_layernorm.weight", (hidden,)),
            (p + "post_attention_layernorm.weight", (hidden,)),
        ]
    out.append(("model.norm.weight", (hidden,)))
    return out  # lm_head.weight is tied to embed_tokens: added by the builder as the same tensor


def qwen2_weights(dtype: torch.dtype, scale: float = 1.0, seed: int = 0) -> dict[str, torch.Tensor]:
    """A state_dict-like dict: matrices and biases ~ N(0, 0.02), norms = 1, lm_head tied."""
    g = torch.Generator().manual_seed(seed)
    sd: dict[str, torch.Tensor] = {}
    for name, shape in qwen2_shapes(scale):
        if name.endswith("norm.weight"):
            t = torch.ones(shape, dtype=dtype)
        else:
            t = torch.randn(shape, generator=g, dtype=torch.float32).mul_(0.02).to(dtype)
        sd[name] = t
    sd["lm_head.weight"] = sd["model.embed_tokens.weight"]
    return sd


def qwen2_params(scale: float = 1.0) -> int:
    """Parameters of ``qwen2_shapes(scale)`` (the tied lm_head counted once): 494M at scale 1."""
    return sum(math.prod(shape) for _, shape in qwen2_shapes(scale))


def qwen2_scale(params: float) -> float:
    """The ``scale`` for about ``params`` parameters (layers and vocabulary shrink together)."""
    return params / qwen2_params(1.0)


def contig_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The strides of a contiguous tensor of ``shape``."""
    out, acc = [], 1
    for n in reversed(shape):
        out.append(acc)
        acc *= n
    return tuple(reversed(out))

"""A deterministic "training run" for the incremental-load and Follower tests.

``state_at(k)`` is the state after k RL-like steps (bf16 weights; each step nudges a few rows of
``w0``, one element of ``w1``, two rows of ``w5`` and a small tensor): the same bytes in every process, so a trainer
process can publish versions and a follower check it got each one bit-exactly.
"""

from __future__ import annotations

from typing import Any

import torch

import deltackpt
from deltackpt.format.codecs import XOR

CHUNK = 64 << 10  # several chunks per tensor: "one chunk changed" is a real case
SMALL = 16 << 10


def state_at(k: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    model = {f"w{i}": torch.randn(256, 256, generator=g).to(torch.bfloat16) for i in range(5)}
    model["bias"] = torch.randn(10, generator=g)
    model["norm"] = torch.ones(20)
    # 400 rows of 256 bytes over two 64 KiB chunks: split over 2 ranks at row 200 (byte 51200),
    # rank 0's rows end inside chunk 0 and rank 1's start there (a chunk straddling the edge)
    model["w5"] = torch.randn(400, 128, generator=g).to(torch.bfloat16)
    for step in range(k):
        model["w5"][300 + step] += 0.01
        model["w5"][10] += 0.01
        model["w0"][: 3 + step] += 0.01
        model["w1"].view(-1)[1000 * step] += 1.0
        model["bias"][0] += 1.0
    return {"model": model, "step": k}


def publish(st: deltackpt.Store, k: int, **kw: Any) -> None:
    """Save ``state_at(k)`` as snapshot ``s<k>`` (xor deltas allowed: ``encoding="smallest"``)."""
    deltackpt.save(state_at(k), st, f"s{k}", encoding="smallest", **kw)


def new_store(where: Any, **kw: Any) -> deltackpt.Store:
    return deltackpt.open_store(where, chunk_bytes=CHUNK, small_bytes=SMALL, **kw)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def same(got: dict[str, Any], want: dict[str, Any]) -> bool:
    a, b = got["model"], want["model"]
    return a.keys() == b.keys() and all(torch.equal(bits(a[k]), bits(b[k])) for k in a)


def is_mid_chain(st: deltackpt.Store, name: str) -> bool:
    """Whether ``w0``'s first chunk (the one every step changes) is an xor delta in ``name``."""
    m = st.manifest(name)
    e = next(e for e in m.tensors if e.path == "model/w0")
    assert e.data is not None
    return m.chunks[e.data[0][0]].codec == XOR

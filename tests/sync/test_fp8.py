"""Block-scaled FP8 weights (``deltackpt.sync.fp8``) and their rounds: the quantizer against an
independent per-block reference, its error bound, its refusals, and FP8 bytes with their
float32 scales crossing a round bit for bit beside bf16 tensors (full, then sparse deltas)."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from deltackpt import sync
from deltackpt.sync.dtypes import resolve_dtype
from deltackpt.sync.fp8 import SCALE_SUFFIX, Fp8Blocks, dequantize_blocks, quantize_blocks
from tests.sync._common import local_pair, run_threads

E4M3 = torch.float8_e4m3fn


def reference(w: torch.Tensor, block: tuple[int, int], dtype: torch.dtype, fmax: float) -> Any:
    """Block by block, with plain Python bounds: what quantize_blocks must give."""
    b0, b1 = block
    o, i = w.shape
    n0, n1 = math.ceil(o / b0), math.ceil(i / b1)
    q = torch.empty(o, i, dtype=dtype)
    s = torch.empty(n0, n1)
    x = w.float()
    for r in range(n0):
        for c in range(n1):
            blk = x[r * b0 : (r + 1) * b0, c * b1 : (c + 1) * b1]
            amax = blk.abs().max()
            sc = amax / fmax if amax > 0 else torch.tensor(1.0)
            s[r, c] = sc
            q[r * b0 : (r + 1) * b0, c * b1 : (c + 1) * b1] = (
                (blk / sc).clamp(-fmax, fmax).to(dtype)
            )
    return q, s


@pytest.mark.parametrize(
    "shape,block,dtype,fmax",
    [
        ((256, 384), (128, 128), E4M3, 448.0),  # whole blocks
        ((300, 200), (128, 128), E4M3, 448.0),  # edges: the amax over the weight's elements only
        ((64, 96), (32, 64), torch.float8_e5m2, 57344.0),
    ],
)
def test_quantized_blocks_are_the_per_block_reference_bit_for_bit(
    shape: tuple[int, int], block: tuple[int, int], dtype: torch.dtype, fmax: float
) -> None:
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(shape, generator=g) * 0.05).to(torch.bfloat16)
    w[: block[0], : block[1]] = 0  # a block of zeros: scale 1, all zeros
    w[-1, -1] = 3.0  # a large edge element sets its (partial) block's scale
    q, s = quantize_blocks(w, block, dtype)
    rq, rs = reference(w, block, dtype, fmax)
    assert q.dtype == dtype and q.shape == w.shape and q.is_contiguous()
    assert s.dtype == torch.float32 and torch.equal(s, rs)
    assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8))
    assert s[0, 0] == 1.0 and not q[: block[0], : block[1]].float().any()
    assert s[-1, -1] == torch.tensor(3.0) / fmax


def test_dequantized_weights_are_within_half_an_fp8_step() -> None:
    g = torch.Generator().manual_seed(1)
    w = torch.randn(384, 256, generator=g) * torch.rand(384, 1, generator=g)  # varied scales
    q, s = quantize_blocks(w)
    d = dequantize_blocks(q, s, dtype=torch.float32)
    tol = torch.maximum(w.abs() * 2**-4, s.max() * 2**-10)
    assert bool(((d - w).abs() <= tol).all())
    assert not torch.equal(d, w)  # (it is a quantization)
    with pytest.raises(sync.PlanError, match=r"scales of shape \[2, 2\].*expected \[3, 2\]"):
        dequantize_blocks(q, s[:2], dtype=torch.float32)


@pytest.mark.parametrize(
    "w,kwargs,match",
    [
        (torch.zeros(8), {}, r"2-D bf16/fp16/fp32 weight, got torch.float32 of shape \[8\]"),
        (torch.zeros(4, 4, dtype=E4M3), {}, "got torch.float8_e4m3fn"),
        (torch.zeros(4, 4, dtype=torch.int32), {}, "got torch.int32"),
        (torch.zeros(4, 4), {"block": (0, 128)}, r"block sizes must be positive"),
        (torch.zeros(4, 4), {"block": (128,)}, r"expected two block sizes"),
        (torch.zeros(4, 4), {"dtype": torch.bfloat16}, r"float8_e4m3fn or torch.float8_e5m2"),
    ],
)
def test_bad_quantize_arguments_are_refused(w: torch.Tensor, kwargs: dict, match: str) -> None:
    with pytest.raises(sync.PlanError, match=match):
        quantize_blocks(w, **kwargs)


def test_apply_quantizes_the_picked_weights_and_adds_their_scales() -> None:
    sd = {
        "emb.weight": torch.randn(16, 8).to(torch.bfloat16),
        "l.q.weight": torch.randn(256, 128),  # fp32 master: cast to bf16 first
        "l.q.bias": torch.randn(256),
        "norm.weight": torch.ones(8),
    }
    spec = Fp8Blocks(include={"l.q.weight", "l.q.bias", "norm.weight"})
    out = spec.apply(sd, cast=torch.bfloat16)
    assert list(out) == ["emb.weight", "l.q.weight", "l.q.weight" + SCALE_SUFFIX, "l.q.bias",
                         "norm.weight"]  # fmt: skip
    assert out["emb.weight"] is sd["emb.weight"] and out["l.q.bias"] is sd["l.q.bias"]
    q, s = quantize_blocks(sd["l.q.weight"].to(torch.bfloat16))
    assert torch.equal(out["l.q.weight"].view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(out["l.q.weight_scale_inv"], s) and s.shape == (2, 1)
    assert spec.names(sd) == {"l.q.weight", "l.q.weight_scale_inv"}
    # a state already quantized: its scale's name is taken
    with pytest.raises(sync.PlanError, match=r"'l.q.weight_scale_inv' is already one of"):
        spec.apply({**sd, "l.q.weight_scale_inv": s})
    with pytest.raises(sync.PlanError, match="expected f\\(name\\) -> bool or a set"):
        Fp8Blocks(include=3)  # type: ignore[arg-type]


def test_a_dtype_casts_floating_tensors_but_not_fp8_bytes_or_their_scales() -> None:
    assert resolve_dtype(torch.bfloat16, "w", torch.float32) == torch.bfloat16
    assert resolve_dtype(torch.bfloat16, "w", E4M3) == E4M3
    assert resolve_dtype(torch.bfloat16, "l.weight_scale_inv", torch.float32) == torch.float32
    assert resolve_dtype(torch.bfloat16, "l.weight_scale", torch.float32) == torch.bfloat16
    assert resolve_dtype(torch.bfloat16, "w", torch.float8_e5m2) == torch.float8_e5m2
    assert resolve_dtype(torch.bfloat16, "i", torch.int64) == torch.int64


@pytest.fixture
def pair() -> Iterator[tuple[sync.SyncGroup, sync.SyncGroup]]:
    with local_pair() as groups:
        yield groups


def test_fp8_bytes_and_their_scales_cross_rounds_bit_for_bit(
    pair: tuple[sync.SyncGroup, sync.SyncGroup],
) -> None:
    """A trainer's bf16 state quantized each round: FP8 weights and float32 scales arrive as
    they were sent (the receiver's dtype=bf16 casts neither), bf16 tensors beside them; after a
    small step the delta round carries a fraction of the full round's bytes."""
    g0, g1 = pair
    gen = torch.Generator().manual_seed(3)
    state = {
        "emb.weight": torch.randn(64, 128, generator=gen),  # fp32: sent as bf16
        "l.w.weight": (torch.randn(512, 256, generator=gen) * 0.02).to(torch.bfloat16),
    }
    spec = Fp8Blocks(include={"l.w.weight"})

    # dtype=bf16 on both sides (a trainer's and a vLLM worker's): FP8 bytes and scales kept
    sender = sync.WeightSender(g0, dtype=torch.bfloat16)
    receiver = sync.WeightReceiver(g1, dtype=torch.bfloat16)
    got: dict[str, torch.Tensor] = {}

    def one(v: int) -> Any:
        sent = spec.apply(state)
        out = run_threads(
            lambda: sender.push(sent, version=v),
            lambda: receiver.pull(lambda ws: got.update({n: t.clone() for n, t in ws})),
        )
        for o in out:
            if isinstance(o, BaseException):
                raise o
        assert got.keys() == sent.keys()
        assert got["emb.weight"].dtype == torch.bfloat16
        assert torch.equal(got["emb.weight"], sent["emb.weight"].to(torch.bfloat16))
        for n, t in sent.items():
            if n != "emb.weight":
                assert got[n].dtype == t.dtype, n
                assert torch.equal(got[n].view(torch.uint8), t.view(torch.uint8)), n
        return out[0]

    full = one(1)
    assert got["l.w.weight"].dtype == E4M3 and got["l.w.weight_scale_inv"].dtype == torch.float32
    with torch.no_grad():  # an RL-like step: 2% of the elements, a little
        w = state["l.w.weight"]
        mask = torch.rand(w.shape, generator=gen) < 0.02
        w[mask] += (torch.randn(w.shape, generator=gen) * 1e-3).to(w.dtype)[mask]
    delta = one(2)
    assert not delta.full and delta.payload_bytes < full.payload_bytes / 5


@pytest.mark.gpu
def test_cuda_quantizes_to_the_same_bytes_as_the_cpu() -> None:
    """One code path: the trainer's quantize on its GPU gives the bytes the CPU reference (and a
    worker quantizing a store's weights on the host) gives."""
    g = torch.Generator().manual_seed(4)
    for shape in [(1024, 768), (300, 200)]:
        w = (torch.randn(shape, generator=g) * 0.03).to(torch.bfloat16)
        q, s = quantize_blocks(w)
        qd, sd = quantize_blocks(w.cuda())
        assert qd.is_cuda and torch.equal(sd.cpu(), s)
        assert torch.equal(qd.cpu().view(torch.uint8), q.view(torch.uint8))


def test_a_shard_of_whole_blocks_is_quantized_where_it_is() -> None:
    """FSDP2-like Shard(0) rows on block boundaries (the last shard shorter, one rank past the
    end empty): each rank's FP8 bytes and its blocks' scales, as shards that tile the whole;
    put together, the whole weight's quantization. A box that cuts a block is refused."""
    g = torch.Generator().manual_seed(5)
    w = (torch.randn(300, 200, generator=g) * 0.02).to(torch.bfloat16)
    q, s = quantize_blocks(w)
    spec = Fp8Blocks(include=lambda n: n.startswith("l."))
    got_q, got_s = torch.empty_like(q), torch.full_like(s, float("nan"))
    for lo, hi in [(0, 128), (128, 256), (256, 300), (300, 300)]:
        shard = sync.LocalShard(w[lo:hi], (lo, 0), (300, 200))
        out = spec.apply({"l.w.weight": shard})
        qs, ss = out["l.w.weight"], out["l.w.weight" + SCALE_SUFFIX]
        assert isinstance(qs, sync.LocalShard) and isinstance(ss, sync.LocalShard)
        assert qs.offset == (lo, 0) and qs.shape == (300, 200) and qs.tensor.shape == (hi - lo, 200)
        assert ss.shape == (3, 2) and ss.offset == (lo // 128, 0)
        got_q[lo:hi] = qs.tensor
        got_s[ss.offset[0] : ss.offset[0] + ss.tensor.shape[0]] = ss.tensor
    assert torch.equal(got_q.view(torch.uint8), q.view(torch.uint8)) and torch.equal(got_s, s)
    cut = sync.LocalShard(w[100:200], (100, 0), (300, 200))
    with pytest.raises(
        sync.PlanError, match=r"rows/columns 100..200 of 300 along dim 0, which cut"
    ):
        spec.apply({"l.w.weight": cut})


def test_trainer_shards_quantized_where_they_are_reach_a_receiver_whole() -> None:
    """Two trainer ranks, each with its Shard(0) rows of a weight (whole blocks), one receiver:
    the receiver holds the whole weight's FP8 bytes and scales."""
    from tests._dist import free_port

    g = torch.Generator().manual_seed(6)
    w = (torch.randn(256, 256, generator=g) * 0.02).to(torch.bfloat16)
    q, s = quantize_blocks(w)
    spec = Fp8Blocks(include={"l.w.weight"})
    port = free_port()
    groups = run_threads(
        *[
            lambda r=r: sync.SyncGroup("127.0.0.1", port, r, 3, [0, 1], timeout=10.0, links="gloo")
            for r in range(3)
        ]
    )
    try:
        got: dict[str, torch.Tensor] = {}

        def trainer(r: int) -> Any:
            rows = sync.LocalShard(w[r * 128 : (r + 1) * 128], (r * 128, 0), (256, 256))
            sender = sync.WeightSender(groups[r], dtype=torch.bfloat16)
            return sender.push(spec.apply({"l.w.weight": rows}), version=1)

        receiver = sync.WeightReceiver(groups[2], dtype=torch.bfloat16)
        out = run_threads(
            lambda: trainer(0),
            lambda: trainer(1),
            lambda: receiver.pull(lambda ws: got.update({n: t.clone() for n, t in ws})),
        )
        for o in out:
            if isinstance(o, BaseException):
                raise o
        assert torch.equal(got["l.w.weight"].view(torch.uint8), q.view(torch.uint8))
        assert torch.equal(got["l.w.weight" + SCALE_SUFFIX], s)
    finally:
        for grp in groups:
            if not isinstance(grp, BaseException):
                grp.close()

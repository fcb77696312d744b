"""A simulated MxN plan (sizes only): Llama-70B-shaped tensors, FSDP trainers → TP inference.

Trainers hold ``Shard(0)`` of every fp32 tensor (FSDP2); inference ranks form ``replicas``
groups of ``tp`` tensor-parallel ranks and want bf16: column-parallel weights (q/k/v, gate/up,
embeddings, lm_head) as ``Shard(0)`` row blocks, row-parallel weights (o, down) as ``Shard(1)``
column blocks, norms whole. The schedule is built from the declarations alone (no tensors).
"""

from __future__ import annotations

import time
from typing import Any

from deltackpt.sync.schedule import build_schedule
from deltackpt.sync.schedule_decl import Box, Decl, Held, Wanted, shard_box


def llama70b_shapes(layers: int = 80) -> list[tuple[str, tuple[int, ...], int | None]]:
    """(name, shape, TP shard dim or None for replicated) of a Llama-3-70B-like model."""
    h, inter, kv, vocab = 8192, 28672, 1024, 128256
    out: list[tuple[str, tuple[int, ...], int | None]] = [("embed", (vocab, h), 0)]
    for i in range(layers):
        p = f"layers.{i}."
        out += [
            (p + "q", (h, h), 0),
            (p + "k", (kv, h), 0),
            (p + "v", (kv, h), 0),
            (p + "o", (h, h), 1),
            (p + "gate", (inter, h), 0),
            (p + "up", (inter, h), 0),
            (p + "down", (h, inter), 1),
            (p + "in_norm", (h,), None),
            (p + "post_norm", (h,), None),
        ]
    return [*out, ("norm", (h,), None), ("lm_head", (vocab, h), 0)]


def simulate(
    trainers: int = 256, tp: int = 8, replicas: int = 16, layers: int = 80, bucket_mb: int = 256
) -> dict[str, Any]:
    shapes = llama70b_shapes(layers)
    decls = []
    for r in range(trainers):
        held = tuple(Held(n, "float32", s, shard_box(s, 0, r, trainers)) for n, s, _ in shapes)
        decls.append(Decl(r, True, held=held))
    for j in range(tp * replicas):
        wanted = tuple(
            Wanted(n, n, "bfloat16", None if d is None else shard_box(s, d, j % tp, tp))
            for n, s, d in shapes
        )
        decls.append(Decl(trainers + j, False, wanted=wanted))
    t0 = time.perf_counter()
    sched = build_schedule(decls, bucket_bytes=bucket_mb << 20)
    t_build = time.perf_counter() - t0
    t0 = time.perf_counter()
    links_t = sched.links_of(0)
    t_trainer = time.perf_counter() - t0
    t0 = time.perf_counter()
    links_r = sched.links_of(trainers)
    t_receiver = time.perf_counter() - t0
    t0 = time.perf_counter()
    lb = sched.link_bytes()
    t_matrix = time.perf_counter() - t0
    model_bf16 = sum(2 * _numel(s) for _, s, _ in shapes)
    nz = lb[lb > 0]
    return {
        "trainers": trainers,
        "receivers": tp * replicas,
        "tensors": len(shapes),
        "model_bf16_bytes": model_bf16,
        "build_s": t_build,
        "trainer_links_s": t_trainer,
        "receiver_links_s": t_receiver,
        "link_matrix_s": t_matrix,
        "links": int((lb > 0).sum()),
        "link_bytes_max": int(nz.max()),
        "link_bytes_mean": float(nz.mean()),
        "per_receiver_bytes": int(lb[:, 0].sum()),
        "per_trainer_bytes": int(lb[0].sum()),
        "trainer0_links": len(links_t),
        "trainer0_buckets": sum(len(k.buckets) for k in links_t),
        "receiver0_links": len(links_r),
        "broadcast_per_receiver_bytes": sched.full_bytes(trainers),
        # a broadcast design: one rank gathers the model and broadcasts it whole
        "broadcast_root_bytes": model_bf16,
    }


def _numel(s: tuple[int, ...]) -> int:
    n = 1
    for x in s:
        n *= x
    return n


_ = Box  # re-exported for callers building their own declarations

"""Delta rounds after a real optimizer step, for ``bench_sync.py --steps``: M trainer processes
-> N inference processes, gloo or shared-memory links.

State: Qwen2-0.5B-shaped tensors (``--params`` scales it), bf16 copies of fp32 master weights
before and after AdamW steps (``_harness/rl_step.py``): ``rl-<lr>`` (after 2 warm-up steps, as
a trainer mid-run: ~2-3% of elements change at lr 1e-6) and ``pretrain`` (~15%). Trainer ``i``
of M holds ``Shard(0)`` row blocks; inference rank ``j`` of N holds ``Shard(1)`` column blocks
of every matrix and ``Shard(0)`` of every vector, written into its parameters.

Measured in the same processes, best of ``--repeats``:

* full round: ``push(full=True)``;
* delta round, ``encode="patch"``: the state alternates between the two versions, so every
  round is the same change (v0 -> v1 -> v0 ...), sent as patches against the committed version;
* delta round, ``encode="dense"``: the same rounds sending every changed piece whole (what a
  delta round did before patches);
* delta round, ``encode="auto"`` (the default): patches on gloo links when at most 1/16 of a
  piece changed, whole pieces otherwise and on shared memory;
* the reference size of the change: xor of the two versions' bytes, zstd level 1 (one frame
  per local tensor, no byte grouping), summed over the trainers;
* codec speeds on trainer 0, one thread, over its local tensors: ``delta_codec.encode`` and
  ``decode_into``, beside memcpy and xxh3-128 of the same bytes.
"""

from __future__ import annotations

import math
import time
from typing import Any

import _common as C

from _sync.job import run_job, tp_wants

STEPS = {"rl-1e-6": (1e-6, 2), "rl-1e-5": (1e-5, 2), "pretrain": (5e-6, 0)}  # lr, warm-up


def _versions(shapes: list[tuple[str, tuple[int, ...]]], step: str, rank: int, m: int) -> Any:
    """This trainer's ``Shard(0)`` blocks of the two versions, and the global changed share."""
    from _harness.rl_step import changed_fraction, rl_like_versions

    from deltackpt import sync

    lr, warmup = STEPS[step]
    v0, v1 = rl_like_versions([s for _, s in shapes], lr=lr, warmup=warmup)
    frac = changed_fraction(v0, v1)
    local0, local1, boxes = {}, {}, {}
    for (name, s), a, b in zip(shapes, v0, v1, strict=True):
        box = sync.shard_box(s, 0, rank, m)
        idx = box.within(sync.Box((0,) * len(s), s))
        local0[name], local1[name], boxes[name] = a[idx].clone(), b[idx].clone(), box
    return local0, local1, boxes, frac


def _reference_bytes(local0: dict[str, Any], local1: dict[str, Any]) -> int:
    import numpy as np
    import torch
    import zstandard

    z = zstandard.ZstdCompressor(level=1)
    total = 0
    for name, a in local0.items():
        x = np.bitwise_xor(
            a.view(torch.uint8).reshape(-1).numpy(),
            local1[name].view(torch.uint8).reshape(-1).numpy(),
        )
        total += len(z.compress(x.tobytes()))
    return total


def _codec_speeds(local0: dict[str, Any], local1: dict[str, Any]) -> dict[str, float]:
    import numpy as np
    import torch
    import xxhash

    from deltackpt.sync import delta_codec, delta_decode

    pairs = [
        (a.view(torch.uint8).reshape(-1).numpy(), local1[k].view(torch.uint8).reshape(-1).numpy())
        for k, a in local0.items()
    ]
    nbytes = sum(a.size for a, _ in pairs)
    scratch = delta_codec.Scratch()
    outs = [np.empty_like(a) for a, _ in pairs]

    def best(fn: Any) -> float:
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return nbytes / min(times) / C.GB

    encs: list[Any] = []

    def enc() -> None:
        encs.clear()
        for a, b in pairs:
            e = delta_codec.encode(b, a, 2, scratch=scratch)
            encs.append(None if e is None else (e.kind, bytes(memoryview(e.payload)[: e.nbytes])))

    def dec() -> None:
        for (a, _), e, out in zip(pairs, encs, outs, strict=True):
            if e is not None:
                delta_decode.decode_into(e[0], np.frombuffer(e[1], np.uint8), a, 2, out)

    def copy() -> None:
        for (a, _), out in zip(pairs, outs, strict=True):
            np.copyto(out, a)

    # the sender's encode under encode="auto" (the list of changes only, the base written by
    # the diff), over pieces of at most 16 MiB as buckets cut them, on 1 and 2 threads
    # (DELTACKPT_PACK_THREADS): the bases alternate between the versions like the rounds do; a
    # piece that changed too much loses its base (it goes whole: not an encode) and is left
    # out, so the rate is of the bytes encoded (nan when none is)
    from concurrent.futures import ThreadPoolExecutor

    from deltackpt.sync.patches import Bases

    cut = 16 << 20
    pieces = [(k, s) for k, (a, _) in enumerate(pairs) for s in range(0, a.size, cut)]
    bases = Bases()
    bases.allow = frozenset({delta_codec.PACKED, delta_codec.SPARSE})
    bases.packed_below = 1 / 16
    for j, (k, s) in enumerate(pieces):
        bases._base[j] = torch.from_numpy(pairs[k][0][s : s + cut].copy())
    turn = [1]

    def sender(threads: int) -> float:
        def run() -> None:
            side = turn[0]
            turn[0] ^= 1
            bases.start_round()

            def one(j: int) -> None:
                k, s = pieces[j]
                if bases.has(j):
                    bases.encode(j, torch.from_numpy(pairs[k][side][s : s + cut]), 2)

            with ThreadPoolExecutor(threads) as pool:
                list(pool.map(one, range(len(pieces))))

        run()  # the bases at version 1 (those that keep one), the next run encodes back
        run()
        kept = sum(
            min(cut, pairs[k][0].size - s) for j, (k, s) in enumerate(pieces) if bases.has(j)
        )
        times = []
        for _ in range(4):
            t0 = time.perf_counter()
            run()
            times.append(time.perf_counter() - t0)
        return kept / min(times) / C.GB if kept else float("nan")

    def hashing() -> None:
        for a, _ in pairs:
            xxhash.xxh3_128(a).digest()

    return {
        "encode": best(enc),
        "sender_1t": sender(1),
        "sender_2t": sender(2),
        "apply": best(dec),
        "memcpy": best(copy),
        "xxh3": best(hashing),
    }


def _run(rank: int, m: int, n: int, cfg: dict[str, Any], port: int) -> dict[str, Any]:
    import torch

    from deltackpt import sync

    torch.set_num_threads(1)
    shapes = C.qwen2_shapes(C.qwen2_scale(cfg["params"]))
    kind, step = cfg["links"], cfg["step"]
    group = sync.SyncGroup("127.0.0.1", port, rank, m + n, range(m), timeout=600, links=kind)
    bucket = cfg["bucket_mb"] << 20
    out: dict[str, Any] = {}
    if rank < m:
        local0, local1, boxes, out["changed_frac"] = _versions(shapes, step, rank, m)
        state = {
            name: sync.LocalShard(local0[name].clone(), boxes[name].offset, s) for name, s in shapes
        }
        out["ref_bytes"] = _reference_bytes(local0, local1)
        if rank == 0:
            out["codec"] = _codec_speeds(local0, local1)
        endpoint: Any = sync.WeightSender(group, bucket_bytes=bucket)
    else:
        wants = tp_wants(shapes, rank - m, n)
        endpoint = sync.WeightReceiver(group, wants, bucket_bytes=bucket)
    version = 0

    def set_state(which: int) -> None:  # the optimizer step: outside the timed round
        if rank < m:
            src = local1 if which else local0
            for name, sh in state.items():
                sh.tensor.copy_(src[name])

    def round_(full: bool) -> Any:
        nonlocal version
        version += 1
        if rank >= m:
            return endpoint.pull()
        return endpoint.push(state, version, full=full)

    def timed(fn: Any, which: int) -> tuple[float, Any]:
        set_state(which)
        group.pg.barrier().wait()
        t0 = time.perf_counter()
        st = fn()
        group.pg.barrier().wait()
        return time.perf_counter() - t0, st

    timed(lambda: round_(True), 0)  # the schedule
    fulls = [timed(lambda: round_(True), 0) for _ in range(cfg["repeats"])]
    out["full_s"] = min(t for t, _ in fulls)
    out["full_payload"] = fulls[-1][1].payload_bytes
    for enc in ("auto", "patch", "dense"):
        if rank < m:
            endpoint.encode = enc
        timed(lambda: round_(True), 0)  # an anchor, bases recorded
        timed(lambda: round_(False), 1)  # a first delta (records what was not patched yet)
        runs = [timed(lambda: round_(False), i % 2) for i in range(cfg["repeats"])]
        out[f"{enc}_s"] = min(t for t, _ in runs)
        out[f"{enc}_payload"] = runs[-1][1].payload_bytes
        if rank >= m:
            out[f"{enc}_patched"] = runs[-1][1].patched
        elif enc == "patch":  # the sender's bases: one copy of the pieces it sends
            out["base_bytes"] = endpoint._bases.nbytes
    group.close()
    return out


def bench_steps(m: int, n: int, cfg: dict[str, Any]) -> dict[str, Any]:
    results = run_job(_run, m, n, cfg, "step")
    out = dict(results[0])
    trainers = [results[r] for r in range(m)]
    for key in (
        "full_payload",
        "auto_payload",
        "patch_payload",
        "dense_payload",
        "ref_bytes",
        "base_bytes",
    ):
        out[key] = sum(t[key] for t in trainers)
    out["state_bytes"] = 2 * sum(
        math.prod(s) for _, s in C.qwen2_shapes(C.qwen2_scale(cfg["params"]))
    )
    return out


def steps_table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| MxN | link | step | changed | full s | delta s: auto / patch / dense "
        "| auto / full: time · bytes | patch / full: time · bytes | dense / full: time · bytes "
        "| xor+zstd-1 / full | patch bytes / xor+zstd-1 | sender base MB |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        full = r["full_payload"]
        lines.append(
            f"| {r['m']}x{r['n']} | {r['links']} | {r['step']} | {r['changed_frac']:.1%} "
            f"| {r['full_s']:.3f} | {r['auto_s']:.3f} / {r['patch_s']:.3f} / {r['dense_s']:.3f} "
            f"| {r['auto_s'] / r['full_s']:.2f} · {r['auto_payload'] / full:.3f} "
            f"| {r['patch_s'] / r['full_s']:.2f} · {r['patch_payload'] / full:.3f} "
            f"| {r['dense_s'] / r['full_s']:.2f} · {r['dense_payload'] / full:.3f} "
            f"| {r['ref_bytes'] / full:.3f} | {r['patch_payload'] / r['ref_bytes']:.2f} "
            f"| {r['base_bytes'] / 1e6:.0f} |"
        )
    lines += [
        "",
        "| step | encode GB/s (1 core) | sender encode GB/s: 1 · 2 threads | apply GB/s (1 core) "
        "| memcpy GB/s | xxh3-128 GB/s |",
        "|---|---|---|---|---|---|",
    ]
    seen = set()
    for r in rows:
        if r["step"] in seen or "codec" not in r:
            continue
        seen.add(r["step"])
        c = r["codec"]
        lines.append(
            f"| {r['step']} | {c['encode']:.2f} | {_rate(c['sender_1t'])} · {_rate(c['sender_2t'])} "
            f"| {c['apply']:.2f} | {c['memcpy']:.1f} "
            f"| {c['xxh3']:.1f} |"
        )
    return "\n".join(lines)


def _rate(gbs: float) -> str:
    return "- (all whole)" if math.isnan(gbs) else f"{gbs:.2f}"

"""Rounds for ``bench_sync.py``: M trainer processes -> N inference processes over
gloo point-to-point links or shared-memory windows (``--links gloo,shm``;
``deltackpt.sync.WeightSender`` / ``WeightReceiver``).

State: Qwen2-0.5B-shaped (``--params`` scales it), bf16. Trainer ``i`` of M holds ``Shard(0)``
row blocks of every tensor (as FSDP2 would); inference rank ``j`` of N holds tensor-parallel
``Shard(1)`` column blocks of every matrix and ``Shard(0)`` of every vector, written straight
into its preallocated parameters (the direct-into-parameter path). So with M = N = 2 every
trainer sends to every receiver a quarter of each matrix.

Measured in the same processes, best of ``--repeats``:

* ceiling: every trainer sends every receiver one buffer of exactly that link's bytes
  (``send``/``recv`` on the same gloo group, all links at once): the transport's cost for the
  round's bytes, with nothing else;
* full round: ``push(full=True)`` / ``pull()`` until every receiver committed and wrote its
  parameters;
* delta round: after ``--delta-frac`` of the parameters (the last tensors) changed; the
  floor is the time to hash every piece (the trainer reads everything once);
* delta round, ``detect="version"``: the same, skipping the tensors whose in-place version
  counter did not move (no hashing of unchanged tensors).

CPU: every rank's ``process_time`` over the fastest run of each phase (its gloo and helper
threads included, the closing barrier not), summed over the ranks. "full vs its CPU floor" is
that CPU spread over every core of the machine, as a share of the full round's wall time: near
100% the round is bound by this machine's cores, not by the transport or by waiting.

The shm ceiling: every trainer copies its links' bytes into a ``/dev/shm`` file, then every
receiver copies them out (write + read, as a round through the link windows does).
"""

from __future__ import annotations

import math
import os
import time
from typing import Any

import _common as C

from _sync.job import run_job, tp_wants


def _box_all(shape: tuple[int, ...]) -> Any:
    from deltackpt.sync import Box

    return Box((0,) * len(shape), shape)


def _run(rank: int, m: int, n: int, cfg: dict[str, Any], port: int) -> dict[str, Any]:
    import torch

    from deltackpt import sync

    torch.set_num_threads(1)
    shapes = C.qwen2_shapes(C.qwen2_scale(cfg["params"]))
    kind = cfg.get("links", "gloo")
    group = sync.SyncGroup("127.0.0.1", port, rank, m + n, range(m), timeout=600, links=kind)
    bucket = cfg["bucket_mb"] << 20

    def barrier() -> None:
        group.pg.barrier().wait()

    cpu: dict[str, list[tuple[float, float]]] = {}  # phase -> (wall, this process's CPU s)

    def timed(fn: Any, phase: str = "") -> float:
        barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        fn()
        c1 = time.process_time()  # before the barrier: its spinning is not the round's
        barrier()
        wall = time.perf_counter() - t0
        cpu.setdefault(phase, []).append((wall, c1 - c0))
        return wall

    out: dict[str, Any] = {}
    if rank < m:
        g = torch.Generator().manual_seed(rank)
        state: dict[str, Any] = {}
        if cfg.get("replicate"):  # data parallel: every trainer the same whole tensors
            g.manual_seed(0)
        for name, s in shapes:
            box = sync.shard_box(s, 0, 0 if cfg.get("replicate") else rank, m)
            if cfg.get("replicate"):
                box = sync.Box((0,) * len(s), tuple(s))
            local = torch.randn(box.size, generator=g).to(torch.bfloat16)
            state[name] = sync.LocalShard(local, box.offset, tuple(s))
        nparams = sum(math.prod(s) for _, s in shapes)
        changed, acc = [], 0
        for name, s in reversed(shapes):
            if acc >= cfg["delta_frac"] * nparams:
                break
            changed.append(name)
            acc += math.prod(s)
        out["delta_params_frac"] = acc / nparams
        out["bytes"] = 2 * nparams
        zc = cfg.get("zero_copy", "on") == "on"
        endpoint: Any = sync.WeightSender(
            group, bucket_bytes=bucket, **({} if zc else {"zero_copy_min": None})
        )
    else:
        wants = tp_wants(shapes, rank - m, n)
        endpoint = sync.WeightReceiver(group, wants, bucket_bytes=bucket)
    version = 0
    stats: list[Any] = []

    def one(full: bool) -> None:
        nonlocal version
        version += 1
        if rank < m:
            stats.append(endpoint.push(state, version, full=full))
        else:
            stats.append(endpoint.pull())

    out["first_round_s"] = timed(lambda: one(True))  # also builds the schedule
    sched = endpoint.schedule
    links = {(s, r): sched.link(s, r).nbytes for s in sched.trainers for r in sched.receivers}
    out["links"] = {f"{s}->{r}": b for (s, r), b in links.items()}

    # ceiling: the same bytes per link, one buffer each, all links at once (``sizes``: the
    # bytes per link, default a full round's)
    def ceiling(sizes: dict[tuple[int, int], int] | None = None) -> None:
        n = sizes or links
        if kind == "shm":  # every trainer writes its links' windows, then receivers copy out
            if rank < m:
                for r in sched.receivers:
                    if b := n[(rank, r)]:
                        wins[(rank, r)][:b].copy_(bufs[r][:b])
            barrier()
            if rank >= m:
                for s in sched.trainers:
                    if b := n[(s, rank)]:
                        bufs[s][:b].copy_(wins[(s, rank)][:b])
            return
        works = []
        for (s, r), b in n.items():
            if rank == s and b:
                works.append(group.pg.send([bufs[r][:b]], r, 1 << 20))
            elif rank == r and b:
                works.append(group.pg.recv([bufs[s][:b]], s, 1 << 20))
        for w in works:
            w.wait()

    peers = sched.receivers if rank < m else sched.trainers
    bufs = {
        p: torch.ones(links[(rank, p) if rank < m else (p, rank)], dtype=torch.uint8) for p in peers
    }
    wins: dict[tuple[int, int], Any] = {}
    if kind == "shm":
        import mmap

        for (s, r), b in links.items():
            if rank in (s, r) and b:  # (a replica's holder may send nothing)
                path = f"/dev/shm/deltackpt-bench-{port}-{s}-{r}"
                with open(path, "a+b") as f:
                    f.truncate(b)
                    mm = mmap.mmap(f.fileno(), b)
                wins[(s, r)] = torch.frombuffer(mm, dtype=torch.uint8)
                wins[(s, r)].fill_(0)  # fault the pages in, as the links' windows are
        barrier()
        if rank < m:
            for r in sched.receivers:
                if links[(rank, r)]:
                    os.unlink(f"/dev/shm/deltackpt-bench-{port}-{rank}-{r}")
    out["ceiling_s"] = min(timed(ceiling, "ceiling") for _ in range(cfg["repeats"]))
    out["full_round_s"] = min(timed(lambda: one(True), "full") for _ in range(cfg["repeats"]))
    if cfg.get("replicate"):  # the replicas' check (replicas.py) against none
        if rank < m:
            endpoint.replicas = "trust"
        out["full_trust_s"] = min(timed(lambda: one(True)) for _ in range(cfg["repeats"]))
        if rank < m:
            endpoint.replicas = "check"
    deltas = []
    for _ in range(cfg["repeats"]):
        if rank < m:
            for name in changed:
                state[name].tensor.add_(0.5)
        deltas.append(timed(lambda: one(False), "delta"))
    out["delta_round_s"] = min(deltas)
    # the same with detect="version": tensors untouched since the last commit are not hashed
    if rank < m:
        endpoint.detect = "version"
    deltas = []
    for _ in range(cfg["repeats"] + 1):  # the first one records the versions
        if rank < m:
            for name in changed:
                state[name].tensor.add_(0.5)
        deltas.append(timed(lambda: one(False)))
    out["delta_version_s"] = min(deltas[1:])
    # the floor of a delta round: its bytes per link as one buffer each (every rank knows its
    # own links' bytes from the last round), plus, when hashing detects the changes, one hash
    # pass over every local tensor (the slowest trainer's)
    mine = stats[-1].per_link
    dsizes = [(rank, p, mine.get(p, 0)) if rank < m else (p, rank, mine.get(p, 0)) for p in peers]
    everyone: list[Any] = [None] * (m + n)
    torch.distributed.all_gather_object(everyone, dsizes, group=group.pg)
    delta_links = {(a, b): c for got in everyone for a, b, c in got}
    out["delta_ceiling_s"] = min(
        timed(lambda: ceiling(delta_links), "delta_ceiling") for _ in range(cfg["repeats"])
    )
    hashes = [0.0]
    if rank < m:
        from deltackpt.sync.wire import hash_tensor

        def hash_all() -> None:
            for sh in state.values():
                hash_tensor(sh.tensor)

        hashes = [timed(hash_all) for _ in range(cfg["repeats"])]
    else:
        for _ in range(cfg["repeats"]):
            timed(lambda: None)
    took: list[Any] = [None] * (m + n)
    torch.distributed.all_gather_object(took, min(hashes), group=group.pg)
    out["hash_pass_s"] = max(took)
    bufs.clear()
    wins.clear()
    out["full_payload"] = stats[1].payload_bytes
    out["full_zero_copy"] = stats[1].zero_copy_bytes
    out["delta_payload"] = stats[-1].payload_bytes
    out["buckets"] = stats[1].buckets
    # CPU seconds of this process in the fastest run of each phase (gloo's threads included)
    out["cpu_s"] = {ph: min(runs)[1] for ph, runs in cpu.items() if ph}
    group.close()
    return out


def bench_mxn(m: int, n: int, cfg: dict[str, Any]) -> dict[str, Any]:
    results = run_job(_run, m, n, cfg, "MxN")
    out = dict(results[0])
    out["payload_total"] = sum(out["links"].values())
    # CPU of the whole job per phase (every rank), and the wall time the machine's cores
    # allow for it: a round cannot finish before its CPU work spread over every core
    out["cpu_s"] = {ph: sum(res["cpu_s"][ph] for res in results.values()) for ph in out["cpu_s"]}
    out["cores"] = len(os.sched_getaffinity(0))
    return out


def mxn_table(rows: list[dict[str, Any]]) -> str:
    """Two tables: full rounds against the transport ceiling and the CPU floor; delta rounds
    against their floor."""
    lines = [
        "| MxN | transport | zero-copy | bytes/link MB | ceiling s (GB/s) | full round s (GB/s) | "
        "full vs ceiling | CPU s ceiling / full (all ranks) | full vs its CPU floor |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        gb = r["payload_total"] / C.GB
        cpu = r["cpu_s"]
        per = sorted({round(b / 1e6, 1) for b in r["links"].values()})
        lines.append(
            f"| {r['m']}x{r['n']} | {r['kind']} | {zc_share(r)} | {'/'.join(map(str, per))} | "
            f"{r['ceiling_s']:.3f} ({gb / r['ceiling_s']:.2f}) | {r['full_round_s']:.3f} "
            f"({gb / r['full_round_s']:.2f}) | {r['ceiling_s'] / r['full_round_s']:.0%} | "
            f"{cpu['ceiling']:.3f} / {cpu['full']:.3f} | "
            f"{cpu['full'] / r['cores'] / r['full_round_s']:.0%} |"
        )
    if any("full_trust_s" in r for r in rows):
        lines += [
            "",
            "| MxN | transport | full round, replicas checked s | trusted s | check / trust |",
            "|---|---|---|---|---|",
        ]
        for r in rows:
            if "full_trust_s" in r:
                lines.append(
                    f"| {r['m']}x{r['n']} | {r['kind']} | {r['full_round_s']:.3f} | "
                    f"{r['full_trust_s']:.3f} | {r['full_round_s'] / r['full_trust_s']:.2f}x |"
                )
    lines += [
        "",
        "| MxN | transport | zero-copy | delta bytes / full | delta ceiling s | hash pass s | "
        "delta (hash) s | / full | / its floor | delta (version) s | / full | / its floor |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        full, dc, hp = r["full_round_s"], r["delta_ceiling_s"], r["hash_pass_s"]
        dh, dv = r["delta_round_s"], r["delta_version_s"]
        lines.append(
            f"| {r['m']}x{r['n']} | {r['kind']} | {zc_share(r)} | "
            f"{r['delta_payload'] / r['full_payload']:.1%} | {dc:.4f} | {hp:.4f} | {dh:.3f} | "
            f"{dh / full:.0%} | {dh / (hp + dc):.1f}x | {dv:.3f} | {dv / full:.0%} | "
            f"{dv / dc:.1f}x |"
        )
    return "\n".join(lines)


def zc_share(r: dict[str, Any]) -> str:
    """'off', or the share of a full round's payload sent from the tensors themselves."""
    if r.get("zero_copy", "on") == "off":
        return "off"
    return f"{r['full_zero_copy'] / r['full_payload']:.0%}"


def sim_table(res: dict[str, Any]) -> str:
    gb = 1e9
    return "\n".join(
        [
            "| plan | value |",
            "|---|---|",
            f"| ranks | {res['trainers']} trainers (FSDP Shard(0), fp32) -> {res['receivers']} "
            "inference (TP 8 x 16 replicas, bf16) |",
            f"| tensors | {res['tensors']} ({res['model_bf16_bytes'] / gb:.1f} GB in bf16) |",
            f"| build (validate every declaration) s | {res['build_s']:.2f} |",
            f"| one trainer's links s | {res['trainer_links_s']:.2f} |",
            f"| one receiver's links s | {res['receiver_links_s']:.2f} |",
            f"| all link sizes (vectorised) s | {res['link_matrix_s']:.2f} |",
            f"| links | {res['links']} |",
            f"| bytes per link, mean / max MB | {res['link_bytes_mean'] / 1e6:.1f} / "
            f"{res['link_bytes_max'] / 1e6:.1f} |",
            f"| into one receiver GB (MxN / broadcast) | {res['per_receiver_bytes'] / gb:.2f} / "
            f"{res['broadcast_per_receiver_bytes'] / gb:.2f} |",
            f"| out of one trainer GB (MxN) | {res['per_trainer_bytes'] / gb:.2f} |",
            f"| out of the broadcast root GB | {res['broadcast_root_bytes'] / gb:.2f} "
            f"(x{res['receivers']} receivers over a tree/ring) |",
        ]
    )

"""Distributed load modes: deltackpt ``mode="all_ranks"`` / ``mode="broadcast"`` vs DCP ``dcp.load``.

One state (the Qwen2-shaped bf16 weights of ``_harness/models.py``, scaled to ``--mb`` MB, lm_head
untied) is saved once by one process as a deltackpt snapshot (``deltackpt.save``) and as a DCP
checkpoint (``dcp.save`` with ``FileSystemWriter``, no process group). Then ``--world`` gloo ranks
(spawned, 127.0.0.1, hard deadline) load it ``--reps`` times each, alternating systems, in two
layouts:

* ``replicated``: every rank needs every byte (``into=`` plain tensors, as for inference
  replicas or a DDP model): ``all_ranks`` and DCP read the whole state on every rank, ``broadcast``
  reads it once on rank 0 and sends it;
* ``sharded``: DTensor ``Shard(0)`` targets (each rank needs 1/world of the rows).

Per system and layout: seconds (median over reps of the max over ranks, timed between barriers)
and bytes read from storage per rank: deltackpt's pack reads counted at ``PackReaders``
(``pack``: deltackpt reads local packs through memory maps, which ``/proc/self/io`` does not
see), and ``rchar`` of ``/proc/self/io`` (the read syscalls: DCP's file reads, and gloo's socket
reads). ``min`` is the least a rank must read: the bytes it needs, or for ``broadcast`` the whole
state once, on rank 0 only. The page cache is warm (the files were just written): this measures
the load path, not the disk. Every load is checked bit-exact against the saved values.

    python benchmarks/bench_distload.py                    # ~200 MB, 2 ranks, 3 reps
    python benchmarks/bench_distload.py --mb 50 --reps 1   # quick
"""

from __future__ import annotations

import argparse
import datetime
import multiprocessing as mp
import queue
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from _harness.env import OUT_DIR, free_port, machine_info, make_log
from _harness.models import qwen2_scale, qwen2_weights
from _harness.report import fmt_bytes, md_table, write_json

log = make_log()
SYSTEMS = ("dk all_ranks", "dk broadcast", "dcp.load")


def state(mb: float) -> dict[str, torch.Tensor]:
    sd = qwen2_weights(torch.bfloat16, qwen2_scale(mb * 1e6 / 2))
    del sd["lm_head.weight"]  # untied: both systems store the same tensors
    return sd


def rchar() -> int:
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("rchar"):
                return int(line.split()[1])
    return 0


class PackCounter:
    """Bytes delivered by deltackpt's pack reads in this process (its one read path)."""

    def __init__(self) -> None:
        from deltackpt.store.packs import PackReaders

        self.n = 0
        one, vec = PackReaders.read_into, PackReaders.readv_into

        def read_into(r: Any, pack: str, offset: int, out: Any) -> int:
            got = one(r, pack, offset, out)
            self.n += got
            return got

        def readv_into(r: Any, pack: str, offset: int, bufs: Any) -> int:
            got = vec(r, pack, offset, bufs)
            self.n += got
            return got

        PackReaders.read_into = read_into  # type: ignore[method-assign]
        PackReaders.readv_into = readv_into  # type: ignore[method-assign]


def rank_main(rank: int, world: int, port: int, cfg: dict[str, Any]) -> dict[str, Any]:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    import deltackpt

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
        timeout=datetime.timedelta(seconds=300),
    )  # fmt: skip
    pg = dist.group.WORLD
    mesh = init_device_mesh("cpu", (world,))
    full = state(cfg["mb"])
    counter = PackCounter()
    layouts: dict[str, Any] = {
        "replicated": {k: torch.zeros_like(v) for k, v in full.items()},
        "sharded": {
            k: distribute_tensor(torch.zeros_like(v), mesh, [Shard(0)]) for k, v in full.items()
        },
    }

    def check(target: dict[str, Any]) -> bool:
        ok = True
        for k, v in full.items():
            t = target[k]
            if hasattr(t, "to_local"):
                from deltackpt.format.dtensor import local_box

                (o, *_), (n, *_) = local_box(t)
                ok &= torch.equal(t.to_local(), v.narrow(0, o, n)) if n else True
            else:
                ok &= torch.equal(t, v)
        return bool(ok)

    def zero(target: dict[str, Any]) -> None:
        for t in target.values():
            (t.to_local() if hasattr(t, "to_local") else t).zero_()

    def run(system: str, target: dict[str, Any]) -> None:
        if system == "dcp.load":
            reader = dcp.FileSystemReader(cfg["dcp"])
            dcp.load(target, storage_reader=reader, process_group=pg)
        else:
            mode = system.split()[1]
            deltackpt.load(
                cfg["dk"], "s", into=target, process_group=pg, mode=mode,
                bucket_bytes=cfg["bucket"], threads=cfg["threads"],
            )  # fmt: skip

    rows: list[dict[str, Any]] = []
    for rep in range(cfg["reps"]):
        for layout, target in layouts.items():
            order = SYSTEMS if rep % 2 == 0 else tuple(reversed(SYSTEMS))
            for system in order:
                zero(target)
                dist.barrier()
                p0, c0, t0 = counter.n, rchar(), time.perf_counter()
                run(system, target)
                t1 = time.perf_counter()
                p1, c1 = counter.n, rchar()
                dist.barrier()
                rows.append({
                    "rep": rep, "layout": layout, "system": system, "seconds": t1 - t0,
                    "pack": p1 - p0, "rchar": c1 - c0, "ok": check(target),
                })  # fmt: skip
    dist.destroy_process_group()
    return {"rank": rank, "rows": rows}


def _child(rank: int, world: int, port: int, cfg: dict[str, Any], q: Any) -> None:
    try:
        q.put((rank, True, rank_main(rank, world, port, cfg)))
    except BaseException:
        q.put((rank, False, traceback.format_exc()))


def spawn_ranks(cfg: dict[str, Any], timeout: float) -> list[dict[str, Any]]:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port, world = free_port(), cfg["world"]
    procs = [
        ctx.Process(target=_child, args=(r, world, port, cfg, q), daemon=True) for r in range(world)
    ]
    for p in procs:
        p.start()
    out: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(out) < world:
            if time.monotonic() > deadline:
                raise TimeoutError(f"ranks exceeded {timeout:g} s")
            try:
                rank, ok, payload = q.get(timeout=1.0)
            except queue.Empty:
                if any(p.exitcode not in (None, 0) for p in procs):
                    raise RuntimeError(f"a rank died: {[p.exitcode for p in procs]}") from None
                continue
            if not ok:
                raise RuntimeError(f"rank {rank} failed:\n{payload}")
            out[rank] = payload
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(5)
    return [out[r] for r in range(world)]


def save_both(cfg: dict[str, Any]) -> int:
    import warnings

    import torch.distributed.checkpoint as dcp

    import deltackpt

    warnings.filterwarnings("ignore", message="torch.distributed is (disabled|unavailable)")
    sd = state(cfg["mb"])
    deltackpt.save(sd, cfg["dk"], "s")
    dcp.save(sd, storage_writer=dcp.FileSystemWriter(cfg["dcp"]), no_dist=True)
    return sum(t.numel() * t.element_size() for t in sd.values())


def summarise(results: list[dict[str, Any]], total: int, world: int) -> list[list[Any]]:
    """One table row per layout and system: median seconds (max over ranks), bytes each rank
    read in the last rep (pack reads for deltackpt, rchar for DCP), the least it must read."""

    def rows_of(layout: str, system: str, rank: int) -> list[dict[str, Any]]:
        return [x for x in results[rank]["rows"] if x["layout"] == layout and x["system"] == system]

    table = []
    for layout in ("replicated", "sharded"):
        need = total if layout == "replicated" else total / world
        secs = {}
        for system in SYSTEMS:
            per_rank = [rows_of(layout, system, r) for r in range(world)]
            reps = len(per_rank[0])
            secs[system] = statistics.median(
                max(per_rank[r][i]["seconds"] for r in range(world)) for i in range(reps)
            )
            key = "pack" if system.startswith("dk") else "rchar"
            reads = [per_rank[r][-1][key] for r in range(world)]
            least = [total] + [0] * (world - 1) if system == "dk broadcast" else [need] * world
            ok = all(x["ok"] for rows in per_rank for x in rows)
            table.append([
                layout, system, f"{secs[system]:.3f}", secs[system],
                " / ".join(fmt_bytes(b) for b in reads), " / ".join(fmt_bytes(b) for b in least),
                f"{sum(reads) / max(1, sum(least)):.3f}", "yes" if ok else "NO",
            ])  # fmt: skip
        for row in table[-len(SYSTEMS) :]:
            row[3] = f"{row[3] / secs['dcp.load']:.2f}"
    return table


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mb", type=float, default=200.0, help="state size in MB (bf16)")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--bucket-mb", type=float, default=64.0)
    ap.add_argument("--threads", type=int, default=2, help="deltackpt reader threads per rank")
    ap.add_argument("--timeout", type=float, default=900.0)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-distload-"))
    cfg = {
        "mb": args.mb, "world": args.world, "reps": args.reps, "threads": args.threads,
        "bucket": int(args.bucket_mb * (1 << 20)), "dk": str(work / "dk"), "dcp": str(work / "dcp"),
    }  # fmt: skip
    try:
        log(f"saving ~{args.mb:g} MB both ways under {work}")
        total = save_both(cfg)
        log(f"state: {fmt_bytes(total)}; loading on {args.world} ranks x {args.reps} reps")
        results = spawn_ranks(cfg, args.timeout)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    rows = summarise(results, total, args.world)
    header = [
        "layout", "system", "seconds", "x dcp", "read per rank (pack / rchar)", "min per rank",
        "reads / min", "bit-exact",
    ]  # fmt: skip
    print(md_table(header, rows))
    path = write_json(
        OUT_DIR / "bench_distload.json",
        {"config": cfg, "state_bytes": total, "machine": machine_info(), "ranks": results},
    )
    log(f"raw results: {path}")


if __name__ == "__main__":
    main()

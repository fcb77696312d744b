"""Tiered checkpoints (issue 28): blocking time per step, bytes moved per tier, restore time.

2 ranks on this machine (spawned processes, gloo on 127.0.0.1) posing as 2 nodes of one rank
each: local tiers in ``/dev/shm/<dir>/node0`` and ``node1`` (RAM), replicas=1 (each rank's
replica on the other "node"), the durable tier a directory on disk. State per rank: ``--mb`` MB
of fp32 tensors of 16 MB each (every rank its own values).

Timed on each rank, the max over ranks reported, median of ``--reps``:

* **warm copy**: ``dst.copy_(src)`` of every tensor into buffers allocated and touched before:
  one warm copy of the local state, the floor of any blocking capture;
* **blocking** of ``TieredCheckpointer.save`` after a dense step (every element changed), a
  sparse step (one row of 1 in 8 tensors changed) and no step (unchanged): until it returns
  (staged; the previous save's replication finished first, outside the timing); "paired": the
  median of each save's time over a warm copy timed right before it (the machine is shared: its
  load moves both alike); "commit": the local save's call-to-commit time (``SnapshotInfo.seconds``).
  Once per stage order of the async save (``--orders``; deltackpt/saving/order.py): ``auto``
  (the default), ``hash-first``, ``copy-first``, side by side in one run;
* **bytes** per step: written to the local tier, sent to the peer (only chunks it lacks), and
  written to the durable tier by ``persist`` (a distributed save, from the local tier in the
  background; its blocking part is the local save), after a dense and a sparse
  step;
* **restore**: a plain gloo ``send``/``recv`` of one rank's state (the link's ceiling);
  ``restore_latest`` with every local tier intact (a process restart: each rank verifies and
  loads its own), with node1's local tier wiped (rank 1 fetches its state from
  rank 0's replica; rank 0 verifies and loads its own), with both local tiers wiped (durable
  tier, a distributed load), and ``torch.distributed.checkpoint.load`` (``FileSystemReader``)
  of the same state saved by ``dcp.save`` on the same disk. Reads are warm (page cache) for the
  durable and DCP directories: the comparison is of the software path, not of the disk.

    python benchmarks/bench_tiers.py                  # 256 MB per rank, 3 reps (~1-2 min)
    python benchmarks/bench_tiers.py --mb 64 --reps 2 # quick
    python benchmarks/bench_tiers.py --blocking-only  # blocking rows only (~30 s)
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import shutil
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import _common as C

from deltackpt.saving.order import STAGE_ORDERS

TENSOR_MB = 16


def _state(rank: int, mb: int) -> dict[str, Any]:
    import torch

    n = TENSOR_MB * (1 << 20) // 4
    # the same on every rank, as DDP replicas are: the durable tier's distributed save keeps one
    # copy of a plain tensor and refuses ranks that hold it differently (replicated="check")
    g = torch.Generator().manual_seed(1000)
    return {f"t{i:03d}": torch.randn(n, generator=g) for i in range(max(1, mb // TENSOR_MB))}


KINDS = ("dense", "sparse", "unchanged")


def _step(state: dict[str, Any], kind: str, step: int) -> None:
    if kind == "dense":
        _dense(state)
    elif kind == "sparse":
        _sparse(state, step)


def _dense(state: dict[str, Any]) -> None:
    for t in state.values():
        t.add_(1e-3)


def _sparse(state: dict[str, Any], step: int) -> None:
    for i, t in enumerate(state.values()):
        if i % 8 == step % 8:
            t[(step * 4099) % (t.numel() - 1024) :][:1024] += 1.0


class Rank:
    def __init__(self, rank: int, world: int, port: int, cfg: dict[str, Any]) -> None:
        import datetime

        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
            timeout=datetime.timedelta(seconds=cfg["timeout"]),
        )  # fmt: skip
        self.dist, self.rank, self.world, self.cfg = dist, rank, world, cfg
        self.root = Path(cfg["workdir"])
        self.shm = Path(cfg["shm"])
        self.rows: dict[str, Any] = {}

    def barrier(self) -> None:
        self.dist.barrier()

    def max_over_ranks(self, x: float) -> float:
        out: list[Any] = [None] * self.world
        self.dist.all_gather_object(out, x)
        return max(out)

    def tiers(self) -> Any:
        from deltackpt.tiers import Tiers

        return Tiers(
            local=self.shm / f"node{self.rank}", durable=self.root / "durable", replicas=1,
            ranks_per_node=1, keep_last=2, durable_keep_last=2,
        )  # fmt: skip

    def timed(self, fn: Any) -> float:
        self.barrier()
        t0 = time.perf_counter()
        fn()
        return self.max_over_ranks(time.perf_counter() - t0)

    def main(self) -> dict[str, Any]:
        from deltackpt.saving.engine import saver_for
        from deltackpt.tiers import TieredCheckpointer

        reps, mb = self.cfg["reps"], self.cfg["mb"]
        state = _state(self.rank, mb)
        nbytes = sum(t.numel() * 4 for t in state.values())
        bufs = {k: v.clone() for k, v in state.items()}

        def warm_copy() -> None:
            for k, v in state.items():
                bufs[k].copy_(v)

        self.rows["warm_copy_s"] = statistics.median(self.timed(warm_copy) for _ in range(reps))
        ck = TieredCheckpointer(self.tiers(), every=1, process_group=self.dist.group.WORLD)
        step = 0
        ck.save(step, state)  # first save: everything new
        ck.wait()
        first = (ck.stats.local_bytes_written, ck.stats.replicated_bytes_sent)
        self.rows["first_local_bytes"], self.rows["first_sent_bytes"] = first
        order = saver_for(ck.own).order
        # the orders interleaved save by save (the machine's load moves them alike); in auto, the
        # previous save (another order's, of the same kind of step) is what the choice learns from
        copies: list[float] = []
        for kind in KINDS:
            got: dict[str, dict[str, list[float]]] = {}
            for _ in range(reps):
                for mode in self.cfg["orders"]:
                    order.mode = mode
                    x = got.setdefault(mode, {})
                    step += 1
                    _step(state, kind, step)
                    ck.wait()
                    s0 = (ck.stats.local_bytes_written, ck.stats.replicated_bytes_sent)
                    copy_s = self.timed(warm_copy)  # paired: the same moment's load on the box
                    copies.append(copy_s)
                    hs: list[Any] = []
                    block = self.timed(lambda s=step, hs=hs: hs.append(ck.save(s, state)))
                    x.setdefault("blocking_s", []).append(block)
                    x.setdefault("paired", []).append(block / copy_s)
                    x.setdefault("commit_s", []).append(self.max_over_ranks(hs[0].result().seconds))
                    ck.wait()
                    x.setdefault("local_bytes", []).append(ck.stats.local_bytes_written - s0[0])
                    x.setdefault("sent_bytes", []).append(ck.stats.replicated_bytes_sent - s0[1])
            for mode, x in got.items():
                for key, values in x.items():
                    self.rows[f"{mode}_{kind}_{key}"] = statistics.median(values)
        order.mode = "auto"
        self.rows["warm_copy_s"] = statistics.median(copies)  # over the whole blocking part
        if self.cfg["blocking_only"]:
            ck.close()
            self.rows["state_bytes"] = nbytes
            return self.rows
        # durable: a first persist, then one after a dense and one after a sparse step
        assert ck.durable is not None
        persisted: dict[str, int] = {}
        for kind in ("first", "dense", "sparse"):
            if kind != "first":
                step += 1
                _dense(state) if kind == "dense" else _sparse(state, step)
            ck.wait()
            # a persist step: the local save (staged once) whose snapshot the background thread
            # then persists from the local tier (tiers/persist.py)
            block = self.timed(lambda s=step: ck.persist(s, state))
            self.rows[f"persist_{kind}_blocking_s"] = block
            ck.wait()
            persisted[kind] = int(ck.durable.infos[-1].bytes_written)
        self.rows["persisted_bytes"] = persisted
        ck.close()
        want = {k: v.clone() for k, v in state.items()}

        def link() -> None:  # the transport's ceiling: the state's bytes, rank 0 -> rank 1
            for k in want:
                if self.rank == 0:
                    self.dist.send(want[k], 1)
                else:
                    self.dist.recv(bufs[k], 0)

        self.rows["link_s"] = statistics.median(self.timed(link) for _ in range(reps))
        self.rows.update(self.restores(state, want, reps))
        self.rows["state_bytes"] = nbytes
        return self.rows

    def restores(self, state: dict[str, Any], want: dict[str, Any], reps: int) -> dict[str, Any]:
        import torch
        import torch.distributed.checkpoint as dcp

        from deltackpt.tiers import TieredCheckpointer

        out: dict[str, Any] = {}
        pg = self.dist.group.WORLD
        dcp_dir = self.root / "dcp"
        dcp.save(want, storage_writer=dcp.FileSystemWriter(str(dcp_dir)))
        for what in ("local", "peer", "durable", "dcp"):
            secs, sources = [], None
            for _ in range(reps):
                for t in state.values():
                    t.zero_()
                self.barrier()
                wipe = {"peer": [1], "durable": [0, 1]}.get(what, [])
                if self.rank in wipe:
                    shutil.rmtree(self.shm / f"node{self.rank}", ignore_errors=True)
                self.barrier()
                if what == "dcp":
                    secs.append(self.timed(lambda: dcp.load(state, checkpoint_id=str(dcp_dir))))
                else:
                    ck = TieredCheckpointer(self.tiers(), every=1, process_group=pg)
                    secs.append(self.timed(lambda ck=ck: ck.restore_latest(state)))
                    sources = ck.last_restore.sources if ck.last_restore else None
                    ck.close()
                # a distributed save keeps one rank's copy of a plain tensor (taken as
                # replicated): deltackpt rank 0's, DCP whichever rank its dedupe picked
                if what in ("local", "peer") or (what == "durable" and self.rank == 0):
                    assert all(torch.equal(state[k], want[k]) for k in want), what
            out[f"restore_{what}_s"] = statistics.median(secs)
            out[f"restore_{what}_sources"] = sources
        return out


def _child(rank: int, world: int, port: int, cfg: dict[str, Any], q: Any) -> None:
    try:
        q.put((rank, Rank(rank, world, port, cfg).main()))
    except BaseException:
        q.put((rank, traceback.format_exc()))


def _table(r: dict[str, Any], limits: dict[str, Any], orders: list[str]) -> list[str]:
    gb = C.fmt_bytes
    warm = r["warm_copy_s"]
    p = r.get("persisted_bytes", {})
    rows = [["warm copy of the local state (floor)", "", f"{warm * 1e3:.1f} ms", "1.00x", "", ""]]
    for mode in orders:
        for k in KINDS:
            x = f"{mode}_{k}"
            step = "no step (unchanged)" if k == "unchanged" else f"a {k} step"
            persisted = f", persisted {gb(p[k])}" if k in p else ""
            rows.append(
                [
                    f"blocking `save` after {step}",
                    mode,
                    f"{r[f'{x}_blocking_s'] * 1e3:.1f} ms",
                    f"{r[f'{x}_blocking_s'] / warm:.2f}x (paired {r[f'{x}_paired']:.2f}x)",
                    f"{r[f'{x}_commit_s'] * 1e3:.0f} ms",
                    f"local {gb(r[f'{x}_local_bytes'])}, replicated {gb(r[f'{x}_sent_bytes'])}"
                    + persisted,
                ]
            )
    lim = ", ".join(
        f"{k} {v['gbps']:.1f} GB/s" for k, v in limits.items() if k in ("memcpy", "xxh3")
    )
    head = ["per rank", "stage order", "blocking", "ratio to warm copy", "commit", "bytes per step"]
    out = [C.md_table(head, rows), "", f"Machine limits measured in the same run: {lim}."]
    if "restore_dcp_s" not in r:
        return out
    first = (
        f"First save: local {gb(r['first_local_bytes'])}, replicated "
        f"{gb(r['first_sent_bytes'])}, persisted {gb(p['first'])} (2 ranks). Blocking of a "
        f"persist step (`persist`: the local save; the durable save runs in the background, "
        f"from the local tier): after a dense step {r['persist_dense_blocking_s'] * 1e3:.1f} ms "
        f"({r['persist_dense_blocking_s'] / warm:.2f}x a warm copy), after a sparse step "
        f"{r['persist_sparse_blocking_s'] * 1e3:.1f} ms "
        f"({r['persist_sparse_blocking_s'] / warm:.2f}x)."
    )
    link = [
        "gloo send of one rank's state, rank 0 -> 1 (the link's ceiling)",
        f"{r['link_s']:.2f} s",
        f"{r['link_s'] / r['restore_dcp_s']:.2f}x of dcp.load",
        "",
    ]
    restore = [link] + [
        [
            f"restore: {name}",
            f"{r[f'restore_{k}_s']:.2f} s",
            f"{r[f'restore_{k}_s'] / r['restore_dcp_s']:.2f}x of dcp.load",
            str(r.get(f"restore_{k}_sources") or ""),
        ]
        for k, name in (
            ("local", "a process restart: every rank from its own local tier"),
            ("peer", "node1 wiped, rank 1 from rank 0's replica"),
            ("durable", "both local tiers wiped, durable tier"),
            ("dcp", "`dcp.load` (FileSystemReader) of the same state"),
        )
    ]
    return [
        *out,
        "",
        first,
        "",
        C.md_table(["restore (2 ranks)", "time", "ratio", "sources"], restore),
    ]


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--mb", type=int, default=256, help="MB of state per rank")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument(
        "--orders",
        default="auto,hash-first,copy-first",
        help="stage orders of the local async save to time, comma-separated",
    )
    ap.add_argument("--blocking-only", action="store_true", help="skip persist and restores")
    ap.add_argument("--out", default=str(C.OUT_DIR / "tiers.md"))
    args = ap.parse_args()
    cmd = "python " + " ".join([os.path.relpath(__file__, C.REPO), *sys.argv[1:]])
    info = C.machine_info()
    work = C.OUT_DIR / f"tiers-work-{os.getpid()}"
    shm = Path("/dev/shm") / f"deltackpt-bench-tiers-{os.getpid()}"
    orders = [o.strip() for o in args.orders.split(",") if o.strip()]
    bad = [o for o in orders if o not in STAGE_ORDERS]
    if bad or not orders:
        raise SystemExit(
            f"--orders={args.orders!r}: expected a comma-separated subset of {STAGE_ORDERS}"
        )
    cfg = {"mb": args.mb, "reps": args.reps, "timeout": args.timeout, "orders": orders}
    cfg["blocking_only"] = args.blocking_only
    cfg.update(workdir=str(work), shm=str(shm))
    try:
        limits = C.measure_limits(work / "limits", args.mb << 20, reps=args.reps)
        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        port = C.free_port()
        procs = [ctx.Process(target=_child, args=(r, 2, port, cfg, q)) for r in range(2)]
        for p in procs:
            p.start()
        results = C.collect(procs, q, args.timeout)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)
    if len(results) != 2 or any(isinstance(v, str) for v in results.values()):
        raise SystemExit(f"ranks failed: {results}")
    md = [
        f"# bench_tiers ({info['date']}, {info.get('cpus')} CPUs)",
        "",
        f"Command: `{cmd}`; {args.mb} MB of fp32 per rank, 2 ranks as 2 nodes, median of "
        f"{args.reps}; times are the max over ranks.",
        "",
        *_table(results[0], limits, orders),
    ]
    text = "\n".join(md) + "\n"
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()

"""Distributed checkpointing: deltackpt(process_group=pg) vs torch.distributed.checkpoint (DCP).

Part 1, real: 2 ranks on this machine (spawned processes, gloo on 127.0.0.1, a hard timeout),
the Qwen2-0.5B-shaped state (hidden 896, MLP 4864, 24 layers, 14 q / 2 kv heads of dim 64, vocab
151936, q/k/v biases, tied lm_head; ~494M params) as bf16 DTensors ``Shard(0)`` on a 1-D mesh of
2. Each rank builds only its own shards (seeded per rank) as an fp32 master plus its bf16 copy.
The state is the flat ``{fqn: DTensor}`` dict, with ``lm_head.weight`` the same DTensor object as
``model.embed_tokens.weight`` (as ``model.state_dict()`` returns tied weights).

"Step": one AdamW step at lr=1e-5 as Adam's first step is, ``w -= lr * sign(g)``: the fp32
master takes ``w.sub_(1e-5 * s)`` with ``s`` = +-1 (views at random offsets into a fixed random
+-1 pool, so drawing the signs costs no RNG time), then the bf16 weights are ``copy_``-ed from it
in place (~10-15% of bf16 elements change, every 4 MiB chunk changes).

Timed per system (median of ``--reps``; each time is the max over ranks, taken after a barrier):
deltackpt.save full (fresh store), unchanged (same store, no step), incremental (step, save);
deltackpt.load(into=DTensors, process_group=pg) into the same layout and resharded (2-D
``Shard(1)``, 1-D ``Replicate``); deltackpt.async_save after a step (blocking = until it returns,
total = until ``result()``). DCP: ``dcp.save`` with ``FileSystemWriter`` (defaults: fsync, 1
thread) full (fresh dir) and after a step (fresh dir; DCP rewrites everything), once more with
``DefaultSavePlanner(enable_plan_caching=True)``; ``dcp.load`` with ``FileSystemReader`` into the
same two layouts; ``dcp.async_save`` after a step. Loads are verified bit-exact (every rank's
local shards against the saved values; resharded targets against ``redistribute`` of the saved
DTensors). Bytes = growth of ``du`` of the store / checkpoint directory.

Part 2, simulated (benchmarks/_dist/sim.py): the planning step of both systems at N ranks
(default 2, 64, 256, 1024) with their real classes and functions; bytes exchanged per save and
rank 0's planning time, for a full save and for saves after 0%, 1%, 10%, 100% of chunks changed.

    python benchmarks/bench_dist.py                      # default: real 2 ranks + simulation
    python benchmarks/bench_dist.py --scale 0.05 --sim-ranks 2,16   # quick debug
    python benchmarks/bench_dist.py --skip-real          # simulation only
"""

from __future__ import annotations

import argparse
import os
import pickle
import shutil
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import _common as C
from _dist import log
from _dist import sim as S
from _dist.report import coll_table, real_tables, sim_tables
from _dist.spawn import run_real


def run_sim(ranks: list[int], fracs: list[float], tied: bool) -> dict[str, Any]:
    keys = S.state_keys(C.qwen2_shapes(1.0), tied)
    out: dict[str, Any] = {"dk": [], "dcp": [], "layout_keys": {}}
    for n in ranks:
        t0 = time.perf_counter()
        out["dk"] += S.sim_deltackpt(keys, n, fracs)
        t1 = time.perf_counter()
        out["dcp"] += S.sim_dcp(keys, n)
        t2 = time.perf_counter()
        log(f"sim N={n}: deltackpt {t1 - t0:.1f}s, DCP {t2 - t1:.1f}s")
    return out


def sim_check(scale: float, world: int, tied: bool) -> dict[str, Any]:
    """The simulation's per-rank inputs at the real run's scale, to compare with the real run."""
    from deltackpt.store.store import DEFAULT_CHUNK_BYTES, DEFAULT_SMALL_BYTES

    keys = S.state_keys(C.qwen2_shapes(scale), tied)
    cache: dict[Any, Any] = {}
    return {
        "layout_keys": [
            S.dk_layout(keys, world, r, DEFAULT_CHUNK_BYTES, DEFAULT_SMALL_BYTES, cache)[0].key()
            for r in range(world)
        ],
        "dcp_plan_bytes": [len(pickle.dumps(p)) for p in S.dcp_local_plans(keys, world)],
        "dk_rows": S.sim_deltackpt(keys, world, [0.0, 1.0]),
        "dcp_rows": S.sim_dcp(keys, world),
    }


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--scale", type=float, default=1.0, help="shrink layers/vocab (real run only)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--cold", action="store_true", help="drop the page cache before every load")
    ap.add_argument("--no-tie", action="store_true", help="leave out lm_head.weight")
    ap.add_argument("--dcp-first", action="store_true", help="run DCP before deltackpt")
    ap.add_argument("--sim-ranks", default="2,64,256,1024")
    ap.add_argument("--fracs", default="0,0.01,0.1,1")
    ap.add_argument("--skip-real", action="store_true")
    ap.add_argument("--skip-sim", action="store_true")
    ap.add_argument(
        "--mem-need-gb",
        type=float,
        default=7.0,
        help="MemAvailable to wait for before spawning the ranks: 0.8 + this x scale GB "
        "(2 ranks peak at ~3.2 GB RSS each at scale 1)",
    )
    ap.add_argument("--timeout", type=float, default=600, help="hard limit for the real run (s)")
    ap.add_argument("--workdir", default=str(C.OUT_DIR / f"dist-work-{os.getpid()}"))
    ap.add_argument("--out", default=str(C.OUT_DIR / "dist.md"))
    args = ap.parse_args()

    cmd = "python " + " ".join([os.path.relpath(__file__, C.REPO), *sys.argv[1:]])
    info = C.machine_info()
    log(f"{cmd}  {info}")
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    cfg = {
        "scale": args.scale,
        "reps": args.reps,
        "world": args.world,
        "cold": args.cold,
        "tied": not args.no_tie,
        "dcp_first": args.dcp_first,
        "workdir": str(work),
        "torch_threads": 1,
        "pg_timeout": max(120.0, args.timeout),
        "mem_need": int((0.8 + args.mem_need_gb * args.scale) * 1e9),
        "mem_floor": int(0.7e9),
        "mem_wait": 300,
    }
    real = sim = None
    if not args.skip_sim:  # first: it needs little memory, the real run needs ~6.5 GB
        sim = run_sim(
            [int(x) for x in args.sim_ranks.split(",") if x],
            [float(x) for x in args.fracs.split(",") if x],
            not args.no_tie,
        )
    try:
        if not args.skip_real:
            real = run_real(cfg, args.timeout)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    md = [
        f"# bench_dist: deltackpt vs DCP, distributed ({info['date']})",
        "",
        f"Command: `{cmd}` (default run ~6-9 min here). Quick debug: "
        "`python benchmarks/bench_dist.py --scale 0.05 --reps 2 --sim-ranks 2,16`; simulation only: "
        "`python benchmarks/bench_dist.py --skip-real`.",
        "",
        f"Machine: {info['cpus']} cpus, {info['mem_total']}, torch {info['torch']}, python "
        f"{info['python']}, git {info['git_rev']}{' (dirty)' if info['git_dirty'] else ''}, "
        f"load average at start {tuple(round(x, 2) for x in info['loadavg_start'])}; "
        f"load average at end {tuple(round(x, 2) for x in os.getloadavg())}. Shared, noisy machine: "
        "compare ratios within this run.",
        "",
    ]
    if real is not None:
        md += [
            f"## 1. Real run: {args.world} ranks (gloo, 127.0.0.1), Qwen2-0.5B-shaped bf16 DTensors "
            f"Shard(0), scale {args.scale}",
            "",
            f"State: {real['keys']} keys ({'lm_head tied: the same DTensor under two keys' if cfg['tied'] else 'no lm_head'}), "
            f"{real['unique_global_bytes'] / 1e9:.3f} GB global (tied counted once; GB/s uses this). "
            "Times: max over ranks after a barrier; 'runs' lists each repetition. 'Step' = one "
            "AdamW step at lr 1e-5 in Adam's first-step form w -= 1e-5*sign(g) on the fp32 master, "
            "then copied into the bf16 weights. deltackpt's unchanged and incremental saves are "
            "compared with DCP's save after a step (DCP rewrites everything). Loads "
            f"{'cold (drop_caches before each)' if cfg['cold'] else 'warm (page cache)'}; "
            "torch threads 1 per rank, deltackpt threads default, DCP FileSystemWriter defaults.",
            "",
            real_tables(real),
            "",
        ]
        chk = real["checks"]
        sc = sim_check(args.scale, args.world, cfg["tied"])
        w = range(args.world)
        same = [chk[r].get(f"dk_layout_key_rank{r}") == sc["layout_keys"][r] for r in w]
        dk_full: dict[str, Any] = next(
            (r for r in real["rows"] if r["op"] == "save full (fresh store)"), {}
        )
        md += [
            f"Simulation check (same scale, N={args.world}): deltackpt `Layout.key()` of each real "
            f"rank's plan equals the simulated layout: {same}; deltackpt plan bytes of a full "
            f"save real {dk_full.get('plan_bytes')} vs simulated {sc['dk_rows'][0]['gather_plan']}; "
            f"DCP local plan bytes real (per save) "
            f"{[chk[r].get(f'dcp_local_plan_bytes_rank{r}') for r in w]} vs simulated "
            f"{sc['dcp_plan_bytes']}; DCP .metadata real "
            f"{next((r.get('metadata_bytes') for r in real['rows'] if r.get('metadata_bytes')), '-')}"
            f" vs simulated {sc['dcp_rows'][0]['metadata_file']}.",
            "",
            "Object-collective bytes per save measured in the real run (pickled sizes counted by "
            "wrapping torch.distributed.gather_object / scatter_object_list / "
            "broadcast_object_list; same counting rules as the simulation; the incremental row is "
            "compared with the simulation's 100%-changed save, as every chunk changes):",
            "",
            coll_table(real, sc),
            "",
            f"`Store.chunk_index()` (called by every rank at every distributed save since "
            f"0da86df, to vouch for xor bases), timed on the store after all deltackpt saves: "
            f"{[chk[r].get(f'chunk_index_ms_rank{r}') for r in w]}.",
            "",
        ]
    if sim is not None:
        md += [
            "## 2. Planning at simulated scale (no processes; the 0.5B state Shard(0) over N ranks)",
            "",
            "Each system's own planning code on synthetic inputs (benchmarks/_dist/sim.py). deltackpt: "
            "save #1 full, then saves with 0%, 1%, 10%, 100% of all chunks given new digests (each "
            "after the previous). DCP's plans do not depend on the data: #1 is also what every save "
            "without plan caching costs; '#2+ with caching' is every later save with "
            "`enable_plan_caching=True` (local plans sent as `SavePlan([], usable=False)`), whatever "
            "changed. Bytes = pickled size of what each collective carries; a broadcast counts N-1 "
            "times. Times are single runs on a shared 2-core machine (rank 0's Python work only; no "
            "network).",
            "",
            sim_tables(sim),
            "",
        ]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(md) + "\n")
    C.write_json(
        out.with_suffix(".json"), {"cmd": cmd, "info": info, "cfg": cfg, "real": real, "sim": sim}
    )
    print("\n".join(md))
    log(f"wrote {out}")


if __name__ == "__main__":
    main()

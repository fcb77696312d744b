"""One state kind (bf16 or train): every system's saves, then deltackpt restores of the chain
end vs the keyframe."""

from __future__ import annotations

import argparse
import gc
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import _common as C
from _harness import stores

import deltackpt
from _async import log
from _async.master import Master, state_bytes
from _async.systems import Rec, run_dcp, run_deltackpt, run_torch_save, run_tsnap


def restore(
    st: Any, kind: str, master: Master, names: dict[str, str], cold_reps: int, warm_reps: int
) -> list[dict[str, Any]]:
    out = []
    target = master.state(kind)
    nbytes = state_bytes(target)
    for label, name in names.items():
        depth = stores.depth_bytes(st, name)
        for mode, reps in (("cold", cold_reps), ("warm", warm_reps)):
            secs = []
            ok = True
            for _ in range(reps):
                if mode == "cold":
                    ok = C.drop_caches() and ok
                else:
                    deltackpt.load(st, name, into=target)  # make sure it is cached
                gc.collect()
                t0 = time.perf_counter()
                deltackpt.load(st, name, into=target)
                secs.append(time.perf_counter() - t0)
                log(f"  restore {label} {mode}: {secs[-1]:.2f}s")
            if reps:
                out.append(
                    {
                        "snapshot": label,
                        "name": name,
                        "mode": mode if ok else "warm(!)",
                        "seconds": secs,
                        "bytes": nbytes,
                        "max_depth": max(depth),
                        "depth_bytes": dict(depth),
                    }
                )
    return out


# =========================================================================== one state kind


def bench_kind(kind: str, master: Master, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    scale = master.scale
    log(f"== {kind} (scale {scale})")
    if kind == "bf16":
        master.export_bf16()
    i0 = len(master.step_seconds)
    state = master.state(kind)
    nbytes = state_bytes(state)
    log(
        f"   state {nbytes / 1e9:.3f} GB, rss {C.rss() / 1e9:.1f} GB, "
        f"avail {C.mem_available() / 1e9:.1f} GB"
    )
    res: dict[str, Any] = {
        "kind": kind,
        "scale": scale,
        "params": master.numel,
        "state_bytes": nbytes,
        "warm_copy": [],
        "systems": {},
    }
    n = args.saves
    systems: list[tuple[str, Callable[[], list[Rec]]]] = [
        ("torch.save (sync, +fsync)", lambda: run_torch_save(master, kind, work / "torch", n)),
        (
            "dcp.async_save (default stager)",
            lambda: run_dcp(master, kind, work / "dcp", n, cached=False),
        ),
        (
            "dcp.async_save (reused DefaultStager)",
            lambda: run_dcp(master, kind, work / "dcpc", n, cached=True),
        ),
    ]
    try:
        import torchsnapshot  # noqa: F401

        systems.append(
            ("torchsnapshot async_take", lambda: run_tsnap(master, kind, work / "tsnap", n))
        )
        res["torchsnapshot"] = "0.1.0 (pip install --no-deps torchsnapshot + its non-torch deps)"
    except Exception as e:
        res["torchsnapshot"] = f"skipped: import failed: {e!r}"
        log(f"   torchsnapshot skipped: {e!r}")

    for label, fn in systems:
        log(f"-- {label}")
        res["systems"][label] = fn()
        res["warm_copy"] += [x["warm"] for x in res["systems"][label]]
        gc.collect()

    need = 2 * nbytes + 1.5e9  # two staging arenas (xor deltas on) + slack
    deadline = time.perf_counter() + args.mem_wait
    while C.mem_available() < need and time.perf_counter() < deadline:
        log(
            f"   waiting for memory before deltackpt: need {need / 1e9:.1f} GB, "
            f"have {C.mem_available() / 1e9:.1f} GB"
        )
        time.sleep(10)
    res["mem_available_at_deltackpt"] = C.mem_available()
    log(
        f"-- deltackpt (needs {2 * nbytes / 1e9:.1f} GB of staging; "
        f"avail {C.mem_available() / 1e9:.1f} GB)"
    )
    recs, st = run_deltackpt(master, kind, work / "deltackpt", args.chain)
    res["systems"]["deltackpt.async_save"] = recs
    res["keyframe_every"] = deltackpt.SaveOptions().keyframe_every
    res["warm_copy"] += [x["warm"] for x in recs]
    master.wc_buf = None

    log("-- restore")
    names = {
        "keyframe (save #0)": "step-0",
        f"chain end (save #{args.chain - 1})": f"step-{args.chain - 1}",
    }
    keep = None
    if kind == "bf16":  # check bit-exactness of the chain end against the live state
        keep = {k: v.clone() for k, v in master.state(kind).items()}
    # drop the staging arenas before loading (they are not needed and hold 2x the state)
    stores.release(st, forget=False)  # benchmark only: release the saver's arenas before loading
    gc.collect()
    # warm restores only when the store fits in the page cache (the train chain end reads
    # keyframe + 7 deltas, ~6x the state)
    res["store_bytes"] = C.du_bytes(work / "deltackpt")
    warm = args.restore_reps if res["store_bytes"] < 0.6 * C.mem_available() else 0
    res["restore"] = restore(st, kind, master, names, args.restore_reps, warm)
    if keep is not None:
        got = master.state(kind)
        res["restore_chain_end_bit_exact"] = all(C.bit_equal(keep[k], got[k]) for k in keep)
        del keep
    res["step_seconds"] = master.step_seconds[i0:]
    master.bf16 = None
    for sub in ("torch", "dcp", "dcpc", "tsnap", "deltackpt"):
        C.rmtree(work / sub)
    return res

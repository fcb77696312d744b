"""The timed runs: every scenario's saves, then loads of the last saved state, each checked
bit-exact against the source."""

from __future__ import annotations

import gc
import os
from collections.abc import Sequence
from typing import Any

import _common as C
import torch

from _saveload.state import BenchState
from _saveload.systems import System

SLOW = 10.0  # a measurement slower than this is not repeated
SCENARIOS = ("full", "unchanged", "10pct", "step")


def run_saves(
    bs: BenchState, systems: Sequence[System], reps: int, log: Any
) -> list[dict[str, Any]]:
    rows: dict[tuple[str, str], dict[str, Any]] = {}
    for sc in SCENARIOS:
        skip: set[str] = set()
        for rep in range(reps):
            active = [s for s in systems if s.name not in skip]
            if not active:
                break
            mut = bs.mutate(sc)
            k = rep % len(systems)  # rotate the order: no system always runs right after another
            for s in systems[k:] + systems[:k]:
                if s.name in skip:
                    continue
                row = rows.setdefault(
                    (sc, s.name),
                    {"op": "save", "scenario": sc, "system": s.name, "runs": [], "mutations": []},
                )
                rss0 = C.rss()
                try:
                    r = s.save(bs.state, fresh=(sc == "full"))
                except Exception as e:  # a broken system must not end the comparison
                    row["error"] = f"{type(e).__name__}: {e}"[:300]
                    log(f"  save {sc} rep {rep} {s.name} FAILED: {row['error']}")
                    skip.add(s.name)
                    continue
                r["loadavg"] = os.getloadavg()[0]
                r["rss_after"] = C.rss()
                r["rss_delta"] = r["rss_after"] - rss0
                row["runs"].append(r)
                log(
                    f"  save {sc:9s} rep {rep} {s.name:13s} {r['seconds']:7.3f} s "
                    f"{C.fmt_bytes(r['bytes_added'])}"
                    + (
                        f" new={r['chunks_new']} reused={r['chunks_reused']} {r['new_codecs']}"
                        if "chunks_new" in r
                        else ""
                    )
                )
                must_follow = s.incremental and sc in ("10pct", "step")
                if r["seconds"] > SLOW and not must_follow:
                    skip.add(s.name)
            for row in rows.values():
                if row["scenario"] == sc:
                    row["mutations"].append(mut)
            if mut:
                log(f"  mutation {sc} rep {rep}: {mut}")
    return list(rows.values())


def run_loads(
    bs: BenchState,
    systems: Sequence[System],
    reps: int,
    cold_ok: bool,
    into_cold: bool,
    log: Any,
) -> list[dict[str, Any]]:
    src = C.flat_tensors(bs.state)
    src_vals = C.flat_values(bs.state)
    ties = C.tied_pairs(bs.state)
    rows = []

    src_digests = C.bit_digests(src)

    def check(s: System, got: Any, mode: str, rep: int) -> dict[str, Any]:
        # First load of a row: torch.equal on the raw bits of every tensor. Repeats: xxh3-128 of
        # the raw bits (same verdict, ~10x cheaper; torch.equal of 1 GB takes 3-5 s here).
        if rep == 0:
            res = C.compare(src, C.flat_tensors(got))
            res["check"] = "torch.equal"
        else:
            res = C.compare_digests(src_digests, C.flat_tensors(got))
            res["check"] = "xxh3-128"
        if mode == "new" and s.name != "safetensors":
            vals = C.flat_values(got)
            res["values_equal"] = all(vals.get(k) == v for k, v in src_vals.items())
            res["exact"] = res["exact"] and res["values_equal"]
        if mode == "new":
            ft = C.flat_tensors(got)
            res["ties_kept"] = all(
                a in ft
                and b in ft
                and ft[a].untyped_storage().data_ptr() == ft[b].untyped_storage().data_ptr()
                for a, b in ties
            )
        return res

    caches = ["warm"] + (["cold"] if cold_ok else [])
    into_caches = caches if into_cold else ["warm"]
    target = None
    failed: dict[str, str] = {}
    for mode in ("new", "into"):
        if mode == "into":
            target = C.map_tensors(bs.state, torch.zeros_like)  # touched, ties kept
        for s in systems:
            for cache in caches if mode == "new" else into_caches:
                row: dict[str, Any] = {
                    "op": "load",
                    "mode": mode,
                    "cache": cache,
                    "system": s.name,
                    "runs": [],
                }
                if s.name in failed:  # same read path: do not spend minutes failing again
                    row["runs"].append(
                        {
                            "seconds": float("nan"),
                            "exact": False,
                            "error": f"not run: {failed[s.name]}",
                        }
                    )
                    rows.append(row)
                    continue
                if cache == "warm":
                    C.warm_files(s.files())
                for rep in range(reps):
                    if cache == "cold":
                        C.drop_caches()
                    row.setdefault("loadavg", []).append(os.getloadavg()[0])
                    try:
                        if mode == "into":
                            C.zero_(target)
                            secs, _ = C.timed(lambda s=s, t=target: s.load_into(t))
                            got = target
                        else:
                            secs, got = C.timed(lambda s=s: s.load_new(bs.state))
                    except Exception as e:  # record the failure, keep comparing the others
                        err = f"{type(e).__name__}: {e}"[:300]
                        row["runs"].append({"seconds": float("nan"), "exact": False, "error": err})
                        log(f"  load {mode:4s} {cache:4s} rep {rep} {s.name:13s} FAILED: {err}")
                        failed[s.name] = f"{mode} {cache} load failed with {err[:60]}"
                        break
                    chk = check(s, got, mode, rep)
                    del got
                    row["runs"].append({"seconds": secs, **chk})
                    log(
                        f"  load {mode:4s} {cache:4s} rep {rep} {s.name:13s} {secs:7.3f} s "
                        f"exact={chk['exact']}"
                        + (f" ties={chk['ties_kept']}" if "ties_kept" in chk else "")
                    )
                    gc.collect()
                    if secs > SLOW:
                        break
                rows.append(row)
    del target
    return rows

"""The markdown report: machine limits, saves and loads, each against torch and the limits."""

from __future__ import annotations

import json
from typing import Any

import _common as C

from _saveload.runs import SCENARIOS


def summarize(result: dict[str, Any]) -> str:
    lim = result["limits"]
    nbytes = result["state"]["logical_bytes"]
    out = []

    out.append("Machine limits (same run):\n")
    lrows = []
    for k, v in lim.items():
        if "gbps" in v:
            lrows.append(
                [
                    k,
                    v["what"],
                    C.fmt_bytes(v["bytes"]),
                    f"{C.median(v['seconds']):.3f}",
                    f"{v['gbps']:.2f}",
                ]
            )
    out.append(C.md_table(["limit", "what", "bytes", "median s", "GB/s"], lrows))
    out.append(f"\ndrop_caches worked: {lim.get('drop_caches_ok', {}).get('ok')}\n")

    def g(key: str) -> float | None:
        return lim[key]["gbps"] if key in lim else None

    saves = [r for r in result["rows"] if r["op"] == "save"]
    base: dict[tuple[str, str], float] = {}
    for r in saves:
        if r["system"] == "torch":
            base[(r["scenario"], "durable")] = C.median([x["seconds"] for x in r["runs"]])
            base[(r["scenario"], "nofsync")] = C.median([x["seconds_nofsync"] for x in r["runs"]])

    srows = []
    for sc in SCENARIOS:
        for r in [r for r in saves if r["scenario"] == sc]:
            if not r["runs"]:
                srows.append([sc, r["system"], "FAILED", "", "", "", "", "", r.get("error", "")])
                continue
            variants = [("durable", "seconds")]
            if any("seconds_nofsync" in x for x in r["runs"]):
                variants.append(("nofsync", "seconds_nofsync"))
            for var, key in variants:
                secs = [x[key] for x in r["runs"]]
                med = C.median(secs)
                gbps = nbytes / med / C.GB
                lkey = "write_fsync" if var == "durable" else "write_buffered"
                if r["system"].startswith("deltackpt") and sc == "unchanged":
                    lkey = "xxh3"
                limit = g(lkey)
                name = r["system"]
                if r["system"] in ("torch", "safetensors"):
                    name += " + fsync" if var == "durable" else " (no fsync)"
                notes = []
                first = r["runs"][-1]
                if "chunks_new" in first:
                    notes.append(
                        f"new {first['chunks_new']}/reused {first['chunks_reused']} "
                        f"chunks, {first['new_codecs'] or 'no new'}, stored/raw "
                        f"{first['new_stored_over_raw']:.2f}"
                    )
                if r["system"] == "dcp":
                    notes.append("FileSystemWriter defaults (sync_files=True, 1 thread)")
                if r["system"].startswith("deltackpt"):
                    notes.append(f"RSS {C.fmt_bytes(first['rss_after'])} after")
                if r.get("error"):
                    notes.append(f"later rep FAILED: {r['error'][:80]}")
                tb = base.get((sc, var))
                srows.append(
                    [
                        sc,
                        name,
                        f"{med:.3f}",
                        f"{min(secs):.3f}-{max(secs):.3f} (n={len(secs)})",
                        f"{gbps:.2f}",
                        f"{tb / med:.2f}x" if tb else "-",
                        f"{100 * gbps / limit:.0f}% {lkey}" if limit else "-",
                        C.fmt_bytes(C.median([x["bytes_added"] for x in r["runs"]])),
                        "; ".join(notes),
                    ]
                )
    out.append(
        "\nSaves (GB/s = state bytes / time; t_torch/t > 1 means faster than torch.save "
        "with the same durability):\n"
    )
    out.append(
        C.md_table(
            [
                "scenario",
                "system",
                "median s",
                "range",
                "GB/s",
                "t_torch/t",
                "% of limit",
                "bytes added",
                "notes",
            ],
            srows,
        )
    )
    muts = {r["scenario"]: r["mutations"] for r in saves if r["system"] == saves[0]["system"]}
    for sc in ("10pct", "step"):
        m = [x for x in muts.get(sc, []) if x]
        if m:
            out.append(
                f"\n{sc}: "
                + "; ".join(
                    json.dumps(
                        {k: (round(v, 4) if isinstance(v, float) else v) for k, v in x.items()}
                    )
                    for x in m
                )
            )

    loads = [r for r in result["rows"] if r["op"] == "load"]
    lbase = {
        (r["mode"], r["cache"]): C.median([x["seconds"] for x in r["runs"]])
        for r in loads
        if r["system"] == "torch"
    }
    lrows2 = []
    how = {
        ("torch", "new"): "torch.load(weights_only=True)",
        ("torch", "into"): "torch.load(mmap=True) + copy_",
        ("safetensors", "new"): "load_file + clone()",
        ("safetensors", "into"): "load_file + copy_",
        ("dcp", "new"): "torch.empty + dcp.load",
        ("dcp", "into"): "dcp.load in place",
        ("deltackpt", "new"): "deltackpt.load (verify=True)",
        ("deltackpt", "into"): "deltackpt.load(into=) (verify=True)",
        ("deltackpt-ng", "new"): "deltackpt.load, small_bytes=0 store",
        ("deltackpt-ng", "into"): "deltackpt.load(into=), small_bytes=0 store",
        ("deltackpt-raw", "new"): "deltackpt.load, raw chunks",
        ("deltackpt-raw", "into"): "deltackpt.load(into=), raw chunks",
    }
    for r in loads:
        errs = [x["error"] for x in r["runs"] if "error" in x]
        if errs:
            lrows2.append(
                [
                    f"{r['mode']} {r['cache']}",
                    r["system"],
                    how.get((r["system"], r["mode"]), ""),
                    "FAILED",
                    "",
                    "",
                    "",
                    "",
                    "NO: " + errs[0][:120],
                ]
            )
            continue
        secs = [x["seconds"] for x in r["runs"]]
        med = C.median(secs)
        gbps = nbytes / med / C.GB
        lkey = f"read_{r['cache']}" + ("_fresh" if r["mode"] == "new" else "")
        limit = g(lkey)
        tb = lbase.get((r["mode"], r["cache"]))
        exact = all(x["exact"] for x in r["runs"])
        ties = [x.get("ties_kept") for x in r["runs"] if "ties_kept" in x]
        bad = r["runs"][0]
        ex = (
            "yes"
            if exact
            else (
                f"NO: {bad['n_mismatch']} of {bad['checked']} tensors differ, "
                f"{bad['n_missing']} missing, e.g. {bad['mismatch'][:2]}"
            )
        )
        if ties:
            ex += ", ties kept" if all(ties) else ", ties NOT kept"
        lrows2.append(
            [
                f"{r['mode']} {r['cache']}",
                r["system"],
                how.get((r["system"], r["mode"]), ""),
                f"{med:.3f}",
                f"{min(secs):.3f}-{max(secs):.3f} (n={len(secs)})",
                f"{gbps:.2f}",
                f"{tb / med:.2f}x" if tb else "-",
                f"{100 * gbps / limit:.0f}% {lkey}" if limit else "-",
                ex,
            ]
        )
    for k, v in result.get("deltackpt_latest_chains", {}).items():
        out.append(
            f"\n{k} latest snapshot: {v['chunks']} chunks {v['codecs']}, xor chain depth "
            f"mean {v['mean_xor_depth']} max {v['max_xor_depth']}; a load reads "
            f"{C.fmt_bytes(v['pack_bytes_read'])} of packs for {C.fmt_bytes(v['raw_bytes'])}"
            " of chunks"
        )
    out.append("\nLoads of the last saved state (t_torch/t vs torch in the same mode/cache):\n")
    out.append(
        C.md_table(
            [
                "load",
                "system",
                "how",
                "median s",
                "range",
                "GB/s",
                "t_torch/t",
                "% of limit",
                "bit-exact",
            ],
            lrows2,
        )
    )
    return "\n".join(out)

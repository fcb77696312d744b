"""The markdown tables: the real run (with deltackpt/DCP ratios), its measured collective bytes
next to the simulation, and the simulated planning at N ranks."""

from __future__ import annotations

import math
from typing import Any

import _common as C


def fb(n: float | None) -> str:
    return C.fmt_bytes(n) if n is not None and not (isinstance(n, float) and math.isnan(n)) else "-"


def real_tables(res: dict[str, Any]) -> str:
    rows = res["rows"]
    gb = res["unique_global_bytes"] / 1e9
    by = {(r["system"], r["op"]): r for r in rows}
    pairs = {  # deltackpt op -> DCP op it is compared with
        "save full (fresh store)": "save full (fresh dir)",
        "save unchanged (no step)": "save after step (rewrites all)",
        "save incremental (after step)": "save after step (rewrites all)",
        "async_save after step: blocking": "async_save after step: blocking",
        "async_save after step: total (result())": "async_save after step: total (future)",
    }
    for r in rows:
        if r["op"].startswith("load"):
            pairs[r["op"]] = r["op"].split(" - ")[0]
    hdr = [
        "system",
        "operation",
        "runs (s)",
        "median s",
        "GB/s",
        "bytes added (du)",
        "deltackpt/DCP time",
        "deltackpt/DCP bytes",
        "notes",
    ]
    out = []
    for r in rows:
        m = C.median(r["secs"])
        ratio_t = ratio_b = ""
        if r["system"] == "deltackpt" and r["op"] in pairs and ("DCP", pairs[r["op"]]) in by:
            d = by[("DCP", pairs[r["op"]])]
            ratio_t = f"{m / C.median(d['secs']):.2f}"
            if r.get("bytes") is not None and d.get("bytes"):
                ratio_b = f"{r['bytes'] / d['bytes']:.3g}"
        notes = []
        if r.get("bytes_each") and len(set(r["bytes_each"])) > 1:
            notes.append("du per run " + ", ".join(fb(b) for b in r["bytes_each"]))
        if "bit_exact" in r:
            notes.append(f"bit-exact={r['bit_exact']}")
        if "codecs_new" in r:
            notes.append(f"new-chunk codecs per run {r['codecs_new']}")
        if "chunks_new" in r:
            notes.append(f"chunks_new {r['chunks_new']}")
        if "plan_bytes" in r:
            notes.append(
                f"plan msgs {r['plan_bytes']} B; manifest {fb(C.median(r['manifest_bytes']))}"
            )
        if "lib_blocked" in r:
            notes.append(f"lib blocked_seconds {r['lib_blocked']}")
        if "global_plan_ms" in r:
            notes.append(
                f"global plan ms {r['global_plan_ms']}; gathered plans "
                f"{r.get('gathered_plan_bytes')} B; results {r.get('gathered_results_bytes')} B; "
                f".metadata {r.get('metadata_bytes')} B"
            )
        out.append(
            [
                r["system"],
                r["op"],
                " ".join(f"{s:.2f}" for s in r["secs"]),
                f"{m:.2f}",
                f"{gb / m:.2f}",
                fb(r.get("bytes")),
                ratio_t,
                ratio_b,
                "; ".join(notes),
            ]
        )
    return C.md_table(hdr, out)


def coll_table(real: dict[str, Any], sc: dict[str, Any]) -> str:
    """Measured collective bytes per save in the real run next to the simulation at the same N."""
    by = {(r["system"], r["op"]): r for r in real["rows"]}
    dk = {r["save"]: r for r in sc["dk_rows"]}
    dc = {r["save"]: r for r in sc["dcp_rows"]}
    spec = [
        ("deltackpt", "save full (fresh store)", dk.get("#1 full")),
        ("deltackpt", "save unchanged (no step)", dk.get("0% changed")),
        ("deltackpt", "save incremental (after step)", dk.get("100% changed")),
        ("DCP", "save full (fresh dir)", dc.get("#1 (and #2+ no caching)")),
        ("DCP", "save after step (rewrites all)", dc.get("#1 (and #2+ no caching)")),
        ("DCP", "save after step, plan caching", dc.get("#2+ with caching")),
    ]
    hdr = [
        "system",
        "save",
        "measured per save: gather / scatter / broadcast x(N-1) = total",
        "simulated total (same N)",
    ]
    out = []
    for system, op, simrow in spec:
        r = by.get((system, op))
        if r is None or not r.get("coll"):
            continue
        meas = "; ".join(
            f"{c['gather']} / {c['scatter']} / {c['broadcast']} = **{c['total']}**"
            for c in r["coll"]
        )
        out.append([system, op, meas, simrow["exchanged"] if simrow else "-"])
    return C.md_table(hdr, out)


def sim_tables(sim: dict[str, Any]) -> str:
    dcp = {(r["N"], r["save"]): r for r in sim["dcp"]}
    rows = []
    for r in sim["dk"]:
        n = r["N"]
        d1 = dcp[(n, "#1 (and #2+ no caching)")]
        dc = d1 if r["save"] == "#1 full" else dcp[(n, "#2+ with caching")]
        dc_no_md = dc["exchanged"] - dc["bcast_metadata"]
        rows.append(
            [
                n,
                r["save"],
                f"{r['changed']} of {r['chunks']}",
                fb(r["exchanged"]),
                fb(d1["exchanged"]),
                fb(dc["exchanged"]),
                f"{r['exchanged'] / dc['exchanged']:.2g}",
                fb(dc_no_md),
                f"{r['exchanged'] / dc_no_md:.2g}",
                fb(r["gather_plan"]),
                fb(dc["gather_plan"]),
                fb(r["manifest"]),
                fb(d1["metadata_file"]),
            ]
        )
    exchanged = C.md_table(
        [
            "N",
            "save",
            "chunks changed",
            "deltackpt exchanged",
            "DCP exchanged, no caching",
            "DCP exchanged, plan caching",
            "deltackpt / DCP (caching)",
            "DCP caching without its Metadata broadcast",
            "deltackpt / that",
            "deltackpt plan gather",
            "DCP plan gather (caching)",
            "deltackpt manifest",
            "DCP .metadata",
        ],
        rows,
    )
    dk = C.md_table(
        [
            "N",
            "save",
            "new chunks",
            "gather plan msgs",
            "scatter assignments",
            "gather records",
            "broadcast outcome x(N-1)",
            "rank_message per rank (ms)",
            "rank 0 resolve+merge+assign+remember (ms)",
            "rank 0 manifest build+JSON (ms)",
        ],
        [
            [
                r["N"],
                r["save"],
                r["new_chunks"],
                fb(r["gather_plan"]),
                fb(r["scatter_assign"]),
                fb(r["gather_records"]),
                fb(r["bcast_outcome"]),
                f"{r['t_rank_msg_ms']:.2f}",
                f"{r['t_rank0_ms']:.0f}",
                f"{r['t_manifest_ms']:.0f}",
            ]
            for r in sim["dk"]
        ],
    )
    dcp_table = C.md_table(
        [
            "N",
            "save",
            "write items",
            "gather local plans",
            "scatter global plans",
            "gather WriteResults",
            "broadcast Metadata x(N-1)",
            ".metadata",
            "create_global_plan (ms)",
            "finish: storage_data + pickle (ms)",
        ],
        [
            [
                r["N"],
                r["save"],
                r["items"],
                fb(r["gather_plan"]),
                fb(r["scatter_plan"]),
                fb(r["gather_results"]),
                fb(r["bcast_metadata"]),
                fb(r["metadata_file"]),
                f"{r['t_global_ms']:.0f}",
                f"{r['t_finish_ms']:.0f}",
            ]
            for r in sim["dcp"]
        ],
    )
    return "\n".join(
        [
            "#### Bytes exchanged per save (all collectives: gather plans, scatter "
            "plans/assignments, gather write results, broadcast outcome x (N-1))",
            "",
            exchanged,
            "",
            "#### deltackpt per-save breakdown and rank-0 time",
            "",
            dk,
            "",
            "#### DCP per-save breakdown and rank-0 time (DefaultSavePlanner + FileSystemWriter)",
            "",
            dcp_table,
        ]
    )

"""The markdown of one state kind and of the training loop, with the targets each one meets."""

from __future__ import annotations

import argparse
from typing import Any

import _common as C

import deltackpt


def f3(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def ok(b: bool) -> str:
    return "✓" if b else "✗"


def report_kind(r: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    nb = r["state_bytes"]
    wc = C.median(r["warm_copy"])
    targets: dict[str, Any] = {}
    lines = [
        f"### {r['kind']} state: {nb / 1e9:.3f} GB ({r['params'] / 1e6:.1f}M params, "
        f"scale {r['scale']})",
        "",
        f"Warm copy of the state into a touched buffer (the state's size, capped at 1 GiB and "
        f"wrapping around), timed right before every save "
        f"({len(r['warm_copy'])} saves): median **{wc:.3f} s = {nb / wc / 1e9:.2f} GB/s** "
        f"(min {min(r['warm_copy']):.3f}, max {max(r['warm_copy']):.3f}: background load). "
        "'x warm copy' = median over the steady saves of (blocking / the copy timed just "
        "before that save); the target is judged on it. "
        f"AdamW step (fused, {len(r['step_seconds'])} steps in this part): median "
        f"{C.median(r['step_seconds']):.2f} s.",
        "",
    ]
    hdr = [
        "system",
        "saves",
        "first: blocking s",
        "steady: blocking s (median)",
        "x warm copy: paired / of medians",
        "blocking GB/s",
        "steady: total s",
        "total GB/s",
        "bytes/save (steady)",
        "% of state",
        "blocking ≤1.5x copy",
    ]
    rows = []
    full_bytes = nb
    for label, recs in r["systems"].items():
        first = recs[0]
        # deltackpt alternates two arenas: saves #0 and #1 both allocate; steady from #2
        skip = 2 if label.startswith("deltackpt") else 1
        steady = recs[skip:] or recs[-1:]
        b = C.median([x["blocking"] for x in steady])
        tot = C.median([x["total"] for x in steady])
        by = C.median([x["bytes"] for x in steady])
        ratio = C.median([x["blocking"] / x["warm"] for x in steady])
        met = ratio <= 1.5
        targets[f"{r['kind']}: {label} blocking ≤ 1.5x warm copy"] = (met, ratio)
        first_s = f"{first['blocking']:.3f}"
        if label.startswith("deltackpt"):
            first_s += f" (#1: {recs[1]['blocking']:.3f})" if len(recs) > 1 else ""
        extra = ""
        if "total_fsync" in first:
            extra = f" (+fsync {C.median([x['total_fsync'] for x in steady]):.3f})"
        if "staged" in first and any(abs(x["staged"] - x["blocking"]) > 1e-3 for x in recs):
            extra += f" (staged {C.median([x['staged'] for x in steady]):.3f})"
        rows.append(
            [
                label,
                len(recs),
                first_s,
                f"{b:.3f}",
                f"{ratio:.2f} / {b / wc:.2f}",
                f"{nb / b / 1e9:.2f}",
                f"{tot:.3f}{extra}",
                f"{nb / tot / 1e9:.2f}",
                C.fmt_bytes(by),
                f"{by / full_bytes:.1%}",
                ok(met),
            ]
        )
    lines.append(C.md_table(hdr, rows))
    lines.append("")

    d = r["systems"]["deltackpt.async_save"]
    lim = 0.25 if r["kind"] == "bf16" else 0.70

    def is_key(x: dict[str, Any]) -> bool:  # most of its bytes start a new chain
        d0 = {int(k): v for k, v in x["depth_bytes"].items()}.get(0, 0)
        return d0 >= 0.5 * nb

    inc = [x for x in d if not is_key(x)]  # saves that wrote xor deltas (not keyframes)
    kf = r.get("keyframe_every", deltackpt.SaveOptions().keyframe_every)
    cycle = d[-kf:]
    amort = sum(x["bytes"] for x in cycle) / len(cycle) / nb
    hdr2 = [
        "save",
        "blocking s",
        "warm copy s (just before)",
        "total s",
        "bytes written",
        "% of state",
        "payload by codec",
        "max xor depth",
    ]
    rows2 = []
    for x in d:
        mix = ", ".join(f"{k} {C.fmt_bytes(v)}" for k, v in sorted(x["codec_bytes"].items()))
        rows2.append(
            [
                f"#{x['i']}" + (" (keyframe)" if is_key(x) else ""),
                f"{x['blocking']:.3f}",
                f"{x['warm']:.3f}",
                f"{x['total']:.3f}",
                C.fmt_bytes(x["bytes"]),
                f"{x['bytes'] / nb:.1%}",
                mix,
                x["max_depth"],
            ]
        )
    med_frac = C.median([x["bytes"] / nb for x in inc]) if inc else float("nan")
    max_frac = max((x["bytes"] / nb for x in inc), default=float("nan"))
    met = max_frac <= lim
    targets[f"{r['kind']}: incremental bytes ≤ {lim:.0%} of a full save (max of the xor saves)"] = (
        met,
        max_frac,
    )
    targets[f"{r['kind']}: bytes per save amortized over a keyframe cycle (info; ≤ {lim:.0%}?)"] = (
        None,
        amort,
    )
    e2e = C.median([x["total"] for x in inc if x["i"] >= 2] or [x["total"] for x in inc])
    cats: dict[str, list[int]] = {}
    for x in inc:
        for k, (raw, pay) in x.get("by_category", {}).items():
            v = cats.setdefault(k, [0, 0])
            v[0] += raw
            v[1] += pay
    cat_line = "; ".join(
        f"{k}: {pay / raw:.1%} of its bytes" for k, (raw, pay) in sorted(cats.items()) if raw
    )
    lines += [
        f"deltackpt saves, each after one AdamW step (xor-delta saves: median "
        f"{med_frac:.1%}, max {max_frac:.1%} of the state; target ≤ {lim:.0%} "
        f"{ok(met)}. Amortized over the last keyframe cycle (#{cycle[0]['i']}-"
        f"#{cycle[-1]['i']}, keyframe_every={kf}): {amort:.1%} of the state per save. "
        f"End-to-end time of a delta save, median: {e2e:.3f} s = "
        f"{nb / e2e / 1e9:.2f} GB/s of state):",
        "",
        C.md_table(hdr2, rows2),
        "",
        f"Incremental (xor) saves, payload written per part of the state: {cat_line}.",
        "",
    ]

    hdr3 = [
        "restore (deltackpt.load into the live state)",
        "mode",
        "s (median)",
        "GB/s",
        "x keyframe",
        "chain depth of its bytes",
    ]
    rows3 = []
    base: dict[str, float] = {}
    for x in r["restore"]:
        s = C.median(x["seconds"])
        if x["snapshot"].startswith("keyframe"):
            base[x["mode"]] = s
    for x in r["restore"]:
        s = C.median(x["seconds"])
        depth = ", ".join(
            f"d{k}: {v / x['bytes']:.0%}" for k, v in sorted(x["depth_bytes"].items())
        )
        rel = s / base[x["mode"]] if x["mode"] in base else float("nan")
        rows3.append(
            [
                x["snapshot"],
                x["mode"],
                f"{s:.3f}",
                f"{x['bytes'] / s / 1e9:.2f}",
                f"{rel:.2f}",
                depth,
            ]
        )
    lines += [C.md_table(hdr3, rows3), ""]
    if "restore_chain_end_bit_exact" in r:
        lines += [
            f"Chain-end restore bit-exact vs the live bf16 state: "
            f"{r['restore_chain_end_bit_exact']}. Store size after {len(d)} saves: "
            f"{C.fmt_bytes(r['store_bytes'])}.",
            "",
        ]
    else:
        lines += [
            f"Every restored chunk is verified against its xxh3 digest (verify=True). "
            f"Store size after {len(d)} saves: {C.fmt_bytes(r['store_bytes'])}.",
            "",
        ]
    return "\n".join(lines), targets


def report_loop(loops: list[dict[str, Any]], args: argparse.Namespace) -> tuple[str, dict]:
    by = {x["mode"]: x for x in loops}
    base = by["none"]
    nseg = len(base["segments"])
    seg = args.every * args.loop_periods

    def per_step(x: dict[str, Any], with_drain: bool) -> list[float]:
        return [(t + (d if with_drain else 0.0)) / seg for t, d in x["segments"]]

    hdr = [
        "condition",
        "mean s/step (steps only)",
        "mean s/step (+ drain)",
        "slowdown steps only: pooled / median of rounds",
        "slowdown + drain: pooled / median of rounds",
        "median step s",
        "save steps: mean s",
        "other steps: mean s",
        "saves",
    ]
    rows = []
    targets = {}
    b0 = per_step(base, False)
    for x in loops:
        a0, a1 = per_step(x, False), per_step(x, True)
        m0, m1 = sum(a0) / nseg, sum(a1) / nseg
        name = {
            "none": "no checkpointing",
            "deltackpt": f"deltackpt.Checkpointer(async_=True, every={args.every})",
            "deltackpt-1t": "same, threads=1 (SaveOptions)",
            "dcp": f"dcp.async_save every {args.every} (default stager)",
        }[x["mode"]]
        if x["mode"] == "none":
            s0 = s1 = "-"
        else:
            r0 = [a / b - 1 for a, b in zip(a0, b0, strict=True)]
            r1 = [a / b - 1 for a, b in zip(a1, b0, strict=True)]
            p0, p1 = m0 / (sum(b0) / nseg) - 1, m1 / (sum(b0) / nseg) - 1
            s0 = f"{p0:+.1%} / {C.median(r0):+.1%}"
            s1 = f"{p1:+.1%} / {C.median(r1):+.1%}"
            targets[f"loop: {x['mode']} slowdown (steps only .. + drain, pooled)"] = (
                None,
                (p0, p1),
            )
        rows.append(
            [
                name,
                f"{m0:.4f}",
                f"{m1:.4f}",
                s0,
                s1,
                f"{C.median(x['times']):.4f}",
                f3(x["save_step_mean"]),
                f3(x["other_step_mean"]),
                x["saves"],
            ]
        )
    p = loops[0]
    rounds = "; ".join(
        f"round {i}: " + ", ".join(f"{x['mode']} {per_step(x, False)[i]:.3f}" for x in loops)
        for i in range(nseg)
    )
    text = [
        f"### Training-step slowdown ({p['params'] / 1e6:.1f}M-param MLP, AdamW, batch "
        f"{args.loop_batch}, state {p['state_bytes'] / 1e6:.0f} MB incl. AdamW)",
        "",
        f"{args.loop_rounds} rounds; in each, every condition trains {seg} steps "
        f"({args.loop_periods} save periods of {args.every} steps; rotating order), then "
        "waits for its pending save (drain). 'steps only' ignores that wait (lower bound of "
        "the cost), '+ drain' charges all of it (upper bound: in a continuous run part of it "
        "would overlap the next steps). 2 cores shared by torch's intra-op threads, "
        "the savers' threads and other agents' jobs.",
        "",
        C.md_table(hdr, rows),
        "",
        f"Per-round s/step (steps only): {rounds}.",
        "",
    ]
    return "\n".join(text), targets

"""A follower in tensor-parallel boxes against one that holds the whole model (``Follower(boxes=)``,
what ``deltackpt_follow(tp_boxes=True)`` runs on each vLLM worker).

A trainer (fp32 master, AdamW on random gradients, bf16 published after every step: the refit
benchmark's) publishes Qwen2-0.5B-shaped weights (``--params``) to a local store, raw
(``encoding="fast-restore"``: a local disk's default, dedupe only) or xor deltas
(``encoding="smallest"``: what an object store gets). Followers: ``whole`` (the copy every worker
held before) and rank 0 of ``--tp`` (vLLM's rules: q, k, v, gate, up and the embedding by rows,
o and down by columns, k and v whole where there are fewer kv heads than ranks, norms whole).
Per follower: its copy's bytes, the first (full) load, and the median catch-up of ``--steps``
versions at lr 1e-6 then 1e-5 (seconds, bytes read); every copy checked bit-exact against the
trainer's weights (the box of them) after each step. Files are in the page cache: loads measure
reading from it, decoding and copying. Machine limits measured in the same run come first.

Run: ``python benchmarks/bench_follow_boxes.py --params 2.5e8 --tp 2,4``
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import _common as C
import torch
from _refit.trainer import Trainer

import deltackpt

log = C.make_log()
KV_HEADS = 2  # Qwen2-0.5B's


def rank_box(tp: int, r: int, name: str, shape: tuple[int, ...]) -> Any:
    """The box of ``name`` that rank ``r`` of ``tp`` loads, by vLLM's rules (tp_boxes.py)."""
    rows = ("q_proj", "gate_proj", "up_proj", "embed_tokens")
    if any(f".{k}." in f".{name}" for k in ("k_proj", "v_proj")) and KV_HEADS % tp == 0:
        rows = (*rows, "k_proj", "v_proj")
    if any(f"{k}." in name for k in rows):
        n = shape[0] // tp
        return (r * n, *([0] * (len(shape) - 1))), (n, *shape[1:])
    if name.endswith(("o_proj.weight", "down_proj.weight")):
        n = shape[1] // tp
        return (0, r * n), (shape[0], n)
    return None


def cut(t: torch.Tensor, box: Any) -> torch.Tensor:
    if box is None:
        return t
    return t[tuple(slice(o, o + n) for o, n in zip(*box, strict=True))]


class Follow:
    """One follower of the store, ``tp`` 0 for the whole model."""

    def __init__(self, store: Any, tp: int) -> None:
        self.tp = tp
        boxes = None if tp == 0 else (lambda n, s: rank_box(tp, 0, n, s))
        self.f = deltackpt.Follower(store, load_weights=lambda w: None, keys=["model"],
                                    rename=lambda k: k.removeprefix("model/"), boxes=boxes,
                                    lease_ttl=None)  # fmt: skip
        self.polls: list[dict[str, float]] = []

    def poll(self, want: dict[str, torch.Tensor]) -> None:
        t0 = time.perf_counter()
        s = self.f.poll()
        dt = time.perf_counter() - t0
        assert s is not None
        self.polls.append({"s": dt, "bytes": s.load.bytes_read, "mode": s.mode})
        held = self.f.state
        boxes = self.f.held_boxes if self.tp else {}
        for n, t in want.items():
            k = f"model/{n}"
            mine = held[k] if self.tp else held["model"][n]
            assert torch.equal(mine, cut(t, boxes.get(k))), (self.tp, n)

    def copy_bytes(self) -> int:
        st = self.f.state
        leaves = st.values() if self.tp else st["model"].values()
        return sum(t.nbytes for t in leaves)


def scenario(encoding: str, args: argparse.Namespace, base: Path) -> list[dict[str, Any]]:
    w = C.qwen2_weights(torch.bfloat16, C.qwen2_scale(args.params), 0)
    del w["lm_head.weight"]
    trainer = Trainer(w)
    store = deltackpt.open_store(base / encoding)
    followers = [Follow(store, tp) for tp in [0, *args.tp]]
    v = 0

    def publish() -> None:
        nonlocal v
        sd = {k: t.clone() for k, t in trainer.weights.items()}
        deltackpt.save({"model": sd}, store, f"v{v}", encoding=encoding)
        v += 1
        for f in followers:
            f.poll(trainer.weights)

    publish()
    phases = [("full", 0)]
    for lr in (1e-6, 1e-5):
        for _ in range(args.steps):
            trainer.step(lr)
            publish()
        phases.append((f"lr {lr:g}", args.steps))
    model = sum(t.nbytes for t in trainer.weights.values())
    out = []
    for f in followers:
        i = 0
        for phase, n in phases:
            got = f.polls[i : i + max(n, 1)]
            i += max(n, 1)
            out.append({
                "encoding": encoding, "follower": "whole" if f.tp == 0 else f"tp {f.tp}, rank 0",
                "tp": f.tp, "phase": phase, "copy_x_model": f.copy_bytes() / model,
                "s": C.median([p["s"] for p in got]),
                "read_x_model": sum(p["bytes"] for p in got) / len(got) / model,
                "modes": sorted({p["mode"] for p in got}),
            })  # fmt: skip
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", type=float, default=2.5e8)
    ap.add_argument("--tp", type=lambda s: [int(x) for x in s.split(",")], default=[2, 4])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--encodings", default="fast-restore,smallest")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-follow-boxes-") as tmp:
        limits = C.measure_limits(Path(tmp) / "limits", 512 * C.MiB)
        log(
            "limits: "
            + "; ".join(f"{k} {v['gbps']:.2f} GB/s" for k, v in limits.items() if "gbps" in v)
        )
        rows: list[dict[str, Any]] = []
        for enc in args.encodings.split(","):
            rows += scenario(enc, args, Path(tmp))
            log(f"{enc} done")
    whole = {(r["encoding"], r["phase"]): r for r in rows if r["tp"] == 0}
    table = []
    for r in rows:
        w = whole[(r["encoding"], r["phase"])]
        table.append([
            r["encoding"], r["phase"], r["follower"], f"{r['copy_x_model']:.2f}",
            f"{r['s']:.3f}", f"{r['s'] / w['s']:.2f}", f"{r['read_x_model']:.3f}",
            ",".join(r["modes"]),
        ])  # fmt: skip
    text = C.md_table(
        ["encoding", "phase", "follower", "copy / model", "poll s (median)", "/ whole",
         "read / model", "mode"], table,
    )  # fmt: skip
    print(text)
    doc = {"args": vars(args), "limits": limits, "rows": rows, "machine": C.machine_info()}
    C.write_results(args.out or C.OUT_DIR, "follow_boxes", doc, text)


if __name__ == "__main__":
    main()

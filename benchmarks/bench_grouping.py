"""Group chunks by what changes together (deltackpt/saving/grouping.py) vs plain tree order.

Three runs of ``--saves`` saves each, on the Qwen2-shaped state (``--scale``, bf16), side by side
with the old layout (every small tensor packed in tree order, one class):

* ``lora``: the base frozen, peft-named LoRA adapters (r=16 on q/v, ``lora_A/B.default``) change
  at every step (plus their AdamW moments with ``--optim``);
* ``lora-unnamed``: the same adapters under keys that name nothing (``adapters.<i>.a``): only the
  change history separates them (from the third save on);
* ``full``: a full fine-tune, every tensor changes at every step: must not write more or be slower;
* ``full, 5000 small tensors``: the same with 5000 tensors of 8 kB, all grouped: the worst case
  for the bookkeeping (one look into every group at saves 1, 2 and every 8th).

Per run: bytes the first save wrote, median bytes written by the later saves (pack + manifest),
median wall time of the later ``deltackpt.save`` calls (what runs after the commit included);
medians over ``--repeat`` interleaved runs.

    python benchmarks/bench_grouping.py --scale 0.05 --saves 8
    python benchmarks/bench_grouping.py --scale 0.05 --saves 8 --only lora --encoding smallest
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import deltackpt
from benchmarks._harness.models import qwen2_weights
from benchmarks._harness.report import fmt_bytes, md_table
from deltackpt.saving import grouping
from deltackpt.saving.engine import saver_for

Step = Callable[[int], dict[str, Any]]


def lora_state(
    scale: float, named: bool, optim: bool, r: int = 16, share: float | None = None
) -> tuple[Step, int]:
    """A step function returning the state after ``step`` steps, and the adapter bytes.
    ``share``: RL-like steps instead: bf16 adapters of which that share of the elements
    changes a little at each step (``lora-rl``)."""
    base = qwen2_weights(torch.bfloat16, scale)
    g = torch.Generator().manual_seed(1)
    sd: dict[str, torch.Tensor] = {}
    adapters: list[torch.Tensor] = []
    for k, v in base.items():
        stem = k.removesuffix(".weight")
        if k.endswith(("q_proj.weight", "v_proj.weight")):
            sd[f"base_model.model.{stem}.base_layer.weight"] = v
            for ab, shape in (("A", (r, v.shape[1])), ("B", (v.shape[0], r))):
                t = torch.randn(shape, generator=g).mul_(0.01)
                key = f"base_model.model.{stem}.lora_{ab}.default.weight"
                sd[key if named else f"adapters.{len(adapters)}.{ab.lower()}"] = t
                adapters.append(t)
        else:
            sd[f"base_model.model.{k}"] = v
    if share is not None:
        for k in [k for k, v in sd.items() if any(v is a for a in adapters)]:
            sd[k] = sd[k].to(torch.bfloat16)
        adapters = [v for k, v in sd.items() if "lora_" in k or k.startswith("adapters.")]
    moments = [torch.zeros_like(t) for t in adapters for _ in range(2)] if optim else []
    nbytes = sum(t.numel() * t.element_size() for t in adapters)

    def step(i: int) -> dict[str, Any]:
        for t in adapters + moments:
            if share is None:
                t.add_(1e-3 * (i + 1))
                continue
            mask = torch.rand(t.shape, generator=g) < share
            t[mask] += (torch.randn(t.shape, generator=g) * 0.01).to(t.dtype)[mask]
        state: dict[str, Any] = {"model": sd}
        if optim:
            state["optim"] = {
                "state": {j: {"exp_avg": moments[2 * j], "exp_avg_sq": moments[2 * j + 1]}
                          for j in range(len(adapters))},
                "param_groups": [{"lr": 1e-4, "params": list(range(len(adapters)))}],
            }  # fmt: skip
        return state

    return step, nbytes


def full_state(scale: float) -> tuple[Step, int]:
    sd = qwen2_weights(torch.bfloat16, scale)
    total = sum(t.numel() * t.element_size() for k, t in sd.items() if k != "lm_head.weight")

    def step(i: int) -> dict[str, Any]:
        for k, t in sd.items():
            if k != "lm_head.weight":  # tied to the embedding
                t.add_(1e-3 * (i + 1))
        return {"model": sd}

    return step, total


def many_small_state(n: int = 5000, numel: int = 2048) -> tuple[Step, int]:
    """A full fine-tune of ``n`` small fp32 tensors (8 kB each): every one is grouped."""
    g = torch.Generator().manual_seed(2)
    sd = {f"layers.{i}.w": torch.randn(numel, generator=g) for i in range(n)}

    def step(i: int) -> dict[str, Any]:
        for t in sd.values():
            t.add_(1e-3 * (i + 1))
        return {"model": sd}

    return step, n * numel * 4


ENCODING = "auto"  # --encoding: "smallest" also xors each group against its last version


def run(step: Step, saves: int, grouped: bool) -> dict[str, float]:
    saved = grouping.ChangeHistory.is_hot, grouping.ChangeHistory.learn
    if not grouped:  # the old layout: one class, no history
        grouping.ChangeHistory.is_hot = lambda self, key, n, rg: False  # type: ignore[method-assign]
        grouping.ChangeHistory.learn = lambda self, plan, digests, bufs: None  # type: ignore[method-assign]
    try:
        with tempfile.TemporaryDirectory() as d:
            store = deltackpt.open_store(d)
            infos, walls = [], []
            for i in range(saves):
                state = step(i)
                t0 = time.perf_counter()  # the call: includes what runs after the commit
                infos.append(deltackpt.save(state, store, f"s{i}", encoding=ENCODING))
                walls.append(time.perf_counter() - t0)
            saver_for(store).close()
    finally:
        grouping.ChangeHistory.is_hot, grouping.ChangeHistory.learn = saved
    later = infos[1:]
    return {
        "first": infos[0].bytes_written,
        "later": statistics.median(i.bytes_written for i in later),
        "steady": statistics.median(i.bytes_written for i in infos[3:] or later),
        "seconds": statistics.median(walls[1:]),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--scale", type=float, default=0.05)
    ap.add_argument("--saves", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=3, help="runs per layout, interleaved")
    ap.add_argument("--only", default=None, help="run one state (lora, lora+optim, ...)")
    ap.add_argument("--encoding", default="auto", help="save encoding (auto, smallest, ...)")
    args = ap.parse_args()
    global ENCODING
    ENCODING = args.encoding
    cases: list[tuple[str, Callable[[], tuple[Step, int]]]] = [
        ("lora", lambda: lora_state(args.scale, True, False)),
        ("lora+optim", lambda: lora_state(args.scale, True, True)),
        ("lora-unnamed", lambda: lora_state(args.scale, False, False)),
        ("lora-rl", lambda: lora_state(args.scale, True, False, share=0.03)),
        ("full", lambda: full_state(args.scale)),
        ("full, 5000 small tensors", many_small_state),
    ]
    rows = []
    for name, make in cases:
        if args.only and name != args.only:
            continue
        res: dict[bool, list[dict[str, float]]] = {False: [], True: []}
        for _ in range(args.repeat):
            for grouped in (False, True):
                step, changed = make()
                res[grouped].append(run(step, args.saves, grouped))
        old, new = (
            {k: statistics.median(r[k] for r in res[g]) for k in res[g][0]} for g in (False, True)
        )
        rows.append([
            name, fmt_bytes(changed),
            fmt_bytes(old["later"]), fmt_bytes(new["later"]), fmt_bytes(new["steady"]),
            f"{new['later'] / old['later']:.2f}",
            f"{old['seconds'] * 1e3:.1f}", f"{new['seconds'] * 1e3:.1f}",
            f"{new['seconds'] / old['seconds']:.2f}",
        ])  # fmt: skip
        print(f"{name}: tree order {old} / grouped {new}", file=sys.stderr)
    print(
        md_table(
            [
                "state",
                "changed bytes/step",
                "written/save, tree order",
                "grouped",
                "grouped, save 4+",
                "ratio",
                "save ms, tree order",
                "grouped",
                "ratio",
            ],
            rows,
        )
    )


if __name__ == "__main__":
    main()

"""Checkpoint-coordinate patches (vLLM's sparse wire format) from a trainer, side by side in one
run: ``sync.CheckpointPatcher`` against the torch code a trainer writes for them, and what the
receiving side's apply costs.

A simulated trainer (fp32 masters, AdamW with random gradients; ``--lr`` 1e-6 after two warm-up
steps is an RL step: ~2% of the bf16 casts change) on Qwen2-0.5B shapes (``--params``). Per
step, the patches that bring an engine holding the previous bf16 weights to the new ones:

* ``CheckpointPatcher`` (``threads`` 1 and 2): the masters handed over as they are (the patcher
  casts to bf16 and diffs the casts against its bases with its C loop), then ``commit`` (the
  changed elements written into the bases);
* ``torch, per tensor``: what a trainer writes without it: ``cast = t.to(bf16)``, ``mask =
  cast.view(int16) != base.view(int16)``, ``idx = mask.nonzero()``, ``vals = cast[idx]``, then
  ``base.copy_(cast)``; the same patches, checked element for element.

Bytes: the sparse round (int32 index + bf16 value per changed element, dense tensors whole)
against the full round, and against xor+zstd-1 of the change (what deltackpt's own delta rounds
send, within 1.07x: BENCHMARKS.md).

The receiver (one process here, the work a vLLM worker does per round): vLLM's sparse apply as
``load_checkpoint_weight_patches`` runs it (a NaN-filled tensor of the full shape per patched
tensor, the values written in, then ``where(isnan(src), dst, src)`` into the parameter),
against a dense copy of every tensor (what a full round's ``load_weights`` copies) and
``index_copy_`` of the changed elements only (deltackpt's in-place commits). Limits measured in
the same run: memcpy of the bf16 weights and a compare of two copies (``torch.equal``, the
read of piece and base a diff must do), one thread.

    python benchmarks/bench_checkpoint_patches.py --params 2.5e8 --steps 3
    python benchmarks/bench_checkpoint_patches.py --params 1e9 --steps 3 --device cuda  # a GPU
"""

from __future__ import annotations

import argparse
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as C
import torch
from _refit.trainer import Trainer, change_stats

from deltackpt.sync import CheckpointPatch, CheckpointPatcher

log = C.make_log()


class TorchPatcher:
    """The per-tensor torch code a trainer writes for checkpoint patches (module doc)."""

    def __init__(self) -> None:
        self.bases: dict[str, torch.Tensor] = {}

    def diff(self, state: dict[str, torch.Tensor]) -> list[CheckpointPatch]:
        out = []
        for name, t in state.items():
            cast = t.detach().to(torch.bfloat16).reshape(-1)
            base = self.bases.get(name)
            if base is None:
                self.bases[name] = cast.clone()
                out.append(CheckpointPatch(name, tuple(t.shape), torch.bfloat16, cast))
                continue
            idx = (cast.view(torch.int16) != base.view(torch.int16)).nonzero().squeeze(1)
            if idx.numel():
                idx = idx.to(torch.int32)
                out.append(CheckpointPatch(name, tuple(t.shape), torch.bfloat16, cast[idx], idx))
            base.copy_(cast)
        return out


def vllm_apply(params: dict[str, torch.Tensor], patches: list[CheckpointPatch]) -> None:
    """vLLM's sparse apply (checkpoint_weight_patch.py), the parameter a plain copy target."""
    for p in patches:
        flat = torch.full(
            (params[p.name].numel(),), float("nan"), dtype=p.dtype, device=p.values.device
        )
        flat.index_copy_(0, p.indices.long(), p.values)  # type: ignore[union-attr]
        dst = params[p.name]
        src = flat.view(p.shape)
        torch.where(torch.isnan(src), dst, src, out=dst)


def dense_copy(params: dict[str, torch.Tensor], new: dict[str, torch.Tensor]) -> None:
    for k, v in new.items():
        params[k].copy_(v)


def index_apply(params: dict[str, torch.Tensor], patches: list[CheckpointPatch]) -> None:
    for p in patches:
        params[p.name].view(-1).index_copy_(0, p.indices.long(), p.values)  # type: ignore[union-attr]


def apply_times(
    prev: dict[str, torch.Tensor], new: dict[str, torch.Tensor], sparse: list[CheckpointPatch]
) -> dict[str, float]:
    """Seconds of each receiver apply of one round onto a copy of ``prev``; each result checked
    bit for bit against ``new``."""
    out = {}
    for name, fn in (
        ("vLLM sparse apply (NaN mask)", lambda params: vllm_apply(params, sparse)),
        ("dense copy of every tensor", lambda params: dense_copy(params, new)),
        ("index_copy_ of the changed elements", lambda params: index_apply(params, sparse)),
    ):
        params = {k: v.clone() for k, v in prev.items()}
        out[name] = timed(lambda fn=fn, params=params: fn(params))[0]
        for k, v in params.items():
            assert torch.equal(v.view(torch.int16), new[k].detach().view(torch.int16)), (name, k)
    return out


def engine_report(engine: dict[str, torch.Tensor]) -> dict[str, Any]:
    """What ``deltackpt_checkpoint_digests`` answers for a worker holding ``engine``'s tensors
    whole (TP=1, unfused: each region is the whole tensor)."""
    from deltackpt.sync.device_digest import piece_digest

    out = {}
    for k, v in engine.items():
        a, b = piece_digest(v.contiguous().reshape(-1).view(torch.uint8))
        out[k] = [[0] * v.dim(), list(v.shape), str(a), str(b)]
    return {"digests": out, "unchecked": [], "rank": 0}


def limits(weights: dict[str, torch.Tensor]) -> tuple[float, float]:
    """Seconds of a memcpy and of a compare of two copies of ``weights`` (best of 3)."""
    flat = [v.detach().reshape(-1) for v in weights.values()]
    copies = [torch.empty_like(v) for v in flat]

    def copy() -> None:
        for c, v in zip(copies, flat, strict=True):
            c.copy_(v)

    def compare() -> None:
        for c, v in zip(copies, flat, strict=True):
            torch.equal(c, v)

    return min(timed(copy)[0] for _ in range(3)), min(timed(compare)[0] for _ in range(3))


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn: Any) -> tuple[float, Any]:
    """Seconds of ``fn()`` and its result, the device's queued work included."""
    _sync()
    t0 = time.perf_counter()
    out = fn()
    _sync()
    return time.perf_counter() - t0, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", type=float, default=2.5e8)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--lr", type=float, default=1e-6)
    ap.add_argument("--device", default="cpu", help="where the masters and the engine live")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dev = torch.device(args.device)
    torch.set_num_threads(1)
    weights = C.qwen2_weights(torch.bfloat16, C.qwen2_scale(args.params))
    weights.pop("lm_head.weight")  # tied: the engine ignores it
    trainer = Trainer(weights)
    for _ in range(2):  # AdamW's first steps move every element by lr: warm it up
        trainer.step(args.lr)
    nbytes = sum(v.numel() * v.element_size() for v in trainer.weights.values())
    log(f"{len(weights)} tensors, {nbytes / 1e6:.0f} MB bf16")
    # the trainer steps on the host; its masters are copied to --device after each step
    masters = {k: v.detach().to(dev) for k, v in trainer.master.items()}
    memcpy, compare = limits({k: v.to(dev) for k, v in trainer.weights.items()})
    log(
        f"limits: memcpy {nbytes / memcpy / 1e9:.2f} GB/s, compare {2 * nbytes / compare / 1e9:.2f} GB/s read"
    )
    patchers = {"CheckpointPatcher, 1 thread": CheckpointPatcher(torch.bfloat16, threads=1),
                "CheckpointPatcher, 2 threads": CheckpointPatcher(torch.bfloat16, threads=2)}  # fmt: skip
    naive = TorchPatcher()
    if dev.type != "cpu":  # threads matter only for host tensors
        patchers = {"CheckpointPatcher (on the device)": CheckpointPatcher(torch.bfloat16)}
    for p in patchers.values():
        p.commit(p.diff(masters))
    naive.diff(masters)
    times: dict[str, list[float]] = {k: [] for k in [*patchers, "torch, per tensor"]}
    commits: dict[str, list[float]] = {k: [] for k in patchers}
    applies: dict[str, list[float]] = {"vLLM sparse apply (NaN mask)": [], "dense copy of every tensor": [], "index_copy_ of the changed elements": []}  # fmt: skip
    rows_bytes = []
    checks: dict[str, list[float]] = {"a worker's region digests": [], "the patcher's check of them": []}  # fmt: skip
    pool = ThreadPoolExecutor(2)
    for step in range(args.steps):
        prev = {k: v.detach().clone() for k, v in trainer.weights.items()}
        trainer.step(args.lr)
        with torch.no_grad():
            for k, v in masters.items():
                v.copy_(trainer.master[k])
            got = {}
            for name, p in patchers.items():
                s, rnd = timed(lambda p=p: p.diff(masters))
                times[name].append(s)
                c, _ = timed(lambda p=p, rnd=rnd: p.commit(rnd))
                commits[name].append(c)
                got[name] = rnd
            s, mine = timed(lambda: naive.diff(masters))
            times["torch, per tensor"].append(s)
        rnd = got[list(patchers)[-1]]
        assert not rnd.dense, rnd.why_dense
        theirs = {p.name: p for p in mine}
        assert set(theirs) == {p.name for p in rnd.sparse}
        for p in rnd.sparse:
            q = theirs[p.name]
            assert torch.equal(p.indices, q.indices) and torch.equal(
                p.values.view(torch.int16), q.values.view(torch.int16)
            )
        xor_bytes, frac = change_stats(prev, trainer.weights, 1 << 22, pool)
        rows_bytes.append({"step": step, "changed": frac, "sparse": rnd.nbytes, "full": rnd.full_bytes, "xor_zstd1": xor_bytes})  # fmt: skip
        on_dev = {k: v.detach().to(dev) for k, v in trainer.weights.items()}
        prev = {k: v.to(dev) for k, v in prev.items()}
        for name, sec in apply_times(prev, on_dev, rnd.sparse).items():
            applies[name].append(sec)
        # the check of what an engine holds: a worker's region digests (here: the whole
        # tensors of an engine at the new version), then the patcher's comparison
        patcher = patchers[list(patchers)[-1]]
        s_rep, rep = timed(lambda on_dev=on_dev: engine_report(on_dev))
        s_chk, chk = timed(lambda p=patcher, r=rep: p.check([r]))
        assert chk.ok and chk.checked == len(on_dev), chk
        checks["a worker's region digests"].append(s_rep)
        checks["the patcher's check of them"].append(s_chk)
        log(f"step {step}: {frac:.2%} changed, sparse {rnd.nbytes / 1e6:.1f} MB")
    naive_s = C.median(times["torch, per tensor"])
    where = "host tensors, one thread" if dev.type == "cpu" else str(dev)
    table = [[k, f"{C.median(v):.3f}", f"{nbytes / C.median(v) / 1e9:.2f}", f"{C.median(v) / naive_s:.2f}",
              f"{C.median(commits[k]):.3f}" if k in commits else "in the diff"] for k, v in times.items()]  # fmt: skip
    text = "Finding the patches (fp32 masters in, bf16 patches out), medians of the steps:\n\n"
    text += C.md_table(["producer", "s", "GB/s of bf16", "/ torch", "commit s"], table)
    b = rows_bytes[-1]
    text += "\n\nBytes per round (last step):\n\n" + C.md_table(
        ["changed elements", "sparse round", "/ full round", "/ xor+zstd-1 of the change"],
        [[f"{b['changed']:.2%}", C.fmt_bytes(b["sparse"]), f"{b['sparse'] / b['full']:.4f}", f"{b['sparse'] / b['xor_zstd1']:.2f}"]],
    )  # fmt: skip
    dense_s = C.median(applies["dense copy of every tensor"])
    text += f"\n\nApplying a round on the receiver ({where}):\n\n" + C.md_table(
        ["apply", "s", "/ dense copy"],
        [[k, f"{C.median(v):.3f}", f"{C.median(v) / dense_s:.2f}"] for k, v in applies.items()],
    )  # fmt: skip
    text += f"\n\nChecking what an engine holds ({where}):\n\n" + C.md_table(
        ["side", "s", "GB/s of bf16"],
        [[k, f"{C.median(v):.3f}", f"{nbytes / C.median(v) / 1e9:.2f}"] for k, v in checks.items()],
    )  # fmt: skip
    text += f"\n\nlimits: memcpy {nbytes / memcpy / 1e9:.2f} GB/s, compare {2 * nbytes / compare / 1e9:.2f} GB/s read ({nbytes / compare / 1e9:.2f} GB/s of bf16)"
    print(text)
    doc = {"args": vars(args), "times": times, "commits": commits, "applies": applies, "checks": checks,
           "bytes": rows_bytes, "limits": {"memcpy_s": memcpy, "compare_s": compare, "nbytes": nbytes},
           "machine": C.machine_info()}  # fmt: skip
    C.write_results(args.out or C.OUT_DIR, "checkpoint_patches", doc, text)


if __name__ == "__main__":
    main()

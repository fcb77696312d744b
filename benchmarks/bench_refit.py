"""Catch-up and refit through the store (issue 27): a trainer publishes bf16 weights after every
step; followers catch up with ``load(since=held)``; a fresh reader loads the latest version.

The state is Qwen2-0.5B-shaped bf16 weights (``--params``, default 0.5e9 = 1 GB; the tied
lm_head left out), an fp32 master copy updated by AdamW on random gradients and cast to bf16
after every step. Phases: ``--rl-steps`` RL-like steps at lr 1e-6, ``--rl5-steps`` at lr 1e-5,
``--pretrain-steps`` pretraining-like steps (lr 1e-3: nearly every element changes), then
``--lora-steps`` of a LoRA fine-tune (rank ``--lora-rank`` bf16 adapters on every projection, PEFT's
names and init, AdamW at lr 1e-4; the base weights frozen, saved with the adapters into stores
of their own, as a LoRA run starts; its first version, base + new adapters, is not counted, and
"changed" is the adapters' share). Every
version is saved into one store per policy (``raw``: encoding ``fast-restore``, dedupe only;
``default``: ``encoding="smallest"`` with the default chain policy; ``NAME=B/K``:
``chain_budget=B, keyframe_every=K``; ``NAME=B/K/F`` also folds each new version's chains over
``F`` links right after its save, ``deltackpt.fold(max_chain=F)``, issue 39; ``old=64/4`` is the
depth-only policy before issue 27), and
once as a safetensors file, on local disk and (``--s3-params``, a smaller state: the loopback
moto server keeps objects in RAM and is CPU-bound Python) on a loopback S3 server.

Reported per phase and policy: bytes written per version / xor+zstd-1 of the change (the bytes
an ideal delta writer would write; goal <= 1.3); at the phase's last version N+1 (after a
phase of the same steps): catch-up from N and from N+1-k (``--k`` 10) with ``load(since=)``:
bytes read and seconds as a share of a full load of N+1 from the same store (goals <= 5% and
<= 10% for one version); a fresh reader's full load of N+1 / a full load of the same version from
the ``raw`` store (goal <= 1.5). Loads go into preallocated tensors and are checked bit-exact;
each time is the best of 2. Files are in the page cache (just written): local loads measure
decoding and copying, not the disk. Machine limits measured in the same run come first.

Run: ``python benchmarks/bench_refit.py --params 5e8 --out bench-out/refit.json``
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import _common as C
import torch
from _refit.runs import Run, empty_like, measure_point, policies
from _refit.trainer import Trainer, change_stats, snapshot, state_digest

import deltackpt

warnings.filterwarnings("ignore")
log = C.make_log()


def weights(params: float, seed: int) -> dict[str, torch.Tensor]:
    sd = C.qwen2_weights(torch.bfloat16, C.qwen2_scale(params), seed)
    del sd["lm_head.weight"]  # tied to the embedding: one tensor
    return sd


def adapters(w: dict[str, torch.Tensor], rank: int, seed: int) -> dict[str, torch.Tensor]:
    """LoRA adapters on every attention and MLP projection, named as PEFT names them: A small
    random, B zero (PEFT's init), bf16."""
    g = torch.Generator().manual_seed(seed + 1)
    out = {}
    for k, v in w.items():
        if v.dim() == 2 and k.endswith("proj.weight"):
            stem = k[: -len(".weight")]
            a = torch.randn(rank, v.shape[1], generator=g).mul_(v.shape[1] ** -0.5)
            out[f"{stem}.lora_A.weight"] = a.to(torch.bfloat16)
            out[f"{stem}.lora_B.weight"] = torch.zeros(v.shape[0], rank, dtype=torch.bfloat16)
    return out


def safetensors_point(
    w: dict[str, torch.Tensor], where: str, base: Any, buf: dict[str, torch.Tensor]
) -> dict[str, float]:
    """Write the whole state as one safetensors file (local: save_file, no fsync; S3: upload),
    then read it back into ``buf`` (local: safe_open + copy, so the mmap is really read)."""
    from safetensors import safe_open
    from safetensors.torch import load, save, save_file

    t0 = time.perf_counter()
    if where == "local":
        path = Path(base) / "model.safetensors"
        save_file(w, str(path))
        t1 = time.perf_counter()
        with safe_open(str(path), framework="pt") as f:
            for k in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                buf[k].copy_(f.get_tensor(k))
    else:
        fs, path = base
        fs.pipe_file(path, save(w))
        t1 = time.perf_counter()
        for k, v in load(fs.cat_file(path)).items():
            buf[k].copy_(v)
    t2 = time.perf_counter()
    assert state_digest(buf) == state_digest(w), "safetensors round trip is not bit-exact"
    return {"save_s": t1 - t0, "load_s": t2 - t1}


def scenario(where: str, params: float, args: argparse.Namespace, server: Any) -> dict[str, Any]:
    w0 = weights(params, args.seed)
    nbytes = sum(v.numel() * 2 for v in w0.values())
    log(f"{where}: {len(w0)} bf16 tensors, {C.fmt_bytes(nbytes)}")
    trainer = Trainer(w0, args.seed)
    del w0
    tmp = Path(tempfile.mkdtemp(prefix=f"refit-{where}-", dir=args.workdir))

    def new_runs(run: str) -> list[Run]:
        out = []
        for pol in policies(args.policies):
            if where == "local":
                st = deltackpt.open_store(tmp / f"{run}{pol.name}")
            else:
                from deltackpt.store.objstore import FsspecStorage

                url = f"s3://bench/refit-{run}{pol.name}"
                # one writer per prefix: the raw store may gc its old versions
                storage = FsspecStorage(url, server.opts, no_concurrent_saves=True)
                st = deltackpt.open_store(url, storage=storage)
            out.append(Run(pol, st))
        return out

    runs = new_runs("")
    st_base: Any = tmp if where == "local" else (server.fs, "bench/refit/model.safetensors")
    chunk = runs[0].store.chunk_bytes
    pool = ThreadPoolExecutor(2)
    names, digests = ["v0"], [state_digest(trainer.weights)]
    for r in runs:
        r.save(trainer.weights, "v0")
    buf = empty_like(trainer.weights)
    phases = [("rl lr 1e-6", 1e-6, args.rl_steps), ("rl lr 1e-5", 1e-5, args.rl5_steps)]
    phases.append(("pretrain lr 1e-3", 1e-3, args.pretrain_steps))
    # a LoRA fine-tune of the last weights (frozen): the adapters change, the base does not
    phases.append(("lora lr 1e-4", 1e-4, args.lora_steps))
    out: dict[str, Any] = {"state_bytes": nbytes, "phases": []}
    base: dict[str, torch.Tensor] = {}
    stepper, extra = trainer, {}
    for label, lr, steps in phases:
        if not steps:
            continue
        if label.startswith("lora"):
            # a run of its own, into new stores, as a LoRA fine-tune starts: its first version
            # (the base and the new adapters) is not counted
            stepper = Trainer(adapters(trainer.weights, args.lora_rank, args.seed), args.seed)
            extra = stepper.weights
            nbytes_lora = sum(v.numel() * 2 for v in extra.values())
            log(f"{where}: LoRA rank {args.lora_rank}, {len(extra)} adapters, "
                f"{C.fmt_bytes(nbytes_lora)}")  # fmt: skip
            runs = new_runs("lora-")
            # the base is frozen (requires_grad False, as PEFT leaves it): the save's grouping
            # keeps its small tensors apart from the adapters from the start
            base = {k: v.detach() for k, v in trainer.weights.items()}
            names, digests = ["v0"], [state_digest({**base, **extra})]
            for r in runs:
                r.save({**base, **extra}, "v0")
            buf = empty_like({**base, **extra})
        first = len(names)
        change, frac = 0, []
        for _ in range(steps):
            prev = snapshot(extra) if extra else snapshot(trainer.weights)
            stepper.step(lr)
            c, f = change_stats(prev, extra or trainer.weights, chunk, pool)
            del prev
            change, frac = change + c, [*frac, f]
            names.append(f"v{len(names)}")
            state = {**base, **extra} if extra else trainer.weights
            digests.append(state_digest(state))
            for r in runs:
                r.save(state, names[-1], keep=args.k + 1 if r is runs[0] else None)
        log(f"{where} {label}: {steps} steps, {sum(frac) / len(frac):.2%} of elements changed")
        ph: dict[str, Any] = {"phase": label, "steps": steps, "change_bytes": change}
        ph["changed_frac"] = sum(frac) / len(frac)
        for r in runs:
            pt = measure_point(r, runs[0], names, digests, buf, args.k, first)
            pt["written"] = sum(r.written[first:])
            pt["save_s"] = sum(r.save_s[first:]) / steps
            pt["fold_written"] = sum(r.fold_written[first:])
            pt["fold_s"] = sum(r.fold_s[first:]) / steps
            ph[r.policy.name] = pt
            log(f"  {r.policy.name}: {pt}")
        ph["safetensors"] = safetensors_point(state, where, st_base, buf)
        out["phases"].append(ph)
    C.rmtree(tmp)
    return out


class S3:
    def __init__(self) -> None:
        import s3fs
        from bench_objstore import Server

        self.server = Server()
        self.opts = {"endpoint_url": self.server.url, "key": "bench", "secret": "bench"}
        self.fs = s3fs.S3FileSystem(**self.opts)
        self.fs.mkdir("bench")

    def close(self) -> None:
        self.server.close()


def rows(where: str, res: dict[str, Any], k: int) -> list[list[Any]]:
    out = []
    n = res["state_bytes"]
    for ph in res["phases"]:
        raw_full = ph["raw"]["full_s"]
        per_v = ph["change_bytes"] / ph["steps"]
        for name, pt in ph.items():
            if not isinstance(pt, dict) or name == "safetensors":
                continue
            c1 = (
                f"{pt['catch1_bytes'] / pt['full_bytes']:.1%} / {pt['catch1_s'] / pt['full_s']:.0%}"
            )
            if "catch1_full_s" in pt:  # verify="full" beside the default
                c1 += f" ({pt['catch1_full_s'] / pt['full_s']:.0%} full)"
            ck = (
                f"{pt[f'catch{k}_bytes'] / pt['full_bytes']:.1%} / "
                f"{pt[f'catch{k}_s'] / pt['full_s']:.0%}"
                if f"catch{k}_s" in pt
                else "-"
            )
            fold = (
                f"{pt['fold_written'] / ph['steps'] / n:.2%} / {pt['fold_s']:.2f}"
                if r_folds(pt)
                else "-"
            )
            out.append(
                [where, ph["phase"], f"{ph['changed_frac']:.2%}", name,
                 f"{pt['written'] / ph['steps'] / n:.2%}", fold,
                 f"{pt['written'] / max(ph['change_bytes'], 1):.2f}",
                 f"{pt['save_s']:.2f}", c1, ck, f"{pt['full_s']:.2f}",
                 f"{pt['full_s'] / raw_full:.2f} ({pt['links']})",
                 f"{pt['worst_s'] / raw_full:.2f} ({pt['worst_links']})"]
            )  # fmt: skip
        st = ph["safetensors"]
        out.append(
            [where, ph["phase"], "", "safetensors", "100%", "-", f"{n / max(per_v, 1):.1f}",
             f"{st['save_s']:.2f}", "-", "-", f"{st['load_s']:.2f}",
             f"{st['load_s'] / raw_full:.2f}", "-"]
        )  # fmt: skip
    return out


def r_folds(pt: dict[str, Any]) -> bool:
    """Whether the policy of point ``pt`` folds after its saves."""
    return bool(pt.get("fold_written") or pt.get("fold_s"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--params", type=float, default=5e8, help="local state, parameters")
    ap.add_argument("--s3-params", type=float, default=1e8, help="S3 state (0: skip S3)")
    ap.add_argument("--rl-steps", type=int, default=24)
    ap.add_argument("--rl5-steps", type=int, default=12)
    ap.add_argument("--pretrain-steps", type=int, default=2)
    ap.add_argument("--lora-steps", type=int, default=6, help="then a LoRA fine-tune (0: none)")
    ap.add_argument("--lora-rank", type=int, default=16)
    ap.add_argument("--k", type=int, default=10, help="catch-up over k versions")
    ap.add_argument("--policies", default="old=64/4,default", help="NAME=B/K or default")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workdir", type=Path, default=C.OUT_DIR / "refit-work")
    ap.add_argument("--out", type=Path, default=C.OUT_DIR / "refit.json")
    args = ap.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    nbytes = int(2 * args.params)
    limits = C.measure_limits(args.workdir / "limits", min(nbytes, 1 << 30))
    log(
        "limits: "
        + ", ".join(f"{k} {v['gbps']:.2f} GB/s" for k, v in limits.items() if "gbps" in v)
    )
    results: dict[str, Any] = {"machine": C.machine_info(), "limits": limits, "args": vars(args)}
    results["local"] = scenario("local", args.params, args, None)
    if args.s3_params:
        s3 = S3()
        try:
            results["s3"] = scenario("s3", args.s3_params, args, s3)
        except Exception as e:  # keep the local results
            log(f"s3 failed: {type(e).__name__}: {e}")
        finally:
            s3.close()
    header = ["where", "phase", "changed", "policy", "written/version",
              "fold written/version / s", "/ xor+zstd-1",
              "save s", "catch-up 1: bytes / time (verify=\"full\")", f"catch-up {args.k}: bytes / time",
              "full load s", "latest load / raw (links)",
              "end-of-chain load / raw (links)"]  # fmt: skip
    table = [r for w in ("local", "s3") if w in results for r in rows(w, results[w], args.k)]
    print(C.md_table(header, table))
    print(
        "\nlimits: "
        + "; ".join(f"{k}: {v['gbps']:.2f} GB/s" for k, v in limits.items() if "gbps" in v)
    )
    C.write_json(
        args.out, {**results, "table": table, "args": {k: str(v) for k, v in vars(args).items()}}
    )


if __name__ == "__main__":
    main()

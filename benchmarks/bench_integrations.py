"""Lightning and HF Trainer checkpointing: per-save blocking time and bytes written, deltackpt vs
each framework's default, on the same small training run.

The model is a fine-tuning shape: a frozen embedding table (unchanged between saves, as frozen
layers, embeddings of a LoRA run or a frozen backbone are) and a trainable MLP with AdamW.
Every system runs the same steps and saves every ``--every`` steps:

* Lightning: ``TorchCheckpointIO`` (the default: ``torch.save`` of the checkpoint dict to
  ``epoch=..-step=...ckpt``, no fsync), ``DeltaCheckpointIO`` (fsync'd commit) and
  ``DeltaCheckpointIO(async_save=True)``; ``ModelCheckpoint(every_n_train_steps=N,
  save_top_k=-1)`` so nothing is removed. Blocking = time inside ``save_checkpoint`` on the
  training thread. Bytes = the file's size / ``SnapshotInfo.bytes_written``.
* HF Trainer: its own ``save_steps`` output (``checkpoint-N/``: ``model.safetensors``,
  ``optimizer.pt``, ``scheduler.pt``, ``rng_state.pth``, ``trainer_state.json``; no fsync) vs
  ``DeltaCheckpointCallback`` sync and async. Blocking = ``Trainer._save_checkpoint`` / the
  callback's save. Bytes = the folder's size / ``bytes_written``.

The first save writes everything in every system; later saves are where deltackpt skips the
unchanged chunks (the frozen table) and xor-encodes the changed ones, so both are shown.

    python benchmarks/bench_integrations.py                   # ~12M params, 6 saves each
    python benchmarks/bench_integrations.py --vocab 64000 --saves 4 --json out.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from _harness.env import machine_info
from _harness.files import du_bytes
from _harness.report import fmt_bytes, md_table, write_json

# ---------------------------------------------------------------------------- the run


class Net(torch.nn.Module):
    """Frozen embedding table + trainable MLP; ``forward`` returns the loss (HF style too)."""

    def __init__(self, vocab: int, dim: int, hidden: int) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, dim)
        self.emb.weight.requires_grad_(False)
        self.mlp = torch.nn.Sequential(
            torch.nn.Linear(dim, hidden), torch.nn.GELU(), torch.nn.Linear(hidden, dim)
        )

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        out = self.mlp(self.emb(ids).mean(1))
        return {"loss": torch.nn.functional.mse_loss(out, labels)}


class Rows(torch.utils.data.Dataset):
    def __init__(self, n: int, vocab: int, dim: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, vocab, (n, 16), generator=g)
        self.y = torch.randn(n, dim, generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"ids": self.ids[i], "labels": self.y[i]}


def summary(blocking: list[float], written: list[int]) -> dict[str, Any]:
    later_b, later_w = blocking[1:] or blocking, written[1:] or written
    return {
        "saves": len(blocking),
        "first_blocking_s": blocking[0],
        "median_blocking_s": statistics.median(later_b),
        "first_bytes": written[0],
        "median_bytes": statistics.median(later_w),
        "total_bytes": sum(written),
    }


# ---------------------------------------------------------------------------- Lightning


def lightning_run(a: argparse.Namespace, root: Path, system: str) -> dict[str, Any]:
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.plugins.io import TorchCheckpointIO

    from deltackpt.integrations.lightning import DeltaCheckpointIO

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = Net(a.vocab, a.dim, a.hidden)

        def training_step(self, batch: Any, i: int) -> torch.Tensor:
            return self.net(**batch)["loss"]

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-3)

    blocking: list[float] = []
    sizes: list[int] = []

    def timed(cls: type) -> type:
        class Timed(cls):  # type: ignore[valid-type, misc]
            def save_checkpoint(self, checkpoint: Any, path: Any, storage_options: Any = None):  # type: ignore[no-untyped-def]
                t0 = time.perf_counter()
                super().save_checkpoint(checkpoint, path, storage_options)
                blocking.append(time.perf_counter() - t0)
                if cls is TorchCheckpointIO:
                    sizes.append(du_bytes(path))

        return Timed

    if system == "torch":
        io: Any = timed(TorchCheckpointIO)()
    else:
        io = timed(DeltaCheckpointIO)(root / "store", async_save=system == "deltackpt-async")
    torch.manual_seed(0)
    trainer = pl.Trainer(
        max_steps=a.every * a.saves,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        accelerator="cpu",
        default_root_dir=root,
        plugins=[io],
        callbacks=[
            ModelCheckpoint(dirpath=root / "ckpt", every_n_train_steps=a.every, save_top_k=-1)
        ],
    )
    loader = torch.utils.data.DataLoader(Rows(512, a.vocab, a.dim), batch_size=8, shuffle=True)
    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(Module(), loader)
    wall = time.perf_counter() - t0
    if system != "torch":
        sizes = [i.bytes_written for i in io.infos]
    return {"wall_s": wall, **summary(blocking, sizes)}


# ---------------------------------------------------------------------------- HF Trainer


def hf_run(a: argparse.Namespace, root: Path, system: str) -> dict[str, Any]:
    from transformers import Trainer, TrainingArguments

    from deltackpt.integrations.hf_trainer import DeltaCheckpointCallback

    blocking: list[float] = []
    sizes: list[int] = []
    torch.manual_seed(0)
    args = TrainingArguments(
        output_dir=str(root / "out"),
        max_steps=a.every * a.saves,
        per_device_train_batch_size=8,
        save_strategy="steps",
        save_steps=a.every,
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        logging_strategy="no",
        dataloader_num_workers=0,
    )
    callbacks = []
    if system != "hf":
        cb = DeltaCheckpointCallback(root / "store", async_save=system == "deltackpt-async")
        real = cb._save

        def timed_cb(*args_: Any) -> None:
            t0 = time.perf_counter()
            real(*args_)
            blocking.append(time.perf_counter() - t0)

        cb._save = timed_cb  # type: ignore[method-assign]
        callbacks.append(cb)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = Trainer(
            model=Net(a.vocab, a.dim, a.hidden),
            args=args,
            train_dataset=Rows(512, a.vocab, a.dim),
            callbacks=callbacks,
        )
        if system == "hf":
            real_save = trainer._save_checkpoint

            def timed_hf(model: Any, trial: Any) -> None:
                t0 = time.perf_counter()
                real_save(model, trial)
                blocking.append(time.perf_counter() - t0)
                sizes.append(du_bytes(root / "out" / f"checkpoint-{trainer.state.global_step}"))

            trainer._save_checkpoint = timed_hf  # type: ignore[method-assign]
        t0 = time.perf_counter()
        trainer.train()
        wall = time.perf_counter() - t0
    if system != "hf":
        sizes = [i.bytes_written for i in callbacks[0].checkpointer.infos]
    return {"wall_s": wall, **summary(blocking, sizes)}


# ---------------------------------------------------------------------------- main


def table(results: dict[str, dict[str, Any]], base: str) -> str:
    rows = []
    b = results[base]
    for name, r in results.items():
        rows.append(
            [
                name,
                r["saves"],
                f"{r['first_blocking_s'] * 1e3:.0f} ms",
                f"{r['median_blocking_s'] * 1e3:.0f} ms",
                f"{b['median_blocking_s'] / r['median_blocking_s']:.1f}x",
                fmt_bytes(r["first_bytes"]),
                fmt_bytes(r["median_bytes"]),
                f"{b['median_bytes'] / max(r['median_bytes'], 1):.1f}x",
                fmt_bytes(r["total_bytes"]),
                f"{r['wall_s']:.1f} s",
            ]
        )
    header = [
        "system",
        "saves",
        "blocking, 1st save",
        "blocking, median later",
        "vs default",
        "bytes, 1st save",
        "bytes, median later",
        "vs default",
        "bytes, all saves",
        "run wall",
    ]
    return md_table(header, rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--vocab", type=int, default=32000, help="frozen embedding rows")
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--hidden", type=int, default=4096, help="trainable MLP width")
    ap.add_argument("--every", type=int, default=5, help="steps between saves")
    ap.add_argument("--saves", type=int, default=6)
    ap.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    ap.add_argument("--which", choices=["both", "lightning", "hf"], default="both")
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    n = Net(a.vocab, a.dim, a.hidden)
    frozen = n.emb.weight.numel()
    trainable = sum(p.numel() for p in n.mlp.parameters())
    print(
        f"model: {frozen / 1e6:.1f}M frozen + {trainable / 1e6:.1f}M trainable fp32 params "
        f"(AdamW), save every {a.every} steps, {a.saves} saves; threads={a.threads}\n"
    )
    out: dict[str, Any] = {"machine": machine_info(), "args": vars(a) | {"json": str(a.json)}}
    runs = [
        ("lightning", lightning_run, ["torch", "deltackpt", "deltackpt-async"]),
        ("hf", hf_run, ["hf", "deltackpt", "deltackpt-async"]),
    ]
    for fw, fn, systems in runs:
        if a.which not in ("both", fw):
            continue
        res = {}
        for s in systems:
            with tempfile.TemporaryDirectory(prefix=f"bench-int-{fw}-", dir=".") as d:
                res[s] = fn(a, Path(d), s)
        out[fw] = res
        title = "Lightning (TorchCheckpointIO = default)" if fw == "lightning" else "HF Trainer"
        print(f"### {title}\n\n{table(res, systems[0])}\n", flush=True)
    if a.json:
        write_json(a.json, out)


if __name__ == "__main__":
    main()

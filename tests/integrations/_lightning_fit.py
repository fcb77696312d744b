"""A tiny deterministic Lightning run shared by the Lightning tests and their child process.

Dropout and a shuffled loader draw from the global generators, so a resume is bit-identical to an
uninterrupted run only if the model, optimizer, scheduler, loops *and* RNG state all come back.
8 batches per epoch; ``ModelCheckpoint`` keeps the 2 best by ``train_loss`` plus ``last.ckpt``.
"""

from __future__ import annotations

import random
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

STEPS_PER_EPOCH = 8
EPOCHS = 4


class TinyModule(pl.LightningModule):
    def __init__(self, lr: float = 0.02, hidden: int = 16) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(8, hidden),
            torch.nn.ReLU(),
            torch.nn.Dropout(0.3),
            torch.nn.Linear(hidden, 1),
        )

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, 2, 0.5)}


def seed_all(seed: int) -> None:
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)


def loader() -> DataLoader:
    g = torch.Generator().manual_seed(7)  # the data itself; the shuffle draws from the global RNG
    ds = TensorDataset(
        torch.randn(8 * STEPS_PER_EPOCH, 8, generator=g), torch.randn(64, 1, generator=g)
    )
    return DataLoader(ds, batch_size=8, shuffle=True)


def fit(
    root: Path,
    plugins: Sequence[Any] = (),
    *,
    epochs: int = EPOCHS,
    ckpt_path: str | None = None,
    extra: Sequence[Callback] = (),
    seed: int = 0,
) -> tuple[pl.Trainer, TinyModule, ModelCheckpoint]:
    seed_all(seed)
    module = TinyModule()
    mc = ModelCheckpoint(
        dirpath=root / "checkpoints", monitor="train_loss", save_top_k=2, save_last=True
    )
    trainer = pl.Trainer(
        max_epochs=epochs,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=root,
        plugins=list(plugins),
        callbacks=[mc, *extra],
        accelerator="cpu",
        devices=1,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, loader(), ckpt_path=ckpt_path)
    return trainer, module, mc


def weights(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


class StopAt(Callback):
    """Calls ``action`` at the start of the batch that would make global step ``step``."""

    def __init__(self, step: int, action: Any) -> None:
        self.step = step
        self.action = action

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step == self.step:
            self.action()

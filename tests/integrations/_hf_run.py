"""A tiny deterministic ``transformers.Trainer`` run shared by the HF Trainer tests.

The model has dropout and the sampler shuffles (``data_seed``), so a resume matches an
uninterrupted run bit for bit only if weights, optimizer moments, scheduler position, the data
position inside the epoch and the RNG state all come back. 32 samples, batch 4: 8 steps per
epoch; ``max_steps=12`` crosses an epoch boundary.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from transformers import Trainer, TrainerCallback, TrainingArguments

MAX_STEPS = 12
SAVE_STEPS = 4


class TinyNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Dropout(0.3), torch.nn.Linear(16, 1)
        )

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        out = self.net(x)
        return {"loss": torch.nn.functional.mse_loss(out, labels), "logits": out}


class Rows(torch.utils.data.Dataset):
    def __init__(self) -> None:
        g = torch.Generator().manual_seed(3)
        self.x = torch.randn(32, 8, generator=g)
        self.y = torch.randn(32, 1, generator=g)

    def __len__(self) -> int:
        return 32

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": self.x[i], "labels": self.y[i]}


class Tokens(torch.utils.data.Dataset):
    """Causal-LM rows for :func:`tiny_llama`."""

    def __init__(self) -> None:
        self.ids = torch.randint(0, 128, (32, 16), generator=torch.Generator().manual_seed(1))

    def __len__(self) -> int:
        return 32

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def tiny_llama() -> torch.nn.Module:
    """A 23k-parameter LlamaForCausalLM with tied embeddings and attention dropout."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
        max_position_embeddings=64,
        tie_word_embeddings=True,
        attention_dropout=0.1,
    )
    return LlamaForCausalLM(cfg)


def make_trainer(
    out: Path,
    callbacks: Sequence[TrainerCallback] = (),
    *,
    init_seed: int = 0,
    evaluate: bool = False,
    llama: bool = False,
    **overrides: Any,
) -> Trainer:
    """A fresh trainer; ``evaluate`` adds an evaluation every ``SAVE_STEPS`` steps, ``llama``
    trains :func:`tiny_llama` instead of :class:`TinyNet`."""
    torch.manual_seed(init_seed)
    args = dict(
        output_dir=str(out),
        max_steps=MAX_STEPS,
        per_device_train_batch_size=4,
        learning_rate=5e-2,
        lr_scheduler_type="linear",
        warmup_steps=2,
        save_strategy="steps",
        save_steps=SAVE_STEPS,
        logging_steps=1,
        report_to=[],
        use_cpu=True,
        seed=0,
        data_seed=0,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    if evaluate:
        args.update(eval_strategy="steps", eval_steps=SAVE_STEPS)
    args.update(overrides)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return Trainer(
            model=tiny_llama() if llama else TinyNet(),
            args=TrainingArguments(**args),
            train_dataset=Tokens() if llama else Rows(),
            eval_dataset=(Tokens() if llama else Rows()) if evaluate else None,
            callbacks=list(callbacks),
        )


def weights(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


class CallAt(TrainerCallback):
    """Calls ``action()`` when global step ``step`` begins (a kill point, a stop)."""

    def __init__(self, step: int, action: Any) -> None:
        self.step, self.action = step, action

    def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        if state.global_step == self.step:
            self.action()


class Interrupt(Exception):
    pass


class StopAtStep(TrainerCallback):
    """Raises :class:`Interrupt` when a step begins with ``global_step == step``."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        if state.global_step == self.step:
            raise Interrupt(self.step)

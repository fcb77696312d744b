"""Training-step slowdown: a small CPU MLP trained with no checkpointing, with
``deltackpt.Checkpointer(async_=True)`` (2 and 1 threads) and with ``dcp.async_save``."""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import _common as C
import torch

import deltackpt
from _async import log


class MLP(torch.nn.Module):
    def __init__(self, d: int = 1024, hidden: int = 4096, blocks: int = 3) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(
                torch.nn.LayerNorm(d),
                torch.nn.Linear(d, hidden),
                torch.nn.GELU(),
                torch.nn.Linear(hidden, d),
            )
            for _ in range(blocks)
        )
        self.head = torch.nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = x + b(x)
        return self.head(x)


class LoopRunner:
    """One training run (own model, optimizer, checkpointing), advanced segment by segment."""

    def __init__(self, mode: str, args: argparse.Namespace, work: Path) -> None:
        torch.manual_seed(0)
        self.mode = mode
        self.every = args.every
        self.model = MLP(blocks=args.loop_blocks)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        self.x = torch.randn(args.loop_batch, 1024)
        self.y = torch.randn(args.loop_batch, 1024)
        self.root = work / f"loop-{mode}"
        self.ckpt = None
        self.pending: Any = None
        self.dcp_dirs: list[Path] = []
        if mode == "deltackpt":
            self.ckpt = deltackpt.Checkpointer(self.root, every=self.every, async_=True)
        elif mode == "deltackpt-1t":  # background encoding on one thread, leaving a core
            self.ckpt = deltackpt.Checkpointer(self.root, every=self.every, async_=True, threads=1)
        elif mode == "dcp":
            self.root.mkdir(parents=True)
        self.state = {"model": self.model, "optim": self.opt}
        self.step_no = 0
        self.times: list[float] = []
        self.is_save: list[bool] = []
        self.drains: list[float] = []
        self.segments: list[tuple[float, float]] = []  # (sum of step times, drain)
        for _ in range(args.loop_warmup):  # untimed warm-up, no saves
            self._train()

    def _train(self) -> None:
        self.opt.zero_grad(set_to_none=True)
        torch.nn.functional.mse_loss(self.model(self.x), self.y).backward()
        self.opt.step()

    def _save(self) -> None:
        import torch.distributed.checkpoint as dcp

        if self.ckpt is not None:
            self.ckpt.maybe_save(self.step_no, self.state)
        elif self.mode == "dcp" and (self.step_no + 1) % self.every == 0:
            if self.pending is not None:
                self.pending.result()  # one save in flight, like deltackpt's back-pressure
                for d in self.dcp_dirs[:-1]:
                    C.rmtree(d)
                self.dcp_dirs = self.dcp_dirs[-1:]
            sd = {"model": self.model.state_dict(), "optim": self.opt.state_dict()}
            d = self.root / f"s{self.step_no}"
            self.dcp_dirs.append(d)
            self.pending = dcp.async_save(sd, storage_writer=dcp.FileSystemWriter(str(d)))

    def segment(self, steps: int) -> None:
        total = 0.0
        for _ in range(steps):
            t0 = time.perf_counter()
            self._train()
            self._save()
            dt = time.perf_counter() - t0
            total += dt
            self.times.append(dt)
            self.is_save.append(self.mode != "none" and (self.step_no + 1) % self.every == 0)
            self.step_no += 1
        t0 = time.perf_counter()
        self.drain()
        drain = time.perf_counter() - t0
        self.drains.append(drain)
        self.segments.append((total, drain))

    def drain(self) -> None:
        if self.ckpt is not None:
            self.ckpt.wait()
        elif self.pending is not None:
            self.pending.result()
            self.pending = None

    def result(self) -> dict[str, Any]:
        nparams = sum(p.numel() for p in self.model.parameters())
        save_t = [t for t, s in zip(self.times, self.is_save, strict=True) if s]
        other = [t for t, s in zip(self.times, self.is_save, strict=True) if not s]
        out = {
            "mode": self.mode,
            "params": nparams,
            "state_bytes": nparams * 4 * 3,
            "times": self.times,
            "is_save": self.is_save,
            "segments": self.segments,
            "save_step_mean": sum(save_t) / len(save_t) if save_t else None,
            "other_step_mean": sum(other) / len(other) if other else None,
            "saves": len(save_t),
        }
        if self.ckpt is not None:
            out["deltackpt_infos"] = [
                {
                    "bytes": i.bytes_written,
                    "blocked": i.blocked_seconds,
                    "waited": i.waited_seconds,
                    "seconds": i.seconds,
                }
                for i in self.ckpt.infos
            ]
            self.ckpt.close()
        C.rmtree(self.root)
        return out


def train_loops(args: argparse.Namespace, work: Path) -> list[dict[str, Any]]:
    """Interleave the conditions in segments (rotating order) so each sees the same background
    load; a segment is ``loop_periods`` save periods and ends by waiting for its last save."""
    modes = ["none", "deltackpt", "deltackpt-1t", "dcp"]
    runners = {m: LoopRunner(m, args, work) for m in modes}
    seg = args.every * args.loop_periods
    for r in range(args.loop_rounds):
        order = modes[r % len(modes) :] + modes[: r % len(modes)]
        for m in order:
            runners[m].segment(seg)
            tot, dr = runners[m].segments[-1]
            log(f"  round {r} {m}: {tot / seg:.4f} s/step, drain {dr:.2f}s")
    return [runners[m].result() for m in modes]

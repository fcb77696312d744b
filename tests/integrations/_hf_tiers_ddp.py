"""One rank of a 2-rank gloo DDP ``transformers.Trainer`` run over tiers (as torchrun would start
it: the Trainer sets up ``torch.distributed`` from the environment). Each rank poses as its own
node: its local tier is ``<root>/node<rank>``, and with ``replicas=1, ranks_per_node=1`` each
rank's state is replicated to the other one.

``phase="crash"``: an uninterrupted run first (its final weights are the reference), then a run
with the tiered callback that stops after 10 steps (saved 4 and 8; durable 8).
``phase="resume"``: a fresh trainer resumed through ``resume_trainer``; returns its weights and
the restore report.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from tests.integrations._hf_run import MAX_STEPS, Interrupt, StopAtStep, make_trainer, weights


def _arrays(tensors: dict[str, Any]) -> dict[str, Any]:
    """numpy copies: torch tensors cross a multiprocessing queue as shared-memory handles that
    die with this process (``fast_exit``)."""
    return {k: v.numpy().copy() for k, v in tensors.items()}


def tiers_of(root: Path, rank: int) -> Any:
    from deltackpt.tiers import Tiers

    return Tiers(
        local=root / f"node{rank}",
        durable=root / "durable",
        replicas=1,
        ranks_per_node=1,
        persist_every=8,
    )


def run_rank(rank: int, world: int, port: int, root: str, phase: str) -> dict[str, Any]:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
    )
    from deltackpt.integrations.hf_trainer import DeltaCheckpointCallback, resume_trainer

    out: dict[str, Any] = {}
    base, tiers = Path(root), tiers_of(Path(root), rank)
    if phase == "crash":
        ref = make_trainer(base / f"ref{rank}")
        assert ref.args.world_size == world, ref.args.world_size
        assert ref.train().global_step == MAX_STEPS
        out["reference"] = _arrays(weights(ref))
        cb = DeltaCheckpointCallback(tiers)
        with pytest.raises(Interrupt):
            make_trainer(base / f"run{rank}", [cb, StopAtStep(10)]).train()
        cb.checkpointer.wait()
        out["stats"] = cb.checkpointer.stats
        cb.close()
    else:
        cb = DeltaCheckpointCallback(tiers)
        trainer = make_trainer(base / f"run{rank}", [cb], init_seed=9)
        result = resume_trainer(trainer)
        out["global_step"] = result.global_step
        out["weights"] = _arrays(weights(trainer))
        out["report"] = cb.checkpointer.last_restore
        cb.close()
    return out

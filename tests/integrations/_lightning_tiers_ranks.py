"""A rank of ``test_lightning_tiers``'s two-rank load: every rank calls ``load_checkpoint`` (as
Lightning's strategies do); rank 0 reads the tiers and broadcasts the dict to the others."""

from __future__ import annotations

from typing import Any

from tests._dist import init_gloo


def load_on_rank(rank: int, world: int, port: int, tiers: Any, path: str) -> dict[str, Any]:
    import torch

    from deltackpt.errors import DistributedError, SnapshotNotFoundError
    from deltackpt.integrations.lightning import DeltaCheckpointIO

    init_gloo(rank, world, port)
    io = DeltaCheckpointIO(tiers)
    torch.manual_seed(1000 + rank)  # differs per rank until the saved RNG state is put back
    loaded = io.load_checkpoint(path)
    out: dict[str, Any] = {
        "step": loaded["global_step"],
        "w": loaded["state_dict"]["w"].tolist(),
        "draw": torch.rand(1).item(),
    }
    try:
        io.load_checkpoint(path + ".missing")
    except (SnapshotNotFoundError, DistributedError) as e:
        out["error"] = type(e).__name__
    io.teardown()
    return out

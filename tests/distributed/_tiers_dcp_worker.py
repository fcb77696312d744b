"""The rank body of tests/distributed/test_tiers_dcp.py: the training loop of
``_tiers_worker.py`` saved with ``dcp.save(..., storage_writer=TieredWriter(ckpt, step))`` and
restored with ``dcp.load(..., storage_reader=TieredReader(ckpt))``. ``cfg["shard_dim"]`` shards
``model.w`` and ``model.e`` on dim 0 (the default) or 1 (another sharding, same world size)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tests.distributed._tiers_worker import bias, full_e, full_w


def _state(mesh: Any, step: int, dim: int) -> dict[str, Any]:
    from torch.distributed.tensor import Shard, distribute_tensor

    return {
        "model": {
            "w": distribute_tensor(full_w(step), mesh, [Shard(dim)]),
            "e": distribute_tensor(full_e(), mesh, [Shard(dim)]),
        },
        "bias": bias(step),
        "step": step,
    }


def _matches(state: dict[str, Any], step: int) -> bool:
    return (
        state["step"] == step
        and torch.equal(state["model"]["w"].full_tensor(), full_w(step))
        and torch.equal(state["model"]["e"].full_tensor(), full_e())
        and torch.equal(state["bias"], bias(step))
    )


def _train(state: dict[str, Any], mesh: Any, step: int) -> None:
    """The step of ``_tiers_worker.train`` (row ``(step * 37) % R`` of w gains ``step + 1``),
    on any sharding."""
    from torch.distributed.tensor import distribute_tensor

    w = state["model"]["w"]
    delta = torch.zeros(w.shape)
    delta[(step * 37) % w.shape[0]] = step + 1
    with torch.no_grad():
        w.to_local().add_(distribute_tensor(delta, mesh, w.placements).to_local())
        state["bias"] += 1
    state["step"] = step


def run(rank: int, world: int, port: int, root: str, cfg: dict[str, Any]) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh

    from deltackpt.tiers import TieredCheckpointer, Tiers
    from deltackpt.tiers.dcp import TieredReader, TieredWriter
    from tests._dist import init_gloo

    pg = init_gloo(rank, world, port)
    mesh = init_device_mesh("cpu", (world,))
    rpn = cfg.get("ranks_per_node", 2)
    tiers = Tiers(
        local=Path(root) / f"node{rank // rpn}",
        durable=Path(root) / "durable",
        replicas=1,
        persist_every=cfg.get("persist_every"),
        ranks_per_node=rpn,
    )
    ckpt = TieredCheckpointer(tiers, process_group=pg)
    dim = cfg.get("shard_dim", 0)
    state = _state(mesh, -1, dim)
    out: dict[str, Any] = {"start": 0}
    if not cfg.get("fresh"):
        with torch.no_grad():
            for t in (state["model"]["w"], state["model"]["e"], state["bias"]):
                t.zero_()
        state["step"] = -99
        try:
            dcp.load(state, storage_reader=TieredReader(ckpt, tier=cfg.get("tier")))
        except BaseException as e:  # DCP wraps errors in a CheckpointException (BaseException)
            out["error"] = f"{type(e).__name__}: {e}"
            if "retry_tier" not in cfg:
                ckpt.close()
                return out
            # what the error says to do, in the same processes: load from the tier it names
            with torch.no_grad():
                for t in (state["model"]["w"], state["model"]["e"], state["bias"]):
                    t.zero_()
            state["step"] = -99
            dcp.load(state, storage_reader=TieredReader(ckpt, tier=cfg["retry_tier"]))
        out["start"] = state["step"] + 1
        out["report"] = ckpt.last_restore
        out["restored_ok"] = _matches(state, state["step"])
    for step in range(out["start"], cfg.get("steps", 0)):
        _train(state, mesh, step)
        dcp.save(state, storage_writer=TieredWriter(ckpt, step))
    ckpt.close()
    out["stats"] = ckpt.stats
    out["final_ok"] = out["start"] >= cfg.get("steps", 0) or _matches(state, state["step"])
    return out

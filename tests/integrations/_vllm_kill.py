"""A trainer killed mid-round (used by ``_vllm_run.py``, in the ``.venv-vllm`` interpreter).

The engine stays in the driving process; the trainer runs in a spawned child and reaches the
engine through :class:`PipeClient` (a ``VLLMWeightSyncClient`` whose calls the parent runs on
its ``LLM``, as an HTTP server would). The child commits one round, lets the parent record the
engine's greedy tokens, then dies (``os._exit``) while packing the second bucket of the next
round. The parent records how the engine's ``update_weights`` call failed and how long it took.
"""

from __future__ import annotations

import multiprocessing
import os
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

import torch

BUCKET = 64 << 10  # several buckets per round for the tiny model: the death falls mid-round


class PipeClient:
    """The child's ``VLLMWeightSyncClient``: every call runs in the parent (see
    :func:`serve`); one call at a time."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.lock = threading.Lock()
        self.sent: dict[str, threading.Event] = {}  # name -> set once a call of it was sent

    def was_sent(self, name: str) -> threading.Event:
        return self.sent.setdefault(name, threading.Event())

    def call(self, name: str, *args: Any) -> Any:
        with self.lock:
            self.conn.send((name, args))
            self.was_sent(name).set()
            ok, value = self.conn.recv()
        if not ok:
            raise RuntimeError(f"the engine's {name} failed: {value}")
        return value

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.call("init_weight_transfer_engine", init_info)

    def shutdown_weight_transfer_engine(self) -> None:
        self.call("shutdown_weight_transfer_engine")

    def start_weight_update(self) -> None:
        self.call("start_weight_update")

    def update_weights(self, update_info: Any) -> None:
        self.call("update_weights", update_info)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.call("finish_weight_update", weight_version)


def nudge(sd: dict[str, torch.Tensor], seed: int) -> None:
    """Change about 10% of every tensor's elements (enough to move greedy tokens)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for t in sd.values():
            mask = torch.rand(t.shape, generator=gen) < 0.1
            t[mask] += (torch.randn(t.shape, generator=gen) * 0.05).to(t.dtype)[mask]


def doomed_trainer(conn: Connection) -> None:
    """The child: once told its port, state and version (``(port, state_path, version)`` on
    ``conn``: it is spawned early, so its interpreter starts while the parent works), commit
    ``version``, report, then die while pushing ``version + 1``."""
    from vllm.distributed.weight_transfer import WeightTransferTrainerFactory

    from deltackpt.integrations.vllm.trainer import DeltackptTrainerInitInfo
    from deltackpt.sync.packer import Packer

    if not conn.poll(600):
        return
    port, state_path, version = conn.recv()
    sd: dict[str, torch.Tensor] = torch.load(state_path)
    client = PipeClient(conn)
    info = DeltackptTrainerInitInfo(
        rank=0, master_port=port, dtype="bfloat16", bucket_bytes=BUCKET, timeout=60.0, links="gloo"
    )
    eng = WeightTransferTrainerFactory.trainer_init(info, client=client)
    nudge(sd, 11)
    eng.send_weights(sd, version=version)
    client.call("mark")
    client.was_sent("update_weights").clear()  # the next round's is the one to wait for
    nudge(sd, 12)
    real = Packer.message
    calls = [0]

    def dying(self: Packer, *args: Any, **kw: Any) -> Any:
        calls[0] += 1
        if calls[0] == 2:
            # update_weights goes to the engine from a thread beside the push: sent (the pipe
            # keeps it for the engine) before the death, or a busy machine reorders the two
            client.was_sent("update_weights").wait(60)
            os._exit(17)  # killed mid-round: bucket 0 went out, the rest never will
        return real(self, *args, **kw)

    Packer.message = dying  # type: ignore[method-assign]
    eng.send_weights(sd, version=version + 1)
    os._exit(3)  # not reached: the round must not finish


def serve(llm: Any, conn: Connection, mark: Callable[[], Any]) -> dict[str, Any]:
    """Run the child's calls on ``llm`` until the child is gone; what failed, and when."""
    from deltackpt.integrations.vllm.trainer import LocalLLMClient

    client = LocalLLMClient(llm)
    out: dict[str, Any] = {"calls": [], "failed": None, "marked": None}
    while True:
        try:
            if not conn.poll(120):
                out["hung"] = True
                return out
            name, args = conn.recv()
        except (EOFError, OSError):
            return out
        out["calls"].append(name)
        t0 = time.monotonic()
        try:
            value = mark() if name == "mark" else getattr(client, name)(*args)
            reply: tuple[bool, Any] = (True, None)
            if name == "mark":
                out["marked"] = value
        except Exception as e:  # recorded for the test to judge
            out["failed"] = {
                "call": name,
                "type": type(e).__name__,
                "message": str(e)[-2000:],
                "seconds": time.monotonic() - t0,
            }
            reply = (False, repr(e))
        try:
            conn.send(reply)
        except OSError:
            return out


class Doomed:
    """The doomed trainer's process, spawned now (its interpreter starts meanwhile); run by
    :func:`kill_round`."""

    def __init__(self) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.parent, child = ctx.Pipe()
        self.proc = ctx.Process(target=doomed_trainer, args=(child,), daemon=True)
        self.proc.start()
        child.close()


def kill_round(
    llm: Any,
    state: dict[str, torch.Tensor],
    port: int,
    version: int,
    mark: Callable[[], Any],
    doomed: Doomed | None = None,
) -> dict[str, Any]:
    """Let the doomed trainer (``doomed``, or one spawned now) run on ``state`` and serve it;
    its exit code and what the engine saw. ``mark()`` runs after the child's round ``version``
    committed."""
    import tempfile

    path = os.path.join(tempfile.mkdtemp(prefix="deltackpt-kill-"), "state.pt")
    torch.save({k: v.detach().clone() for k, v in state.items()}, path)
    d = doomed or Doomed()
    d.parent.send((port, path, version))
    out = serve(llm, d.parent, mark)
    d.proc.join(30)
    out["exitcode"] = d.proc.exitcode
    return out

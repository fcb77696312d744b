"""Read-back for the ``deltackpt`` vLLM backend: what an engine committed, as digests, over
``collective_rpc`` (offline ``LLM`` or the server's ``/collective_rpc`` route).

Start the engine with ``worker_extension_cls=EXTENSION`` (``vllm serve ...
--worker-extension-cls deltackpt.integrations.vllm.extension.DeltackptWorkerExtension``): vLLM
mixes the class into every worker, so ``collective_rpc("deltackpt_digests")`` returns, per
worker, the xxh3-128 digest of every tensor of the last committed round (by trainer name), and
the trainer compares them with :func:`state_digests` of what it sent. Plain strings and ints:
they travel as JSON through the HTTP route, where tensors would not.

The same extension is the **store link** of a refit through the store (issue 27): a trainer
publishes versions with ``deltackpt.save`` / ``Checkpointer`` to a directory or an object store,
and ``collective_rpc("deltackpt_follow", args=(url,))`` makes every worker bring its model to the
newest committed version, incrementally from the one it holds (a :class:`deltackpt.Follower`
per worker, loading through the model's ``load_weights`` inside vLLM's layerwise reload). No
weight-transfer backend is needed for that; no trainer process talks to the engine.

Importing this module never imports vLLM.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import torch

from deltackpt.format.hashing import digest

__all__ = ["EXTENSION", "DeltackptWorkerExtension", "state_digests", "tensor_digest"]

#: the value of ``worker_extension_cls`` / ``--worker-extension-cls``
EXTENSION = f"{__name__}.DeltackptWorkerExtension"


def tensor_digest(t: torch.Tensor) -> str:
    """The xxh3-128 hex digest of ``t``'s bytes in its own dtype, C order."""
    flat = t.detach().cpu().contiguous().reshape(-1)
    return digest(flat.view(torch.uint8).numpy()) if flat.numel() else digest(b"")


def state_digests(
    tensors: Mapping[str, torch.Tensor], dtype: torch.dtype | str | None = None
) -> dict[str, str]:
    """:func:`tensor_digest` of every tensor, floating ones cast to ``dtype`` first (the
    ``dtype`` of ``DeltackptTrainerInitInfo``: what the wire carried)."""
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    out = {}
    for name, t in tensors.items():
        if dtype is not None and t.is_floating_point():
            t = t.detach().to(dtype)
        out[name] = tensor_digest(t)
    return out


class DeltackptWorkerExtension:
    """Mixed into vLLM's worker class by ``worker_extension_cls`` (see module doc); its
    methods run on every worker through ``collective_rpc``."""

    def _deltackpt_engine(self) -> Any:
        eng = getattr(self, "weight_transfer_engine", None)
        if eng is None or not hasattr(eng, "committed"):
            raise RuntimeError(
                "deltackpt: this worker has no deltackpt weight-transfer engine; start vLLM "
                "with weight_transfer_config={'backend': 'deltackpt'} (--weight-transfer-config "
                '\'{"backend": "deltackpt"}\')'
            )
        return eng

    # every method returns a dict: the server's /collective_rpc route passes dicts and lists
    # through as JSON and turns anything else into its str()

    def deltackpt_version(self) -> dict[str, int | None]:
        """``{"version": ...}`` of this worker's last committed round (None before the first)."""
        return {"version": self._deltackpt_engine().version}

    def deltackpt_digests(self) -> dict[str, Any]:
        """``{"version": ..., "digests": {trainer name: xxh3-128 hex}}`` of the tensors of the
        last committed round on this worker."""
        eng = self._deltackpt_engine()
        return {"version": eng.version, "digests": state_digests(eng.committed())}

    def deltackpt_paths(self) -> dict[str, dict[str, str]]:
        """Per tensor of the last committed round, the vLLM parameter it lands in and the path
        it takes on this worker (``DeltackptWeightTransferEngine.param_paths``)."""
        return self._deltackpt_engine().param_paths()  # type: ignore[no-any-return]

    def deltackpt_follow(
        self,
        store: str,
        key: str | None = "model",
        storage_options: dict[str, Any] | None = None,
        lease_ttl: float | None = 600.0,
    ) -> dict[str, Any]:
        """Bring this worker's model to the newest committed snapshot of ``store`` (one poll of
        a :class:`deltackpt.Follower` kept on the worker; the first call loads whole, later
        ones catch up from the version held). ``key``: where the state dict sits in the saved
        state (``{"model": sd}`` -> ``"model"``; None: the whole state is the state dict).
        Fail closed as the Follower is: held weights that do not match their version, or a held
        version retention deleted, mean a full load. Memory: the follower's CPU copy of the
        followed tensors (the model's own parameters are fused, sharded or repacked).
        Returns ``{"version", "mode" (None: nothing newer), "reason", "bytes_read",
        "changed"}``."""
        import socket

        from deltackpt.follow import Follower
        from deltackpt.integrations.vllm.worker import reload_layers

        f = getattr(self, "_deltackpt_follower", None)
        if f is None or getattr(self, "_deltackpt_follow_args", None) != (store, key):
            model, cfg = self.model_runner.get_model(), self.model_config  # type: ignore[attr-defined]
            loaded: dict[str, Any] = {}
            prefix = "" if key is None else f"{key}/"
            rank = int(getattr(self, "rank", 0))
            f = Follower(
                store,
                load_weights=lambda w: reload_layers(model, cfg, loaded, list(w)),
                keys=None if key is None else [key],
                rename=lambda k: k.removeprefix(prefix),
                holder=f"vllm-{socket.gethostname()}-{os.getpid()}-rank{rank}",
                lease_ttl=lease_ttl,
                storage_options=storage_options,
            )
            self._deltackpt_follower, self._deltackpt_follow_args = f, (store, key)
            self._deltackpt_loaded = loaded
        s = f.poll()
        return {
            "version": f.version,
            "mode": None if s is None else s.mode,
            "reason": None if s is None else s.reason,
            "bytes_read": 0 if s is None else s.load.bytes_read,
            "changed": 0 if s is None else len(s.changed),
        }

    def deltackpt_follow_digests(self) -> dict[str, Any]:
        """``{"version": ..., "digests": {name: xxh3-128 hex}}`` of the tensors the store link
        (``deltackpt_follow``) last loaded into this worker's model."""
        f = getattr(self, "_deltackpt_follower", None)
        if f is None:
            return {"version": None, "digests": {}}
        return {"version": f.version, "digests": state_digests(self._deltackpt_loaded)}

    def deltackpt_end_stale_update(self) -> dict[str, bool]:
        """End an update session a trainer that died between ``start_weight_update`` and
        ``update_weights`` left open (vLLM then refuses ``start_weight_update``); True when
        one was open. Never fails, so it is safe on engines with several workers, where a
        failing collective RPC desynchronizes vLLM 0.32's executor. Nothing is applied: this
        backend loads a round inside ``update_weights``, after its commit. ``{"ended": ...}``."""
        eng = self._deltackpt_engine()
        was = bool(getattr(self, "_weight_update_active", False))
        if was:
            eng.reset_weight_update_target()
            self._weight_update_active = False
        return {"ended": was}

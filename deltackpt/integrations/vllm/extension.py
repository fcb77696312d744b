"""Read-back for the ``deltackpt`` vLLM backend: what an engine committed, as digests, over
``collective_rpc`` (offline ``LLM`` or the server's ``/collective_rpc`` route).

Start the engine with ``worker_extension_cls=EXTENSION`` (``vllm serve ...
--worker-extension-cls deltackpt.integrations.vllm.extension.DeltackptWorkerExtension``): vLLM
mixes the class into every worker, so ``collective_rpc("deltackpt_digests")`` returns, per
worker, the xxh3-128 digest of every tensor of the last committed round (by trainer name), and
the trainer compares them with :func:`state_digests` of what it sent. Plain strings and ints:
they travel as JSON through the HTTP route, where tensors would not.

Importing this module never imports vLLM.
"""

from __future__ import annotations

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

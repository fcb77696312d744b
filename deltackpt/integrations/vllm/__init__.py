"""A ``deltackpt`` backend for vLLM's weight-transfer API (``vllm.distributed.weight_transfer``).

vLLM loads the ``vllm.general_plugins`` entry points in every process it starts (the API
server, the engine core and each worker), and this package's :func:`register` is one of them
(pyproject.toml): so ``WeightTransferConfig(backend="deltackpt")`` and the HTTP routes work
unchanged in worker processes, not only in the driver. Both registrations name a module path:
importing ``deltackpt`` (or this package) never imports vLLM.

- ``worker``: :class:`~deltackpt.integrations.vllm.worker.DeltackptWeightTransferEngine`, a
  ``WeightTransferEngine`` that takes part in one :class:`~deltackpt.sync.WeightReceiver` round
  per ``update_weights`` and loads what the round committed through the model's own
  ``load_weights``.
- ``trainer``: :class:`~deltackpt.integrations.vllm.trainer.DeltackptTrainerEngine` (a
  ``TrainerWeightTransferEngine`` around a :class:`~deltackpt.sync.WeightSender`), its init info
  and :class:`~deltackpt.integrations.vllm.trainer.LocalLLMClient` (an in-process ``LLM`` as a
  ``VLLMWeightSyncClient``).
- ``extension``: :class:`~deltackpt.integrations.vllm.extension.DeltackptWorkerExtension`
  (``worker_extension_cls``): digests of what each worker committed, the per-parameter path
  report and the end of a stale update session, through ``collective_rpc`` or the server's
  ``/collective_rpc`` route.
"""

from __future__ import annotations

import contextlib

__all__ = ["BACKEND", "register"]

#: the name of the backend in ``WeightTransferConfig(backend=...)`` and both factories
BACKEND = "deltackpt"


def register() -> None:
    """Register the worker and trainer engines with vLLM's factories (idempotent: vLLM may run a
    plugin more than once per process, and the trainer module calls it on import)."""
    from vllm.distributed.weight_transfer.factory import (
        WeightTransferEngineFactory,
        WeightTransferTrainerFactory,
    )

    for factory, module, cls in (
        (WeightTransferEngineFactory, "worker", "DeltackptWeightTransferEngine"),
        (WeightTransferTrainerFactory, "trainer", "DeltackptTrainerEngine"),
    ):
        # ValueError: already registered (a second load of the plugin)
        with contextlib.suppress(ValueError):
            factory.register_engine(BACKEND, f"{__name__}.{module}", cls)

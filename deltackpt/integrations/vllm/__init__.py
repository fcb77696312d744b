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
- ``lora``: LoRA adapters from the store (``add_lora``); the plugin teaches vLLM's worker
  loader their ``deltackpt-lora:`` paths.
- ``resolver``: a LoRA resolver (registered when ``DELTACKPT_VLLM_LORA_STORE`` is set): a
  server request's ``model`` names a saved adapter version.
- ``loader``: ``load_format="deltackpt"``, an engine that starts from a store's snapshot
  (``model_loader_extra_config``: ``store``, ``snapshot``, ``key``, ``follow``).
- ``store_link``: the store link from the driver (``follow(llm, url)``, ``stage``, ``commit``):
  the workers' follow, then the prefix cache dropped and the weight version set.
- ``extension``: :class:`~deltackpt.integrations.vllm.extension.DeltackptWorkerExtension`
  (``worker_extension_cls``): digests of what each worker committed, the per-parameter path
  report and the end of a stale update session, through ``collective_rpc`` or the server's
  ``/collective_rpc`` route.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.util
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

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
    # LoRA adapters named by a deltackpt path (module lora): vLLM's worker loader learns them
    # when vLLM imports it (importing it here would cost every vLLM process ~1 s)
    from deltackpt.integrations.vllm.lora import patch_loader
    from deltackpt.options import vllm_lora_store

    when_imported("vllm.lora.worker_manager", patch_loader)
    # load_format="deltackpt" (module loader): an engine starts from a store's snapshot
    when_imported("vllm.model_executor.model_loader", _register_loader)
    # requests naming "[adapter@]snapshot" as their model, on a server (module resolver)
    store = vllm_lora_store()
    if store is not None:
        from vllm.lora.resolver import LoRAResolverRegistry

        from deltackpt.integrations.vllm.resolver import RESOLVER, StoreResolver

        if RESOLVER not in LoRAResolverRegistry.get_supported_resolvers():
            LoRAResolverRegistry.register_resolver(RESOLVER, StoreResolver(store))


def _register_loader(module: ModuleType) -> None:
    from deltackpt.integrations.vllm.loader import FORMAT, DeltackptModelLoader

    if module._LOAD_FORMAT_TO_MODEL_LOADER.get(FORMAT) is not DeltackptModelLoader:
        module.register_model_loader(FORMAT)(DeltackptModelLoader)


def when_imported(name: str, fn: Callable[[ModuleType], None]) -> None:
    """Call ``fn(module)`` once module ``name`` is imported: now if it is, else right after
    its import runs (a one-shot finder in front of ``sys.meta_path``)."""
    if name in sys.modules:
        fn(sys.modules[name])
        return

    class _After(importlib.abc.MetaPathFinder):
        def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
            if fullname != name:
                return None
            sys.meta_path.remove(self)  # one shot; the real finders answer from here on
            spec = importlib.util.find_spec(fullname)
            if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
                return spec
            run = spec.loader.exec_module

            def exec_module(module: ModuleType) -> None:
                run(module)
                fn(module)

            spec.loader.exec_module = exec_module  # type: ignore[method-assign]
            return spec

    sys.meta_path.insert(0, _After())

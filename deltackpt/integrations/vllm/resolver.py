"""A vLLM LoRA resolver over a deltackpt store: an OpenAI request's ``model`` names a saved
adapter version, and the server loads it from the store on first use.

    DELTACKPT_VLLM_LORA_STORE=s3://bucket/run VLLM_ALLOW_RUNTIME_LORA_UPDATING=1 \\
        vllm serve base-model --enable-lora
    curl .../v1/completions -d '{"model": "step-200", ...}'        # adapter "default"
    curl .../v1/completions -d '{"model": "policy@step-200", ...}'  # adapter "policy"

The plugin (``register``) registers :class:`StoreResolver` under the name ``deltackpt`` when
``DELTACKPT_VLLM_LORA_STORE`` is set. vLLM asks its resolvers about a ``model`` it does not
serve (with ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``), then loads the request the resolver returns
through the engine's ``add_lora``, where the plugin's worker loader reads the adapter from the
store (module ``lora``), and keeps the name. So a name must pin a version: ``latest`` is not
resolved (the server would keep serving the version it found first under that name).

The resolver answers None (vLLM's 404: "does not exist") for a name that is not a committed
snapshot holding that adapter and its LoRA config, after checking on the server, in a thread
(the event loop keeps serving). A version it resolved is leased (``lease_ttl``, 600 s, renewed
by each resolution; the newest 8 resolved), so the training run's retention keeps it while the
server may load it again after an eviction. Importing this module imports vLLM.
"""

from __future__ import annotations

import asyncio
from typing import Any

from vllm.lora.request import LoRARequest
from vllm.lora.resolver import LoRAResolver

from deltackpt.errors import DeltackptError
from deltackpt.integrations.vllm.lora import (
    AdapterLease,
    AdapterSource,
    check_lora_config,
    lease_holder,
)
from deltackpt.interop.peft import adapter_plan, check_adapter_name
from deltackpt.loading.lazy import open_snapshot
from deltackpt.store.leases import check_lease_ttl
from deltackpt.store.location import store_root
from deltackpt.store.snapshot import LATEST
from deltackpt.store.store import open_store

__all__ = ["RESOLVER", "StoreResolver", "parse_name"]

#: the name the resolver is registered under in vLLM's ``LoRAResolverRegistry``
RESOLVER = "deltackpt"


def parse_name(lora_name: str) -> tuple[str, str] | None:
    """``(adapter_name, snapshot)`` of a requested model name (``"step-200"`` is adapter
    ``default`` of snapshot ``step-200``; ``"policy@step-200"`` adapter ``policy``); None for a
    name that cannot be one (empty parts, ``latest``, a dotted adapter name)."""
    adapter, sep, snapshot = lora_name.rpartition("@")
    adapter = adapter if sep else "default"
    if not snapshot or snapshot == LATEST:
        return None
    try:
        check_adapter_name(adapter)
    except DeltackptError:
        return None
    return adapter, snapshot


class StoreResolver(LoRAResolver):
    """Resolve ``[adapter@]snapshot`` names to adapter versions of ``store`` (a directory or a
    URL the server and its workers open), the PEFT state dict under ``key``. ``lease_ttl``:
    how long a resolved version is leased against retention (None: no lease)."""

    def __init__(
        self,
        store: str,
        key: str | None = "model",
        storage_options: dict[str, Any] | None = None,
        lease_ttl: float | None = 600.0,
    ) -> None:
        if lease_ttl is not None:
            check_lease_ttl(lease_ttl, "StoreResolver")
        # a directory absolute: the workers may run elsewhere in the file system (their cwd)
        self.store = str(store_root(store))
        self.key, self.storage_options, self.lease_ttl = key, storage_options, lease_ttl
        self.held = AdapterLease(lease_holder("resolver", 0, id(self)), [])

    async def resolve_lora(self, base_model_name: str, lora_name: str) -> LoRARequest | None:
        return await asyncio.to_thread(self.find, lora_name)

    def find(self, lora_name: str) -> LoRARequest | None:
        """The request for ``lora_name``, or None when the store has no such version."""
        parsed = parse_name(lora_name)
        if parsed is None:
            return None
        adapter, snapshot = parsed
        try:
            st = open_store(self.store, create=False, storage_options=self.storage_options)
            with open_snapshot(st, snapshot) as snap:
                _, _, cfg, _ = adapter_plan(snap, self.key, adapter, None, "LoRA resolver")
                check_lora_config(cfg, "LoRA resolver")
        except (DeltackptError, KeyError, ValueError):
            return None  # not a committed snapshot with this adapter and its config
        if self.lease_ttl is not None:  # kept from retention while the server may reload it
            self.held.hold(st, snapshot, float(self.lease_ttl), "LoRA resolver")
        src = AdapterSource(self.store, snapshot, adapter, self.key)
        # the server replaces the id with its own counter's; the path names the version
        return LoRARequest(lora_name=lora_name, lora_int_id=src.default_id, lora_path=src.path)

"""LoRA adapters from the store into vLLM: versioned, checked, staged on every worker before a
request can name them, with no adapter directory.

A LoRA run saves its PEFT model's state dict with the LoRA config in the snapshot's metadata
(``deltackpt.save({"model": peft_model.state_dict()}, store, "step-100", metadata={"peft_config":
peft_config_dict(lora_config)})``). :func:`add_lora` then makes every worker of an engine started
with ``enable_lora=True`` and the deltackpt worker extension read that snapshot's adapter from the
store (each tensor checked against its checksum) and build vLLM's adapter from it in memory; it
returns the ``LoRARequest`` that names that version:

    req = add_lora(llm, "ckpts", "step-100")           # every worker holds it, or none does
    llm.generate(prompts, params, lora_request=req)

- **A version per request.** The request's path is ``deltackpt-lora:{...}`` (:class:`AdapterSource`:
  store, snapshot, adapter, key), never "the latest": requests that name step-100 keep step-100
  while step-200 is added beside it, and an adapter vLLM evicted from its cache and loads again
  (``max_cpu_loras``) is read again from that snapshot, not from whatever a directory holds now.
- **All workers or none.** A worker that cannot build the adapter (damaged chunk, a rank above
  ``max_lora_rank``, modules the model lacks) answers with its error; the others then drop it and
  :func:`add_lora` raises :class:`~deltackpt.sync.errors.AdapterStageError`. The adapters added
  before stay as they were, so the requests that name them run unchanged.
- **One id, one version.** ``lora_int_id`` (default: derived from the path) is refused when it
  already names another version on a worker (vLLM would serve the cached one for it).

The worker side is vLLM's own ``_load_adapter`` with the tensors in memory instead of read from
``adapter_model.safetensors``: the same checks (``validate_legal``, unexpected modules, the
manager's ``_validate_*``) and ``LoRAModel.from_lora_tensors``. Importing this module never
imports vLLM.
"""

from __future__ import annotations

import json
import math
import os
import re
import socket
import time
import uuid
import warnings
import weakref
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from deltackpt.errors import DeltackptError, InvalidArgumentError, LeaseWarning
from deltackpt.format.hashing import digest, tensor_digest
from deltackpt.interop.peft import adapter_plan, adapter_tensors, check_adapter_name
from deltackpt.loading.lazy import open_snapshot
from deltackpt.store.leases import MAX_SNAPSHOTS, check_lease_ttl, drop_lease, write_lease
from deltackpt.store.location import store_root
from deltackpt.store.snapshot import LATEST
from deltackpt.store.store import Store, open_store
from deltackpt.sync.errors import AdapterStageError

__all__ = ["SCHEME", "AdapterSource", "add_lora", "remove_lora"]

#: the prefix of a ``LoRARequest.lora_path`` that names an adapter in a deltackpt store
SCHEME = "deltackpt-lora:"

# the lowest default lora_int_id: above the small ids vLLM's server counts out (1, 2, ...)
_ID_BASE = 1 << 30


@dataclass(frozen=True)
class AdapterSource:
    """One adapter version: adapter ``adapter_name`` of the PEFT state dict under ``key`` of
    committed snapshot ``snapshot`` of ``store`` (a directory or a URL the workers can open)."""

    store: str
    snapshot: str
    adapter_name: str = "default"
    key: str | None = "model"

    @property
    def path(self) -> str:
        """What ``LoRARequest.lora_path`` holds for this version."""
        return SCHEME + json.dumps(asdict(self), sort_keys=True, separators=(",", ":"))

    @property
    def default_id(self) -> int:
        """A ``lora_int_id`` derived from :attr:`path` (the same in every process)."""
        return _ID_BASE + int(digest(self.path.encode())[:8], 16) % _ID_BASE

    @classmethod
    def parse(cls, path: str) -> AdapterSource | None:
        """The source a ``lora_path`` names; None when it is not a deltackpt one."""
        if not isinstance(path, str) or not path.startswith(SCHEME):
            return None
        try:
            doc = json.loads(path[len(SCHEME) :])
            src = cls(**doc)
        except (ValueError, TypeError) as e:
            raise InvalidArgumentError(
                f"lora_path={path!r} is not a deltackpt adapter path ({e}); make it with "
                "deltackpt.integrations.vllm.lora.AdapterSource(...).path or add_lora"
            ) from None
        if not all(isinstance(v, str) for v in (src.store, src.snapshot, src.adapter_name)) or (
            src.key is not None and not isinstance(src.key, str)
        ):
            raise InvalidArgumentError(
                f"lora_path={path!r}: store, snapshot and adapter_name must be strings, key a "
                "string or null"
            )
        return src


def check_lora_config(cfg: dict[str, Any], where: str) -> None:
    """Refuse a LoRA config (read from a snapshot's metadata: untrusted) that vLLM's
    ``PEFTHelper`` cannot take, naming the field, before anything is read or built for it."""
    problems = []
    r = cfg.get("r")
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        problems.append(f"r={r!r} (expected an int >= 1)")
    alpha = cfg.get("lora_alpha")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
        problems.append(f"lora_alpha={alpha!r} (expected a finite number)")
    tm = cfg.get("target_modules")
    if not (
        (isinstance(tm, str) and tm)
        or (isinstance(tm, list) and tm and all(isinstance(m, str) and m for m in tm))
    ):
        problems.append(f"target_modules={tm!r:.80} (expected a name or a list of names)")
    if cfg.get("peft_type", "LORA") != "LORA":
        problems.append(f"peft_type={cfg.get('peft_type')!r:.40} (expected 'LORA')")
    if problems:
        raise InvalidArgumentError(
            f"{where}: its LoRA config is not one vLLM can load: {'; '.join(problems)}. Save the "
            "snapshot with the LoraConfig the adapter was trained with "
            "(metadata={'peft_config': peft_config_dict(lora_config)})"
        )


def _answers(out: Any) -> list[dict[str, Any]]:
    return list(out) if isinstance(out, (list, tuple)) else [out]


def add_lora(
    llm: Any,
    store: str | os.PathLike[str] | Store,
    snapshot: str = LATEST,
    *,
    adapter_name: str = "default",
    key: str | None = "model",
    lora_name: str | None = None,
    lora_int_id: int | None = None,
    storage_options: dict[str, Any] | None = None,
    lease_ttl: float | None = 600.0,
) -> Any:
    """Stage adapter ``adapter_name`` of ``snapshot`` (default: the newest committed one, taken
    once: the request names that version) on every worker of ``llm`` (an ``LLM`` started with
    ``enable_lora=True`` and ``worker_extension_cls=EXTENSION``) and return the
    ``vllm.lora.request.LoRARequest`` that names it (``lora_name``: default
    ``"<adapter_name>@<snapshot>"``; ``lora_int_id``: default :attr:`AdapterSource.default_id`).

    ``lease_ttl``: this process keeps a lease (``deltackpt.store.leases``) on the versions it
    added to ``llm`` and did not :func:`remove_lora`, renewed by each call, so retention
    (``Checkpointer(keep_last=)``, ``gc``) keeps them while requests may name them: vLLM reads
    an evicted adapter again from its snapshot. None: no lease.

    The snapshot is checked here first (it exists, it holds the adapter and its LoRA config),
    so a bad argument never reaches the engine. Raises
    :class:`~deltackpt.sync.errors.AdapterStageError` when a worker could not build it (each
    worker's error in the message); then no worker holds it."""
    if isinstance(store, Store):  # e.g. a Checkpointer's: the workers open its root
        if storage_options is None:
            storage_options = getattr(store.storage, "storage_options", None) or None
        store = str(store.root)
    if not isinstance(store, (str, os.PathLike)) or not str(store):
        raise InvalidArgumentError(
            f"store={store!r} is invalid: expected the store's directory or URL (a string the "
            "workers open themselves) or a deltackpt Store"
        )
    check_adapter_name(adapter_name)
    if lora_int_id is not None and (
        isinstance(lora_int_id, bool) or not isinstance(lora_int_id, int) or lora_int_id < 1
    ):
        raise InvalidArgumentError(
            f"lora_int_id={lora_int_id!r} is invalid: expected an int >= 1 (vLLM's adapter id)"
        )
    if lora_name is not None and (not isinstance(lora_name, str) or not lora_name):
        raise InvalidArgumentError(f"lora_name={lora_name!r} is invalid: expected a string")
    check_lease_ttl(lease_ttl, "add_lora")
    # a directory absolute: the workers may run elsewhere in the file system (their cwd)
    url = str(store_root(store))
    st = open_store(url, create=False, storage_options=storage_options)
    with open_snapshot(st, snapshot) as snap:
        _, _, cfg, _ = adapter_plan(snap, key, adapter_name, None, "add_lora")
        check_lora_config(cfg, f"add_lora of snapshot {snap.name!r}")
        src = AdapterSource(url, snap.name, adapter_name, key)
    rid = src.default_id if lora_int_id is None else lora_int_id
    name = lora_name or f"{adapter_name}@{src.snapshot}"
    # this call's mark: a failure undoes only what this call added, never a worker's adapter
    # that was there before (an add of a version a worker already held)
    token = uuid.uuid4().hex
    kwargs = {"path": src.path, "lora_int_id": rid, "lora_name": name, "token": token}
    if storage_options:
        kwargs["storage_options"] = storage_options
    try:
        answers = _answers(llm.collective_rpc("deltackpt_lora_add", kwargs=kwargs))
    except Exception as e:  # the engine could not run the method at all
        raise AdapterStageError(
            f"add_lora: the engine did not run deltackpt_lora_add ({type(e).__name__}: {e}). "
            "Start it with enable_lora=True and worker_extension_cls=EXTENSION "
            "(deltackpt.integrations.vllm.extension)"
        ) from e
    failed = [
        (i, a.get("error", a) if isinstance(a, dict) else f"unexpected answer {a!r:.80}")
        for i, a in enumerate(answers)
        if not isinstance(a, dict) or "error" in a
    ]
    if failed:
        undone = [isinstance(a, dict) and a.get("added", False) for a in answers]
        if any(undone):
            llm.collective_rpc(
                "deltackpt_lora_remove", kwargs={"lora_int_id": rid, "only_if_token": token}
            )
        lines = "; ".join(f"worker {i}: {e}" for i, e in failed)
        raise AdapterStageError(
            f"add_lora of {src.adapter_name!r} from snapshot {src.snapshot!r} of {url!r} as "
            f"lora_int_id={rid}: {len(failed)} of {len(answers)} worker(s) could not build "
            f"it ({lines}). No worker holds it; the adapters added before are unchanged"
        )
    if lease_ttl is not None:
        held = _held(llm, st.root)
        held.options = storage_options
        held.hold(st, src.snapshot, float(lease_ttl))
    from vllm.lora.request import LoRARequest

    return LoRARequest(lora_name=name, lora_int_id=rid, lora_path=src.path)


def remove_lora(llm: Any, request: Any) -> bool:
    """Drop the adapter ``request`` names from every worker (requests that still name it load
    it again from the store); True when a worker held it."""
    answers = _answers(
        llm.collective_rpc("deltackpt_lora_remove", kwargs={"lora_int_id": request.lora_int_id})
    )
    src = AdapterSource.parse(getattr(request, "lora_path", ""))
    held = None if src is None else _LEASES.get(llm, {}).get(str(store_root(src.store)))
    if held is not None and src is not None and src.snapshot in held.versions:
        held.versions.remove(src.snapshot)
        held.renew(open_store(src.store, create=False, storage_options=held.options), held.ttl)
    return any(a.get("removed", False) for a in answers)


@dataclass
class AdapterLease:
    """The adapter versions one process added to one engine from one store, under one lease."""

    holder: str
    versions: list[str]
    ttl: float = 600.0
    options: dict[str, Any] | None = None

    def renew(self, st: Any, ttl: float, what: str = "add_lora") -> None:
        """Lease the newest :data:`MAX_SNAPSHOTS` versions for ``ttl`` seconds (none left: drop
        the lease). A failure warns (``what``: who asked); retention may then delete a version
        (a request naming it after vLLM evicted it fails, naming the snapshot)."""
        self.ttl = ttl
        try:
            with st.lock(exclusive=False, timeout=1.0, what="writing a LoRA lease"):
                if self.versions:
                    write_lease(st.storage, self.holder, self.versions[-MAX_SNAPSHOTS:], ttl)
                else:
                    drop_lease(st.storage, self.holder)
        except (OSError, DeltackptError) as e:
            warnings.warn(
                f"{what}: could not write lease {self.holder!r} on {self.versions} ({e}); "
                "retention may delete a served version. On a store this process cannot write, "
                "pass lease_ttl=None",
                LeaseWarning,
                stacklevel=3,
            )

    def hold(self, st: Any, version: str, ttl: float, what: str = "add_lora") -> None:
        """``version`` served (again): it becomes the newest held, and the lease is renewed."""
        self.versions = [v for v in self.versions if v != version] + [version]
        self.renew(st, ttl, what)


# engine -> store root -> what this process added there (weak: a dropped engine drops it)
_LEASES: weakref.WeakKeyDictionary[Any, dict[str, AdapterLease]] = weakref.WeakKeyDictionary()


def lease_holder(kind: str, n: int, tag: int) -> str:
    """A lease holder name unique to this host, process and ``kind`` (``lora``, ``resolver``)."""
    host = re.sub(r"[^A-Za-z0-9._-]", "-", socket.gethostname())[:40] or "host"
    return f"vllm-{kind}-{host}-{os.getpid()}-{n}-{tag & 0xFFFFFF:x}"


def _held(llm: Any, root: Any) -> AdapterLease:
    per = _LEASES.setdefault(llm, {})
    key = str(root)
    if key not in per:
        per[key] = AdapterLease(lease_holder("lora", len(per), id(llm)), [])
    return per[key]


# ---- worker side (runs in vLLM's worker processes) ------------------------------------------


@dataclass
class Registry:
    """What the deltackpt hook on one worker's LoRA manager knows: the version each id names
    and the storage options to read it again with."""

    paths: dict[int, str]
    options: dict[str, dict[str, Any]]
    added_by: dict[int, str] = field(default_factory=dict)  # id -> the add_lora call's token


def registry(manager: Any) -> Registry:
    """The deltackpt record kept on one ``WorkerLoRAManager`` (made on first use)."""
    reg = getattr(manager, "_deltackpt_lora", None)
    if reg is None:
        reg = manager._deltackpt_lora = Registry({}, {})
    return reg  # type: ignore[no-any-return]


def patch_loader(module: Any) -> None:
    """Teach ``module.WorkerLoRAManager`` (``vllm.lora.worker_manager``) deltackpt paths: its
    ``_load_adapter`` builds a ``deltackpt-lora:`` path's adapter with :func:`load_adapter` and
    hands every other path to vLLM's loader unchanged. Idempotent. The plugin (``register``)
    applies it in every vLLM process when vLLM imports that module, so the engine's
    ``add_lora`` (which ``/v1/load_lora_adapter`` and LoRA resolvers call) takes these paths
    too."""
    cls = module.WorkerLoRAManager
    if getattr(cls, "_deltackpt_patched", False):
        return
    vllm_load = cls._load_adapter

    def _load_adapter(self: Any, request: Any) -> Any:
        reg = registry(self)
        src = AdapterSource.parse(request.lora_path)
        if src is None:
            # a directory: vLLM's own; recorded (a deltackpt version may not take its id),
            # never refused (vLLM's rules for ids stay as they are)
            lora = vllm_load(self, request)
            reg.paths[request.lora_int_id] = request.lora_path
            return lora
        before = reg.paths.get(request.lora_int_id)
        claim(reg, request.lora_int_id, request.lora_path, replace=request.load_inplace)
        try:
            return load_adapter(self, request, src, reg.options.get(request.lora_path))
        except BaseException:
            if before is None:  # a failed load claims nothing
                reg.paths.pop(request.lora_int_id, None)
            else:
                reg.paths[request.lora_int_id] = before
            raise

    cls._load_adapter = _load_adapter
    cls._deltackpt_patched = True


def claim(reg: Registry, lora_int_id: int, path: str, replace: bool = False) -> None:
    """Refuse ``lora_int_id`` for ``path`` when it already names another version here (unless
    ``replace``: vLLM's ``load_inplace``)."""
    held = reg.paths.get(lora_int_id)
    if held is not None and held != path and not replace:
        raise InvalidArgumentError(
            f"lora_int_id={lora_int_id} already names {held} on this worker, not {path}: vLLM "
            "would serve the adapter it holds under that id. Pass another lora_int_id (or "
            "remove_lora the old one first)"
        )
    reg.paths[lora_int_id] = path


def _expected_modules(manager: Any) -> set[str]:
    am = manager._adapter_manager
    out: list[str] = []
    for module in am.supported_lora_modules:
        out.extend(am.packed_modules_mapping.get(module, [module]))
        if module == "experts":
            out.append(module)
    return set(out)


def _check_modules(
    tensors: Mapping[str, torch.Tensor],
    expected: set[str],
    helper: Any,
    mapper: Any,
    skip: list[str] | None,
    cls: Any,
    where: str,
) -> None:
    """vLLM's ``check_unexpected_modules`` (``LoRAModel.from_local_checkpoint``)."""
    from vllm.lora.utils import is_base_embedding_weights, parse_fine_tuned_lora_name

    bad = []
    for name in tensors:
        if is_base_embedding_weights(name) or "base_layer" in name:
            continue
        if skip and cls._should_skip_module(name, skip):
            continue
        module, _ = parse_fine_tuned_lora_name(name, mapper)
        if ".experts" in module:
            if module[module.find(".experts") + 1 :] not in expected:
                bad.append(module)
        elif module.rsplit(".", 1)[-1] not in expected | set(helper.modules_to_save or ()):
            bad.append(module)
    if bad:
        raise InvalidArgumentError(
            f"{where}: the adapter targets modules this model has no LoRA layer for: {bad} "
            f"(expected modules named {sorted(expected)}). Check the LoRA config's "
            "target_modules against the served model"
        )


def load_adapter(
    manager: Any, request: Any, src: AdapterSource, storage_options: dict[str, Any] | None
) -> Any:
    """vLLM's ``WorkerLoRAManager._load_adapter`` for a deltackpt path: the adapter's tensors
    read from the store (checked against their checksums) instead of a directory."""
    from vllm.lora.peft_helper import PEFTHelper

    where = f"adapter {src.adapter_name!r} of snapshot {src.snapshot!r} of {src.store!r}"
    if manager._adapter_manager.moe_ep_load_spec is not None:
        raise InvalidArgumentError(
            f"{where}: expert-parallel MoE adapters are not read from a store; export it with "
            "deltackpt.export_peft and load the directory"
        )
    st = open_store(src.store, create=False, storage_options=storage_options)
    with open_snapshot(st, src.snapshot) as snap:
        tensors, cfg = adapter_tensors(
            snap, src.key, src.adapter_name, check=lambda c: check_lora_config(c, where)
        )
    cfg = dict(cfg, vllm_max_position_embeddings=manager.max_position_embeddings)
    helper = PEFTHelper.from_dict(cfg)
    helper.validate_legal(manager.lora_config)
    model = manager._adapter_manager.model
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    mapper = None if mapper is None else mapper.get_rename_mapper()
    skip = getattr(model, "lora_skip_prefixes", None)
    cls = manager._lora_model_cls
    _check_modules(tensors, _expected_modules(manager), helper, mapper, skip, cls, where)
    lora = cls.from_lora_tensors(
        lora_model_id=request.lora_int_id,
        tensors=tensors,
        peft_helper=helper,
        device="cpu",
        dtype=manager.lora_config.lora_dtype,
        model_vocab_size=manager.vocab_size,
        weights_mapper=mapper,
        skip_prefixes=skip,
    )
    lora.is_3d_lora_weight = request.is_3d_lora_weight
    am = manager._adapter_manager
    am._validate_moe_lora_format(lora)
    am._validate_modules_to_save(lora)
    am._validate_token_classification_lora(lora)
    return lora


def lora_manager(worker: Any) -> Any:
    """The worker's ``WorkerLoRAManager`` with the deltackpt hook installed."""
    manager = getattr(getattr(worker, "model_runner", None), "lora_manager", None)
    if manager is None:
        raise InvalidArgumentError(
            "this vLLM engine serves no LoRA adapters: start it with enable_lora=True "
            "(--enable-lora) and max_lora_rank at least the adapter's rank"
        )
    import vllm.lora.worker_manager as wm

    patch_loader(wm)  # the plugin did already, where vLLM loaded it
    return manager


def stage(
    worker: Any,
    path: str,
    lora_int_id: int,
    lora_name: str,
    storage_options: dict[str, Any] | None = None,
    token: str | None = None,
) -> dict[str, Any]:
    """Build and cache the adapter ``path`` names on this worker under ``lora_int_id``:
    ``{"added": bool, "seconds": float}`` (``added`` False: it was held already)."""
    from vllm.lora.request import LoRARequest

    manager = lora_manager(worker)
    if AdapterSource.parse(path) is None:
        raise InvalidArgumentError(f"path={path!r} is not a deltackpt adapter path")
    reg = registry(manager)
    held = lora_int_id in manager.list_adapters()
    if held and reg.paths.get(lora_int_id) == path:
        return {"added": False, "seconds": 0.0}
    if held:
        other = reg.paths.get(lora_int_id) or "an adapter loaded from a directory"
        raise InvalidArgumentError(
            f"lora_int_id={lora_int_id} already names {other} on this worker, not {path}: vLLM "
            "would serve the adapter it holds under that id. Pass another lora_int_id (or "
            "remove_lora the old one first)"
        )
    if storage_options:
        reg.options[path] = dict(storage_options)
    t0 = time.perf_counter()
    manager.add_adapter(LoRARequest(lora_name, lora_int_id, path))  # through the hook
    if token is not None:
        reg.added_by[lora_int_id] = token
    return {"added": True, "seconds": time.perf_counter() - t0}


def unstage(
    worker: Any,
    lora_int_id: int,
    only_if_path: str | None = None,
    only_if_token: str | None = None,
) -> dict[str, bool]:
    """Drop ``lora_int_id`` from this worker's adapters (when ``only_if_path`` is given: only
    if it names that version; ``only_if_token``: only if that ``add_lora`` call added it);
    ``{"removed": bool}``."""
    manager = lora_manager(worker)
    reg = registry(manager)
    if only_if_path is not None and reg.paths.get(lora_int_id) != only_if_path:
        return {"removed": False}
    if only_if_token is not None and reg.added_by.get(lora_int_id) != only_if_token:
        return {"removed": False}
    reg.added_by.pop(lora_int_id, None)
    removed = bool(manager.remove_adapter(lora_int_id))
    reg.paths.pop(lora_int_id, None)
    return {"removed": removed}


def adapter_digests(worker: Any, lora_int_id: int) -> dict[str, Any]:
    """xxh3-128 digests of the adapter vLLM holds under ``lora_int_id`` on this worker, per
    module (``lora_a``, ``lora_b`` as vLLM keeps them): ``{"digests": {...}}``, empty when the
    id is not held."""
    manager = lora_manager(worker)
    lora = manager._adapter_manager.get_adapter(lora_int_id)
    if lora is None:
        return {"digests": {}}
    out: dict[str, str] = {}
    for module, w in sorted(lora.loras.items()):
        for part in ("lora_a", "lora_b"):
            t = getattr(w, part, None)
            # a packed module (qkv_proj) holds one tensor per packed projection, None for one
            # the adapter does not target
            for i, x in enumerate(t) if isinstance(t, (list, tuple)) else [(None, t)]:
                name = f"{module}.{part}" + ("" if i is None else f".{i}")
                out[name] = tensor_digest(x) if isinstance(x, torch.Tensor) else "none"
    return {"digests": out}

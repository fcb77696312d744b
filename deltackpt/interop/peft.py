"""``deltackpt.export_peft``: the LoRA adapter of a snapshot as peft writes it, or merged in.

A LoRA run saves the whole PEFT model's state dict (``{"model": peft_model.state_dict(), ...}``):
frozen base weights under ``...q_proj.base_layer.weight``, adapters under
``...q_proj.lora_A.<adapter>.weight``. :func:`export_peft` writes what
``PeftModel.save_pretrained`` writes, so ``PeftModel.from_pretrained(base, out_dir)`` loads it:

* ``adapter_model.safetensors``: the adapter's tensors only, keyed as
  ``peft.get_peft_model_state_dict`` keys them (adapter name removed: ``...q_proj.lora_A.weight``;
  a DoRA magnitude as ``...lora_magnitude_vector``; a ``modules_to_save`` copy under the wrapped
  module's name), read from the store one tensor at a time (the frozen base is not read);
* ``adapter_config.json``: ``config`` (a ``LoraConfig``: written by its own ``save_pretrained``
  with ``inference_mode=True``, as peft does; or a dict), or, without one, the dict the snapshot
  holds under ``metadata["peft_config"]``.

``merged=True`` writes a plain Hugging Face model directory instead (``model.safetensors`` +
``config.json`` from ``base_model``): every LoRA layer's ``base_layer.weight`` becomes
``weight + (B @ A) * scaling`` (``lora_alpha / r``, or ``/ sqrt(r)`` with ``use_rslora``;
``alpha_pattern`` honoured; ``fan_in_fan_out`` transposed), computed as peft's ``merge`` does (in
float32 for half-precision weights on CPU), so ``AutoModelForCausalLM.from_pretrained`` gives the
logits of ``merge_and_unload()``. The merged state is built in memory (the model must fit).
Supported: LoRA (``bias="none"``), its ``modules_to_save``; not DoRA merges or other methods.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import json
import math
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from deltackpt.errors import InvalidArgumentError, OutputExistsError, StateKeyError
from deltackpt.interop.safetensors_io import StreamWriter, st_dtype
from deltackpt.loading.lazy import open_snapshot
from deltackpt.store.store import LATEST, Store

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
MERGED_WEIGHTS = "model.safetensors"
MERGED_CONFIG = "config.json"
PEFT_PREFIX = "base_model.model."
METADATA_KEY = "peft_config"  # where a snapshot may hold its LoRA config (a dict)


def export_peft(
    store: str | os.PathLike[str] | Store,
    name: str = LATEST,
    out_dir: str | os.PathLike[str] = "",
    *,
    key: str | None = "model",
    adapter_name: str = "default",
    config: Any = None,
    merged: bool = False,
    base_model: Any = None,
    overwrite: bool = False,
) -> list[Path]:
    """Write the adapter ``adapter_name`` of snapshot ``name`` to ``out_dir`` as peft's
    ``save_pretrained`` does (or, with ``merged=True``, the base model with the adapter merged
    in); return the files written.

    ``key`` is the key path of the PEFT model's state dict in the saved state (None: the state
    is the state dict). ``config`` is the ``LoraConfig`` (or its dict); ``base_model`` (merged
    export) is the base model, its config, a config dict or a ``config.json`` path, for the
    ``config.json`` of the merged directory.

    >>> deltackpt.save({"model": peft_model.state_dict()}, "ckpts", "step-100")  # doctest: +SKIP
    >>> deltackpt.export_peft("ckpts", "step-100", "adapter", config=lora_config)  # doctest: +SKIP
    >>> PeftModel.from_pretrained(base, "adapter")                               # doctest: +SKIP
    """
    if not isinstance(out_dir, (str, os.PathLike)) or not str(out_dir):
        raise InvalidArgumentError(f"out_dir={out_dir!r} is invalid: expected a directory path")
    check_adapter_name(adapter_name)
    out = Path(out_dir)
    with open_snapshot(store, name) as snap:
        names, cfg, cfg_doc, adapter = adapter_plan(snap, key, adapter_name, config, "export_peft")
        out.mkdir(parents=True, exist_ok=True)
        if not merged:
            files = [ADAPTER_WEIGHTS, ADAPTER_CONFIG]
            _refuse_existing(out, files, overwrite)
            # the adapter's tensors in one read (small ones share chunks: read once each)
            got = snap.get_tensors([names[old] for old, _ in adapter])
            items: list[Item] = []
            for old, new in adapter:
                t = got[names[old]]
                items.append((new, t.dtype, tuple(t.shape), functools.partial(_same, t)))
            _write_safetensors(out / ADAPTER_WEIGHTS, items)
            _write_adapter_config(out, cfg)
            return [out / f for f in files]
        if base_model is None:
            raise InvalidArgumentError(
                "export_peft(merged=True) needs base_model= (the base model, its config, a "
                "config dict or a config.json path) for the merged directory's config.json"
            )
        base_doc = _base_config(base_model)
        files = [MERGED_WEIGHTS, MERGED_CONFIG]
        _refuse_existing(out, files, overwrite)
        got = snap.get_tensors(names.values())
        state = merged_state({n: got[k] for n, k in names.items()}, cfg_doc, adapter_name)
        items = [
            (n, t.dtype, tuple(t.shape), functools.partial(_same, t)) for n, t in state.items()
        ]
        _write_safetensors(out / MERGED_WEIGHTS, items)
        _write_text(out / MERGED_CONFIG, json.dumps(base_doc, indent=2, sort_keys=True) + "\n")
        return [out / f for f in files]


def check_adapter_name(adapter_name: Any) -> None:
    """Refuse an adapter name peft's key layout cannot hold (empty, not a string, dotted)."""
    if not isinstance(adapter_name, str) or not adapter_name or "." in adapter_name:
        raise InvalidArgumentError(
            f"adapter_name={adapter_name!r} is invalid: expected the name the adapter has in the "
            "PEFT model (peft's default is 'default'), without dots"
        )


def adapter_plan(
    snap: Any, key: str | None, adapter_name: str, config: Any, what: str
) -> tuple[dict[str, str], Any, dict[str, Any], list[tuple[str, str]]]:
    """What an adapter read of open snapshot ``snap`` needs: state dict name -> snapshot key
    (``_state_names``), the LoRA config (``config``, else the snapshot's
    ``metadata["peft_config"]``) and its dict, and ``adapter_keys`` (state dict name, name in
    the adapter file). Refuses, naming the fix, a missing config, a bias the format cannot
    hold and an adapter with no tensors. ``what`` names the caller in the messages."""
    names = _state_names(snap.keys(), key, snap.name)
    cfg = config if config is not None else snap.metadata.get(METADATA_KEY)
    if cfg is None:
        raise InvalidArgumentError(
            f"{what} of snapshot {snap.name!r}: no LoRA config. Pass config= (the "
            "LoraConfig the model was built with, or its to_dict()), or save it with the "
            f"snapshot: deltackpt.save(..., metadata={{{METADATA_KEY!r}: "
            "deltackpt.interop.peft.peft_config_dict(cfg)})"
        )
    cfg_doc = peft_config_dict(cfg)
    if cfg_doc.get("bias", "none") != "none":
        raise InvalidArgumentError(
            f"{what}: LoRA config bias={cfg_doc.get('bias')!r} is not supported (only "
            "'none'); export the model with export_hf and the bias terms with it"
        )
    adapter = adapter_keys(list(names), adapter_name)
    if not adapter:
        raise StateKeyError(
            f"snapshot {snap.name!r} holds no tensors of adapter {adapter_name!r} under "
            f"key={key!r} (no '...lora_*.{adapter_name}...' or 'modules_to_save."
            f"{adapter_name}' keys). Check adapter_name= and key="
        )
    return names, cfg, cfg_doc, adapter


def adapter_tensors(
    snap: Any,
    key: str | None = "model",
    adapter_name: str = "default",
    config: Any = None,
    check: Callable[[dict[str, Any]], None] | None = None,
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The tensors of adapter ``adapter_name`` in open snapshot ``snap`` by the names peft's
    ``adapter_model.safetensors`` gives them (each read and checked against its checksum),
    and the LoRA config as a dict: what ``export_peft`` writes, in memory. ``check`` sees the
    config before any tensor is read (and may refuse it)."""
    names, _, cfg_doc, adapter = adapter_plan(snap, key, adapter_name, config, "adapter read")
    if check is not None:
        check(cfg_doc)
    got = snap.get_tensors([names[old] for old, _ in adapter])  # shared chunks read once
    return {new: got[names[old]] for old, new in adapter}, cfg_doc


def _state_names(keys: list[str], key: str | None, snap_name: str) -> dict[str, str]:
    """State dict name -> snapshot key path, for the tensors under ``key``. A DCP-written
    snapshot's keys are flat dotted fqns (``model.<name>``): matched too."""
    if key is None or key == "":
        return {k: k for k in keys}
    if not isinstance(key, str):
        raise InvalidArgumentError(f"key={key!r} is invalid: expected a key path or None")
    pre = key.strip("/") + "/"
    out = {k[len(pre) :]: k for k in keys if k.startswith(pre)}
    if not out:
        dotted = key.strip("/").replace("/", ".") + "."
        out = {k[len(dotted) :]: k for k in keys if k.startswith(dotted)}
    if not out:
        tops = sorted({k.split("/")[0] for k in keys})[:20]
        raise StateKeyError(
            f"key {key!r} names no tensors in snapshot {snap_name!r}; its top-level keys are "
            f"{tops}. Pass key= the path of the PEFT model's state dict, or None"
        )
    return out


def adapter_keys(names: list[str], adapter_name: str) -> list[tuple[str, str]]:
    """(state dict name, name in the adapter file) of adapter ``adapter_name``'s tensors, in
    state order: what ``peft.get_peft_model_state_dict`` returns for a LoRA model."""
    out = []
    mts = f".modules_to_save.{adapter_name}."
    for n in names:
        segs = n.split(".")
        if mts in f".{n}":
            module, _, rest = f".{n}".partition(mts)
            new = f"{module[1:]}.{rest}" if module else rest
        elif any(
            s.startswith("lora_") and i + 1 < len(segs) and segs[i + 1] == adapter_name
            for i, s in enumerate(segs)
        ):
            new = (
                n.removesuffix(".weight")
                if n.endswith(f"lora_magnitude_vector.{adapter_name}.weight")
                else n
            )
            new = _remove_adapter_name(new, adapter_name)
        else:
            continue
        if not new.startswith(PEFT_PREFIX):
            new = PEFT_PREFIX + new  # saved from the wrapped model: peft's keys start with it
        out.append((n, new))
    return out


def _remove_adapter_name(key: str, adapter_name: str) -> str:
    """peft's ``_remove_adapter_name_from_state_dict_key``."""
    if "." not in key:
        return key
    if key.endswith(f".{adapter_name}"):
        return key.removesuffix(f".{adapter_name}")
    stem, _, suffix = key.rpartition(".")
    stem = re.sub(re.escape(f".{adapter_name}") + r"$", "", stem)
    return f"{stem}.{suffix}"


def merged_state(
    state: dict[str, torch.Tensor], cfg: dict[str, Any], adapter_name: str
) -> dict[str, torch.Tensor]:
    """The base model's state dict with adapter ``adapter_name`` merged in, as
    ``merge_and_unload()`` leaves it: LoRA weights merged, ``base_layer`` unwrapped, trained
    ``modules_to_save`` copies in place of the originals, other adapters dropped."""
    if cfg.get("use_dora"):
        raise InvalidArgumentError(
            "export_peft(merged=True) does not merge DoRA adapters; export the adapter "
            "(merged=False) and merge with peft's merge_and_unload()"
        )
    a_sfx, b_sfx = f".lora_A.{adapter_name}.weight", f".lora_B.{adapter_name}.weight"
    mts = f".modules_to_save.{adapter_name}."
    out: dict[str, torch.Tensor] = {}
    for n, t in state.items():
        if ".lora_" in f".{n}" or ".original_module." in f".{n}":
            continue
        if ".modules_to_save." in f".{n}":
            if mts not in f".{n}":
                continue
            module, _, rest = f".{n}".partition(mts)
            n = f"{module[1:]}.{rest}" if module else rest
        elif n.endswith(".base_layer.weight"):
            module = n.removesuffix(".base_layer.weight")
            a, b = state.get(module + a_sfx), state.get(module + b_sfx)
            if a is not None and b is not None:
                t = _merge(
                    t, a, b, _scaling(module, a.shape[0], cfg), bool(cfg.get("fan_in_fan_out"))
                )
        n = n.replace(".base_layer.", ".")
        out[n.removeprefix(PEFT_PREFIX)] = t
    return out


def _scaling(module: str, r: int, cfg: dict[str, Any]) -> float:
    alpha = cfg.get("lora_alpha", 8)
    pattern = cfg.get("alpha_pattern") or {}
    name = module.removeprefix(PEFT_PREFIX)
    for p, a in pattern.items():  # peft's get_pattern_key
        if re.match(rf"(.*\.)?({p})$", name):
            alpha = a
            break
    return alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r


def _merge(
    w: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scaling: float, fan_in_fan_out: bool
) -> torch.Tensor:
    """``w + delta`` with peft's ``Linear.get_delta_weight`` arithmetic."""
    dtype = b.dtype
    if dtype in (torch.float16, torch.bfloat16):  # peft casts to float32 on CPU
        a, b = a.float(), b.float()
    delta = b @ a
    if fan_in_fan_out:
        delta = delta.T
    delta = (delta * scaling).to(dtype)
    return w + delta.to(w.dtype)


def peft_config_dict(cfg: Any) -> dict[str, Any]:
    """``cfg`` (a peft config or a dict) as a JSON-safe dict (sets as sorted lists), e.g. for
    ``deltackpt.save(..., metadata={"peft_config": peft_config_dict(lora_config)})``."""
    if isinstance(cfg, dict):
        doc = dict(cfg)
    elif callable(getattr(cfg, "to_dict", None)) and isinstance(cfg.to_dict(), dict):
        doc = cfg.to_dict()
    else:
        raise InvalidArgumentError(
            f"config={cfg!r} is invalid: expected a peft LoraConfig (or another PeftConfig) or "
            "a dict"
        )
    return {k: sorted(v) if isinstance(v, (set, frozenset)) else v for k, v in doc.items()}


def peft_metadata(state: Any) -> dict[str, Any]:
    """``{"peft_config": ...}`` for a live state (``{"model": peft_model, ...}``) holding one
    PEFT model with one adapter: what ``export_peft`` and vLLM's ``add_lora`` read, recorded by
    ``Checkpointer`` saves without being asked. ``{}`` when there is none, several, or a
    config that is not plain JSON (then pass ``config=`` to the readers)."""
    found = []
    for v in state.values() if isinstance(state, dict) else ():
        cfgs = getattr(v, "peft_config", None)
        if isinstance(cfgs, dict) and len(cfgs) == 1 and callable(getattr(v, "state_dict", None)):
            found.append(next(iter(cfgs.values())))
    if len(found) != 1:
        return {}
    try:
        doc = peft_config_dict(found[0])
        return {METADATA_KEY: json.loads(json.dumps(doc))}
    except (InvalidArgumentError, TypeError, ValueError):
        return {}


def _write_adapter_config(out: Path, cfg: Any) -> None:
    if callable(getattr(cfg, "save_pretrained", None)) and not isinstance(cfg, dict):
        cfg = copy.deepcopy(cfg)
        if hasattr(cfg, "inference_mode"):
            cfg.inference_mode = True  # what PeftModel.save_pretrained writes
        cfg.save_pretrained(str(out))
        return
    doc = peft_config_dict(cfg)
    doc.setdefault("inference_mode", True)
    _write_text(out / ADAPTER_CONFIG, json.dumps(doc, indent=2, sort_keys=True) + "\n")


def _base_config(base: Any) -> dict[str, Any]:
    if isinstance(base, (str, os.PathLike)):
        p = Path(base)
        p = p / MERGED_CONFIG if p.is_dir() else p
        try:
            doc = json.loads(p.read_text())
        except (OSError, ValueError) as e:
            raise InvalidArgumentError(
                f"base_model={str(base)!r}: cannot read a config.json: {e}"
            ) from e
        if isinstance(doc, dict):
            return doc
    base = getattr(base, "config", base)
    if isinstance(base, dict):
        return dict(base)
    to_dict = getattr(base, "to_dict", None)
    if callable(to_dict):
        return dict(to_dict())
    raise InvalidArgumentError(
        f"base_model={base!r} is invalid: expected a transformers model or config, a config "
        "dict, or a config.json path"
    )


def _refuse_existing(out: Path, files: list[str], overwrite: bool) -> None:
    there = [f for f in files if (out / f).exists()]
    if there and not overwrite:
        raise OutputExistsError(
            f"export_peft: {there} already exist in {str(out)!r}; pass overwrite=True to "
            "replace them, or choose another out_dir"
        )


Item = tuple[
    str, torch.dtype, tuple[int, ...], Callable[[], torch.Tensor]
]  # name, dtype, shape, read


def _write_safetensors(path: Path, items: list[Item]) -> None:
    """One safetensors file, its header from dtypes and shapes, then each tensor read as it is
    written (one at a time in memory); written to a temporary name, fsynced and renamed."""
    header = [(n, st_dtype(dt, n), shape) for n, dt, shape, _ in items]
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with open(tmp, "wb") as f:
            w = StreamWriter(f, header, {"format": "pt"})
            for n, _, _, read in items:
                w.write(n, read())
            w.finish()
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()


def _same(t: torch.Tensor) -> torch.Tensor:
    return t


def _write_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)

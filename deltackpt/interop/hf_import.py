"""``deltackpt.import_checkpoint``: a checkpoint in another format as a snapshot of a store.

Sources, told apart by what is on disk:

=====================================  ==================================================
``*.safetensors`` file                 validated header, tensors viewed through a memory map
directory with ``*.safetensors.index.json``  every shard its ``weight_map`` names (sharded HF)
directory with ``model.safetensors``   that file (an unsharded HF directory)
directory with ``.metadata``           a ``torch.distributed.checkpoint`` checkpoint
any other file                         ``torch.load(weights_only=True, mmap=True)``
=====================================  ==================================================

Everything read is untrusted: safetensors headers are checked before anything is allocated
(:mod:`deltackpt.interop.safetensors_io`), index file names must stay inside the directory, DCP
metadata is unpickled with an allowlist (:mod:`deltackpt.interop.dcp_source`) and ``torch.save``
files load with ``weights_only=True``.

The import is an ordinary :func:`deltackpt.save` of what was read, so it is deduplicated chunk
by chunk against everything the store holds: importing a base model a second time writes only a
manifest, and a fine-tune whose frozen tensors equal the base's writes only the changed bytes.
Memory-mapped sources are hashed straight from the page cache: no second copy of the model.
"""

from __future__ import annotations

import json
import os
import pickle
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from deltackpt.api import save
from deltackpt.errors import ImportFormatError, InvalidArgumentError
from deltackpt.interop.dcp_source import is_dcp_dir, load_dcp
from deltackpt.interop.keys import Rename, check_rename, renamed, select_object
from deltackpt.interop.safetensors_io import map_tensors
from deltackpt.store.store import SnapshotInfo, Store

_INDEX_SUFFIX = ".safetensors.index.json"


def read_source(src: str | os.PathLike[str]) -> tuple[Any, str, int]:
    """``(state, kind, bytes on disk)`` of the checkpoint at ``src``; ``kind`` is one of
    ``safetensors``, ``hf-sharded``, ``dcp``, ``torch``."""
    p = Path(src)
    if p.is_dir():
        indexes = sorted(p.glob("*" + _INDEX_SUFFIX))
        if len(indexes) == 1:
            return _read_index(indexes[0])
        if len(indexes) > 1:
            raise ImportFormatError(
                f"{p} holds several index files {[i.name for i in indexes]}; pass the one to "
                "import: its shards are read"
            )
        if is_dcp_dir(p):
            return load_dcp(p), "dcp", _dir_bytes(p)
        single = p / "model.safetensors"
        if single.is_file():
            return map_tensors(single), "safetensors", single.stat().st_size
        raise ImportFormatError(
            f"{p} is a directory without model.safetensors, a *{_INDEX_SUFFIX} or DCP .metadata "
            f"(it holds {sorted(c.name for c in p.iterdir())[:10]}); pass a file or a "
            "Hugging Face / DCP checkpoint directory"
        )
    if not p.is_file():
        raise InvalidArgumentError(
            f"src={str(src)!r} does not exist (expected a file or directory)"
        )
    if p.name.endswith(_INDEX_SUFFIX):
        return _read_index(p)
    if p.suffix == ".safetensors":
        return map_tensors(p), "safetensors", p.stat().st_size
    return _torch_load(p), "torch", p.stat().st_size


def _dir_bytes(p: Path) -> int:
    return sum(c.stat().st_size for c in p.iterdir() if c.is_file())


def _read_index(index: Path) -> tuple[dict[str, torch.Tensor], str, int]:
    """The tensors of a sharded Hugging Face checkpoint, shard by shard in file order."""
    try:
        doc = json.loads(index.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise ImportFormatError(f"{index} is not a readable JSON index: {e}") from e
    wm = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(wm, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in wm.items()
    ):
        raise ImportFormatError(f"{index} has no weight_map of tensor name -> file name")
    by_file: dict[str, set[str]] = {}
    for k, f in wm.items():
        by_file.setdefault(f, set()).add(k)
    out: dict[str, torch.Tensor] = {}
    size = 0
    for fname in sorted(by_file):
        path = index.parent / fname
        if "/" in fname or "\\" in fname or fname in ("", ".", "..") or not path.is_file():
            raise ImportFormatError(
                f"{index} maps tensors to {fname!r:.80}, which is not a file in {index.parent}; "
                "the checkpoint is incomplete (download every shard) or hostile"
            )
        tensors = map_tensors(path)
        missing = sorted(by_file[fname] - set(tensors))
        if missing:
            raise ImportFormatError(
                f"{index} says {fname} holds {missing[:5]}, which it does not; the shard is "
                "from another checkpoint or damaged"
            )
        out.update((k, t) for k, t in tensors.items() if k in by_file[fname])
        size += path.stat().st_size
    return out, "hf-sharded", size


def _torch_load(p: Path) -> Any:
    try:
        try:
            return torch.load(p, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as e:
            if "mmap" not in str(e):
                raise
            return torch.load(p, map_location="cpu", weights_only=True)  # legacy (non-zip) format
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError) as e:
        raise ImportFormatError(
            f"{p} could not be loaded with torch.load(weights_only=True): {str(e)[:300]}. "
            "deltackpt imports torch.save files of tensors, dicts, lists and plain values only "
            "(no pickled objects), safetensors files, and HF or DCP checkpoint directories"
        ) from e


def _nest(key: str | None, obj: Any) -> Any:
    for seg in reversed([s for s in (key or "").split("/") if s]):
        obj = {seg: obj}
    return obj


def import_checkpoint(
    src: str | os.PathLike[str],
    store: str | os.PathLike[str] | Store,
    name: str,
    *,
    key: str | None = "model",
    src_key: str | None = None,
    rename: Rename = None,
    metadata: dict[str, Any] | None = None,
    progress: Callable[[int], None] | None = None,
    **save_options: Any,
) -> SnapshotInfo:
    """Import the checkpoint at ``src`` (a safetensors file, a Hugging Face directory, a
    ``torch.save`` file or a DCP directory) as snapshot ``name`` of ``store``.

    The state saved is ``{key: state}`` (``key=None``: the state itself), so
    ``deltackpt.load(store, name)["model"]`` is the imported state dict and
    ``export_hf(store, name, out, key="model")`` writes it back. ``src_key`` selects a sub-tree
    of the source (e.g. ``"model"`` of a ``torch.save({"model": ..., "optim": ...})`` file or a
    DCP training checkpoint); ``rename`` maps the keys of the imported dict. Other keyword
    arguments are :func:`deltackpt.save` options (``overwrite``, ``threads``...). Returns the
    save's :class:`~deltackpt.SnapshotInfo`: ``bytes_written`` is what was new to the store.
    ``progress(n)`` is called with the bytes imported once the snapshot is committed.

    >>> deltackpt.import_checkpoint("Qwen2-0.5B/", "ckpts", "base")     # doctest: +SKIP
    >>> state = deltackpt.load("ckpts", "base")                         # doctest: +SKIP
    """
    check_rename(rename)
    if not isinstance(src, (str, os.PathLike)):
        raise InvalidArgumentError(f"src={src!r} is invalid: expected a file or directory path")
    state, kind, _size = read_source(src)
    obj = select_object(state, src_key, f"the checkpoint at {str(src)!r}")
    if rename is not None:
        if not isinstance(obj, Mapping) or not all(isinstance(k, str) for k in obj):
            raise InvalidArgumentError(
                f"rename= needs a dict with string keys to rename; the imported state is a "
                f"{type(obj).__name__}. Select one with src_key="
            )
        names = renamed(list(obj), rename)
        obj = {new: v for new, v in zip(names, obj.values(), strict=True) if new is not None}
    meta = {"imported_from": str(src)[-200:], "import_format": kind, **(metadata or {})}
    info = save(_nest(key, obj), store, name, metadata=meta, **save_options)
    if progress is not None:
        progress(info.logical_bytes)
    return info

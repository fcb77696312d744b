"""``deltackpt.export_hf``: a snapshot's model state dict as Hugging Face safetensors files.

The output is what ``PreTrainedModel.save_pretrained`` writes: ``model.safetensors``, or
``model-0000k-of-0000n.safetensors`` shards (cut in key order, a shard closed before it would
pass ``max_shard_size``, a bigger tensor alone in its own shard) and
``model.safetensors.index.json`` (``metadata.total_size``, ``weight_map``), plus ``config.json``
when ``config=`` is given.

Streaming: the whole layout (names, dtypes, shapes, offsets) comes from the manifest, so each
file's header is written first and then its tensors in batches of at most ``_BATCH_BYTES``,
each read through the load path (:func:`deltackpt.loading.plan.read_entry`: a tensor saved as
shards by many ranks is reassembled piece by piece, every chunk checked against its digest),
cast, written and dropped. Peak memory is one batch, not the model.

Tied weights: tensors the manifest records as the same view of one shared storage (an
``lm_head.weight`` tied to ``embed_tokens.weight``) are written once, under the first name in
key order, as ``save_pretrained`` does (safetensors has no aliasing; ``from_pretrained`` ties
them again from ``config.tie_word_embeddings``). With a config that says
``tie_word_embeddings: false`` every name is written.

Block FP8 (``fp8=True`` or an :class:`~deltackpt.sync.fp8.Fp8Blocks`): the chosen weights are
written as ``float8_e4m3fn`` in 128 x 128 blocks, each followed by its ``weight_scale_inv``, and
the config gets the ``quantization_config`` vLLM and transformers read (``quant_method: fp8``,
``weight_block_size``): the checkpoint an engine that serves FP8 starts from, made by the same
quantizer the trainer's refit into that engine uses (docs/sync.md, "FP8 engines"). Experts
saved fused (transformers 5's ``experts.gate_up_proj`` [E, 2I, H], ``experts.down_proj``) are
written per expert (``experts.<e>.gate_proj.weight``...), as vLLM's FP8 MoE loader takes them.

Atomicity: every file is written to a hidden temporary name in ``out_dir``, fsynced, then
renamed into place, the index last; a failed export removes its temporaries, so a reader never
sees a half-written file.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from deltackpt.errors import CorruptChunkError, InvalidArgumentError, OutputExistsError
from deltackpt.format.dcp_values import byte_value_paths
from deltackpt.format.dtypes import dtype_from_name
from deltackpt.format.manifest import Manifest
from deltackpt.interop.keys import Rename, renamed, select_tree_tensors
from deltackpt.interop.safetensors_io import StreamWriter, st_dtype
from deltackpt.loading.plan import Reads, read_entry
from deltackpt.options import LoadOptions
from deltackpt.store.store import LATEST, Store, open_store
from deltackpt.sync.fp8 import (
    SCALE_SUFFIX,
    Fp8Blocks,
    block_grid,
    expert_parts,
    quantize_blocks,
)

WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
CONFIG = "config.json"
_SHARD_RE = re.compile(r"^model-\d{5}-of-\d{5}\.safetensors$")
_BATCH_BYTES = 128 << 20  # bytes read per pass: bounds peak memory below one shard
#: the weights ``fp8=True`` quantizes: the projections of decoder layers (attention and MLP, MoE
#: experts' too), not embeddings, the LM head, norms, routers or biases
FP8_WEIGHTS = re.compile(r"(^|\.)layers\.\d+\..*_proj\.weight$")
_UNITS = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_UNITS.update({"KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "TIB": 1 << 40, "B": 1})
_DTYPES = {
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "f16": torch.float16,
    "float16": torch.float16,
    "half": torch.float16,
    "fp32": torch.float32,
    "f32": torch.float32,
    "float32": torch.float32,
    "float": torch.float32,
    "fp64": torch.float64,
    "float64": torch.float64,
}

Progress = Callable[[int], None]  # called with the number of bytes just written


@dataclass(frozen=True)
class ExportItem:
    """One tensor to write: its output name, manifest entry index, output dtype and shape;
    ``fp8``: written as the FP8 bytes (``"q"``) or the scales (``"scale"``) of that entry's
    weight, cast to ``cast`` then quantized to ``qdtype`` in blocks of ``block``."""

    name: str
    index: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    fp8: str | None = None
    block: tuple[int, int] = (128, 128)
    qdtype: torch.dtype = torch.float8_e4m3fn
    cast: torch.dtype | None = None
    part: tuple[int, int, int] | None = None  # (expert, first row, end row) of a 3-D entry

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass(frozen=True)
class ExportPlan:
    """What an export writes: the files (name -> tensors in order) and the tied names dropped
    (dropped name -> the name written)."""

    snapshot: str
    files: dict[str, list[ExportItem]]
    tied: dict[str, str]
    total_bytes: int
    total_parameters: int


@dataclass(frozen=True)
class ExportReport:
    """What :func:`export_hf` wrote."""

    snapshot: str
    out_dir: Path
    files: list[str]  # file names written in out_dir, config and index included
    tensors: int
    total_bytes: int  # tensor bytes written (the index's metadata.total_size)
    seconds: float
    tied: dict[str, str] = field(default_factory=dict)


def parse_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    """``"bf16"``, ``"float16"``, ``torch.bfloat16``... -> a floating torch dtype (or None)."""
    if dtype is None or (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        return dtype
    got = _DTYPES.get(dtype.lower().removeprefix("torch.")) if isinstance(dtype, str) else None
    if got is None:
        raise InvalidArgumentError(
            f"dtype={dtype!r} is invalid: expected a floating dtype such as 'bf16', 'fp16', "
            f"'fp32' (or torch.bfloat16...); known names: {sorted(_DTYPES)}"
        )
    return got


def parse_size(size: int | str) -> int:
    """``"5GB"`` (decimal units, as transformers), ``"500MiB"``, or an int -> bytes."""
    if isinstance(size, int) and not isinstance(size, bool) and size > 0:
        return size
    m = (
        re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", size)
        if isinstance(size, str)
        else None
    )
    unit = (m.group(2) or "B").upper() if m else ""
    if m is None or unit not in _UNITS or float(m.group(1)) <= 0:
        raise InvalidArgumentError(
            f"max_shard_size={size!r} is invalid: expected a positive int of bytes or a size "
            "such as '5GB', '500MB', '2GiB'"
        )
    return int(float(m.group(1)) * _UNITS[unit])


def fp8_spec(fp8: Fp8Blocks | bool | None) -> Fp8Blocks | None:
    """``fp8=``: None/False (no quantization), True (:data:`FP8_WEIGHTS` in 128 x 128 blocks) or
    an :class:`Fp8Blocks`."""
    if fp8 is None or fp8 is False:
        return None
    if fp8 is True:
        return Fp8Blocks(include=lambda n: FP8_WEIGHTS.search(n) is not None)
    if isinstance(fp8, Fp8Blocks):
        return fp8
    raise InvalidArgumentError(
        f"fp8={fp8!r:.80} is invalid: expected None, True (decoder layers' projections in "
        "128 x 128 blocks) or a deltackpt.sync.fp8.Fp8Blocks"
    )


def config_doc(
    config: Any, dtype: torch.dtype | None, fp8: Fp8Blocks | None = None
) -> dict[str, Any] | None:
    """``config=`` (a config.json path, a dict, or a transformers config) as a JSON object,
    with its dtype set to the export's when one is given, and with ``fp8`` its
    ``quantization_config``."""
    if config is None:
        return None
    if isinstance(config, (str, os.PathLike)):
        try:
            doc = json.loads(Path(config).read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise InvalidArgumentError(
                f"config={str(config)!r} is not a readable JSON file: {e}"
            ) from e
    elif isinstance(config, dict):
        doc = dict(config)
    elif hasattr(config, "to_json_string"):
        doc = json.loads(config.to_json_string(use_diff=False))
    else:
        doc = None
    if not isinstance(doc, dict):
        raise InvalidArgumentError(
            f"config={config!r:.80} is invalid: expected a path to a config.json, a dict, or a "
            "transformers config object"
        )
    if dtype is not None:
        name = str(dtype).removeprefix("torch.")
        keys = [k for k in ("dtype", "torch_dtype") if k in doc] or ["dtype"]
        doc.update(dict.fromkeys(keys, name))
    if fp8 is not None:
        doc["quantization_config"] = {
            "quant_method": "fp8",
            "activation_scheme": "dynamic",
            "fmt": "e4m3" if fp8.dtype == torch.float8_e4m3fn else "e5m2",
            "weight_block_size": list(fp8.block),
        }
    return doc


def fp8_unquantized(doc: dict[str, Any] | None, plan: ExportPlan) -> None:
    """Name in ``doc``'s ``quantization_config`` the modules of the 2-D weights the export left
    unquantized (``ignored_layers``, vLLM's key; ``modules_to_not_convert``, transformers'): a
    loader of a block-FP8 config would otherwise expect FP8 for every linear (an MoE router)."""
    if doc is None or "quantization_config" not in doc:
        return
    q = {it.index for its in plan.files.values() for it in its if it.fp8 is not None}
    kept = sorted(
        it.name.removesuffix(".weight")
        for its in plan.files.values()
        for it in its
        if it.fp8 is None and it.index not in q and it.name.endswith(".weight")
        and len(it.shape) == 2
    )  # fmt: skip
    doc["quantization_config"]["ignored_layers"] = kept
    doc["quantization_config"]["modules_to_not_convert"] = kept


def plan_export(
    m: Manifest,
    *,
    key: str | None = "model",
    dtype: str | torch.dtype | None = None,
    max_shard_size: int | str = "5GB",
    rename: Rename = None,
    keep_tied: bool = False,
    fp8: Fp8Blocks | None = None,
) -> ExportPlan:
    """The files an export of manifest ``m`` writes, computed from the manifest alone."""
    cast = parse_dtype(dtype)
    limit = parse_size(max_shard_size)
    values = byte_value_paths(m)  # DCP values stored as torch.save bytes: not weights
    picked = [
        (n, i)
        for n, i in select_tree_tensors(m.tree, key, f"snapshot {m.name!r}")
        if m.tensors[i].path not in values
    ]
    names = renamed([n for n, _ in picked], rename)
    items: list[ExportItem] = []
    tied: dict[str, str] = {}
    views: dict[tuple[Any, ...], str] = {}
    for (old, i), name in zip(picked, names, strict=True):
        if name is None:
            continue
        e = m.tensors[i]
        src = dtype_from_name(e.dtype)
        out = cast if cast is not None and src.is_floating_point else src
        st_dtype(out, old)  # refuse dtypes safetensors cannot hold, before writing anything
        if e.storage is not None and not keep_tied:
            view = (e.storage.id, e.storage.offset, e.storage.stride, e.shape, e.dtype)
            if view in views:
                tied[name] = views[view]
                continue
            views[view] = name
        if fp8 is None:
            items.append(ExportItem(name, i, out, e.shape))
            continue
        # fused experts (transformers 5) per expert, as vLLM's FP8 MoE loader takes them
        parts = expert_parts(name, e.shape) or [(name, e.shape, None)]
        for each, shape, part in parts:
            if not fp8.chooses(each, out, len(shape)):
                items.append(ExportItem(each, i, out, shape, part=part))
                continue
            blocks = block_grid(shape, fp8.block)
            q = ExportItem(each, i, fp8.dtype, shape, "q", fp8.block, fp8.dtype, out, part)
            items += [q, replace(q, name=each + SCALE_SUFFIX, dtype=torch.float32,
                                 shape=blocks, fp8="scale")]  # fmt: skip
    shards: list[list[ExportItem]] = []
    cur: list[ExportItem] = []
    size = 0
    for it in items:  # huggingface_hub.split_torch_state_dict_into_shards, in key order
        if it.nbytes > limit:
            shards.append([it])
            continue
        if cur and size + it.nbytes > limit:
            shards.append(cur)
            cur, size = [], 0
        cur.append(it)
        size += it.nbytes
    if cur or not shards:
        shards.append(cur)
    n = len(shards)
    files = {
        WEIGHTS if n == 1 else f"model-{k + 1:05d}-of-{n:05d}.safetensors": s
        for k, s in enumerate(shards)
    }
    return ExportPlan(
        m.name,
        files,
        tied,
        sum(it.nbytes for it in items),
        sum(math.prod(it.shape) for it in items),
    )


def export_hf(
    store: str | os.PathLike[str] | Store,
    name: str = LATEST,
    out_dir: str | os.PathLike[str] = "",
    *,
    key: str | None = "model",
    dtype: str | torch.dtype | None = None,
    max_shard_size: int | str = "5GB",
    rename: Rename = None,
    config: Any = None,
    overwrite: bool = False,
    progress: Progress | None = None,
    fp8: Fp8Blocks | bool | None = None,
) -> ExportReport:
    """Write the model state dict of snapshot ``name`` to ``out_dir`` as Hugging Face
    safetensors (``model.safetensors``, or shards + ``model.safetensors.index.json``).

    ``key`` is the key path of the model state dict in the saved state (``"model"`` for
    ``save({"model": model.state_dict(), "optim": ...})``; None for a state that *is* the
    state dict). ``dtype`` casts floating tensors (``"bf16"``). ``rename`` maps names (a dict,
    or a callable returning the new name or None to leave a tensor out). ``config`` (a
    config.json path, a dict or a transformers config) is written as ``config.json``.
    ``fp8``: True writes the decoder layers' projection weights as block FP8 with their
    ``weight_scale_inv`` (an :class:`~deltackpt.sync.fp8.Fp8Blocks` chooses others) and adds
    the ``quantization_config`` to the config.
    Existing output files are refused unless ``overwrite=True``. ``progress(n)`` is called
    with the bytes written as they are.

    >>> deltackpt.export_hf("ckpts", "step-100", "hf-out", config=model.config)  # doctest: +SKIP
    >>> AutoModelForCausalLM.from_pretrained("hf-out")                            # doctest: +SKIP
    """
    t0 = time.perf_counter()
    if not isinstance(out_dir, (str, os.PathLike)) or not str(out_dir):
        raise InvalidArgumentError(f"out_dir={out_dir!r} is invalid: expected a directory path")
    st = open_store(store, create=False)
    m = st.manifest(name)
    spec = fp8_spec(fp8)
    doc = config_doc(config, parse_dtype(dtype), spec)
    plan = plan_export(
        m,
        key=key,
        dtype=dtype,
        max_shard_size=max_shard_size,
        rename=rename,
        keep_tied=doc is not None and doc.get("tie_word_embeddings") is False,
        fp8=spec,
    )
    fp8_unquantized(doc, plan)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    final = list(plan.files) + ([CONFIG] if doc is not None else [])
    final += [INDEX] if len(plan.files) > 1 else []
    stale = _check_outputs(out, final, overwrite)
    tmps: dict[str, Path] = {}
    try:
        opts = LoadOptions()
        for fname, items in plan.files.items():
            tmps[fname] = _tmp(out, fname)
            m = _write_file(st, m, items, tmps[fname], opts, progress)
        if doc is not None:
            tmps[CONFIG] = _write_text(
                out, CONFIG, json.dumps(doc, indent=2, sort_keys=True) + "\n"
            )
        if len(plan.files) > 1:
            index = {
                "metadata": {
                    "total_parameters": plan.total_parameters,
                    "total_size": plan.total_bytes,
                },
                "weight_map": {it.name: f for f, its in plan.files.items() for it in its},
            }
            tmps[INDEX] = _write_text(
                out, INDEX, json.dumps(index, indent=2, sort_keys=True) + "\n"
            )
        for old in stale:  # files of an earlier export this one does not replace
            with contextlib.suppress(FileNotFoundError):
                (out / old).unlink()
        for fname in final:  # the index last: a reader that finds it finds every shard
            os.replace(tmps.pop(fname), out / fname)
        _fsync_dir(out)
    finally:
        for p in tmps.values():
            with contextlib.suppress(OSError):
                p.unlink()
    return ExportReport(
        m.name,
        out,
        final,
        sum(len(v) for v in plan.files.values()),
        plan.total_bytes,
        time.perf_counter() - t0,
        plan.tied,
    )


def _check_outputs(out: Path, final: list[str], overwrite: bool) -> list[str]:
    """Refuse to replace files unless ``overwrite``; return the stale weight files of an earlier
    export (other shards, a single file or index) that would confuse a loader."""
    present = {p.name for p in out.iterdir()}
    weights = {n for n in present if n in (WEIGHTS, INDEX) or _SHARD_RE.match(n)}
    clash = sorted((set(final) & present) | weights)
    if clash and not overwrite:
        raise OutputExistsError(
            f"{out} already holds {clash[:6]}; export_hf does not replace files. Pass "
            "overwrite=True (CLI: --overwrite), or export to an empty directory"
        )
    return sorted(weights - set(final))


def _tmp(out: Path, fname: str) -> Path:
    return out / f".{fname}.tmp-{os.getpid()}"


def _write_text(out: Path, fname: str, text: str) -> Path:
    p = _tmp(out, fname)
    with open(p, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    return p


def _fsync_dir(d: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(d, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _batches(items: list[ExportItem]) -> list[list[ExportItem]]:
    out: list[list[ExportItem]] = [[]]
    size = 0
    for it in items:
        if out[-1] and size + it.nbytes > _BATCH_BYTES:
            out.append([])
            size = 0
        out[-1].append(it)
        size += it.nbytes
    return out


def _read_batch(
    st: Store, m: Manifest, batch: list[ExportItem], opts: LoadOptions
) -> tuple[Manifest, list[torch.Tensor]]:
    """Read the tensors of ``batch``. gc compaction repoints manifests before it deletes a pack:
    if ours moved while we read, read again once from the fresh manifest (as ``load`` does)."""
    while True:
        r = Reads(m)
        once: dict[int, torch.Tensor] = {}  # (the experts of one fused entry: read once)
        for it in batch:
            if it.index not in once:
                once[it.index] = read_entry(r, m.tensors[it.index])
        got = [once[it.index] for it in batch]
        try:
            # pack maps are opened per batch: their pages leave this process's RSS with them
            with st.pack_readers() as packs:
                r.run(packs, opts.verify, opts.threads, "deltackpt-export")
            return m, got
        except CorruptChunkError as e:
            fresh = st.manifest(m.name) if e.missing_pack else m
            if fresh is m:
                raise
            m = fresh


def _write_file(
    st: Store,
    m: Manifest,
    items: list[ExportItem],
    path: Path,
    opts: LoadOptions,
    progress: Progress | None,
) -> Manifest:
    """One safetensors file: the header, then the tensors read a batch at a time. Returns the
    manifest read last (a fresh one if a gc compaction moved chunks meanwhile)."""
    layout = [(it.name, st_dtype(it.dtype, it.name), it.shape) for it in items]
    with open(path, "wb") as f:
        w = StreamWriter(f, layout)
        for batch in _batches(items):
            m, got = _read_batch(st, m, batch, opts)
            quantized: dict[Any, tuple[torch.Tensor, torch.Tensor]] = {}
            for it, t in zip(batch, got, strict=True):
                if it.part is not None:  # one expert's rows of a fused entry
                    e, r0, r1 = it.part
                    t = t[e, r0:r1]
                if it.fp8 is not None:  # the weight's FP8 bytes or its scales, quantized once
                    key = (it.index, it.part)
                    if key not in quantized:
                        src = t.to(it.cast) if it.cast is not None else t
                        quantized[key] = quantize_blocks(src, it.block, it.qdtype)
                    t = quantized[key][0 if it.fp8 == "q" else 1]
                w.write(it.name, t.to(it.dtype) if t.dtype != it.dtype else t)
                if progress is not None:
                    progress(it.nbytes)
            del got, quantized
        w.finish()
        f.flush()
        os.fsync(f.fileno())
    return m

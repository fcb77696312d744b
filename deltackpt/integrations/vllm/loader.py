"""``load_format="deltackpt"``: a vLLM engine that starts from a snapshot of a deltackpt store.

::

    vllm serve /models/qwen3-4b --load-format deltackpt \\
        --model-loader-extra-config '{"store": "s3://bucket/run", "snapshot": "latest"}'

    LLM(model="/models/qwen3-4b", load_format="deltackpt",
        model_loader_extra_config={"store": "ckpts", "snapshot": "step-200"})

The model directory gives the config (``config.json``; its weight files are not read, and need
not be there); the weights are the snapshot's tensors under ``key`` (``"model"``: what
``deltackpt.save({"model": sd}, ...)`` and the ``Checkpointer`` write), read in windows of
:data:`WINDOW` bytes (every chunk checked as it is read: :func:`deltackpt.open_snapshot`), each
handed to the model's own ``load_weights`` (the path vLLM's default loader takes, so vLLM fuses,
shards and post-processes them as it does a Hugging Face checkpoint) and dropped: a worker's
host memory holds one window, not the model. An engine that serves block-FP8 weights gets the store's weights of
those modules quantized in its blocks (``fp8_layout``), as the backend's rounds do.

Why: a training checkpoint is served as it is, without an export; and an engine that restarts
in an RL fleet (a recovered or a new replica) comes up at the version the trainer published
last (``"latest"``), instead of the base weights of its model directory until someone pushes.
Every worker of the engine loads the same snapshot: the first worker names it, the others take
its name (a trainer may commit a newer one while they start). With ``"follow": true`` each worker
loads it whole and keeps it as the worker extension's follower copy, so its first
``collective_rpc("deltackpt_follow", args=(store,))`` is incremental (the same store, however
its path is spelt);
that costs a host copy of the weights per worker from the start, which a follow holds anyway.
Workers that follow in boxes (``"tp_boxes": true``, by default the workers'
``DELTACKPT_VLLM_TP_BOXES``: each holds its tensor-parallel share, not the model) read the
snapshot in windows as without ``follow`` and keep each tensor's box on the way (the share a
boxed follower holds, by the same rules), for a first ``deltackpt_follow(..., tp_boxes=True)``
that is incremental too. An FP8 engine's boxed workers keep nothing (their first follow reads
their boxes).

Checks, as vLLM's default loader makes them: an unquantized model whose parameters were not all
loaded fails its start, naming them (the snapshot holds another model, or ``key`` is wrong).
The fields are checked before anything is read (:mod:`.loader_args`). Registered by the
package's vLLM plugin (:func:`deltackpt.integrations.vllm.register`) when vLLM imports its
model loaders.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from vllm.config import ModelConfig
from vllm.config.load import LoadConfig
from vllm.model_executor.model_loader.base_loader import BaseModelLoader

from deltackpt.distributed.load import load
from deltackpt.errors import StateMismatchError
from deltackpt.format.dtypes import dtype_from_name
from deltackpt.format.manifest import Manifest
from deltackpt.format.tree import flatten
from deltackpt.integrations.vllm import feed, fp8_layout, tp_boxes
from deltackpt.integrations.vllm.joins import snapshot_step
from deltackpt.integrations.vllm.loader_args import StartFrom, resolve, start_from
from deltackpt.integrations.vllm.worker import (
    first_workers,
    mark_store_step,
    mark_written,
    new_writer,
)
from deltackpt.loading.boxed import box_plan
from deltackpt.loading.lazy import SnapshotReader, open_snapshot
from deltackpt.store.store import Store
from deltackpt.sync import PlanError

__all__ = ["FORMAT", "STARTED_ATTR", "WEIGHT_FILES", "WINDOW", "DeltackptModelLoader", "Started"]

log = logging.getLogger(__name__)
#: the ``load_format`` name
FORMAT = "deltackpt"
#: the model attribute holding :class:`Started` (what the engine started from)
STARTED_ATTR = "_deltackpt_started"


@dataclass
class Started:
    """What a worker's engine started from; with ``follow``, the loaded copies the worker
    extension's first ``deltackpt_follow`` of the same store adopts (then dropped here)."""

    start: StartFrom
    root: str  # the store as opened (a local directory resolved, or the URL)
    snapshot: str
    created_ns: int
    step: int | None  # the snapshot's training step (joins.snapshot_step)
    metadata: dict[str, Any]  # the snapshot's metadata, as loaded
    held: Any = None  # the loaded state, as a Follower holds it
    boxed: bool = False  # held is each tensor's tensor-parallel box, by key path
    loaded: dict[str, torch.Tensor] | None = None  # what load_weights got, by its names
    writer: str | None = None  # the follower's mark on the model (worker.mark_written)

    def report(self) -> dict[str, Any]:
        s = self.start
        return {"store": s.store, "snapshot": self.snapshot, "step": self.step, "key": s.key,
                "follow": s.follow}  # fmt: skip


class DeltackptModelLoader(BaseModelLoader):
    """vLLM's ``load_format="deltackpt"`` (module doc)."""

    def __init__(self, load_config: LoadConfig) -> None:
        super().__init__(load_config)
        self.start = start_from(load_config.model_loader_extra_config)

    def download_model(self, model_config: ModelConfig) -> None:
        """Nothing to download: the store and the snapshot are checked."""
        resolve(self.start)

    def _snapshot(self) -> tuple[Store, str, Manifest]:
        """The store, the snapshot every worker loads (the first one names it) and its
        manifest, read before the load: the version that load reads."""
        store, name = resolve(self.start)
        name = str(first_workers(name))
        return store, name, store.manifest(name)

    def _engine_items(
        self, model: nn.Module, model_config: ModelConfig
    ) -> Callable[[list[tuple[str, torch.Tensor]]], list[tuple[str, torch.Tensor]]]:
        """What turns tensors of the snapshot into what the model's ``load_weights`` takes: an
        FP8 engine's weights quantized in its blocks (``fp8_layout``, the engine's layout read
        once per load), what it cannot take refused."""
        layout = fp8_layout.engine_layout(model)
        blocks = fp8_layout.blocks_for(layout)

        def convert(items: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
            items = fp8_layout.for_engine(layout, blocks, model_config.dtype, items)
            refused = fp8_layout.refusal(model, layout, items)
            if refused is not None:
                raise PlanError(f"load_format='deltackpt': {refused}")
            return items

        return convert

    def _nothing(self, name: str) -> StateMismatchError:
        s = self.start
        return StateMismatchError(
            f"load_format='deltackpt': snapshot {name!r} of store {s.store!r} holds no tensor "
            f"under key {s.key!r}; give the key its state dict was saved under "
            "(model_loader_extra_config 'key'; null: the saved state is the state dict)"
        )

    def _whole(
        self, model: nn.Module, model_config: ModelConfig, store: Store, name: str
    ) -> tuple[Any, list[tuple[str, torch.Tensor]]]:
        """The snapshot loaded whole (the follower's copy, ``"follow": true``) and what
        ``load_weights`` takes of it."""
        s = self.start
        state = load(store, name, keys=None if s.key is None else [s.key])
        prefix = "" if s.key is None else f"{s.key}/"
        _, leaves = flatten(state, allow_pickle=True, check_tensors=False)
        items = [(x.path.removeprefix(prefix), x.tensor) for x in leaves]
        if not items:
            raise self._nothing(name)
        return state, self._engine_items(model, model_config)(items)

    def _streamed(
        self, model: nn.Module, model_config: ModelConfig, store: Store, name: str
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """The snapshot's tensors read in windows of about :data:`WINDOW` bytes (each chunk
        checked as it is read), handed on and dropped: host memory holds one window, not the
        model, on every worker (a tensor-parallel engine's workers each read the snapshot, as
        vLLM's default loader reads the checkpoint files)."""
        s = self.start
        prefix = "" if s.key is None else f"{s.key}/"
        with open_snapshot(store, name) as snap:
            keys = [k for k in snap if s.key is None or k.startswith(prefix)]
            if not keys:
                raise self._nothing(name)
            convert = self._engine_items(model, model_config)
            for window in _windows(snap, keys, WINDOW):
                got = snap.get_tensors(window)
                yield from convert([(k.removeprefix(prefix), got.pop(k)) for k in window])

    def _boxes_kept(
        self,
        model: nn.Module,
        m: Manifest,
        items: Iterable[tuple[str, torch.Tensor]],
        held: dict[str, torch.Tensor],
        loaded: dict[str, torch.Tensor],
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """``items`` handed on as they are, each tensor's box (``tp_boxes``' rules for this
        worker, planned as a boxed follower plans them: ``loading.boxed.box_plan``) copied into
        ``held`` by key path and ``loaded`` by name on the way; a tensor held whole is kept as
        it is, one another rank holds (an expert) not at all."""
        prefix = "" if self.start.key is None else f"{self.start.key}/"
        rule = tp_boxes.box_rules(model)

        def box_of(name: str, shape: tuple[int, ...]) -> Any:
            r = rule(name, shape)
            return False if r.skip else r.box

        plan = box_plan(
            m,
            None if not prefix else (lambda path: path.startswith(prefix)),
            box_of,
            lambda path: path.removeprefix(prefix),
        )
        for name, t in items:
            box = plan.get(prefix + name, False)
            if box is not False:
                if box is not None:
                    cut = tuple(slice(o, o + n) for o, n in zip(*box, strict=True))  # type: ignore[misc]
                    kept = t[cut].clone()
                else:
                    kept = t
                held[prefix + name] = loaded[name] = kept
            yield name, t

    def load_weights(self, model: nn.Module, model_config: ModelConfig) -> None:
        t0 = time.perf_counter()
        s = self.start
        store, name, m = self._snapshot()
        step = snapshot_step(m.metadata)
        boxed = s.follow and tp_boxes.enabled(s.tp_boxes)
        keep = s.follow and not boxed
        if boxed and fp8_layout.engine_layout(model) is not None:
            boxed = False  # the engine's items are quantized: its first follow reads its boxes
        if keep:  # the whole copy is kept for the first follow anyway
            state, whole = self._whole(model, model_config, store, name)
            items: Iterable[tuple[str, torch.Tensor]] = whole
        else:
            items = self._streamed(model, model_config, store, name)
        if boxed:  # each tensor's box kept on the way: what a boxed follower holds
            held: dict[str, torch.Tensor] = {}
            loaded: dict[str, torch.Tensor] = {}
            items = self._boxes_kept(model, m, items, held, loaded)
        got = model.load_weights(feed.feed(items, feed.model_device(model)))
        if model_config.quantization is None and got is not None:
            missing = sorted({n for n, _ in model.named_parameters()} - set(got))
            if missing:
                raise StateMismatchError(
                    f"load_format='deltackpt': snapshot {name!r} of store {s.store!r} (key "
                    f"{s.key!r}) left {len(missing)} of the model's parameters unloaded: "
                    f"{missing[:8]}; it holds another model's weights, or its state dict sits "
                    "under another key"
                )
        started = Started(s, str(store.root), name, m.created_ns, step, dict(m.metadata))
        # the store route wrote the model: a trainer that joins continues after its step
        started.writer = new_writer("store")
        mark_written(model, started.writer)
        mark_store_step(model, step)
        if keep:  # the extension's first follow of this store adopts them
            started.held, started.loaded = state, dict(whole)
        elif boxed:
            started.held, started.loaded, started.boxed = held, loaded, True
        model.__dict__[STARTED_ATTR] = started
        log.info(
            "deltackpt: loaded snapshot %r of %s in %.2f s", name, s.store, time.perf_counter() - t0
        )

    def get_all_weights(
        self, model_config: ModelConfig, model: nn.Module
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """What vLLM's ``reload_weights`` loads. vLLM puts a ``weights_path`` in
        ``model_config.model``, so a reload cannot tell "no path" from "the start's directory
        again"; the rule is the directory's content: one that holds weight files
        (:data:`WEIGHT_FILES`; a ``weights_path``, or a start directory that had them) is read
        by vLLM's default loader, as on any engine; a config-only one means the store's
        snapshot again (``"latest"``: the newest now). Either way the model is marked as
        written outside both routes, so a trainer's next round and the next
        ``deltackpt_follow`` load every tensor (``worker.whole_if_overwritten``)."""
        mark_written(model, "outside")
        where = str(model_config.model)
        if not os.path.isdir(where) or _has_weight_files(where):
            from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

            plain = dataclasses.replace(
                self.load_config, load_format="auto", model_loader_extra_config={}
            )
            mark_store_step(model, None)  # a directory's weights: no snapshot's step
            yield from DefaultModelLoader(plain).get_all_weights(model_config, model)
            return
        store, name, m = self._snapshot()
        mark_store_step(model, snapshot_step(m.metadata))
        yield from self._streamed(model, model_config, store, name)


#: bytes of tensors read at a time without ``"follow"`` (a window, then handed on and dropped)
WINDOW = 256 << 20


def _windows(snap: SnapshotReader, keys: list[str], limit: int) -> Iterator[list[str]]:
    """``keys`` in save order, cut where a window would pass ``limit`` bytes (a tensor larger
    than ``limit`` is a window of its own)."""
    window: list[str] = []
    size = 0
    for k in keys:
        e = snap.entry(k)
        n = math.prod(e.shape) * dtype_from_name(e.dtype).itemsize
        if window and size + n > limit:
            yield window
            window, size = [], 0
        window.append(k)
        size += n
    if window:
        yield window


#: the files vLLM's default loader reads weights from (a directory without any is config-only)
WEIGHT_FILES = (".safetensors", ".bin", ".pt")


def _has_weight_files(directory: str) -> bool:
    return any(name.endswith(WEIGHT_FILES) for name in os.listdir(directory))

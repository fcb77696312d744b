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

LoRA adapters come from the store the same way, versioned and without a directory:
``deltackpt_lora_add`` / ``deltackpt_lora_remove`` / ``deltackpt_lora_digests``, called by
:func:`deltackpt.integrations.vllm.lora.add_lora` (module ``lora``).

Importing this module never imports vLLM.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

import torch

from deltackpt.errors import InvalidArgumentError
from deltackpt.format.hashing import tensor_digest
from deltackpt.integrations.vllm.joins import snapshot_step
from deltackpt.store.location import store_root
from deltackpt.sync import PlanError

log = logging.getLogger(__name__)

__all__ = ["EXTENSION", "DeltackptWorkerExtension", "state_digests", "tensor_digest"]

#: the value of ``worker_extension_cls`` / ``--worker-extension-cls``
EXTENSION = f"{__name__}.DeltackptWorkerExtension"


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


def _follow_report(f: Any, s: Any) -> dict[str, Any]:
    return {
        "version": f.version,
        "step": snapshot_step(f.metadata),  # the snapshot's training step, if it has one
        "mode": None if s is None else s.mode,
        "reason": None if s is None else s.reason,
        "bytes_read": 0 if s is None else s.load.bytes_read,
        "changed": 0 if s is None else len(s.changed),
        "held_bytes": f.held_bytes,  # the follower's copy (with tp_boxes: its boxes)
    }


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

    def deltackpt_checkpoint_digests(self, tensors: list[Any]) -> dict[str, Any]:
        """Digests of the parameter regions that hold each checkpoint tensor ``[name, shape,
        dtype]`` on this worker, taken where the parameters live
        (:func:`deltackpt.integrations.vllm.inplace.region_digests`): what
        ``sync.CheckpointPatcher.check`` compares with its bases, after an update by any route
        (vLLM's sparse backend checks nothing itself)."""
        from deltackpt.integrations.vllm import inplace

        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        out = inplace.region_digests(model, [tuple(t) for t in tensors])
        out["rank"] = int(getattr(self, "rank", 0))
        return out

    def deltackpt_memory(self) -> dict[str, Any]:
        """Host bytes this worker's receiver holds (``DeltackptWeightTransferEngine.memory``:
        ``held``, ``staging``, ``undo`` beside ``model`` and this worker's ``share``)."""
        return dict(self._deltackpt_engine().memory())

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
        stage: bool = False,
        whole: bool = False,
        tp_boxes: bool | None = None,
    ) -> dict[str, Any]:
        """Bring this worker's model to the newest committed snapshot of ``store`` (one poll of
        a :class:`deltackpt.Follower` kept on the worker; the first call loads whole, later
        ones catch up from the version held). ``key``: where the state dict sits in the saved
        state (``{"model": sd}`` -> ``"model"``; None: the whole state is the state dict).
        Fail closed as the Follower is: held weights that do not match their version, or a held
        version retention deleted, mean a full load. Memory: the follower's CPU copy of the
        followed tensors (the model's own parameters are fused, sharded or repacked).
        Returns ``{"version", "step", "mode" (None: nothing newer), "reason", "bytes_read",
        "changed", "held_bytes"}`` (``held_bytes``: the follower copy's size).

        A trainer's rounds (the ``deltackpt`` backend) that wrote the model since the last
        follow make this load every tensor of the followed copy, not the change alone (mode
        ``"whole again"`` when nothing is newer): ``worker.whole_if_overwritten``.
        ``whole=True`` does the same after a change neither route sees (vLLM's own
        ``reload_weights``, another backend).

        ``tp_boxes=True`` (default: the workers' ``DELTACKPT_VLLM_TP_BOXES``, as for a trainer's
        rounds): a tensor-parallel worker holds only the boxes of the tensors its shards load
        (:mod:`~deltackpt.integrations.vllm.tp_boxes`' rules), so its copy is its share of the
        model, not the model; a changed box is read again whole (its rows or columns), where the
        whole copy patches chunks (:mod:`deltackpt.loading.boxed`).

        ``stage=True``: prepare while the engine serves. The poll (reads, patches, checks) runs
        on a background thread and this returns ``{"staged": True}`` at once; the model is
        untouched until :meth:`deltackpt_follow_commit`, the pause (the reload of the changed
        layers)."""
        import socket
        import threading

        from deltackpt.follow import Follower
        from deltackpt.integrations.vllm import fp8_layout, inplace
        from deltackpt.integrations.vllm import tp_boxes as tpb
        from deltackpt.integrations.vllm.worker import new_writer

        if getattr(self, "_deltackpt_follow_staged", None) is not None:
            raise RuntimeError(
                "deltackpt_follow: a staged version waits for deltackpt_follow_commit"
            )
        f = getattr(self, "_deltackpt_follower", None)
        boxed = tpb.enabled(tp_boxes)
        args = (str(store_root(store)), key, boxed)  # one store however its path is spelt
        if f is None or getattr(self, "_deltackpt_follow_args", None) != args:
            model, cfg = self.model_runner.get_model(), self.model_config  # type: ignore[attr-defined]
            loaded: dict[str, Any] = {}
            prefix = "" if key is None else f"{key}/"
            rank = int(getattr(self, "rank", 0))
            sink: list[Any] = [None]  # a staged poll collects here instead of reloading
            # where each tensor sits in the parameters (inplace.py; None: always reload)
            slots: dict[str, Any] | None = {} if inplace.enabled() else None
            # an engine that serves block-FP8 weights: the store's weights of those modules
            # quantized in its blocks, each with its scales (docs/sync.md, "FP8 engines")
            layout = fp8_layout.engine_layout(model)
            fp8 = fp8_layout.blocks_for(layout)
            # tp_boxes: per tensor, its full shape and the box this worker holds (None: whole)
            shapes: dict[str, tuple[int, ...]] = {}
            boxes: dict[str, Any] = {}
            rule = tpb.box_rules(model) if boxed else None

            def box_of(name: str, shape: tuple[int, ...]) -> Any:
                assert rule is not None
                r = rule(name, shape)
                shapes[name], boxes[name] = tuple(shape), r.box
                return False if r.skip else r.box  # another rank's expert: not held

            def load_weights(w: Any) -> None:
                w = fp8_layout.for_engine(layout, fp8, cfg.dtype, list(w))
                refused = fp8_layout.refusal(model, layout, w)
                if refused is not None:
                    raise PlanError(f"deltackpt_follow: {refused}")
                if sink[0] is not None:
                    sink[0].extend(w)
                else:
                    self._deltackpt_follow_load(w)

            f = Follower(
                store,
                load_weights=load_weights,
                keys=None if key is None else [key],
                rename=lambda k: k.removeprefix(prefix),
                holder=f"vllm-{socket.gethostname()}-{os.getpid()}-rank{rank}",
                lease_ttl=lease_ttl,
                storage_options=storage_options,
                boxes=box_of if boxed else None,
            )
            self._deltackpt_follower, self._deltackpt_follow_args = f, args
            self._deltackpt_follow_boxes = (shapes, boxes)
            self._deltackpt_loaded, self._deltackpt_follow_sink = loaded, sink
            self._deltackpt_slots = slots
            self._deltackpt_follow_writer = new_writer("store")
            self._deltackpt_follow_adopt(f)
        if whole:  # changed outside both routes: as if another route wrote it
            from deltackpt.integrations.vllm.worker import mark_written

            mark_written(self.model_runner.get_model(), "outside")  # type: ignore[attr-defined]
        # every worker of the engine polls the snapshot the first one found newest: each
        # looking for itself, a save committed between their looks would split a
        # tensor-parallel model across two versions
        from deltackpt.integrations.vllm.worker import first_workers

        target = first_workers(f.latest())
        if stage:
            staged: dict[str, Any] = {"weights": [], "stats": None, "error": None}

            def prepare() -> None:
                self._deltackpt_follow_sink[0] = staged["weights"]
                try:
                    staged["stats"] = None if target is None else f.poll(target=target)
                except BaseException as e:  # reported by deltackpt_follow_commit
                    staged["error"] = e
                finally:
                    self._deltackpt_follow_sink[0] = None

            staged["thread"] = threading.Thread(target=prepare, name="deltackpt-follow-stage")
            staged["thread"].start()
            self._deltackpt_follow_staged = staged
            return {"staged": True, "version": f.version}
        got = None if target is None else f.poll(target=target)
        if got is None and self._deltackpt_follow_overwritten():
            # nothing newer, but the trainer's route wrote the model since: the held version
            # goes back in whole (the question asked is "serve the newest snapshot")
            self._deltackpt_follow_load([])
            return {**_follow_report(f, None), "mode": "whole again"}
        return _follow_report(f, got)

    def _deltackpt_follow_adopt(self, f: Any) -> None:
        """An engine started from this store (as opened: a relative path is the same store as
        its absolute one) with ``load_format="deltackpt"`` and ``"follow": true`` (module
        ``loader``): the new follower takes what the start loaded as its held version, so its
        first poll is incremental; the start's references are dropped."""
        from deltackpt.integrations.vllm.loader import STARTED_ATTR

        started = self.model_runner.get_model().__dict__.get(STARTED_ATTR)  # type: ignore[attr-defined]
        key, boxed = self._deltackpt_follow_args[1:]
        if started is None or started.held is None:
            return
        if boxed != started.boxed:  # whole tensors for a boxed follower, or the reverse: the
            started.held = started.loaded = None  # first poll loads what it holds instead
            return
        # the same store however it was written ("ckpts", "./ckpts", an absolute path)
        if (started.root, started.start.key) != (str(f.store.root), key):
            return
        try:
            f.adopt(started.snapshot, started.held, started.created_ns, started.metadata)
        except InvalidArgumentError as e:  # boxes planned otherwise than the start kept them
            log.warning("deltackpt_follow: the start's copy is not adopted (%s); loading", e)
            started.held = started.loaded = None
            return
        self._deltackpt_loaded.update(started.loaded)
        self._deltackpt_follow_writer = started.writer
        started.held = started.loaded = None

    def deltackpt_started(self) -> dict[str, Any]:
        """What this worker's engine started from with ``load_format="deltackpt"``:
        ``{"store", "snapshot", "key", "follow"}``; ``{}`` for another load format."""
        from deltackpt.integrations.vllm.loader import STARTED_ATTR

        started = self.model_runner.get_model().__dict__.get(STARTED_ATTR)  # type: ignore[attr-defined]
        return {} if started is None else started.report()

    def _deltackpt_follow_overwritten(self) -> bool:
        """Another route (a trainer's rounds) wrote the model since the store link's last load."""
        from deltackpt.integrations.vllm.worker import written_by_other

        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        return bool(self._deltackpt_loaded) and written_by_other(
            model, self._deltackpt_follow_writer
        )

    def _deltackpt_follow_load(self, w: list[tuple[str, Any]]) -> str:
        """Load ``w`` (what changed since the store link's last load, or nothing) into the
        model, whole when another route wrote it meanwhile (``worker.whole_if_overwritten``:
        the rest of the model is not the store link's previous version then); the path taken
        (``worker.commit_layers``)."""
        from deltackpt.integrations.vllm import tp_boxes
        from deltackpt.integrations.vllm.worker import (
            commit_layers,
            mark_store_step,
            mark_written,
            whole_if_overwritten,
        )

        model, cfg = self.model_runner.get_model(), self.model_config  # type: ignore[attr-defined]
        me = self._deltackpt_follow_writer
        whole = whole_if_overwritten(model, me, self._deltackpt_loaded, w)
        mark_written(model, me)
        mark_store_step(model, snapshot_step(self._deltackpt_follower.metadata))
        shapes, boxes = self._deltackpt_follow_boxes

        def expand(name: str, t: Any) -> Any:  # a box as the full-shape view load_weights takes
            box = boxes.get(name)
            return t if box is None else tp_boxes.full_view(t, box, shapes[name])

        return commit_layers(
            model, cfg, self._deltackpt_loaded, w if whole is None else whole,
            self._deltackpt_slots, expand=expand, shapes=shapes, boxes=boxes,
        )  # fmt: skip

    def deltackpt_follow_commit(self) -> dict[str, Any]:
        """Load what the staged ``deltackpt_follow(..., stage=True)`` prepared (the pause: the
        changed tensors written into the parameters where they were seen, else the reload of
        the changed layers: ``worker.commit_layers``); the same answer as ``deltackpt_follow``
        plus ``"seconds"`` (of the pause) and ``"path"`` (``"in place"``, ``"reload"``, None), or ``{"error": ...}`` when the poll failed (the model is
        untouched). A reload that fails is not rolled back on this path: the follower then
        hands every tensor over at the next ``deltackpt_follow`` (its resend), which brings the
        model to the newest version; the error is raised."""
        import time

        staged = getattr(self, "_deltackpt_follow_staged", None)
        if staged is None:
            raise RuntimeError("deltackpt_follow_commit: nothing is staged")
        staged["thread"].join()
        self._deltackpt_follow_staged = None
        f = self._deltackpt_follower
        if staged["error"] is not None:
            return {"error": f"{type(staged['error']).__name__}: {staged['error']}"}
        t0 = time.perf_counter()
        if staged["weights"] or self._deltackpt_follow_overwritten():
            try:
                path = self._deltackpt_follow_load(staged["weights"])
            except BaseException:
                f._resend = True  # the next poll hands every tensor over again
                raise
        else:
            path = None
        out = _follow_report(f, staged["stats"])
        out["seconds"] = time.perf_counter() - t0
        out["path"] = path
        return out

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

    # ---- LoRA adapters from the store (module lora; add_lora calls these) ----------------
    # They answer {"error": ...} instead of raising: a collective RPC that fails on one worker
    # of several desynchronizes vLLM 0.32's executor; add_lora raises for them.

    def deltackpt_lora_add(
        self,
        path: str,
        lora_int_id: int,
        lora_name: str,
        storage_options: dict[str, Any] | None = None,
        token: str | None = None,
    ) -> dict[str, Any]:
        """Build the adapter ``path`` (``lora.AdapterSource.path``) names and cache it under
        ``lora_int_id`` (``token``: the calling ``add_lora``'s mark, for its undo):
        ``{"added": bool, "seconds": float}`` or ``{"error": ...}``."""
        from deltackpt.integrations.vllm import lora

        try:
            return lora.stage(self, path, lora_int_id, lora_name, storage_options, token)
        except Exception as e:
            return {"error": f"{type(e).__name__}: {e}"}

    def deltackpt_lora_remove(
        self,
        lora_int_id: int,
        only_if_path: str | None = None,
        only_if_token: str | None = None,
    ) -> dict[str, Any]:
        """Drop adapter ``lora_int_id`` (``only_if_path``: only if it names that version;
        ``only_if_token``: only if that ``add_lora`` call added it): ``{"removed": bool}`` or
        ``{"error": ...}``."""
        from deltackpt.integrations.vllm import lora

        try:
            return lora.unstage(self, lora_int_id, only_if_path, only_if_token)
        except Exception as e:
            return {"error": f"{type(e).__name__}: {e}"}

    def deltackpt_lora_digests(self, lora_int_id: int) -> dict[str, Any]:
        """xxh3-128 digests of what this worker holds under ``lora_int_id`` (vLLM's
        ``lora_a`` / ``lora_b`` per module): ``{"digests": {...}}`` or ``{"error": ...}``."""
        from deltackpt.integrations.vllm import lora

        try:
            return lora.adapter_digests(self, lora_int_id)
        except Exception as e:
            return {"error": f"{type(e).__name__}: {e}"}

"""Receiver adapters: turn ``load_weights(list of (name, tensor))`` into writes to a model.

vLLM and SGLang model classes already have ``model.load_weights(weights)``: pass it to
:meth:`WeightReceiver.pull` directly. For a plain ``torch.nn.Module`` use :class:`ModuleAdapter`,
which copies in place (so optimizer state, hooks and CUDA graphs that hold the parameters keep
working) and records which parameters a round covered.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import torch

from deltackpt.sync.errors import SyncError

__all__ = ["Coverage", "ModuleAdapter"]


@dataclass(frozen=True)
class Coverage:
    """What the adapter wrote since construction or the last :meth:`ModuleAdapter.reset`.

    ``loaded``: module keys written (a tied parameter counts under all its names);
    ``missing``: module keys never written; ``unexpected``: incoming names with no module key;
    ``skipped``: incoming names the name map dropped (mapped to ``None``).
    """

    loaded: tuple[str, ...]
    missing: tuple[str, ...]
    unexpected: tuple[str, ...]
    skipped: tuple[str, ...]

    @property
    def complete(self) -> bool:
        return not self.missing and not self.unexpected


class ModuleAdapter:
    """``load_weights`` for an ``nn.Module``: ``param.copy_(tensor)`` under ``no_grad``.

    ``name_map`` renames incoming (sender) names to module keys: a mapping (names not in it
    pass unchanged, a ``None`` value drops the tensor) or a function ``name -> key | None``.
    ``copy_`` casts dtype and moves devices as needed. A shape mismatch raises
    :class:`SyncError`; an unknown name is recorded in :meth:`coverage` (``strict=True``: raises).

    Example::

        adapter = ModuleAdapter(model, name_map={"model.embed.weight": "embed.weight"})
        receiver.pull(adapter)
        assert adapter.coverage().complete
    """

    def __init__(
        self,
        module: torch.nn.Module,
        *,
        name_map: Mapping[str, str | None] | Callable[[str], str | None] | None = None,
        strict: bool = False,
        buffers: bool = True,
    ) -> None:
        self.module = module
        self.name_map = name_map
        self.strict = strict
        self._targets: dict[str, torch.Tensor] = dict(
            module.named_parameters(remove_duplicate=False)
        )
        if buffers:
            self._targets.update(module.named_buffers(remove_duplicate=False))
        self._aliases: dict[int, list[str]] = {}
        for key, t in self._targets.items():
            self._aliases.setdefault(id(t), []).append(key)
        self.reset()

    def reset(self) -> None:
        """Start a new coverage report."""
        self._loaded: set[str] = set()
        self._unexpected: list[str] = []
        self._skipped: list[str] = []

    def _key(self, name: str) -> str | None:
        if self.name_map is None:
            return name
        if callable(self.name_map):
            return self.name_map(name)
        return self.name_map.get(name, name)

    def __call__(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        with torch.no_grad():
            for name, tensor in weights:
                key = self._key(name)
                if key is None:
                    self._skipped.append(name)
                    continue
                dst = self._targets.get(key)
                if dst is None:
                    if self.strict:
                        raise SyncError(
                            f"sync sent {name!r} (module key {key!r}) but the module "
                            f"has no such parameter or buffer; add it to name_map "
                            "(None to drop it) or pass strict=False"
                        )
                    self._unexpected.append(name)
                    continue
                if dst.shape != tensor.shape:
                    raise SyncError(
                        f"sync sent {name!r} with shape {list(tensor.shape)} but "
                        f"module key {key!r} has shape {list(dst.shape)}; fix "
                        "name_map or the model definition"
                    )
                dst.copy_(tensor)
                self._loaded.update(self._aliases[id(dst)])

    load_weights = __call__

    def coverage(self) -> Coverage:
        return Coverage(
            loaded=tuple(k for k in self._targets if k in self._loaded),
            missing=tuple(k for k in self._targets if k not in self._loaded),
            unexpected=tuple(self._unexpected),
            skipped=tuple(self._skipped),
        )

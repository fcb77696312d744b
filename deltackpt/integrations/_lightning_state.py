"""Lightning's checkpoint dict <-> the state ``DeltaCheckpointIO`` stores, for both backends (a
store, :mod:`._lightning_store`; tiers, :mod:`._lightning_tiers`).

Lightning's dict is nested dicts, lists, numbers, strings and tensors, plus ``AttributeDict``
values (``hyper_parameters``), which are stored as plain dicts. What the plug-in keeps beside
the dict (:class:`Extras`: which keys were ``AttributeDict``, the global RNG state) is stored by
each backend its own way, under :data:`OWNER_KEY`."""

from __future__ import annotations

import threading
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch

from deltackpt import rng as _rng
from deltackpt.errors import InvalidArgumentError

try:
    from lightning.fabric.utilities.data import AttributeDict
except ImportError:  # the standalone pytorch_lightning package
    from lightning_fabric.utilities.data import AttributeDict  # type: ignore[no-redef]

__all__ = ["OWNER_KEY", "Extras", "plain_dicts", "rng_now", "to_device"]

# The plug-in's record: a store snapshot's metadata {"path": ..., "attribute_dicts": [...]};
# in a tier snapshot, a key of the saved state {"rng": ..., "attribute_dicts": [...]}.
OWNER_KEY = "deltackpt.lightning"


@dataclass
class Extras:
    """What is saved beside Lightning's dict: the keys whose ``AttributeDict`` values are stored
    as plain dicts, and the global RNG state (None: not saved). ``rng_field`` names where a
    loaded RNG state was (for the errors of a damaged one)."""

    attribute_dicts: list[str] = field(default_factory=list)
    rng: Any = None
    rng_field: str = ""

    def apply(self, loaded: dict[str, Any], rng: bool) -> None:
        """Turn the recorded keys of ``loaded`` back into ``AttributeDict`` values, and put the
        RNG state back (``rng``: the plug-in restores it)."""
        for k in self.attribute_dicts:
            if isinstance(k, str) and isinstance(loaded.get(k), dict):
                loaded[k] = AttributeDict(loaded[k])
        if rng and self.rng is not None:
            _rng.prepare(self.rng, self.rng_field)()


def plain_dicts(checkpoint: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """A shallow copy of Lightning's dict with ``AttributeDict`` values as plain dicts, and the
    keys converted (Lightning's dict itself is never changed)."""
    state: dict[str, Any] = {}
    converted: list[str] = []
    for k, v in checkpoint.items():
        if type(v) is AttributeDict:
            v = dict(v)
            converted.append(k)
        state[k] = v
    return state, converted


def rng_now(owner: Any, advice: str) -> Any:
    """The global RNG state now; warns once per ``owner`` when called off the main thread."""
    if threading.current_thread() is not threading.main_thread() and not owner._warned:
        owner._warned = True
        warnings.warn(
            f"{type(owner).__name__}(rng=True) saves on a background thread (Lightning's "
            "AsyncCheckpointIO?): the RNG state it records is that of this moment, not of the "
            "checkpoint's step, so random draws after a resume may differ from an "
            f"uninterrupted run. {advice}",
            RuntimeWarning,
            stacklevel=4,
        )
    return _rng.capture()


def to_device(obj: Any, map_location: Any) -> Any:
    if not isinstance(map_location, (str, torch.device)):
        raise InvalidArgumentError(
            f"DeltaCheckpointIO.load_checkpoint(map_location={map_location!r}): expected None, a "
            "device string or a torch.device (the snapshot loads to CPU; Lightning moves tensors "
            "to the module's device itself)"
        )
    if isinstance(obj, torch.Tensor):
        return obj.to(map_location)
    if isinstance(obj, dict):
        out = type(obj)() if type(obj) is not AttributeDict else AttributeDict()
        for k, v in obj.items():
            out[k] = to_device(v, map_location)
        if hasattr(obj, "_metadata"):
            out._metadata = obj._metadata  # type: ignore[attr-defined]
        return out
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_device(v, map_location) for v in obj)
    return obj

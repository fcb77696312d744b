"""Values of DCP snapshots that are stored as their ``torch.save`` bytes (light: no DCP import).

:class:`deltackpt.dcp.StoreWriter` keeps plain-data values (numbers, strings, lists, ...) inline in
the manifest tree. A value that holds tensors or needs pickle (a custom class) is stored instead as
a 1-D uint8 tensor entry holding DCP's ``torch.save`` bytes, and its path is listed in
``manifest.metadata["dcp"]["bytes"]``. :func:`decode_byte_values` turns those entries back into
the values, for ``deltackpt.load``: with ``weights_only=True`` (no code runs) when that suffices,
otherwise only with ``allow_pickle=True``.
"""

from __future__ import annotations

import io
import pickle
from typing import Any

import torch

from deltackpt.errors import PickleNotAllowedError
from deltackpt.format.manifest import Manifest

DCP_KEY = "dcp"


def byte_value_paths(m: Manifest) -> set[str]:
    """Paths of the tensor entries of ``m`` that hold a DCP value's torch.save bytes."""
    info = m.metadata.get(DCP_KEY)
    if not isinstance(info, dict):
        return set()
    paths = info.get("bytes")
    return {p for p in paths if isinstance(p, str)} if isinstance(paths, list) else set()


def decode_byte_values(m: Manifest, tensors: list[Any], allow_pickle: bool) -> None:
    """Replace, in ``tensors`` (one per entry of ``m``), DCP byte entries by their values."""
    paths = byte_value_paths(m)
    if not paths:
        return
    for i, e in enumerate(m.tensors):
        if e.path not in paths or not isinstance(tensors[i], torch.Tensor):
            continue
        raw = tensors[i].detach().reshape(-1).numpy().tobytes()
        try:
            tensors[i] = torch.load(io.BytesIO(raw), weights_only=True)
        except pickle.UnpicklingError:
            if not allow_pickle:
                raise PickleNotAllowedError(
                    f"snapshot {m.name!r} key {e.path!r} is a value DCP pickled (torch.save); "
                    "unpickling can execute code, so load it only from a store you trust, with "
                    "allow_pickle=True"
                ) from None
            tensors[i] = torch.load(io.BytesIO(raw), weights_only=False)

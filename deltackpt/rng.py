"""The process's random generators: capture them into a state, and put them back.

:func:`capture` / :func:`restore` (public as ``deltackpt.get_rng_state`` /
``deltackpt.set_rng_state``, used by ``Checkpointer``) cover the global generators of torch (CPU
and, once CUDA is initialised, every CUDA device), numpy's legacy global ``RandomState`` and
Python's ``random``, as a dict of tensors, ints, floats and strings that any ``save`` stores as
ordinary values. :func:`prepare` validates such a dict and returns the function that applies it,
so that :func:`restore` applies nothing unless every part is valid.

How each generator's state is laid out and checked (it is untrusted when read back) is
:mod:`deltackpt.format.rng_state`, which also stores generator *objects* found inside a state
(the ``rng`` tag of the state tree).
"""

from __future__ import annotations

import random
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch

from deltackpt.format import rng_state as rs

__all__ = ["FORMAT", "capture", "prepare", "restore"]

FORMAT = 1  # version of the dict capture() returns


# ---------------------------------------------------------------------------- CUDA


def _cuda_ready() -> bool:
    # Only once CUDA is initialised: get_rng_state would otherwise initialise it (seconds, and
    # a CUDA context in every process that merely saves).
    return torch.cuda.is_available() and torch.cuda.is_initialized()


def _restore_cuda(states: list[torch.Tensor], where: str) -> None:
    if not torch.cuda.is_available():
        warnings.warn(
            f"{where}: the snapshot holds RNG state for {len(states)} CUDA device(s) but CUDA is "
            "not available here, so CUDA generators are not restored (GPU random draws will not "
            "resume identically)",
            RuntimeWarning,
            stacklevel=3,
        )
        return
    n = torch.cuda.device_count()
    if n != len(states):
        warnings.warn(
            f"{where}: the snapshot holds RNG state for {len(states)} CUDA device(s), this "
            f"process sees {n}; restoring the first {min(n, len(states))}",
            RuntimeWarning,
            stacklevel=3,
        )
    for i, t in enumerate(states[:n]):
        try:
            torch.cuda.set_rng_state(t, i)
        except RuntimeError as e:
            raise rs.bad(f"{where}/{i}", f"a valid CUDA generator state ({e})", "state") from None


# ---------------------------------------------------------------------------- capture / restore


def capture() -> dict[str, Any]:
    """The state of every global random generator, as values ``deltackpt.save`` stores without
    pickle: ``{"format", "torch", "numpy", "python"}`` plus ``"cuda"`` (one state per device)
    once CUDA is initialised. Save it with the model; :func:`restore` puts it back.

    >>> state["rng"] = deltackpt.get_rng_state()        # doctest: +SKIP
    """
    out: dict[str, Any] = {
        "format": FORMAT,
        "torch": torch.get_rng_state(),
        "numpy": rs.encode_numpy(
            np.random.get_state(legacy=False), rs.GAUSS, rs.AS_TENSORS, "numpy.random"
        ),
        "python": rs.encode_python(random.getstate(), rs.AS_TENSORS, "random"),
    }
    if _cuda_ready():
        out["cuda"] = [torch.cuda.get_rng_state(i) for i in range(torch.cuda.device_count())]
    return out


def restore(state: Mapping[str, Any], where: str = "rng") -> None:
    """Set the global generators from a :func:`capture` dict (as loaded back from a store).

    Every part is validated first and nothing is changed unless all of it is valid; a bad field
    raises :class:`~deltackpt.errors.ManifestError` naming it (``where`` is its key in the
    state). CUDA states are restored only where CUDA is available (a warning otherwise).

    >>> deltackpt.set_rng_state(deltackpt.load("ckpts")["rng"])     # doctest: +SKIP
    """
    prepare(state, where)()


def prepare(state: Mapping[str, Any], where: str = "rng") -> Callable[[], None]:
    """Validate a :func:`capture` dict and return the function that applies it: a caller can
    check it before restoring anything else and apply it last."""
    known = {"format", "torch", "numpy", "python", "cuda"}
    if not isinstance(state, Mapping) or not set(state) <= known or "format" not in state:
        got = list(state) if isinstance(state, Mapping) else state
        raise rs.bad(
            where, f"a dict from deltackpt.get_rng_state() (keys among {sorted(known)})", got
        )
    rs.check_int(state["format"], FORMAT, FORMAT, f"{where}/format")
    apply: list[Callable[[], None]] = []
    if "torch" in state:
        t = rs.torch_state(state["torch"], f"{where}/torch", torch.get_rng_state().numel())
        try:
            torch.Generator().set_state(t)  # torch's own consistency check, on a scratch one
        except RuntimeError as e:
            raise rs.bad(f"{where}/torch", f"a valid CPU generator state ({e})", "state") from None
        apply.append(lambda: torch.set_rng_state(t))
    if "numpy" in state:
        np_state = rs.decode_numpy(state["numpy"], rs.GAUSS, f"{where}/numpy")
        if np_state["bit_generator"] != "MT19937":  # numpy's global RandomState is always one
            raise rs.bad(f"{where}/numpy/bit_generator", "'MT19937'", np_state["bit_generator"])
        rs.random_state(np_state, f"{where}/numpy")
        apply.append(lambda: np.random.set_state(np_state))
    if "python" in state:
        py_state = rs.decode_python(state["python"], f"{where}/python")
        apply.append(lambda: random.setstate(py_state))
    if "cuda" in state:
        cuda = state["cuda"]
        if not isinstance(cuda, list) or len(cuda) > 1024:
            raise rs.bad(f"{where}/cuda", "a list of per-device CUDA generator states", cuda)
        cuda_states = [rs.torch_state(t, f"{where}/cuda/{i}", None) for i, t in enumerate(cuda)]
        # first: torch checks a CUDA state only when it is set, so a bad one changes nothing else
        apply.insert(0, lambda: _restore_cuda(cuda_states, f"{where}/cuda"))

    def run() -> None:
        for f in apply:
            f()

    return run

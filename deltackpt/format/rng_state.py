"""How generator states are written, and the checks that make a stored one safe to use.

Two layouts share one set of field specs and validators:

* inside a state saved by :func:`deltackpt.rng.capture` (:data:`AS_TENSORS`): big arrays as
  tensors (a manifest stays small and ``deltackpt diff`` shows one changed tensor, not 624
  changed ints), floats as floats;
* the ``rng`` tag of the state tree (:func:`to_node` / :func:`from_node`, called by
  :mod:`deltackpt.format.tree`): a ``torch.Generator``, ``numpy.random.Generator`` /
  ``RandomState`` or ``random.Random`` found in a state, as plain JSON (arrays as lists of ints,
  floats as ``float.hex``, bytes as base64).

Everything read back is untrusted: each field is checked for type, length and range before any
generator sees it (numpy's setters accept an MT19937 ``pos`` of 10**6 or a Philox
``buffer_pos`` of 9, which index past their buffers; ``random.setstate`` accepts a
``gauss_next`` that is a string). A bad field raises :class:`~deltackpt.errors.ManifestError`
naming it (:func:`bad`), never a builtin error from deep inside a generator. Nothing here reads
or sets the process's global generators: that is :mod:`deltackpt.rng`.
"""

from __future__ import annotations

import base64
import binascii
import random
import reprlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Union

import numpy as np
import torch

from deltackpt.errors import ManifestError, UnsupportedValueError

_U32_MAX = (1 << 32) - 1
_U64_MAX = (1 << 64) - 1
_U128_MAX = (1 << 128) - 1
_MT_N = 624  # words of Mersenne Twister state (numpy's MT19937 and Python's random)
_MAX_TORCH_STATE = 1 << 20  # bytes; real states are 5056 (CPU) and 16 (CUDA)
_DEVICE_TYPES = ("cpu", "cuda", "mps", "xpu")  # devices a torch.Generator may be rebuilt on


# ---------------------------------------------------------------------------- field specs


@dataclass(frozen=True)
class _Int:
    lo: int
    hi: int  # inclusive


@dataclass(frozen=True)
class _Array:
    dtype: type[np.unsignedinteger[Any]]
    n: int


@dataclass(frozen=True)
class _Float:
    pass


_Spec = dict[str, Union[_Int, _Array, _Float, "_Spec"]]

_FLAG = _Int(0, 1)
_UINT32 = _Int(0, _U32_MAX)
_PCG = {"state": {"state": _Int(0, _U128_MAX), "inc": _Int(0, _U128_MAX)}}

# The state layout of each numpy bit generator (``bit_generator.state`` without its
# "bit_generator" name). Ranges are what the C code indexes with: numpy's own setters do not
# check them. A layout numpy changes in a later version is refused on save, never guessed.
_BIT_GENERATORS: dict[str, _Spec] = {
    "MT19937": {"state": {"key": _Array(np.uint32, _MT_N), "pos": _Int(0, _MT_N)}},
    "PCG64": {**_PCG, "has_uint32": _FLAG, "uinteger": _UINT32},
    "PCG64DXSM": {**_PCG, "has_uint32": _FLAG, "uinteger": _UINT32},
    "Philox": {
        "state": {"counter": _Array(np.uint64, 4), "key": _Array(np.uint64, 2)},
        "buffer": _Array(np.uint64, 4),
        "buffer_pos": _Int(0, 4),
        "has_uint32": _FLAG,
        "uinteger": _UINT32,
    },
    "SFC64": {"state": {"state": _Array(np.uint64, 4)}, "has_uint32": _FLAG, "uinteger": _UINT32},
}
GAUSS: _Spec = {"has_gauss": _FLAG, "gauss": _Float()}  # RandomState's cached normal draw
_TORCH_UINT = {np.uint32: torch.uint32, np.uint64: torch.uint64}


@dataclass(frozen=True)
class _Form:
    """How arrays and floats are written: as tensors and floats inside a saved state (capture),
    or as JSON lists and ``float.hex`` strings inside a tree node (to_node)."""

    array: Callable[[np.ndarray], Any]
    float_: Callable[[float], Any]


AS_TENSORS = _Form(lambda a: torch.from_numpy(a.copy()), float)
_AS_JSON = _Form(lambda a: [int(x) for x in a.tolist()], lambda f: float(f).hex())


def bad(where: str, expected: str, got: Any) -> ManifestError:
    shown = reprlib.repr(got)  # bounded: a hostile value may be huge or deeply nested
    return ManifestError(
        f"RNG state {where!r} is {type(got).__name__} {shown}; expected {expected}. The "
        "snapshot is damaged or was not written by deltackpt: load another snapshot (a "
        "Checkpointer skips its RNG state with rng=False)",
        field=where,
    )


def _keys(value: Any, want: set[str], where: str) -> Mapping[Any, Any]:
    if not isinstance(value, Mapping) or set(value) != want:
        got = list(value) if isinstance(value, Mapping) else value
        raise bad(where, f"a dict with the keys {sorted(want)}", got)
    return value


def check_int(value: Any, lo: int, hi: int, where: str) -> int:
    if type(value) is not int or not lo <= value <= hi:  # bool is not an int here
        raise bad(where, f"an int in [{lo}, {hi}]", value)
    return value


def _float(value: Any, where: str) -> float:
    if type(value) is float:
        return value
    if isinstance(value, str) and len(value) <= 64:
        try:
            return float.fromhex(value)
        except ValueError:
            pass
    raise bad(where, "a float (or its float.hex() string)", value)


def _array(value: Any, dtype: type[np.unsignedinteger[Any]], n: int, where: str) -> np.ndarray:
    """A 1-D unsigned array of ``n`` elements from a list of ints or a tensor of that dtype."""
    hi = int(np.iinfo(dtype).max)
    if isinstance(value, torch.Tensor):
        want = _TORCH_UINT[dtype]
        if value.dtype != want or tuple(value.shape) != (n,) or value.device.type != "cpu":
            raise bad(where, f"a CPU tensor of {n} {want}", f"{value.dtype} {list(value.shape)}")
        return value.contiguous().numpy().copy()
    if isinstance(value, (list, tuple)) and len(value) == n:
        if all(type(x) is int and 0 <= x <= hi for x in value):
            return np.array(value, dtype=dtype)
        raise bad(where, f"{n} ints in [0, {hi}]", next(x for x in value if not _in(x, hi)))
    raise bad(where, f"a list of {n} ints in [0, {hi}]", value)


def _in(x: Any, hi: int) -> bool:
    return type(x) is int and 0 <= x <= hi


def _encode(state: Any, spec: _Spec, form: _Form, what: str) -> dict[str, Any]:
    """``state`` (as numpy gives it) -> plain data, refusing any layout that is not ``spec``."""
    if not isinstance(state, Mapping) or set(state) != set(spec):
        raise UnsupportedValueError(
            f"{what}: numpy {np.__version__} reports a state layout deltackpt does not know "
            f"({sorted(map(str, state)) if isinstance(state, Mapping) else type(state)}, "
            f"expected {sorted(spec)}); pass allow_pickle=True to store it pickled"
        )
    out: dict[str, Any] = {}
    for k, s in spec.items():
        v = state[k]
        if isinstance(s, dict):
            out[k] = _encode(v, s, form, what)
        elif isinstance(s, _Array):
            out[k] = form.array(np.ascontiguousarray(v, dtype=s.dtype))
        elif isinstance(s, _Float):
            out[k] = form.float_(v)
        else:
            out[k] = int(v)
    return out


def _decode(value: Any, spec: _Spec, where: str) -> dict[str, Any]:
    """Plain data -> the state dict numpy expects, every field checked against ``spec``."""
    value = _keys(value, set(spec), where)
    out: dict[str, Any] = {}
    for k, s in spec.items():
        w = f"{where}/{k}"
        if isinstance(s, dict):
            out[k] = _decode(value[k], s, w)
        elif isinstance(s, _Array):
            out[k] = _array(value[k], s.dtype, s.n, w)
        elif isinstance(s, _Float):
            out[k] = _float(value[k], w)
        else:
            out[k] = check_int(value[k], s.lo, s.hi, w)
    return out


# ---------------------------------------------------------------------------- numpy


def _bit_generator_name(bg: Any) -> str | None:
    name = type(bg).__name__
    return name if name in _BIT_GENERATORS and type(bg) is getattr(np.random, name) else None


def encode_numpy(state: Mapping[str, Any], extra: _Spec, form: _Form, what: str) -> dict:
    name = state.get("bit_generator")
    spec = _BIT_GENERATORS.get(name) if isinstance(name, str) else None
    if spec is None:
        raise UnsupportedValueError(
            f"{what} uses the numpy bit generator {name!r}; deltackpt stores "
            f"{', '.join(_BIT_GENERATORS)} without pickle. Use one of those, or pass "
            "allow_pickle=True to store it pickled"
        )
    fields = {k: v for k, v in state.items() if k != "bit_generator"}
    return {"bit_generator": name, **_encode(fields, {**spec, **extra}, form, what)}


def decode_numpy(value: Any, extra: _Spec, where: str) -> dict[str, Any]:
    if not isinstance(value, Mapping):
        raise bad(where, "a dict with a 'bit_generator' name", value)
    name = value.get("bit_generator")
    if not isinstance(name, str) or name not in _BIT_GENERATORS:
        raise bad(f"{where}/bit_generator", f"one of {sorted(_BIT_GENERATORS)}", name)
    fields = {k: v for k, v in value.items() if k != "bit_generator"}
    return {"bit_generator": name, **_decode(fields, {**_BIT_GENERATORS[name], **extra}, where)}


def _bit_generator(state: dict[str, Any], where: str) -> Any:
    """A fresh bit generator of ``state``'s kind holding ``state`` (already validated)."""
    name = state["bit_generator"]
    bg = getattr(np.random, name)(0)  # seeded: no OS entropy needed for a state overwritten now
    try:
        bg.state = {k: v for k, v in state.items() if k not in GAUSS}
    except (ValueError, TypeError, OverflowError) as e:
        raise bad(where, f"a valid {name} state ({e})", name) from None
    return bg


def random_state(state: dict[str, Any], where: str) -> np.random.RandomState:
    rs = np.random.RandomState(_bit_generator(state, where))
    try:
        rs.set_state(state)
    except (ValueError, TypeError, OverflowError) as e:
        raise bad(where, f"a valid RandomState state ({e})", state["bit_generator"]) from None
    return rs


# ---------------------------------------------------------------------------- Python random


def encode_python(state: tuple[Any, ...], form: _Form, what: str) -> dict[str, Any]:
    if not (isinstance(state, tuple) and len(state) == 3 and state[0] == 3):
        raise UnsupportedValueError(
            f"{what}: random.Random reports a state of version "
            f"{state[0] if isinstance(state, tuple) and state else '?'}; deltackpt stores "
            "version 3 (CPython's Mersenne Twister). Pass allow_pickle=True to store it pickled"
        )
    version, internal, gauss_next = state
    return {
        "version": version,
        "internal": form.array(np.array(internal, dtype=np.uint32)),
        "gauss_next": None if gauss_next is None else form.float_(gauss_next),
    }


def decode_python(value: Any, where: str) -> tuple[Any, ...]:
    value = _keys(value, {"version", "internal", "gauss_next"}, where)
    check_int(value["version"], 3, 3, f"{where}/version")
    internal = _array(value["internal"], np.uint32, _MT_N + 1, f"{where}/internal")
    if not 0 <= int(internal[-1]) <= _MT_N:  # the last word is the position in the state
        raise bad(f"{where}/internal/{_MT_N}", f"a position in [0, {_MT_N}]", int(internal[-1]))
    g = value["gauss_next"]
    gauss_next = None if g is None else _float(g, f"{where}/gauss_next")
    state = (3, tuple(int(x) for x in internal), gauss_next)
    try:
        random.Random().setstate(state)  # CPython's own checks, on a scratch generator
    except (ValueError, TypeError, OverflowError) as e:
        raise bad(where, f"a valid random.Random state ({e})", "state") from None
    return state


# ---------------------------------------------------------------------------- torch


def torch_state(value: Any, where: str, n: int | None) -> torch.Tensor:
    """A CPU uint8 tensor of ``n`` bytes (any length up to 1 MiB when ``n`` is None)."""
    if (
        not isinstance(value, torch.Tensor)
        or value.dtype != torch.uint8
        or value.dim() != 1
        or value.device.type != "cpu"
        or not (value.numel() == n if n is not None else 0 < value.numel() <= _MAX_TORCH_STATE)
    ):
        got = f"{value.dtype} {list(value.shape)}" if isinstance(value, torch.Tensor) else value
        raise bad(where, f"a CPU uint8 tensor of {n or 'at most 1 MiB of'} bytes", got)
    return value.contiguous().clone()


# ---------------------------------------------------------------------------- tree nodes

_TYPES = (torch.Generator, np.random.Generator, np.random.RandomState, random.Random)


def is_generator(obj: Any) -> bool:
    """A generator the ``rng`` tree tag stores (exact types: a subclass may hold more state)."""
    return type(obj) in _TYPES


def to_node(obj: Any, path: str, allow_pickle: bool) -> dict[str, Any] | None:
    """The JSON value of an ``rng`` node for generator ``obj`` at state key ``path``; None when
    this kind cannot be stored without pickle and ``allow_pickle`` is set (the caller pickles)."""
    what = f"state key {path or '.'!r}"
    try:
        if type(obj) is torch.Generator:
            raw = obj.get_state().contiguous().numpy().tobytes()
            return {
                "type": "torch.Generator",
                "device": str(obj.device),
                "seed": obj.initial_seed(),
                "state": base64.b64encode(raw).decode("ascii"),
            }
        if type(obj) is np.random.Generator:
            bg = obj.bit_generator
            name = _bit_generator_name(bg)
            state = bg.state if name is not None else {"bit_generator": type(bg).__qualname__}
            node = encode_numpy(state, {}, _AS_JSON, what)
            return {"type": "numpy.random.Generator", **node}
        if type(obj) is np.random.RandomState:
            bg = getattr(obj, "_bit_generator", None)  # get_state() gives only its name
            if _bit_generator_name(bg) is None:
                state: Mapping[str, Any] = {"bit_generator": type(bg).__qualname__}
            else:
                state = obj.get_state(legacy=False)
            return {
                "type": "numpy.random.RandomState",
                **encode_numpy(state, GAUSS, _AS_JSON, what),
            }
        if type(obj) is random.Random:
            return {"type": "random.Random", **encode_python(obj.getstate(), _AS_JSON, what)}
    except UnsupportedValueError:
        if allow_pickle:
            return None
        raise
    raise UnsupportedValueError(f"{what}: {type(obj).__qualname__} is not a generator")


def from_node(value: Any, path: str) -> Any:
    """Rebuild the generator of an ``rng`` node read from a manifest (untrusted: validated)."""
    where = path or "."
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "torch.Generator":
        return _torch_generator(_keys(value, {"type", "device", "seed", "state"}, where), where)
    if kind == "numpy.random.Generator":
        fields = {k: v for k, v in value.items() if k != "type"}
        return np.random.Generator(_bit_generator(decode_numpy(fields, {}, where), where))
    if kind == "numpy.random.RandomState":
        fields = {k: v for k, v in value.items() if k != "type"}
        return random_state(decode_numpy(fields, GAUSS, where), where)
    if kind == "random.Random":
        fields = {k: v for k, v in value.items() if k != "type"}
        r = random.Random()
        r.setstate(decode_python(fields, where))
        return r
    kinds = [
        "torch.Generator",
        "numpy.random.Generator",
        "numpy.random.RandomState",
        "random.Random",
    ]
    raise bad(f"{where}/type", f"one of {kinds}", kind if isinstance(value, dict) else value)


def _torch_generator(value: Mapping[str, Any], where: str) -> torch.Generator:
    dev = value["device"]
    try:
        device = torch.device(dev) if isinstance(dev, str) and len(dev) <= 32 else None
    except RuntimeError:
        device = None
    if device is None or device.type not in _DEVICE_TYPES:
        raise bad(f"{where}/device", f"a device string of type {list(_DEVICE_TYPES)}", dev)
    seed = check_int(value["seed"], 0, _U64_MAX, f"{where}/seed")
    b64 = value["state"]
    if not isinstance(b64, str) or len(b64) > 2 * _MAX_TORCH_STATE:
        raise bad(f"{where}/state", "base64 of a generator state", b64)
    try:
        raw = base64.b64decode(b64, validate=True)
    except (binascii.Error, ValueError):
        raise bad(f"{where}/state", "base64 of a generator state", b64) from None
    try:
        g = torch.Generator(device=device)
    except RuntimeError as e:
        raise UnsupportedValueError(
            f"state key {where!r} holds a torch.Generator on {str(device)!r}, which this process "
            f"cannot create ({e}); load the snapshot where that device exists"
        ) from None
    n = g.get_state().numel()
    if len(raw) != n:
        raise bad(f"{where}/state", f"{n} bytes for a {device.type} generator", len(raw))
    g.manual_seed(seed)  # for devices whose state does not carry the seed
    try:
        g.set_state(torch.frombuffer(bytearray(raw), dtype=torch.uint8))
    except RuntimeError as e:
        raise bad(
            f"{where}/state", f"a valid {device.type} generator state ({e})", "state"
        ) from None
    return g

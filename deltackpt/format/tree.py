"""The state tree: nested containers <-> a JSON-safe tree whose tensor leaves are numbered.

A manifest never holds pickle unless the caller opted in, so loading cannot execute code. Every
node is plain JSON (``str``, ``int``, ``bool``, ``null``) or an object with one tag key:

=============  ===================================================================
``dict``       ``[[key_node, value_node], ...]`` in insertion order (keys may be int)
``odict``      same, for ``OrderedDict``; ``meta`` holds ``state_dict()._metadata``
``list``       ``[node, ...]``
``tuple``      ``[node, ...]``
``tensor``     index into the manifest's tensor list
``float``      ``float.hex()`` (exact, and nan/inf survive JSON)
``bytes``      base64
``size``       ``torch.Size`` as a list of ints
``dtype``      a torch dtype name; ``device``: a device string
``rng``        a generator's state as JSON: ``{"type": "torch.Generator" | ...}`` (rng_state)
``pickle``     base64 of ``pickle.dumps`` (only with ``allow_pickle=True``)
=============  ===================================================================
"""

from __future__ import annotations

import base64
import pickle
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from deltackpt.errors import (
    DeltackptError,
    PickleNotAllowedError,
    StoreFormatError,
    UnsupportedValueError,
)
from deltackpt.format import rng_state
from deltackpt.format.dtensor import Piece, is_dtensor
from deltackpt.format.dtypes import dtype_from_name, dtype_name

Node = Any  # a JSON value
# Deepest container nesting a save accepts. Must not exceed what a load accepts
# (deltackpt.format.validate.MAX_TREE_DEPTH), or a save would commit a snapshot no load can read; both
# stay far below Python's recursion limit (flattening recurses ~2 frames per level).
MAX_DEPTH = 100


@dataclass
class Leaf:
    """A tensor found in the state: its display path and the tensor itself."""

    path: str
    tensor: torch.Tensor


def _key_segment(key: Any) -> str:
    return key if isinstance(key, str) else repr(key) if not isinstance(key, int) else str(key)


class _Flattener:
    def __init__(self, allow_pickle: bool, check_tensors: bool = True) -> None:
        self.allow_pickle = allow_pickle
        self.check_tensors = check_tensors  # False for load targets: meta is a mismatch there
        self.leaves: list[Leaf] = []
        self._paths: set[str] = set()
        self._active: set[int] = set()  # ids of the containers on the current path

    def _unique(self, path: str) -> str:
        if path not in self._paths:
            self._paths.add(path)
            return path
        n = 2
        while f"{path}#{n}" in self._paths:
            n += 1
        self._paths.add(f"{path}#{n}")
        return f"{path}#{n}"

    def node(self, obj: Any, path: str) -> Node:
        # Exact type checks: a subclass (namedtuple, defaultdict, a Parameter subclass with
        # extra attributes) would not come back as itself, so it is refused or pickled.
        t = type(obj)
        if t is Piece:  # a piece of a global tensor without a DTensor (format/dtensor.py)
            self.leaves.append(Leaf(self._unique(path or "."), obj))  # type: ignore[arg-type]
            return {"tensor": len(self.leaves) - 1}
        if isinstance(obj, torch.Tensor):
            if is_dtensor(obj):  # a shard of a global tensor: planned by the distributed layer
                self.leaves.append(Leaf(self._unique(path or "."), obj))
                return {"tensor": len(self.leaves) - 1}
            if self.check_tensors:
                self._check_tensor(obj, path)
            if t not in (torch.Tensor, torch.nn.Parameter) and not _is_plain_tensor(obj):
                return self._fallback(obj, path)
            self.leaves.append(Leaf(self._unique(path or "."), obj))
            return {"tensor": len(self.leaves) - 1}
        if obj is None or t in (bool, int, str):
            return obj
        if t is float:
            return {"float": obj.hex()}
        if t is bytes:
            return {"bytes": base64.b64encode(obj).decode("ascii")}
        if t is torch.Size:
            return {"size": list(obj)}
        if t is torch.dtype:
            return {"dtype": dtype_name(obj, path)}
        if t is torch.device:
            return {"device": str(obj)}
        if rng_state.is_generator(obj):  # torch / numpy / random generators: their state, no pickle
            rng = rng_state.to_node(obj, path, self.allow_pickle)
            return {"rng": rng} if rng is not None else self._fallback(obj, path)
        if t in (dict, OrderedDict, list, tuple):
            self._enter(obj, path)  # refuses cycles and runaway nesting
            try:
                return self._container(obj, t, path)
            finally:
                self._active.discard(id(obj))
        return self._fallback(obj, path)

    def _container(self, obj: Any, t: type, path: str) -> Node:
        if t in (dict, OrderedDict):
            items = [
                [
                    self.key(k, path),
                    self.node(v, f"{path}/{_key_segment(k)}" if path else _key_segment(k)),
                ]
                for k, v in obj.items()
            ]
            if t is dict:
                return {"dict": items}
            out: dict[str, Node] = {"odict": items}
            meta = getattr(obj, "_metadata", None)
            if meta is not None:
                out["meta"] = self.node(meta, f"{path}/_metadata")
            return out
        seq = [self.node(v, f"{path}/{i}" if path else str(i)) for i, v in enumerate(obj)]
        return {"list" if t is list else "tuple": seq}

    def _enter(self, obj: Any, path: str) -> None:
        """Push a container on the current path. A container inside itself would recurse
        forever; a very deep one would hit Python's recursion limit here or on load."""
        if id(obj) in self._active:
            raise UnsupportedValueError(
                f"state key {path or '.'!r} holds a {type(obj).__name__} that contains itself "
                "(a self-referencing container, a cycle); a state must be a tree. Remove the "
                "back-reference (store the shared part once, or a key that names it)"
            )
        if len(self._active) >= MAX_DEPTH:
            shown = path if len(path) <= 200 else path[:200] + "..."
            raise UnsupportedValueError(
                f"state key {shown or '.'!r} is nested more than {MAX_DEPTH} containers "
                "deep; deltackpt stores at most that many levels (a state_dict has a handful). "
                "Flatten the structure (e.g. join keys into one string) before saving"
            )
        self._active.add(id(obj))

    def _check_tensor(self, obj: torch.Tensor, path: str) -> None:
        """Refuse tensors whose bytes are not one strided block of real data: their raw bytes
        cannot be saved (sparse, nested, quantized), or there are none (meta)."""
        where = f"state key {path or '.'!r}"
        if obj.is_nested:
            raise UnsupportedValueError(
                f"{where} holds a nested tensor (layout {obj.layout}); deltackpt stores dense "
                "strided tensors. Save its components instead, e.g. list(t.unbind())"
            )
        if obj.layout != torch.strided:
            fix = (
                "t.to_dense()"
                if obj.layout == torch._mkldnn  # type: ignore[attr-defined]
                else "t.to_dense(), or its indices and values as separate tensors "
                "(t.indices()/t.values() for COO, t.crow_indices()/t.col_indices()/t.values() "
                "for CSR)"
            )
            raise UnsupportedValueError(
                f"{where} holds a tensor with layout {obj.layout} (sparse or opaque); "
                f"deltackpt stores dense strided tensors, expected layout torch.strided. "
                f"Convert it first: {fix}"
            )
        if obj.is_meta:
            raise UnsupportedValueError(
                f"{where} holds a meta tensor (shape {list(obj.shape)}, no data); there are no "
                "bytes to save. Materialise it first (e.g. module.to_empty(device='cpu') and "
                "initialise or load the weights), or leave it out of the state"
            )
        if obj.is_quantized:
            raise UnsupportedValueError(
                f"{where} holds a quantized tensor ({obj.dtype}); deltackpt stores plain dtypes. "
                "Save t.dequantize(), or t.int_repr() with t.q_scale()/t.q_zero_point() as "
                "separate values"
            )

    def key(self, key: Any, path: str) -> Node:
        if key is None or type(key) in (bool, int, str, float, tuple, bytes):
            return self.node(key, path)
        return self._fallback(key, path)

    def _fallback(self, obj: Any, path: str) -> Node:
        if not self.allow_pickle:
            raise UnsupportedValueError(
                f"state key {path or '.'!r} holds a {type(obj).__module__}.{type(obj).__qualname__}; "
                "deltackpt stores tensors, dicts, lists, tuples, str, int, float, bool, None and "
                "bytes without pickle. Convert it to one of those (e.g. obj.state_dict()), or "
                "pass allow_pickle=True to store it pickled (loading it will then need "
                "allow_pickle=True too)"
            )
        return {"pickle": base64.b64encode(pickle.dumps(obj, protocol=4)).decode("ascii")}


def _is_plain_tensor(t: torch.Tensor) -> bool:
    # Subclasses such as DTensor are handled by the distributed layer, not here.
    return type(t).__torch_function__ is torch.Tensor.__torch_function__


def flatten(
    state: Any, allow_pickle: bool = False, check_tensors: bool = True
) -> tuple[Node, list[Leaf]]:
    """Return ``(tree, leaves)``: the JSON-safe tree and the tensors in it, in tree order."""
    f = _Flattener(allow_pickle, check_tensors)
    tree = f.node(state, "")
    return tree, f.leaves


def unflatten(
    tree: Node,
    tensor: Callable[[int], torch.Tensor],
    allow_pickle: bool = False,
    path: str = "",
) -> Any:
    """Rebuild the state; ``tensor(i)`` returns the i-th tensor of the manifest."""
    if tree is None or isinstance(tree, (bool, int, str)):
        return tree
    if not isinstance(tree, dict) or len(tree) not in (1, 2):
        raise StoreFormatError(f"manifest tree node at {path or '.'!r} is malformed: {tree!r:.80}")
    tag = next(k for k in tree if k != "meta")
    value = tree[tag]
    sub = lambda v, seg: unflatten(v, tensor, allow_pickle, f"{path}/{seg}" if path else seg)  # noqa: E731
    if tag == "tensor":
        return tensor(value)
    if tag == "float":
        return float.fromhex(value)
    if tag == "bytes":
        return base64.b64decode(value)
    if tag == "size":
        return torch.Size(value)
    if tag == "dtype":
        return dtype_from_name(value)
    if tag == "device":
        return torch.device(value)
    if tag == "rng":  # validated field by field before a generator is built (format.rng_state)
        return rng_state.from_node(value, path)
    if tag in ("dict", "odict"):
        out: dict[Any, Any] = {} if tag == "dict" else OrderedDict()
        for k_node, v_node in value:
            k = unflatten(k_node, tensor, allow_pickle, path)
            out[k] = sub(v_node, _key_segment(k))
        if "meta" in tree:
            out._metadata = sub(tree["meta"], "_metadata")  # type: ignore[attr-defined]
        return out
    if tag in ("list", "tuple"):
        seq = [sub(v, str(i)) for i, v in enumerate(value)]
        return seq if tag == "list" else tuple(seq)
    if tag == "pickle":
        if not allow_pickle:
            raise PickleNotAllowedError(
                f"state key {path or '.'!r} was saved pickled; unpickling can execute code, so "
                "load it only from a store you trust, with allow_pickle=True"
            )
        return pickle.loads(base64.b64decode(value))
    raise StoreFormatError(f"manifest tree node at {path or '.'!r} has unknown tag {tag!r}")


def tensor_paths(tree: Node, path: str = "") -> dict[int, str]:
    """Map tensor index -> path without building tensors (used for ``into=`` matching)."""
    out: dict[int, str] = {}

    def walk(node: Node, p: str) -> None:
        if not isinstance(node, dict):
            return
        if "tensor" in node:
            out[node["tensor"]] = p or "."
        for tag in ("dict", "odict"):
            for k_node, v_node in node.get(tag, ()):
                k = unflatten(k_node, lambda i: torch.empty(0), False, p)
                seg = _key_segment(k)
                walk(v_node, f"{p}/{seg}" if p else seg)
        for tag in ("list", "tuple"):
            for i, v in enumerate(node.get(tag, ())):
                walk(v, f"{p}/{i}" if p else str(i))

    walk(tree, path)
    return out


def value_leaves(tree: Node, path: str = "") -> Iterator[tuple[str, Node]]:
    """(path, node) of every non-tensor leaf of a manifest tree; the node is its JSON form.

    Paths are built like tensor key paths (``load(into=)`` matches on them). An odict's
    ``meta`` (``state_dict()._metadata``) is bookkeeping, not a value, and is skipped.
    """
    if not isinstance(tree, dict):
        yield (path or "."), tree
        return
    if "tensor" in tree:
        return
    for tag in ("dict", "odict"):
        if tag in tree:
            for k_node, v_node in tree[tag]:
                try:
                    seg = _key_segment(unflatten(k_node, _no_tensor, False))
                except DeltackptError:
                    seg = "<pickled key>"
                yield from value_leaves(v_node, f"{path}/{seg}" if path else seg)
            return
    for tag in ("list", "tuple"):
        if tag in tree:
            for i, v_node in enumerate(tree[tag]):
                yield from value_leaves(v_node, f"{path}/{i}" if path else str(i))
            return
    yield (path or "."), tree  # float, bytes, size, dtype, device, rng, pickle


def _no_tensor(i: int) -> torch.Tensor:
    raise AssertionError("unreachable: a value subtree holds no tensor")

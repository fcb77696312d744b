"""Key paths and names shared by export and import: which part of a state is the model, what
each tensor is called in Hugging Face files, and the caller's renames.

A *key path* selects a sub-tree of a saved state: ``"model"`` is ``state["model"]``,
``"model/backbone"`` is ``state["model"]["backbone"]``, ``None`` or ``""`` is the whole state.
Inside the selected sub-tree a tensor's name is its keys joined with ``.`` (a state dict is flat,
so its keys are the names as they are). A snapshot written through the DCP plug-in may hold flat
dotted keys (``"model.layers.0.weight"``); a key path that names no container there selects the
keys that start with ``"<key>."`` instead, with that prefix removed.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from deltackpt.errors import InvalidArgumentError, StateKeyError
from deltackpt.format.tree import Node, _key_segment, unflatten

Rename = Callable[[str], "str | None"] | Mapping[str, str] | None


def _no_tensor(i: int) -> Any:
    raise AssertionError("unreachable: keys hold no tensors")


def _children(node: Node) -> list[tuple[str, Node]] | None:
    """(key segment, child) of a dict/list node of a manifest tree; None for a leaf."""
    if not isinstance(node, dict):
        return None
    for tag in ("dict", "odict"):
        if tag in node:
            return [(_key_segment(unflatten(k, _no_tensor)), v) for k, v in node[tag]]
    for tag in ("list", "tuple"):
        if tag in node:
            return [(str(i), v) for i, v in enumerate(node[tag])]
    return None


def tree_tensors(node: Node, prefix: str = "") -> list[tuple[str, int]]:
    """(name, tensor index) of every tensor under ``node``, in tree order, names joined by
    ``.``; non-tensor values are skipped."""
    if isinstance(node, dict) and "tensor" in node:
        return [(prefix, int(node["tensor"]))]
    out: list[tuple[str, int]] = []
    for seg, child in _children(node) or []:
        out.extend(tree_tensors(child, f"{prefix}.{seg}" if prefix else seg))
    return out


def _segments(key: str | None) -> list[str]:
    if key is None:
        return []
    if not isinstance(key, str):
        raise InvalidArgumentError(
            f"key={key!r} is invalid: expected a key path string such as 'model' or "
            "'model/backbone', or None for the whole state"
        )
    return [s for s in key.split("/") if s]


def _unknown(key: str, where: str, have: list[str]) -> StateKeyError:
    shown = ", ".join(repr(k) for k in have[:20]) + (" ..." if len(have) > 20 else "")
    return StateKeyError(
        f"key {key!r} names nothing in {where}; it holds {shown or 'no keys'}. Pass one of "
        "those as key= (a path such as 'model/backbone' for nested states, or key=None for "
        "the whole state)"
    )


def select_tree_tensors(tree: Node, key: str | None, where: str) -> list[tuple[str, int]]:
    """(name, tensor index) of the tensors of the sub-tree ``key`` of a manifest tree;
    :class:`StateKeyError` naming the key and what exists when it selects nothing."""
    node = tree
    segs = _segments(key)
    for i, seg in enumerate(segs):
        kids = _children(node)
        hit = [child for k, child in kids or [] if k == seg]
        if hit:
            node = hit[0]
            continue
        # DCP-written snapshots: flat dotted keys at this level
        prefix = ".".join(segs[i:]) + "."
        flat = [(n[len(prefix) :], t) for n, t in tree_tensors(node) if n.startswith(prefix)]
        if flat:
            return flat
        raise _unknown(str(key), where, [k for k, _ in kids or []])
    if isinstance(node, dict) and "tensor" in node:
        raise _unknown(str(key), where + " (it is a single tensor, not a state dict)", [])
    return tree_tensors(node)


def select_object(obj: Any, key: str | None, where: str) -> Any:
    """The sub-tree ``key`` of a loaded Python state (nested dicts and lists)."""
    for seg in _segments(key):
        if isinstance(obj, Mapping):
            hit = [v for k, v in obj.items() if _key_segment(k) == seg]
            if hit:
                obj = hit[0]
                continue
            raise _unknown(str(key), where, [_key_segment(k) for k in obj])
        if isinstance(obj, (list, tuple)) and seg.isdigit() and int(seg) < len(obj):
            obj = obj[int(seg)]
            continue
        raise _unknown(str(key), where, [])
    return obj


def check_rename(rename: Rename) -> None:
    if rename is not None and not callable(rename) and not isinstance(rename, Mapping):
        raise InvalidArgumentError(
            f"rename={rename!r} is invalid: expected a dict (old name -> new name), a callable "
            "(name -> new name, or None to leave the tensor out) or None"
        )


def renamed(names: list[str], rename: Rename) -> list[str | None]:
    """Each name after ``rename`` (a dict: names not in it are kept; a callable: a return of
    None leaves the tensor out). Two tensors may not end up with one name."""
    check_rename(rename)
    if rename is None:
        out: list[str | None] = list(names)
    elif isinstance(rename, Mapping):
        out = [rename.get(n, n) for n in names]
    else:
        out = [rename(n) for n in names]
    seen: dict[str, str] = {}
    for old, new in zip(names, out, strict=True):
        if new is None:
            continue
        if not isinstance(new, str) or not new:
            raise InvalidArgumentError(
                f"rename maps {old!r} to {new!r}; expected a non-empty string (or None to leave "
                "the tensor out)"
            )
        if new in seen:
            raise InvalidArgumentError(
                f"rename maps both {seen[new]!r} and {old!r} to {new!r}; every tensor needs its "
                "own name. Fix the mapping, or map one of them to None to leave it out"
            )
        seen[new] = old
    return out

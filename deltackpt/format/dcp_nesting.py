"""The nesting of a DCP-written snapshot, rebuilt for ``deltackpt.load`` (pure: no DCP import).

``torch.distributed.checkpoint.save`` flattens the state before any storage writer sees it:
``{"model": {"w": t}}`` becomes the item ``"model.w"``, and the flattening is recorded in
``Metadata.planner_data`` (fqn -> path tuple: ``("model", "w")``; a list index is an ``int``).
:class:`deltackpt.dcp.StoreWriter` keeps that mapping in ``manifest.metadata["dcp"]
["planner_data"]`` and the manifest tree stays flat (one item per fqn, as DCP's reader needs and as
the golden stores pin). :func:`nested_manifest` rebuilds the nesting from it at load time, so
``deltackpt.load`` returns what was saved, for snapshots written before this module too.

DCP turns every mapping key into ``str`` (``str(k)``), so int keys cannot be told from the path;
the one place where that matters is put back: the ``state`` of an optimizer state dict (a dict
with ``state`` and ``param_groups``) gets its int parameter ids again, as ``torch.optim``'s
``load_state_dict`` needs. A mapping the store cannot back (paths that disagree with their fqn,
clash, leave holes in a list, or nest too deep) leaves the tree flat, as before: a store is
untrusted input, and the flat tree is always a faithful answer.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass, field
from typing import Any

from deltackpt.format.dcp_values import DCP_KEY
from deltackpt.format.manifest import Manifest

MAX_PATH = 32  # path segments per fqn; the value below it adds its own (bounded) depth
_TOP = "dict"


@dataclass
class _Leaf:
    node: Any  # the item's tree node, unchanged


@dataclass
class _Branch:
    kind: str  # "dict" or "list"
    items: dict[Any, _Branch | _Leaf] = field(default_factory=dict)  # insertion order kept


class _Flat(Exception):
    """The mapping cannot be trusted: keep the flat tree."""


def nested_manifest(m: Manifest) -> Manifest:
    """``m`` with its tree nested as DCP saved it, when ``m`` is a DCP-written snapshot with a
    usable ``planner_data``; otherwise ``m`` itself."""
    info = m.metadata.get(DCP_KEY)
    if not isinstance(info, dict):
        return m
    pd = info.get("planner_data")
    tree = m.tree
    if not isinstance(pd, dict) or not isinstance(tree, dict) or list(tree) != [_TOP]:
        return m
    items = tree[_TOP]
    if not isinstance(items, list):
        return m
    try:
        nested, paths = _nest(items, pd)
    except _Flat:
        return m
    # tensor entries and DCP's byte-value list take the paths deltackpt.save would give them
    # ("model/w"), so load(into=) and key selection match the nested state
    tensors = tuple(
        dataclasses.replace(e, path=paths[e.path]) if e.path in paths else e for e in m.tensors
    )
    metadata = m.metadata
    if isinstance(info.get("bytes"), list):
        moved = [paths.get(p, p) if isinstance(p, str) else p for p in info["bytes"]]
        metadata = {**m.metadata, DCP_KEY: {**info, "bytes": moved}}
    return dataclasses.replace(m, tree=nested, tensors=tensors, metadata=metadata)


def _path_of(fqn: Any, pd: dict[str, Any]) -> list[Any]:
    if not isinstance(fqn, str):
        raise _Flat
    path = pd.get(fqn, [fqn])
    if not isinstance(path, list) or not 1 <= len(path) <= MAX_PATH:
        raise _Flat
    if not isinstance(path[0], str) or not all(
        isinstance(p, str) or (type(p) is int and p >= 0) for p in path
    ):
        raise _Flat
    if ".".join(map(str, path)) != fqn:
        raise _Flat
    return path


def _nest(items: list[Any], pd: dict[str, Any]) -> tuple[Any, dict[str, str]]:
    """The nested tree, and every fqn's deltackpt path (segments joined with ``/``)."""
    root = _Branch("dict")
    fqns: list[tuple[str, list[Any]]] = []
    for item in items:
        if not isinstance(item, list) or len(item) != 2:
            raise _Flat
        path = _path_of(item[0], pd)
        fqns.append((item[0], path))
        cur = root
        for seg, nxt in itertools.pairwise(path):
            child = cur.items.get(seg)
            kind = "list" if isinstance(nxt, int) else "dict"
            if child is None:
                child = cur.items[seg] = _Branch(kind)
            if not isinstance(child, _Branch) or child.kind != kind:
                raise _Flat
            cur = child
        if path[-1] in cur.items:
            raise _Flat
        cur.items[path[-1]] = _Leaf(item[1])
    _restore_param_ids(root)
    return _node(root), {fqn: "/".join(map(str, path)) for fqn, path in fqns}


def _node(b: _Branch | _Leaf) -> Any:
    if isinstance(b, _Leaf):
        return b.node
    if b.kind == "list":
        if sorted(b.items) != list(range(len(b.items))):
            raise _Flat  # a hole: DCP dropped an empty container; the list cannot be rebuilt
        return {"list": [_node(b.items[i]) for i in range(len(b.items))]}
    return {"dict": [[k, _node(v)] for k, v in b.items.items()]}


def _restore_param_ids(b: _Branch | _Leaf) -> None:
    """Optimizer state dicts: ``{"state": {"0": ...}, "param_groups": ...}`` -> int ids."""
    if isinstance(b, _Leaf):
        return
    state = b.items.get("state")
    if (
        b.kind == "dict"
        and "param_groups" in b.items
        and isinstance(state, _Branch)
        and state.kind == "dict"
        and all(isinstance(k, str) and k.isdigit() and str(int(k)) == k for k in state.items)
    ):
        state.items = {int(k): v for k, v in state.items.items()}
    for child in b.items.values():
        _restore_param_ids(child)

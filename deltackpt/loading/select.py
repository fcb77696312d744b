"""Which keys of a snapshot a load wants: ``load(keys=...)``, decided before any read.

A selection is a collection of key paths or prefixes, or a predicate. Key paths are those of the
manifest (what :func:`deltackpt.load`'s error messages name): containers joined by ``/``, a state
dict's own keys kept as they are, e.g. ``"model/layers.0.mlp.experts.3.w1"`` for
``{"model": model.state_dict()}``. A collection entry ``k`` selects a path ``p`` when ``p == k``
or ``p`` lies under ``k`` (``k/...`` or ``k....``), comparing both as written and with every ``/``
read as ``.`` (so ``"model.layers.0"`` selects ``"model/layers.0.attn.w"``, and not
``"model/layers.01.w"``). A predicate gets the path and returns whether to load it.

:func:`prune_tree` cuts a manifest tree down to the selected leaves (tensors and values), so
unselected entries are never planned, allocated or read.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any

from deltackpt.errors import InvalidArgumentError
from deltackpt.format.tree import Node, _key_segment, unflatten

KeySelection = Collection[str] | Callable[[str], bool] | None
Select = Callable[[str], bool]


def key_filter(keys: KeySelection) -> Select | None:
    """The predicate of a ``keys=`` argument, or None when everything is wanted."""
    if keys is None:
        return None
    if callable(keys):
        fn = keys
        return lambda p: bool(fn(p))
    if isinstance(keys, (str, bytes)) or not isinstance(keys, Collection):
        raise InvalidArgumentError(
            f"keys={keys!r:.80} is invalid: expected a collection of key paths or prefixes "
            f"(e.g. keys=['model'] or keys={{'model/l1.weight'}}) or a predicate "
            f"Callable[[str], bool], got {type(keys).__name__}. Wrap a single key in a list"
        )
    wanted: set[str] = set()
    for k in keys:
        if not isinstance(k, str) or not k:
            raise InvalidArgumentError(
                f"keys= holds {k!r:.60} ({type(k).__name__}); every entry must be a non-empty "
                "key path string such as 'model/l1.weight' or a prefix such as 'model'"
            )
        wanted.add(k)
        wanted.add(k.replace("/", "."))
    return lambda p: _matches(p, wanted)


def _matches(path: str, wanted: set[str]) -> bool:
    for p in (path, path.replace("/", ".")):
        if p in wanted:
            return True
        # every proper prefix ending just before a separator
        for i, c in enumerate(p):
            if c in "/." and p[:i] in wanted:
                return True
    return False


def _no_tensor(i: int) -> Any:
    raise AssertionError("unreachable: a dict key holds no tensor")


def prune_tree(tree: Node, select: Select) -> tuple[Node, set[int]]:
    """``tree`` with only the leaves ``select`` keeps, and the tensor indices it still holds.

    A dict loses its unselected keys and its containers left empty by the cut; a list or tuple
    keeps its length (an unselected element becomes None) unless nothing in it is selected; an
    odict keeps its ``_metadata``. The root is at least an empty dict."""
    kept: set[int] = set()

    def walk(node: Node, path: str) -> tuple[Node, bool]:
        """(pruned node, whether anything under it is selected)."""
        if isinstance(node, dict) and "tensor" in node:
            if select(path or "."):
                kept.add(node["tensor"])
                return node, True
            return None, False
        for tag in ("dict", "odict"):
            if isinstance(node, dict) and tag in node:
                items = []
                for k_node, v_node in node[tag]:
                    seg = _key_segment(unflatten(k_node, _no_tensor, False, path))
                    sub, any_kept = walk(v_node, f"{path}/{seg}" if path else seg)
                    if any_kept:
                        items.append([k_node, sub])
                out = {tag: items}
                if "meta" in node:
                    out["meta"] = node["meta"]
                return out, bool(items)
        for tag in ("list", "tuple"):
            if isinstance(node, dict) and tag in node:
                seq, hit = [], False
                for i, v in enumerate(node[tag]):
                    sub, any_kept = walk(v, f"{path}/{i}" if path else str(i))
                    seq.append(sub if any_kept else None)
                    hit = hit or any_kept
                return {tag: seq}, hit
        return (node, True) if select(path or ".") else (None, False)

    pruned, hit = walk(tree, "")
    return (pruned if hit else {"dict": []}), kept

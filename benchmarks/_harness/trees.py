"""State trees: leaves by dotted path, tensors by storage, bit-exact comparisons."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch


def iter_leaves(obj: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """(dotted path, leaf) for every leaf of nested dicts / lists / tuples."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from iter_leaves(v, f"{prefix}.{k}" if prefix else str(k))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from iter_leaves(v, f"{prefix}.{i}" if prefix else str(i))
    else:
        yield prefix, obj


def flat_tensors(obj: Any) -> dict[str, torch.Tensor]:
    return {k: v for k, v in iter_leaves(obj) if isinstance(v, torch.Tensor)}


def flat_values(obj: Any) -> dict[str, Any]:
    """Non-tensor leaves (tuples become lists, so JSON round trips compare equal)."""
    return {k: v for k, v in iter_leaves(obj) if not isinstance(v, torch.Tensor)}


def map_tensors(obj: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """Same structure, tensors replaced by ``fn(t)``; tensors sharing a storage stay shared."""
    memo: dict[tuple[int, int, tuple[int, ...]], torch.Tensor] = {}

    def go(o: Any) -> Any:
        if isinstance(o, torch.Tensor):
            key = (o.untyped_storage().data_ptr(), o.storage_offset(), tuple(o.shape))
            if key not in memo:
                memo[key] = fn(o)
            return memo[key]
        if isinstance(o, dict):
            return type(o)((k, go(v)) for k, v in o.items())
        if isinstance(o, list):
            return [go(v) for v in o]
        if isinstance(o, tuple):
            return tuple(go(v) for v in o)
        return o

    return go(obj)


def unique_tensors(obj: Any) -> list[tuple[str, torch.Tensor]]:
    """First (path, tensor) per distinct storage: tied weights counted once."""
    seen: set[int] = set()
    out = []
    for k, t in flat_tensors(obj).items():
        p = t.untyped_storage().data_ptr()
        if p not in seen:
            seen.add(p)
            out.append((k, t))
    return out


def logical_bytes(obj: Any) -> int:
    return sum(t.numel() * t.element_size() for _, t in unique_tensors(obj))


_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bit_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """torch.equal on the raw bits (so -0.0 != 0.0 and NaN payloads count)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    a, b = a.detach().cpu(), b.detach().cpu()
    if a.numel() == 0:
        return True
    it = _INT_OF_SIZE.get(a.element_size())
    if it is None or a.dtype.is_complex:
        return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))
    return torch.equal(a.contiguous().view(it), b.contiguous().view(it))


def _view_key(t: torch.Tensor) -> tuple[int, int, tuple[int, ...]]:
    return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))


def compare(src: dict[str, torch.Tensor], got: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Bit-exact check of every source tensor against the loaded one (matched by path)."""
    missing = [k for k in src if k not in got]
    # A tied pair (same storage in the source) that is also tied in the result is compared once.
    seen: dict[tuple[int, int, tuple[int, ...]], tuple[int, int, tuple[int, ...]]] = {}
    bad = []
    for k in src:
        if k not in got:
            continue
        s_key = _view_key(src[k])
        g_key = _view_key(got[k])
        if seen.get(s_key) == g_key:
            continue
        seen[s_key] = g_key
        if not bit_equal(src[k], got[k]):
            bad.append(k)
    return {
        "exact": not missing and not bad,
        "checked": len(src),
        "n_missing": len(missing),
        "n_mismatch": len(bad),
        "missing": missing[:5],
        "mismatch": bad[:5],
    }


def bit_digests(flat: dict[str, torch.Tensor]) -> dict[str, str]:
    """xxh3-128 of every tensor's raw bytes (plus dtype and shape): a cheap bit-exact check
    (~10x faster than torch.equal here) for repeated loads of the same data."""
    import xxhash

    out = {}
    for k, t in flat.items():
        t = t.detach().cpu().contiguous()
        b = t.reshape(-1).view(torch.uint8).numpy() if t.numel() else b""
        out[k] = f"{t.dtype}{tuple(t.shape)}:{xxhash.xxh3_128_hexdigest(b)}"
    return out


def compare_digests(src: dict[str, str], got: dict[str, torch.Tensor]) -> dict[str, Any]:
    d = bit_digests({k: got[k] for k in src if k in got})
    missing = [k for k in src if k not in got]
    bad = [k for k in src if k in d and d[k] != src[k]]
    return {
        "exact": not missing and not bad,
        "checked": len(src),
        "n_missing": len(missing),
        "n_mismatch": len(bad),
        "missing": missing[:5],
        "mismatch": bad[:5],
    }


def tied_pairs(state: Any) -> list[tuple[str, str]]:
    """(first path, later path) for every tensor that shares the storage of an earlier one."""
    first: dict[int, str] = {}
    out = []
    for k, t in flat_tensors(state).items():
        p = t.untyped_storage().data_ptr()
        if p in first:
            out.append((first[p], k))
        else:
            first[p] = k
    return out


def zero_(state: Any) -> None:
    with torch.no_grad():
        for _, t in unique_tensors(state):
            t.zero_()


def copy_into(
    src: dict[str, torch.Tensor], target: Any, rename: dict[str, str] | None = None
) -> None:
    """copy_ every target tensor from ``src`` (flat, by path); tied targets are copied once."""
    done: set[int] = set()
    with torch.no_grad():
        for k, t in flat_tensors(target).items():
            p = t.untyped_storage().data_ptr()
            if p in done:
                continue
            done.add(p)
            t.copy_(src[(rename or {}).get(k, k)])

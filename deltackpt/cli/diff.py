"""``deltackpt diff STORE A B``: tensors and non-tensor values changed, added and removed.

Two entries with the same layout and the same chunk digests hold the same bytes. Small tensors
share grouped chunks with their neighbours, so for them a differing digest does not mean the
tensor changed: their bytes are read (and verified) and compared.

Exit code 0 when nothing differs, 1 when something does (like ``diff(1)``).
"""

from __future__ import annotations

import argparse
from typing import Any

import numpy as np

from deltackpt.cli.exit_codes import OK, PROBLEM
from deltackpt.cli.format import (
    Console,
    display_value,
    escape,
    human_bytes,
    new_table,
    print_json,
    shape_str,
    value_doc,
)
from deltackpt.cli.snapshots import entry_bytes, open_existing
from deltackpt.format.manifest import Manifest, Slice, TensorEntry
from deltackpt.format.tree import value_leaves
from deltackpt.store.chunks import ChunkReader
from deltackpt.store.store import Store


def _entry_slices(m: Manifest, e: TensorEntry) -> list[Slice]:
    if e.storage is not None:
        return list(m.storages[e.storage.id][1])
    return e.all_slices()


def _signature(m: Manifest, e: TensorEntry) -> tuple[Any, ...]:
    view = (e.storage.offset, e.storage.stride) if e.storage is not None else None
    shards = tuple((sh.offsets, sh.shape) for sh in e.shards) if e.shards is not None else None
    return (e.dtype, e.shape, view, shards, tuple(_entry_slices(m, e)))


def _grouped(m: Manifest, e: TensorEntry) -> bool:
    """Whether any of the tensor's bytes sit in a chunk that holds other bytes too."""
    return any(start or length != m.chunks[d].size for d, start, length in _entry_slices(m, e))


class _Bytes:
    """Reads tensor bytes of manifests of one store (for diffs of tensors in grouped chunks)."""

    def __init__(self, st: Store) -> None:
        self._packs = st.pack_readers()
        self._cache: dict[str, np.ndarray] = {}

    def close(self) -> None:
        self._packs.close()

    def read(self, m: Manifest, e: TensorEntry) -> bytes:
        reader = ChunkReader(self._packs, m.chunks, verify=True)
        out = []
        for d, start, length in _entry_slices(m, e):
            raw = self._cache.get(d)
            if raw is None:
                raw = np.empty(m.chunks[d].size, dtype=np.uint8)
                reader.decode_into(d, raw, f"snapshot {m.name!r} key {e.path!r}")
                self._cache[d] = raw
            out.append(raw[start : start + length].tobytes())
        return b"".join(out)  # for a view of a shared storage: the storage's bytes


# status, key, dtype, shape, bytes, (dtype, shape) before when a changed tensor's layout changed
Row = tuple[str, str, str, tuple[int, ...], int, "tuple[str, tuple[int, ...]] | None"]


def _tensor_rows(st: Store, a: Manifest, b: Manifest) -> tuple[list[Row], int, int, int]:
    """(rows of changed tensors, how many changed, their bytes, how many unchanged)."""
    ea = {e.path: e for e in a.tensors}
    eb = {e.path: e for e in b.tensors}
    rows: list[Row] = []
    changed_bytes = unchanged = n_changed = 0
    reader = _Bytes(st)
    try:
        for path, e in eb.items():
            old = ea.get(path)
            if old is None:
                continue
            if _signature(a, old) == _signature(b, e):
                unchanged += 1
                continue
            was = None
            if old.dtype != e.dtype or old.shape != e.shape:
                was = (old.dtype, old.shape)
            elif (_grouped(a, old) or _grouped(b, e)) and reader.read(a, old) == reader.read(b, e):
                # Small tensors share chunks with their neighbours: a differing digest does
                # not mean this tensor changed, so their bytes decide.
                unchanged += 1
                continue
            n_changed += 1
            changed_bytes += entry_bytes(e)
            rows.append(("changed", path, e.dtype, e.shape, entry_bytes(e), was))
    finally:
        reader.close()
    return rows, n_changed, changed_bytes, unchanged


def cmd_diff(args: argparse.Namespace, out: Console) -> int:
    st = open_existing(args)
    a, b = st.manifest(args.a), st.manifest(args.b)
    ea = {e.path: e for e in a.tensors}
    eb = {e.path: e for e in b.tensors}
    rows, n_changed, changed_bytes, unchanged = _tensor_rows(st, a, b)
    added = [p for p in eb if p not in ea]
    removed = [p for p in ea if p not in eb]
    for status, paths, entries in (("added", added, eb), ("removed", removed, ea)):
        for p in paths:
            e = entries[p]
            rows.append((status, p, e.dtype, e.shape, entry_bytes(e), None))
    va, vb = dict(value_leaves(a.tree)), dict(value_leaves(b.tree))
    vrows: list[tuple[str, str, Any, Any]] = []  # status, key, old node, new node
    for p, node in vb.items():
        if p not in va:
            vrows.append(("added", p, _ABSENT, node))
        elif va[p] != node:
            vrows.append(("changed", p, va[p], node))
    vrows += [("removed", p, node, _ABSENT) for p, node in va.items() if p not in vb]
    code = PROBLEM if rows or vrows else OK
    if args.json:
        summary = {
            "changed": n_changed,
            "changed_bytes": changed_bytes,
            "added": len(added),
            "removed": len(removed),
            "unchanged": unchanged,
            "values_differ": len(vrows),
        }
        print_json(_doc(args, a, b, rows, vrows, summary))
        return code
    out.print(f"diff {escape(a.name)} → {escape(b.name)}")
    if rows:
        t = new_table()
        t.add_column("", no_wrap=True)
        t.add_column("key", overflow="fold")
        t.add_column("dtype")
        t.add_column("shape")
        t.add_column("bytes", justify="right")
        t.add_column("note")
        style = {"changed": "yellow", "added": "green", "removed": "red"}
        for status, path, dtype, shape, n, was in rows:
            note = f"was {was[0]}{shape_str(was[1])}" if was else ""
            t.add_row(
                f"[{style[status]}]{status}[/]",
                escape(path),
                dtype,
                shape_str(shape),
                human_bytes(n),
                note,
            )
        out.print(t)
    if vrows:
        t = new_table("non-tensor values")
        for col in ("", "key", "old", "new"):
            t.add_column(col, overflow="fold")
        for status, p, old, new in vrows:
            t.add_row(*map(escape, (status, p, _display(old), _display(new))))
        out.print(t)
    out.print(
        f"{n_changed} changed ({human_bytes(changed_bytes)}), {len(added)} added, "
        f"{len(removed)} removed, {unchanged} unchanged"
        + (f"; {len(vrows)} non-tensor value(s) differ" if vrows else "")
    )
    return code


_ABSENT = object()  # a value one side of the diff does not have


def _display(node: Any) -> str:
    return "" if node is _ABSENT else display_value(node)


def _doc(
    args: argparse.Namespace,
    a: Manifest,
    b: Manifest,
    rows: list[Row],
    vrows: list[tuple[str, str, Any, Any]],
    summary: dict[str, int],
) -> dict[str, Any]:
    """``diff --json``: ``store``, ``a``, ``b``, ``same`` (bool; the exit code is 0 exactly when
    true); ``tensors``: ``status`` (changed/added/removed), ``key``, ``dtype``, ``shape``,
    ``bytes`` (of B's tensor, or A's when removed), ``was`` (``{"dtype", "shape"}`` before, when a
    changed tensor's layout changed, else null); ``values``: ``status``, ``key``, ``old``, ``new``
    (each ``{"key", "type", "value", "repr"}`` as in ``show --json``, null on the side that lacks
    it); ``summary``: ``changed``, ``changed_bytes``, ``added``, ``removed``, ``unchanged``,
    ``values_differ``."""

    def side(p: str, node: Any) -> dict[str, Any] | None:
        return None if node is _ABSENT else value_doc(p, node)

    return {
        "store": str(args.store),
        "a": a.name,
        "b": b.name,
        "same": not rows and not vrows,
        "tensors": [
            {
                "status": status,
                "key": key,
                "dtype": dtype,
                "shape": list(shape),
                "bytes": n,
                "was": {"dtype": was[0], "shape": list(was[1])} if was else None,
            }
            for status, key, dtype, shape, n, was in rows
        ],
        "values": [
            {"status": st, "key": p, "old": side(p, old), "new": side(p, new)}
            for st, p, old, new in vrows
        ],
        "summary": summary,
    }

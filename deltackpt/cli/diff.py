"""``deltackpt diff STORE A B``: tensors and non-tensor values changed, added and removed.

Two entries with the same layout and the same chunk digests hold the same bytes. Small tensors
share grouped chunks with their neighbours, so for them a differing digest does not mean the
tensor changed: their bytes are read (and verified) and compared.
"""

from __future__ import annotations

import argparse
from typing import Any

import numpy as np

from deltackpt.cli.format import Console, display_value, escape, human_bytes, new_table, shape_str
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


Row = tuple[str, str, str, str, int, str]  # status, key, dtype, shape, bytes, note


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
            note = ""
            if old.dtype != e.dtype or old.shape != e.shape:
                note = f"was {old.dtype}{shape_str(old.shape)}"
            elif (_grouped(a, old) or _grouped(b, e)) and reader.read(a, old) == reader.read(b, e):
                # Small tensors share chunks with their neighbours: a differing digest does
                # not mean this tensor changed, so their bytes decide.
                unchanged += 1
                continue
            n_changed += 1
            changed_bytes += entry_bytes(e)
            rows.append(("changed", path, e.dtype, shape_str(e.shape), entry_bytes(e), note))
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
            rows.append((status, p, e.dtype, shape_str(e.shape), entry_bytes(e), ""))
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
        for status, path, dtype, shape, n, note in rows:
            t.add_row(
                f"[{style[status]}]{status}[/]", escape(path), dtype, shape, human_bytes(n), note
            )
        out.print(t)
    va, vb = dict(value_leaves(a.tree)), dict(value_leaves(b.tree))
    vrows = []
    for p, node in vb.items():
        if p not in va:
            vrows.append(("added", p, "", display_value(node)))
        elif va[p] != node:
            vrows.append(("changed", p, display_value(va[p]), display_value(node)))
    vrows += [("removed", p, display_value(node), "") for p, node in va.items() if p not in vb]
    if vrows:
        t = new_table("non-tensor values")
        for col in ("", "key", "old", "new"):
            t.add_column(col, overflow="fold")
        for row in vrows:
            t.add_row(*map(escape, row))
        out.print(t)
    out.print(
        f"{n_changed} changed ({human_bytes(changed_bytes)}), {len(added)} added, "
        f"{len(removed)} removed, {unchanged} unchanged"
        + (f"; {len(vrows)} non-tensor value(s) differ" if vrows else "")
    )
    return 0

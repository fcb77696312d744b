"""``deltackpt ls``, ``show`` and ``du``: what a store holds, read through the public API.

Each command builds its ``--json`` document (fields documented on the ``*_doc`` functions; sizes
in bytes, times ISO-8601 UTC) or prints tables; never both.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import warnings
from typing import Any

import torch

import deltackpt
from deltackpt.cli.format import (
    Console,
    display_value,
    escape,
    human_bytes,
    iso_utc,
    local_time,
    make_console,
    new_table,
    print_json,
    shape_str,
    value_doc,
)
from deltackpt.cli.progress import progress, show_progress
from deltackpt.errors import DamagedSnapshotWarning, DeltackptError
from deltackpt.format.dtypes import dtype_from_name
from deltackpt.format.manifest import Manifest, TensorEntry
from deltackpt.format.tree import value_leaves
from deltackpt.store.location import store_root
from deltackpt.store.packs import PACK_ALIGN, PACK_SUFFIX
from deltackpt.store.snapshot import SnapshotInfo
from deltackpt.store.storage import PACKS, SNAPSHOTS, Entry
from deltackpt.store.store import Store

# ``show`` without --all lists this many tensors and non-tensor values
SHOW_TENSORS = 50
SHOW_VALUES = 8


def open_existing(args: argparse.Namespace, *, no_concurrent_saves: bool = False) -> Store:
    """The store of ``args.store`` (with ``args.storage_options``); the CLI never creates one.
    ``no_concurrent_saves``: an object store is opened so that gc may run (the user's promise)."""
    opts = getattr(args, "storage_options", None)
    root = store_root(args.store)
    if no_concurrent_saves and isinstance(root, str):
        from deltackpt.store.objstore import FsspecStorage  # imports fsspec: only when used

        storage = FsspecStorage(root, opts, no_concurrent_saves=True)
        return deltackpt.open_store(root, create=False, storage=storage)
    return deltackpt.open_store(args.store, create=False, storage_options=opts)


def entry_bytes(e: TensorEntry) -> int:
    """Logical bytes of a tensor entry (of the view, for a view of a shared storage)."""
    if e.storage is None:
        return e.nbytes
    n = 1
    for s in e.shape:
        n *= s
    return n * torch.empty(0, dtype=dtype_from_name(e.dtype)).element_size()


def cmd_ls(args: argparse.Namespace, out: Console) -> int:
    st = open_existing(args)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DamagedSnapshotWarning)  # listed below instead
        infos = deltackpt.snapshots(st)
    damaged = st.damaged()
    if args.json:
        print_json(
            {
                "store": str(args.store),
                "snapshots": [info_doc(s) for s in infos],
                "damaged": [{"name": d.name, "reason": d.reason} for d in damaged],
            }
        )
        return 0
    for d in damaged:
        make_console(stderr=True).print(
            f"[yellow]damaged:[/] {escape(d.name)}: {escape(' '.join(d.reason.split()))}",
            soft_wrap=True,
        )
    if not infos:
        out.print(f"{escape(args.store)}: no committed snapshots")
        return 0
    t = new_table(f"{escape(args.store)}: {len(infos)} snapshot{'s' * (len(infos) != 1)}")
    t.add_column("name", overflow="fold")
    t.add_column("created")
    for col in ("tensors", "size", "written", "new/reused chunks", "save s"):
        t.add_column(col, justify="right")
    for s in infos:
        t.add_row(
            escape(s.name),
            local_time(s.created),
            str(s.tensors),
            human_bytes(s.logical_bytes),
            human_bytes(s.bytes_written),
            f"{s.chunks_new}/{s.chunks_reused}",
            f"{s.seconds:.3f}",
        )
    out.print(t)
    return 0


def info_doc(s: SnapshotInfo) -> dict[str, Any]:
    """A snapshot in ``ls --json``: ``name``, ``created`` (ISO-8601 UTC), ``tensors``,
    ``logical_bytes`` (tensor bytes of the state), ``bytes_written`` (what its save added to the
    store), ``chunks_new``, ``chunks_reused``, ``seconds`` (save wall time), ``blocked_seconds``,
    ``waited_seconds``, ``world_size``, ``metadata`` (the user's, as saved)."""
    return {
        "name": s.name,
        "created": iso_utc(s.created),
        "tensors": s.tensors,
        "logical_bytes": s.logical_bytes,
        "bytes_written": s.bytes_written,
        "chunks_new": s.chunks_new,
        "chunks_reused": s.chunks_reused,
        "seconds": s.seconds,
        "blocked_seconds": s.blocked_seconds,
        "waited_seconds": s.waited_seconds,
        "world_size": s.world_size,
        "metadata": s.metadata,
    }


def tensor_doc(e: TensorEntry) -> dict[str, Any]:
    """A tensor in ``show --json``: ``key``, ``dtype``, ``shape`` (list), ``bytes`` (logical),
    ``chunks`` (distinct chunks holding it; 0 for a view), ``shards`` (how many, or null),
    ``storage`` (id of the shared storage it is a view of, or null)."""
    chunks = 0 if e.storage is not None else len(dict.fromkeys(d for d, _, _ in e.all_slices()))
    return {
        "key": e.path,
        "dtype": e.dtype,
        "shape": list(e.shape),
        "bytes": entry_bytes(e),
        "chunks": chunks,
        "shards": len(e.shards) if e.shards is not None else None,
        "storage": e.storage.id if e.storage is not None else None,
    }


def show_doc(args: argparse.Namespace, m: Manifest, info: SnapshotInfo) -> dict[str, Any]:
    """``show --json``: ``store``, ``snapshot`` (as in ``ls --json``), ``chunks_referenced`` and
    ``referenced_bytes`` (incl. delta bases), ``tensors`` (every one), ``values`` (every non-tensor
    value: ``key``, ``type``, ``value``, ``repr``)."""
    return {
        "store": str(args.store),
        "snapshot": info_doc(info),
        "chunks_referenced": len(m.chunks),
        "referenced_bytes": sum(r.length for r in m.chunks.values()),
        "tensors": [tensor_doc(e) for e in m.tensors],
        "values": [value_doc(p, v) for p, v in value_leaves(m.tree)],
    }


def cmd_show(args: argparse.Namespace, out: Console) -> int:
    st = open_existing(args)
    m = st.manifest(args.name)
    info = st.info(m.name)
    if args.json:
        print_json(show_doc(args, m, info))
        return 0
    s = m.stats
    out.print(f"[bold]snapshot[/] {escape(m.name)}   created {local_time(info.created)}")
    out.print(
        f"tensors {len(m.tensors)}, logical {human_bytes(s.logical_bytes)}, save wrote "
        f"{human_bytes(info.bytes_written)} ({s.chunks_new} new / {s.chunks_reused} reused "
        f"chunks) in {s.seconds:.3f} s"
        + (f", caller blocked {s.blocked_seconds:.3f} s" if s.blocked_seconds >= 5e-4 else "")
        + (f", waited {s.waited_seconds:.3f} s" if s.waited_seconds >= 5e-4 else "")
    )
    stored = human_bytes(sum(r.length for r in m.chunks.values()))
    out.print(f"chunks referenced, incl. delta bases: {len(m.chunks)} ({stored} stored)")
    if m.metadata:
        out.print("metadata " + escape(json.dumps(m.metadata, sort_keys=True)))
    t = new_table()
    t.add_column("key", overflow="fold")
    t.add_column("dtype")
    t.add_column("shape")
    t.add_column("bytes", justify="right")
    t.add_column("chunks", justify="right")
    tensors = m.tensors if args.all else m.tensors[:SHOW_TENSORS]
    for e in tensors:
        if e.storage is not None:
            chunks = f"storage #{e.storage.id}"
        else:
            chunks = str(len(dict.fromkeys(d for d, _, _ in e.all_slices())))
            if e.shards is not None:
                chunks += f" ({len(e.shards)} shards)"
        t.add_row(escape(e.path), e.dtype, shape_str(e.shape), human_bytes(entry_bytes(e)), chunks)
    out.print(t)
    if len(tensors) < len(m.tensors):
        out.print(f"… {len(m.tensors) - len(tensors)} more tensors (show --all lists every one)")
    values = list(value_leaves(m.tree))
    if args.all and values:
        t = new_table(f"non-tensor values {len(values)}")
        t.add_column("key", overflow="fold")
        t.add_column("value", overflow="fold")
        for p, v in values:  # in state order, uncut
            t.add_row(escape(p), escape(display_value(v, None)))
        out.print(t)
    elif values:
        values.sort(key=lambda pv: pv[0].count("/"))  # top-level ones first
        shown = ", ".join(
            f"{escape(p)}={escape(display_value(v))}" for p, v in values[:SHOW_VALUES]
        )
        more = len(values) - SHOW_VALUES
        more_s = f", … {more} more (show --all lists every one)" if more > 0 else ""
        out.print(f"non-tensor values {len(values)}: {shown}{more_s}")
    else:
        out.print("non-tensor values 0")
    return 0


def read_manifests(st: Store, enabled: bool) -> list[Manifest]:
    """``st.manifests()``, with a bar over the snapshots while they are read (the store caches
    each one it reads, so the listing after it reads nothing again)."""
    if enabled:
        dirs = [e.name for e in st.storage.list(SNAPSHOTS) if e.kind == "dir"]
        with progress(len(dirs), "reading manifests", enabled=True, unit="snapshots") as advance:
            for name in dirs:
                with contextlib.suppress(DeltackptError, OSError):  # damaged or gone: the
                    st.manifest(name)  # listing below skips it too
                advance(1)
    return st.manifests()


def cmd_du(args: argparse.Namespace, out: Console) -> int:
    st = open_existing(args)
    manifests = read_manifests(st, show_progress(args))
    users: dict[str, int] = {}
    stored: dict[str, int] = {}
    for m in manifests:
        for d, r in m.chunks.items():
            users[d] = users.get(d, 0) + 1
            stored[d] = r.length
    t = new_table(f"{escape(args.store)}: disk usage")
    t.add_column("snapshot", overflow="fold")
    for col in ("logical", "stored (referenced)", "shared with others", "only here"):
        t.add_column(col, justify="right")
    logical_total = 0
    for m in manifests:
        ref = sum(r.length for r in m.chunks.values())
        shared = sum(r.length for d, r in m.chunks.items() if users[d] > 1)
        logical_total += m.stats.logical_bytes
        t.add_row(
            escape(m.name),
            human_bytes(m.stats.logical_bytes),
            human_bytes(ref),
            human_bytes(shared),
            human_bytes(ref - shared),
        )
    packs = pack_files(st)
    physical = sum(p.size for p in packs)
    live = sum(stored.values())
    if args.json:
        print_json(du_doc(args, manifests, users, logical_total, live, physical, len(packs)))
        return 0
    t.add_section()
    t.add_row(f"total ({len(manifests)})", human_bytes(logical_total), human_bytes(live), "", "")
    out.print(t)
    ratio = f"{logical_total / physical:.2f}x" if physical else "n/a"
    out.print(
        f"logical {human_bytes(logical_total)} over {len(manifests)} snapshots; chunks "
        f"referenced {human_bytes(live)}; on disk {human_bytes(physical)} in {len(packs)} packs "
        f"(incl. {PACK_ALIGN // 1024} KiB alignment and any garbage); dedupe ratio {ratio}"
    )
    return 0


def du_doc(
    args: argparse.Namespace,
    manifests: list[Manifest],
    users: dict[str, int],
    logical: int,
    live: int,
    physical: int,
    packs: int,
) -> dict[str, Any]:
    """``du --json``: ``store``; ``snapshots``: ``name``, ``logical_bytes``, ``referenced_bytes``
    (stored bytes of the chunks it references), ``shared_bytes`` (of those, referenced by other
    snapshots too), ``unique_bytes`` (only by it); ``logical_bytes`` and ``referenced_bytes`` of
    the store (each chunk once); ``on_disk_bytes`` and ``packs`` (pack files, incl. alignment and
    garbage); ``dedupe_ratio`` (logical / on disk, null for an empty store)."""
    rows = []
    for m in manifests:
        ref = sum(r.length for r in m.chunks.values())
        shared = sum(r.length for d, r in m.chunks.items() if users[d] > 1)
        rows.append(
            {
                "name": m.name,
                "logical_bytes": m.stats.logical_bytes,
                "referenced_bytes": ref,
                "shared_bytes": shared,
                "unique_bytes": ref - shared,
            }
        )
    return {
        "store": str(args.store),
        "snapshots": rows,
        "logical_bytes": logical,
        "referenced_bytes": live,
        "on_disk_bytes": physical,
        "packs": packs,
        "dedupe_ratio": logical / physical if physical else None,
    }


def pack_files(st: Store) -> list[Entry]:
    """Pack files of the store: regular files only (a symlink is never followed; one removed by
    a concurrent gc while listed is left out)."""
    return [e for e in st.storage.list(PACKS) if e.kind == "file" and e.name.endswith(PACK_SUFFIX)]

"""``deltackpt ls``, ``show`` and ``du``: what a store holds, read through the public API."""

from __future__ import annotations

import argparse
import json
import warnings

import torch

import deltackpt
from deltackpt.cli.format import (
    Console,
    display_value,
    escape,
    human_bytes,
    local_time,
    make_console,
    new_table,
    shape_str,
)
from deltackpt.errors import DamagedSnapshotWarning
from deltackpt.format.dtypes import dtype_from_name
from deltackpt.format.manifest import TensorEntry
from deltackpt.format.tree import value_leaves
from deltackpt.store.location import store_root
from deltackpt.store.packs import PACK_ALIGN, PACK_SUFFIX
from deltackpt.store.storage import PACKS, Entry
from deltackpt.store.store import Store


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


def cmd_show(args: argparse.Namespace, out: Console) -> int:
    st = open_existing(args)
    m = st.manifest(args.name)
    info = st.info(m.name)
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
    for e in m.tensors:
        if e.storage is not None:
            chunks = f"storage #{e.storage.id}"
        else:
            chunks = str(len(dict.fromkeys(d for d, _, _ in e.all_slices())))
            if e.shards is not None:
                chunks += f" ({len(e.shards)} shards)"
        t.add_row(escape(e.path), e.dtype, shape_str(e.shape), human_bytes(entry_bytes(e)), chunks)
    out.print(t)
    values = sorted(value_leaves(m.tree), key=lambda pv: pv[0].count("/"))  # top-level ones first
    if values:
        shown = ", ".join(f"{escape(p)}={escape(display_value(v))}" for p, v in values[:8])
        more = f", … {len(values) - 8} more" if len(values) > 8 else ""
        out.print(f"non-tensor values {len(values)}: {shown}{more}")
    else:
        out.print("non-tensor values 0")
    return 0


def cmd_du(args: argparse.Namespace, out: Console) -> int:
    st = open_existing(args)
    manifests = st.manifests()
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


def pack_files(st: Store) -> list[Entry]:
    """Pack files of the store: regular files only (a symlink is never followed; one removed by
    a concurrent gc while listed is left out)."""
    return [e for e in st.storage.list(PACKS) if e.kind == "file" and e.name.endswith(PACK_SUFFIX)]

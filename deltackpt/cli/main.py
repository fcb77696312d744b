"""The ``deltackpt`` command line: inspect, verify, diff and clean up a store.

::

    deltackpt ls STORE                      snapshots with sizes and save costs
    deltackpt show STORE [NAME]             tensors, metadata and stats of one snapshot (default latest)
    deltackpt verify STORE [NAME...]        re-hash every chunk; exit 1 if anything is damaged
    deltackpt diff STORE A B                tensors changed, added and removed from A to B
    deltackpt du STORE                      logical vs stored bytes, sharing, dedupe ratio
    deltackpt gc STORE [--keep-last N] [--keep NAME...] [--dry-run]
    deltackpt demo [--dir DIR] [--steps N] [--keep]

Errors deltackpt raises on purpose (a missing snapshot, a damaged store, ...) print one line to
stderr and exit with status 2.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import sys
import warnings
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np
import torch
from rich.console import Console
from rich.markup import escape
from rich.table import Table

import deltackpt
from deltackpt.errors import DamagedSnapshotWarning, DeltackptError
from deltackpt.format.dtypes import dtype_from_name
from deltackpt.format.manifest import Manifest, Slice, TensorEntry
from deltackpt.format.tree import unflatten, value_leaves
from deltackpt.store.store import PACK_ALIGN, Store

_UNITS = ("KiB", "MiB", "GiB", "TiB", "PiB")


def human_bytes(n: float) -> str:
    """1536 -> '1.5 KiB'; exact bytes below 1 KiB."""
    if abs(n) < 1024:
        return f"{int(n)} B"
    for unit in _UNITS:
        n /= 1024
        if abs(n) < 1024 or unit == _UNITS[-1]:
            return f"{n:.1f} {unit}"
    raise AssertionError("unreachable")


def _console(stderr: bool = False) -> Console:
    f = sys.stderr if stderr else sys.stdout
    width = None
    if not (hasattr(f, "isatty") and f.isatty()):
        try:
            width = int(os.environ.get("COLUMNS", "")) or 120
        except ValueError:
            width = 120
    return Console(file=f, width=width, highlight=False, soft_wrap=False)


def _local(dt: datetime) -> str:
    return dt.astimezone().strftime("%Y-%m-%d %H:%M:%S")


def _open(path: str) -> Store:
    return deltackpt.open_store(path, create=False)


# ---------------------------------------------------------------------------------------- tree


def _short(value: Any, limit: int = 60) -> str:
    s = repr(value)
    return s if len(s) <= limit else s[: limit - 1] + "…"


def _no_tensor(i: int) -> Any:
    raise AssertionError("a key holds no tensor")


def _display(node: Any) -> str:
    if isinstance(node, dict) and "pickle" in node:
        return "<pickled>"
    if isinstance(node, dict) and isinstance(node.get("rng"), dict):
        return f"<{node['rng'].get('type', 'rng')} state>"  # not the object's repr (an address)
    try:
        return _short(unflatten(node, _no_tensor, False))
    except DeltackptError:
        return _short(node)


# ------------------------------------------------------------------------------------- tensors


def _entry_bytes(e: TensorEntry) -> int:
    if e.storage is None:
        return e.nbytes
    n = 1
    for s in e.shape:
        n *= s
    return n * torch.empty(0, dtype=dtype_from_name(e.dtype)).element_size()


def _entry_slices(m: Manifest, e: TensorEntry) -> list[Slice]:
    if e.storage is not None:
        return list(m.storages[e.storage.id][1])
    return e.all_slices()


def _signature(m: Manifest, e: TensorEntry) -> tuple[Any, ...]:
    view = (e.storage.offset, e.storage.stride) if e.storage is not None else None
    shards = tuple((sh.offsets, sh.shape) for sh in e.shards) if e.shards is not None else None
    return (e.dtype, e.shape, view, shards, tuple(_entry_slices(m, e)))


def _shape(shape: tuple[int, ...]) -> str:
    return "[" + ", ".join(map(str, shape)) + "]"


class _Bytes:
    """Reads tensor bytes of manifests of one store (for diffs of tensors in grouped chunks)."""

    def __init__(self, st: Store) -> None:
        from deltackpt.store.packs import PackReaders

        self._packs = PackReaders(st.packs_dir)
        self._cache: dict[str, np.ndarray] = {}

    def close(self) -> None:
        self._packs.close()

    def read(self, m: Manifest, e: TensorEntry) -> bytes:
        from deltackpt.store.chunks import ChunkReader

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


# ------------------------------------------------------------------------------------ commands


def cmd_ls(args: argparse.Namespace, out: Console) -> int:
    st = _open(args.store)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DamagedSnapshotWarning)  # listed below instead
        infos = deltackpt.snapshots(st)
    damaged = st.damaged()
    for d in damaged:
        _console(stderr=True).print(
            f"[yellow]damaged:[/] {escape(d.name)}: {escape(' '.join(d.reason.split()))}",
            soft_wrap=True,
        )
    if not infos:
        out.print(f"{escape(args.store)}: no committed snapshots")
        return 0
    t = Table(
        title=f"{escape(args.store)}: {len(infos)} snapshot{'s' * (len(infos) != 1)}",
        title_justify="left",
    )
    t.add_column("name", overflow="fold")
    t.add_column("created")
    for col in ("tensors", "size", "written", "new/reused chunks", "save s"):
        t.add_column(col, justify="right")
    for s in infos:
        t.add_row(
            escape(s.name),
            _local(s.created),
            str(s.tensors),
            human_bytes(s.logical_bytes),
            human_bytes(s.bytes_written),
            f"{s.chunks_new}/{s.chunks_reused}",
            f"{s.seconds:.3f}",
        )
    out.print(t)
    return 0


def cmd_show(args: argparse.Namespace, out: Console) -> int:
    st = _open(args.store)
    m = st.manifest(args.name)
    info = st.info(m.name)
    s = m.stats
    out.print(f"[bold]snapshot[/] {escape(m.name)}   created {_local(info.created)}")
    out.print(
        f"tensors {len(m.tensors)}, logical {human_bytes(s.logical_bytes)}, save wrote "
        f"{human_bytes(info.bytes_written)} ({s.chunks_new} new / {s.chunks_reused} reused "
        f"chunks) in {s.seconds:.3f} s"
        + (f", caller blocked {s.blocked_seconds:.3f} s" if s.blocked_seconds >= 5e-4 else "")
        + (f", waited {s.waited_seconds:.3f} s" if s.waited_seconds >= 5e-4 else "")
    )
    out.print(
        f"chunks referenced, incl. delta bases: {len(m.chunks)} ({human_bytes(sum(r.length for r in m.chunks.values()))} stored)"
    )
    if m.metadata:
        out.print("metadata " + escape(json.dumps(m.metadata, sort_keys=True)))
    t = Table(title_justify="left")
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
        t.add_row(escape(e.path), e.dtype, _shape(e.shape), human_bytes(_entry_bytes(e)), chunks)
    out.print(t)
    values = sorted(value_leaves(m.tree), key=lambda pv: pv[0].count("/"))  # top-level ones first
    if values:
        shown = ", ".join(f"{escape(p)}={escape(_display(v))}" for p, v in values[:8])
        more = f", … {len(values) - 8} more" if len(values) > 8 else ""
        out.print(f"non-tensor values {len(values)}: {shown}{more}")
    else:
        out.print("non-tensor values 0")
    return 0


def cmd_verify(args: argparse.Namespace, out: Console) -> int:
    report = deltackpt.verify(_open(args.store), args.names or None)
    gbps = report.bytes_checked / report.seconds / 1e9 if report.seconds > 0 else 0.0
    what = (
        f"{len(report.snapshots)} snapshot{'s' * (len(report.snapshots) != 1)}, "
        f"{report.chunks_checked} chunks, {human_bytes(report.bytes_checked)} in "
        f"{report.seconds:.2f} s ({gbps:.2f} GB/s)"
    )
    if report.undigested:
        names = ", ".join(report.undigested[:5]) + (" …" if len(report.undigested) > 5 else "")
        out.print(
            f"[yellow]note:[/] {len(report.undigested)} snapshot(s) written by an older "
            f"deltackpt have no manifest digest (damage to their manifests cannot be detected): "
            f"{escape(names)}"
        )
    if report.ok:
        out.print(f"[green]OK[/] {what}")
        return 0
    t = Table(title=f"{len(report.problems)} problem(s)", title_justify="left")
    t.add_column("snapshots", overflow="fold")
    t.add_column("keys", overflow="fold")
    t.add_column("chunk", overflow="fold")
    t.add_column("reason", overflow="fold")
    for p in report.problems:
        keys = ", ".join(p.keys[:3]) + (f" (+{len(p.keys) - 3})" if len(p.keys) > 3 else "")
        t.add_row(
            escape(", ".join(p.snapshots)),
            escape(keys),
            p.chunk or "-",
            escape(" ".join(p.reason.split())),
        )
    out.print(t)
    out.print(f"[red]FAILED[/] {len(report.damaged)} damaged snapshot(s); checked {what}")
    return 1


def cmd_diff(args: argparse.Namespace, out: Console) -> int:
    st = _open(args.store)
    a, b = st.manifest(args.a), st.manifest(args.b)
    ea = {e.path: e for e in a.tensors}
    eb = {e.path: e for e in b.tensors}
    rows: list[tuple[str, str, str, str, int, str]] = []
    changed_bytes = unchanged = 0
    n_changed = 0
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
                note = f"was {old.dtype}{_shape(old.shape)}"
            elif (_grouped(a, old) or _grouped(b, e)) and reader.read(a, old) == reader.read(b, e):
                # Small tensors share chunks with their neighbours: a differing digest does
                # not mean this tensor changed, so their bytes decide.
                unchanged += 1
                continue
            n_changed += 1
            changed_bytes += _entry_bytes(e)
            rows.append(("changed", path, e.dtype, _shape(e.shape), _entry_bytes(e), note))
    finally:
        reader.close()
    added = [p for p in eb if p not in ea]
    removed = [p for p in ea if p not in eb]
    for p in added:
        e = eb[p]
        rows.append(("added", p, e.dtype, _shape(e.shape), _entry_bytes(e), ""))
    for p in removed:
        e = ea[p]
        rows.append(("removed", p, e.dtype, _shape(e.shape), _entry_bytes(e), ""))
    out.print(f"diff {escape(a.name)} → {escape(b.name)}")
    if rows:
        t = Table(title_justify="left")
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
            vrows.append(("added", p, "", _display(node)))
        elif va[p] != node:
            vrows.append(("changed", p, _display(va[p]), _display(node)))
    vrows += [("removed", p, _display(node), "") for p, node in va.items() if p not in vb]
    if vrows:
        t = Table(title="non-tensor values", title_justify="left")
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


def _grouped(m: Manifest, e: TensorEntry) -> bool:
    """Whether any of the tensor's bytes sit in a chunk that holds other bytes too."""
    return any(start or length != m.chunks[d].size for d, start, length in _entry_slices(m, e))


def cmd_du(args: argparse.Namespace, out: Console) -> int:
    st = _open(args.store)
    manifests = st.manifests()
    users: dict[str, int] = {}
    stored: dict[str, int] = {}
    for m in manifests:
        for d, r in m.chunks.items():
            users[d] = users.get(d, 0) + 1
            stored[d] = r.length
    t = Table(title=f"{escape(args.store)}: disk usage", title_justify="left")
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
    packs = _pack_files(st)
    physical = sum(_size(p) for p in packs)
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


def _pack_files(st: Store) -> list[Path]:
    """Pack files of the store: regular files only (a symlink is never followed)."""
    try:
        return [
            Path(e.path)
            for e in os.scandir(st.packs_dir)
            if e.name.endswith(".pack") and e.is_file(follow_symlinks=False)
        ]
    except FileNotFoundError:
        return []


def _size(p: Path) -> int:
    try:
        return p.lstat().st_size
    except FileNotFoundError:  # removed by a concurrent gc
        return 0


def cmd_gc(args: argparse.Namespace, out: Console) -> int:
    st = _open(args.store)
    keep = [n for group in args.keep or [] for n in group]
    busy = args.dry_run and _save_in_flight(st)
    r = deltackpt.gc(st, keep_last=args.keep_last, keep=keep, dry_run=args.dry_run)
    verb = "to delete" if r.dry_run else "deleted"
    title = "gc --dry-run (nothing deleted)" if r.dry_run else "gc"
    t = Table(title=title, title_justify="left", show_header=False)
    t.add_column("what")
    t.add_column("value", overflow="fold")
    t.add_row(
        f"snapshots {verb}",
        f"{len(r.deleted)}" + (f": {', '.join(r.deleted)}" if r.deleted else ""),
    )
    t.add_row("packs to remove" if r.dry_run else "packs removed", str(r.packs_removed))
    t.add_row("packs to compact" if r.dry_run else "packs compacted", str(r.packs_compacted))
    t.add_row("bytes to free (about)" if r.dry_run else "bytes freed", human_bytes(r.bytes_freed))
    t.add_row("leftovers to remove" if r.dry_run else "leftovers removed", str(r.leftovers_removed))
    if not r.dry_run:
        t.add_row("seconds", f"{r.seconds:.3f}")
    out.print(t)
    if r.damaged:
        out.print(
            f"[yellow]note:[/] {len(r.damaged)} damaged snapshot(s) ({escape(', '.join(r.damaged[:5]))}): "
            "no pack data was collected, since they may need any of it. Run `deltackpt verify`, "
            "then delete or repair them"
        )
    if r.refused:
        out.print(
            f"[yellow]note:[/] left alone (not written by deltackpt): "
            f"{escape(', '.join(r.refused[:10]))}"
        )
    if busy:
        out.print(
            "[yellow]note:[/] a save is in flight: its new packs and temp files count as garbage "
            "above, but gc would wait for the save to commit and keep them"
        )
    return 0


def _save_in_flight(st: Store) -> bool:
    """Whether a save holds the store lock right now (probed without blocking or writing)."""
    try:
        fd = os.open(st.lock_path, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except OSError:
        return True
    finally:
        os.close(fd)  # releases the probe's lock


def cmd_demo(args: argparse.Namespace, out: Console) -> int:
    from deltackpt.cli import demo

    result = demo.run(directory=args.dir, steps=args.steps, console=out, keep=args.keep)
    return 0 if result["bit_exact"] and result["next_step_identical"] and result["verify_ok"] else 1


# -------------------------------------------------------------------------------------- parser


def _non_negative(s: str) -> int:
    n = int(s)
    if n < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {n}")
    return n


def _positive(s: str) -> int:
    n = int(s)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {n}")
    return n


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="deltackpt",
        description="Inspect, verify, diff and clean up deltackpt checkpoint stores.",
    )
    p.add_argument("--version", action="version", version=f"deltackpt {deltackpt.__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    s = sub.add_parser("ls", help="list snapshots with sizes and save costs")
    s.add_argument("store")
    s.set_defaults(func=cmd_ls)

    s = sub.add_parser("show", help="tensors, metadata and stats of one snapshot")
    s.add_argument("store")
    s.add_argument("name", nargs="?", default="latest", help="snapshot (default: latest)")
    s.set_defaults(func=cmd_show)

    s = sub.add_parser("verify", help="re-hash every chunk; exit 1 if any is damaged")
    s.add_argument("store")
    s.add_argument("names", nargs="*", metavar="NAME", help="snapshots (default: all)")
    s.set_defaults(func=cmd_verify)

    s = sub.add_parser("diff", help="tensors changed, added and removed from A to B")
    s.add_argument("store")
    s.add_argument("a", metavar="A")
    s.add_argument("b", metavar="B")
    s.set_defaults(func=cmd_diff)

    s = sub.add_parser("du", help="logical vs stored bytes per snapshot and the dedupe ratio")
    s.add_argument("store")
    s.set_defaults(func=cmd_du)

    s = sub.add_parser("gc", help="apply retention and delete unreferenced pack data")
    s.add_argument("store")
    s.add_argument(
        "--keep-last",
        type=_non_negative,
        metavar="N",
        help="keep the N newest snapshots, delete the others",
    )
    s.add_argument(
        "--keep", nargs="+", action="append", metavar="NAME", help="also keep these snapshots"
    )
    s.add_argument(
        "--dry-run", action="store_true", help="report what would be deleted; change nothing"
    )
    s.set_defaults(func=cmd_gc)

    s = sub.add_parser("demo", help="fine-tune a tiny GPT with a checkpoint per step, then resume")
    s.add_argument("--dir", help="store directory (new or empty; default: a temporary one)")
    s.add_argument("--steps", type=_positive, default=30, help="training steps (default 30)")
    s.add_argument("--keep", action="store_true", help="keep the temporary store")
    s.set_defaults(func=cmd_demo)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help, --version, usage errors
        return e.code if isinstance(e.code, int) else 2
    out = _console()
    try:
        return int(args.func(args, out))
    except DeltackptError as e:
        err = _console(stderr=True)
        msg = " ".join(str(e).split())
        err.print(f"[bold red]error:[/] [red]{escape(msg)}[/]", soft_wrap=True)
        return 2
    except BrokenPipeError:  # e.g. `deltackpt ls STORE | head`
        with contextlib.suppress(OSError):
            sys.stdout = open(os.devnull, "w")  # noqa: SIM115
        return 0
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    raise SystemExit(main())

"""``deltackpt verify`` and ``deltackpt gc``: thin views of :func:`deltackpt.verify` and
:func:`deltackpt.gc` (``--dry-run`` is gc's own plan, ``gc(dry_run=True)``)."""

from __future__ import annotations

import argparse

import deltackpt
from deltackpt.cli.format import Console, escape, human_bytes, new_table
from deltackpt.cli.snapshots import open_existing
from deltackpt.errors import StoreLockedError
from deltackpt.store.objstore import NoLockError
from deltackpt.store.storage import LOCK_FILE
from deltackpt.store.store import Store


def cmd_verify(args: argparse.Namespace, out: Console) -> int:
    report = deltackpt.verify(open_existing(args), args.names or None)
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
    t = new_table(f"{len(report.problems)} problem(s)")
    for col in ("snapshots", "keys", "chunk", "reason"):
        t.add_column(col, overflow="fold")
    for p in report.problems:  # VerifyProblem: typed fields, no message parsing
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


def cmd_gc(args: argparse.Namespace, out: Console) -> int:
    st = open_existing(args, no_concurrent_saves=args.no_concurrent_saves)
    keep = [n for group in args.keep or [] for n in group]
    busy = args.dry_run and _save_in_flight(st)
    try:
        r = deltackpt.gc(st, keep_last=args.keep_last, keep=keep, dry_run=args.dry_run)
    except NoLockError as e:
        raise NoLockError(
            f"gc of {args.store} needs the exclusive store lock, and object stores have none: "
            "a save running meanwhile could lose packs. When nothing saves to the store, run "
            "`deltackpt gc STORE --no-concurrent-saves ...`"
        ) from e
    dry = r.dry_run
    t = new_table("gc --dry-run (nothing deleted)" if dry else "gc", show_header=False)
    t.add_column("what")
    t.add_column("value", overflow="fold")
    t.add_row(
        "snapshots to delete" if dry else "snapshots deleted",
        f"{len(r.deleted)}" + (f": {', '.join(r.deleted)}" if r.deleted else ""),
    )
    t.add_row("packs to remove" if dry else "packs removed", str(r.packs_removed))
    t.add_row("packs to compact" if dry else "packs compacted", str(r.packs_compacted))
    t.add_row("bytes to free (about)" if dry else "bytes freed", human_bytes(r.bytes_freed))
    t.add_row("leftovers to remove" if dry else "leftovers removed", str(r.leftovers_removed))
    if not dry:
        t.add_row("seconds", f"{r.seconds:.3f}")
    out.print(t)
    if r.damaged:
        out.print(
            f"[yellow]note:[/] {len(r.damaged)} damaged snapshot(s) "
            f"({escape(', '.join(r.damaged[:5]))}): no pack data was collected, since they may "
            "need any of it. Run `deltackpt verify`, then delete or repair them"
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
    """Whether a save holds the store lock right now: one try of gc's exclusive lock
    (``Store.lock``), without waiting. A store that no save ever locked has no lock file, and
    the probe creates none."""
    try:
        if not st.storage.exists(LOCK_FILE):
            return False
        with st.lock(exclusive=True, timeout=0, what="gc --dry-run"):
            return False
    except StoreLockedError:
        return True
    except OSError:  # e.g. no write permission on the lock file: cannot tell
        return False

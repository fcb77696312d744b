"""``deltackpt verify``, ``deltackpt gc`` and ``deltackpt fold``: thin views of
:func:`deltackpt.verify`, :func:`deltackpt.gc` (``--dry-run`` is gc's own plan,
``gc(dry_run=True)``) and :func:`deltackpt.fold`, with a progress bar on a terminal and a
``--json`` document for scripts.

fold is its own verb, not a gc option: gc deletes and holds the store lock exclusively for its
whole run, fold only writes (keyframes, then one manifest replace) and runs beside saves; gc's
"compacted" already names its pack rewrite."""

from __future__ import annotations

import argparse
import contextlib
from typing import Any

import deltackpt
from deltackpt.cli.exit_codes import OK, PROBLEM
from deltackpt.cli.format import Console, escape, human_bytes, new_table, print_json
from deltackpt.cli.progress import progress, show_progress
from deltackpt.cli.snapshots import open_existing
from deltackpt.errors import DeltackptError, StoreLockedError
from deltackpt.store.fold import FoldReport
from deltackpt.store.lifecycle import GcReport, VerifyReport
from deltackpt.store.objstore import NoLockError
from deltackpt.store.storage import LOCK_FILE
from deltackpt.store.store import Store


def _verify_total(st: Store, names: list[str]) -> int:
    """Raw bytes verify will check: each chunk once per place it lives (its bar's total)."""
    if names:
        ms = []
        for n in names:
            with contextlib.suppress(DeltackptError, OSError):  # verify reports (or raises) it
                ms.append(st.manifest(n))
    else:
        ms = st.manifests()
    nodes = {(d, r) for m in ms for d, r in m.chunks.items()}
    return sum(r.size for _, r in nodes)


def cmd_verify(args: argparse.Namespace, out: Console) -> int:
    st = open_existing(args)
    if show_progress(args):
        total = _verify_total(st, args.names)
        with progress(total, "verifying", enabled=True) as advance:
            report = deltackpt.verify(st, args.names or None, progress=advance)
    else:
        report = deltackpt.verify(st, args.names or None)
    if args.json:
        print_json(_verify_doc(args, report))
        return OK if report.ok else PROBLEM
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
        return OK
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
    return PROBLEM


def _verify_doc(args: argparse.Namespace, r: VerifyReport) -> dict[str, Any]:
    """``verify --json``: ``store``, ``ok`` (the exit code is 0 exactly when true),
    ``snapshots`` (checked), ``damaged`` (snapshots some problem affects), ``chunks_checked``,
    ``bytes_checked`` (raw), ``seconds``, ``undigested`` (snapshots of format version 1, whose
    manifests carry no digest), ``problems``: ``chunk`` (digest, or null for a damaged
    manifest), ``reason``, ``snapshots``, ``keys``."""
    return {
        "store": str(args.store),
        "ok": r.ok,
        "snapshots": list(r.snapshots),
        "damaged": r.damaged,
        "chunks_checked": r.chunks_checked,
        "bytes_checked": r.bytes_checked,
        "seconds": r.seconds,
        "undigested": list(r.undigested),
        "problems": [
            {
                "chunk": p.chunk or None,
                "reason": p.reason,
                "snapshots": list(p.snapshots),
                "keys": list(p.keys),
            }
            for p in r.problems
        ],
    }


def cmd_gc(args: argparse.Namespace, out: Console) -> int:
    st = open_existing(args, no_concurrent_saves=args.no_concurrent_saves)
    keep = [n for group in args.keep or [] for n in group]
    busy = args.dry_run and _save_in_flight(st)
    try:
        with progress(
            None, "collecting", enabled=show_progress(args) and not args.dry_run
        ) as advance:
            r = deltackpt.gc(
                st, keep_last=args.keep_last, keep=keep, dry_run=args.dry_run, progress=advance
            )
    except NoLockError as e:
        raise NoLockError(
            f"gc of {args.store} needs the exclusive store lock, and object stores have none: "
            "a save running meanwhile could lose packs. When nothing saves to the store, run "
            "`deltackpt gc STORE --no-concurrent-saves ...`"
        ) from e
    if args.json:
        print_json(_gc_doc(args, r, busy))
        return OK
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
    if r.leased:
        t.add_row("kept for followers' leases", ", ".join(r.leased))
    if r.leases_expired:
        t.add_row(
            "expired leases to remove" if dry else "expired leases removed",
            ", ".join(r.leases_expired),
        )
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
    if r.bad_leases:
        out.print(
            f"[yellow]note:[/] {len(r.bad_leases)} bad lease(s) ignored and left in place: "
            f"{escape('; '.join(r.bad_leases[:5]))}"
        )
    if busy:
        out.print(
            "[yellow]note:[/] a save is in flight: its new packs and temp files count as garbage "
            "above, but gc would wait for the save to commit and keep them"
        )
    return OK


def _gc_doc(args: argparse.Namespace, r: GcReport, busy: bool) -> dict[str, Any]:
    """``gc --json``: ``store``, ``dry_run``, ``deleted`` (snapshots; to delete, for a dry run),
    ``packs_removed``, ``packs_compacted``, ``bytes_freed`` (about, for a dry run),
    ``leftovers_removed``, ``uploads_aborted``, ``seconds``, ``damaged`` (while any, no pack data
    is collected), ``refused`` (entries left alone), ``save_in_flight`` (dry run: a save held the
    store lock; null otherwise), ``leased`` (snapshots kept only for a follower's lease),
    ``leases_expired`` (holders whose expired lease was removed), ``bad_leases`` (ignored)."""
    return {
        "store": str(args.store),
        "dry_run": r.dry_run,
        "deleted": list(r.deleted),
        "packs_removed": r.packs_removed,
        "packs_compacted": r.packs_compacted,
        "bytes_freed": r.bytes_freed,
        "leftovers_removed": r.leftovers_removed,
        "uploads_aborted": list(r.uploads_aborted),
        "seconds": r.seconds,
        "damaged": list(r.damaged),
        "refused": list(r.refused),
        "save_in_flight": busy if r.dry_run else None,
        "leased": list(r.leased),
        "leases_expired": list(r.leases_expired),
        "bad_leases": list(r.bad_leases),
    }


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


def cmd_fold(args: argparse.Namespace, out: Console) -> int:
    st = open_existing(args, no_concurrent_saves=args.no_concurrent_saves)
    names = args.names or ["latest"]
    try:
        reports = [
            deltackpt.fold(st, n, max_chain=args.max_chain, keep_links=args.keep_links)
            for n in names
        ]
    except NoLockError as e:
        raise NoLockError(
            f"fold of {args.store} repoints a manifest under the exclusive store lock, and object "
            "stores have none. When nothing saves to the store, run `deltackpt fold STORE "
            "--no-concurrent-saves ...`"
        ) from e
    if args.json:
        print_json({"store": str(args.store), "snapshots": [_fold_doc(r) for r in reports]})
        return OK
    t = new_table("fold")
    for col in ("snapshot", "chunks folded", "bytes written", "deepest chain", "seconds"):
        t.add_column(col)
    for r in reports:
        t.add_row(
            escape(r.snapshot),
            str(r.chunks_folded),
            human_bytes(r.bytes_written),
            f"{r.deepest_before} -> {r.deepest_after}",
            f"{r.seconds:.3f}",
        )
    out.print(t)
    return OK


def _fold_doc(r: FoldReport) -> dict[str, Any]:
    """``fold --json``: per snapshot ``name``, ``chunks_folded``, ``bytes_written``,
    ``deepest_before``, ``deepest_after`` (delta links), ``pack`` (null: nothing written),
    ``attempts``, ``seconds``."""
    return {
        "name": r.snapshot,
        "chunks_folded": r.chunks_folded,
        "bytes_written": r.bytes_written,
        "deepest_before": r.deepest_before,
        "deepest_after": r.deepest_after,
        "pack": r.pack,
        "attempts": r.attempts,
        "seconds": r.seconds,
    }

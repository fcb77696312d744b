"""The ``deltackpt`` command line: inspect, verify, diff and clean up a store.

::

    deltackpt ls STORE                      snapshots with sizes and save costs
    deltackpt show STORE [NAME]             tensors, metadata and stats of one snapshot (default latest)
    deltackpt verify STORE [NAME...]        re-hash every chunk; exit 1 if anything is damaged
    deltackpt diff STORE A B                tensors changed, added and removed from A to B
    deltackpt du STORE                      logical vs stored bytes, sharing, dedupe ratio
    deltackpt gc STORE [--keep-last N] [--keep NAME...] [--dry-run]
    deltackpt demo [--dir DIR] [--steps N] [--keep]

STORE is a directory or an object-store URL (``s3://bucket/prefix``); ``--storage-options JSON``
configures the latter (s3fs: ``{"endpoint_url": ..., "key": ..., "secret": ...}``), else s3fs
reads the usual AWS environment (``AWS_ACCESS_KEY_ID``, ``AWS_ENDPOINT_URL``, ...). gc on an object
store needs ``--no-concurrent-saves``, the promise that nothing saves to it meanwhile.

Errors deltackpt raises on purpose (a missing snapshot, a damaged store, ...) print one line to
stderr and exit with status 2.

This module is the parser and the dispatch; the commands live in ``snapshots.py`` (ls, show,
du), ``diff.py``, ``upkeep.py`` (verify, gc) and ``demo.py``; ``format.py`` renders (with rich
when it is installed, ``pip install deltackpt[cli]``, else as plain text).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from typing import Any

import deltackpt
from deltackpt.cli import demo
from deltackpt.cli.diff import cmd_diff
from deltackpt.cli.format import Console, escape, human_bytes, make_console
from deltackpt.cli.snapshots import cmd_du, cmd_ls, cmd_show
from deltackpt.cli.upkeep import cmd_gc, cmd_verify
from deltackpt.errors import DeltackptError

__all__ = ["build_parser", "human_bytes", "main"]


def cmd_demo(args: argparse.Namespace, out: Console) -> int:
    result = demo.run(directory=args.dir, steps=args.steps, console=out, keep=args.keep)
    return 0 if result["bit_exact"] and result["next_step_identical"] and result["verify_ok"] else 1


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


def _json_options(s: str) -> dict[str, Any]:
    try:
        v = json.loads(s)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not JSON ({e}): {s!r}") from None
    if not isinstance(v, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {s!r}")
    return v


def _store_arg(s: argparse.ArgumentParser) -> None:
    s.add_argument("store", help="store directory or object-store URL (s3://bucket/prefix)")
    s.add_argument(
        "--storage-options",
        type=_json_options,
        metavar="JSON",
        help='object stores: fsspec/s3fs options, e.g. \'{"endpoint_url": "http://..."}\'',
    )


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="deltackpt",
        description="Inspect, verify, diff and clean up deltackpt checkpoint stores.",
    )
    p.add_argument("--version", action="version", version=f"deltackpt {deltackpt.__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    s = sub.add_parser("ls", help="list snapshots with sizes and save costs")
    _store_arg(s)
    s.set_defaults(func=cmd_ls)

    s = sub.add_parser("show", help="tensors, metadata and stats of one snapshot")
    _store_arg(s)
    s.add_argument("name", nargs="?", default="latest", help="snapshot (default: latest)")
    s.set_defaults(func=cmd_show)

    s = sub.add_parser("verify", help="re-hash every chunk; exit 1 if any is damaged")
    _store_arg(s)
    s.add_argument("names", nargs="*", metavar="NAME", help="snapshots (default: all)")
    s.set_defaults(func=cmd_verify)

    s = sub.add_parser("diff", help="tensors changed, added and removed from A to B")
    _store_arg(s)
    s.add_argument("a", metavar="A")
    s.add_argument("b", metavar="B")
    s.set_defaults(func=cmd_diff)

    s = sub.add_parser("du", help="logical vs stored bytes per snapshot and the dedupe ratio")
    _store_arg(s)
    s.set_defaults(func=cmd_du)

    s = sub.add_parser("gc", help="apply retention and delete unreferenced pack data")
    _store_arg(s)
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
    s.add_argument(
        "--no-concurrent-saves",
        action="store_true",
        help="object stores (which have no locks): promise that no save runs meanwhile",
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
    out = make_console()
    try:
        return int(args.func(args, out))
    except DeltackptError as e:
        err = make_console(stderr=True)
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

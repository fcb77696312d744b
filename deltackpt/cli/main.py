"""The ``deltackpt`` command line: inspect, verify, diff and clean up a store.

::

    deltackpt ls STORE                      snapshots with sizes and save costs
    deltackpt show STORE [NAME] [--all]     tensors, metadata and stats of one snapshot (default latest)
    deltackpt verify STORE [NAME...]        re-hash every chunk; exit 1 if anything is damaged
    deltackpt diff STORE A B                tensors changed, added and removed from A to B; exit 1 if any
    deltackpt du STORE                      logical vs stored bytes, sharing, dedupe ratio
    deltackpt gc STORE [--keep-last N] [--keep NAME...] [--dry-run]
    deltackpt fold STORE [NAME...] [--max-chain N] [--keep-links L]
    deltackpt demo [--dir DIR] [--steps N] [--keep]
    deltackpt export STORE [NAME] OUT_DIR   a snapshot's model as Hugging Face safetensors
    deltackpt import SRC STORE NAME         safetensors, a HF directory, torch.save or DCP

STORE is a directory or an object-store URL (``s3://bucket/prefix``); ``--storage-options JSON``
configures the latter (s3fs: ``{"endpoint_url": ..., "key": ..., "secret": ...}``), else s3fs
reads the usual AWS environment (``AWS_ACCESS_KEY_ID``, ``AWS_ENDPOINT_URL``, ...). gc on an object
store needs ``--no-concurrent-saves``, the promise that nothing saves to it meanwhile.

``--json`` (ls, show, diff, du, verify, gc, fold, export, import) prints one JSON document on stdout
and nothing else (sizes in bytes, times ISO-8601 UTC); long commands (verify, gc, du, export,
import) draw a progress bar on stderr when stdout and stderr are terminals, never with ``--json``
or ``--no-progress``.

Exit codes are one table for every command (``exit_codes.py``): 0 success, 1 a problem found
(verify: damage, diff: differences), 2 usage, 3 not found or not valid, 4 other errors. An error
prints one line to stderr; with ``--json`` stdout also gets ``{"error": {"type", "message",
"exit_code"}}``.

This module is the parser and the dispatch; the commands live in ``snapshots.py`` (ls, show,
du), ``diff.py``, ``upkeep.py`` (verify, gc, fold), ``interop.py`` (export, import) and ``demo.py``;
``format.py`` renders (with rich when it is installed, ``pip install deltackpt[cli]``, else as
plain text), ``progress.py`` draws bars, ``exit_codes.py`` holds the exit-code table.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import traceback
from typing import Any, NoReturn

import deltackpt
from deltackpt.cli import demo
from deltackpt.cli.diff import cmd_diff
from deltackpt.cli.exit_codes import USAGE, epilog, exit_code_for
from deltackpt.cli.format import Console, escape, human_bytes, make_console, print_json
from deltackpt.cli.snapshots import cmd_du, cmd_ls, cmd_show
from deltackpt.cli.upkeep import cmd_fold, cmd_gc, cmd_verify
from deltackpt.errors import DeltackptError
from deltackpt.store.fold import DEFAULT_FOLD_CHAIN

__all__ = ["add_output_options", "build_parser", "human_bytes", "main"]


class _UsageError(Exception):
    """argparse refused the command line (its message is already on stderr)."""


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error raises (so that ``--json`` can report it) instead of exiting."""

    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        raise _UsageError(message)


def add_output_options(s: argparse.ArgumentParser, *, progress: bool = False) -> None:
    """``--json`` (and, for a long command, ``--no-progress``) on subcommand ``s``; commands read
    ``args.json`` and pass ``show_progress(args)`` to :func:`deltackpt.cli.progress.progress`."""
    s.add_argument(
        "--json", action="store_true", help="print one JSON document on stdout, nothing else"
    )
    if progress:
        s.add_argument("--no-progress", action="store_true", help="draw no progress bar")


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
    p = _Parser(
        prog="deltackpt",
        description="Inspect, verify, diff and clean up deltackpt checkpoint stores.",
        epilog=epilog(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--version", action="version", version=f"deltackpt {deltackpt.__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    s = sub.add_parser("ls", help="list snapshots with sizes and save costs")
    _store_arg(s)
    add_output_options(s)
    s.set_defaults(func=cmd_ls)

    s = sub.add_parser("show", help="tensors, metadata and stats of one snapshot")
    _store_arg(s)
    s.add_argument("name", nargs="?", default="latest", help="snapshot (default: latest)")
    s.add_argument(
        "--all", action="store_true", help="every tensor and every non-tensor value, uncut"
    )
    add_output_options(s)
    s.set_defaults(func=cmd_show)

    s = sub.add_parser("verify", help="re-hash every chunk; exit 1 if any is damaged")
    _store_arg(s)
    add_output_options(s, progress=True)
    s.add_argument("names", nargs="*", metavar="NAME", help="snapshots (default: all)")
    s.set_defaults(func=cmd_verify)

    s = sub.add_parser("diff", help="tensors changed, added and removed from A to B; exit 1 if any")
    _store_arg(s)
    add_output_options(s)
    s.add_argument("a", metavar="A")
    s.add_argument("b", metavar="B")
    s.set_defaults(func=cmd_diff)

    s = sub.add_parser("du", help="logical vs stored bytes per snapshot and the dedupe ratio")
    _store_arg(s)
    add_output_options(s, progress=True)
    s.set_defaults(func=cmd_du)

    s = sub.add_parser("gc", help="apply retention and delete unreferenced pack data")
    _store_arg(s)
    add_output_options(s, progress=True)
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

    s = sub.add_parser(
        "fold", help="rewrite snapshots' long delta chains as keyframes (faster fresh loads)"
    )
    _store_arg(s)
    s.add_argument("names", nargs="*", metavar="NAME", help="snapshots (default: latest)")
    add_output_options(s)
    s.add_argument(
        "--max-chain",
        type=_non_negative,
        default=DEFAULT_FOLD_CHAIN,
        metavar="N",
        help=f"fold chunks with more than N delta links (default {DEFAULT_FOLD_CHAIN})",
    )
    s.add_argument(
        "--keep-links",
        type=_non_negative,
        default=1,
        metavar="L",
        help="delta links kept above each new keyframe (default 1: followers keep patching)",
    )
    s.add_argument(
        "--no-concurrent-saves",
        action="store_true",
        help="object stores (which have no locks): promise that no save runs meanwhile",
    )
    s.set_defaults(func=cmd_fold)

    s = sub.add_parser("demo", help="fine-tune a tiny GPT with a checkpoint per step, then resume")
    s.add_argument("--dir", help="store directory (new or empty; default: a temporary one)")
    s.add_argument("--steps", type=_positive, default=30, help="training steps (default 30)")
    s.add_argument("--keep", action="store_true", help="keep the temporary store")
    s.set_defaults(func=cmd_demo)

    from deltackpt.cli.interop import add_parsers  # export, import (Hugging Face, torch, DCP)

    add_parsers(sub, _store_arg)
    return p


def _report_error(e: BaseException, code: int, as_json: bool) -> None:
    """One line on stderr; with ``--json`` also the error document on stdout."""
    msg = " ".join(str(e).split()) or type(e).__name__
    if not isinstance(e, (DeltackptError, OSError, _UsageError)):  # a bug: show where
        traceback.print_exception(type(e), e, e.__traceback__, file=sys.stderr)
    if not isinstance(e, _UsageError):  # argparse has printed its own
        err = make_console(stderr=True)
        err.print(f"[bold red]error:[/] [red]{escape(msg)}[/]", soft_wrap=True)
    if as_json:
        name = "UsageError" if isinstance(e, _UsageError) else type(e).__name__
        print_json({"error": {"type": name, "message": msg, "exit_code": code}})


def main(argv: list[str] | None = None) -> int:
    """Run one command; returns its exit code (see ``exit_codes.py``)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help, --version
        return e.code if isinstance(e.code, int) else USAGE
    except _UsageError as e:
        _report_error(e, USAGE, "--json" in argv)
        return USAGE
    as_json = bool(getattr(args, "json", False))
    out = make_console()
    try:
        return int(args.func(args, out))
    except BrokenPipeError:  # e.g. `deltackpt ls STORE | head`
        with contextlib.suppress(OSError):
            sys.stdout = open(os.devnull, "w")  # noqa: SIM115
        return 0
    except (Exception, KeyboardInterrupt) as e:
        code = exit_code_for(e)
        if not isinstance(e, KeyboardInterrupt):
            _report_error(e, code, as_json)
        return code


if __name__ == "__main__":
    raise SystemExit(main())

"""Progress bars for long commands (verify, gc, du, export, import), drawn on stderr.

One call for every command::

    with progress(total_bytes, "verifying", enabled=show_progress(args)) as advance:
        deltackpt.verify(store, progress=advance)      # advance(n): n more bytes done

``advance`` may be called from several threads at once. ``total`` may be ``None`` (unknown: a
count without a bar). With rich installed (``pip install deltackpt[cli]``) the bar is rich's,
transient (it is gone when the command prints its result); without rich it is one plain line
rewritten with ``\\r``, at most 10 times a second, and erased at the end.

When a bar is shown: never with ``--json`` or ``--no-progress``, and otherwise only when both
stdout and stderr are terminals (``enabled=None``, see :func:`show_progress`), so that neither
scripts nor logs get control characters. The bar goes to stderr, never to stdout.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import IO

from deltackpt.cli.format import HAVE_RICH, human_bytes

__all__ = ["Advance", "progress", "show_progress"]

Advance = Callable[[int], None]


def _noop(n: int) -> None:
    pass


def _isatty(f: object) -> bool:
    try:
        return bool(f.isatty())  # type: ignore[attr-defined]
    except (AttributeError, ValueError):  # no isatty, or a closed file
        return False


def show_progress(args: argparse.Namespace | None = None) -> bool:
    """Whether a command should draw a bar: not with ``--json`` or ``--no-progress``, and only
    when stdout and stderr are both terminals."""
    if args is not None and (getattr(args, "json", False) or getattr(args, "no_progress", False)):
        return False
    return _isatty(sys.stdout) and _isatty(sys.stderr)


@contextlib.contextmanager
def progress(
    total: int | None,
    description: str,
    *,
    enabled: bool | None = None,
    file: IO[str] | None = None,
    unit: str = "bytes",
) -> Iterator[Advance]:
    """A bar of ``total`` units (``"bytes"``, shown as KiB/MiB/..., or any other word, shown as a
    count) on ``file`` (default stderr); yields ``advance(n)``. ``enabled=None``: decide with
    :func:`show_progress`; ``True``: draw even when not a terminal (tests); ``False``: yield a
    no-op."""
    if enabled is None:
        enabled = show_progress()
    if not enabled:
        yield _noop
        return
    f = file or sys.stderr
    if HAVE_RICH:
        with _rich_bar(total, description, f, unit) as advance:
            yield advance
    else:
        with _plain_bar(total, description, f, unit) as advance:
            yield advance


@contextlib.contextmanager
def _rich_bar(total: int | None, description: str, f: IO[str], unit: str) -> Iterator[Advance]:
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        MofNCompleteColumn,
        Progress,
        SpinnerColumn,
        TaskProgressColumn,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )

    console = Console(file=f, force_terminal=True, highlight=False)  # enabled: draw it
    amount = (
        [DownloadColumn(binary_units=True), TransferSpeedColumn()]
        if unit == "bytes"
        else [MofNCompleteColumn(), TextColumn(unit)]
    )
    columns = [
        SpinnerColumn() if total is None else TextColumn(""),
        TextColumn("[progress.description]{task.description}"),
        BarColumn(),
        TaskProgressColumn(),
        *amount,
        TimeElapsedColumn() if total is None else TimeRemainingColumn(),
    ]
    with Progress(*columns, console=console, transient=True) as bar:
        task = bar.add_task(description, total=total)

        def advance(n: int) -> None:
            bar.advance(task, n)

        yield advance


class _PlainBar:
    """``description: 42% 1.1 GiB / 2.6 GiB`` rewritten in place (``\\r``), throttled."""

    def __init__(self, total: int | None, description: str, f: IO[str], unit: str) -> None:
        self._total, self._description, self._f, self._unit = total, description, f, unit
        self._done = 0
        self._lock = threading.Lock()
        self._last = 0.0
        self._width = 0

    def _amount(self, n: int) -> str:
        return human_bytes(n) if self._unit == "bytes" else f"{n} {self._unit}"

    def advance(self, n: int) -> None:
        with self._lock:
            self._done += n
            now = time.monotonic()
            if now - self._last < 0.1:
                return
            self._last = now
            if self._total:
                pct = min(100, self._done * 100 // self._total)
                text = f"{self._description}: {pct}% {self._amount(self._done)} / "
                text += self._amount(self._total)
            else:
                text = f"{self._description}: {self._amount(self._done)}"
            self._width = max(self._width, len(text))
            self._f.write("\r" + text.ljust(self._width))
            self._f.flush()

    def close(self) -> None:
        if self._width:
            self._f.write("\r" + " " * self._width + "\r")
            self._f.flush()


@contextlib.contextmanager
def _plain_bar(total: int | None, description: str, f: IO[str], unit: str) -> Iterator[Advance]:
    bar = _PlainBar(total, description, f, unit)
    try:
        yield bar.advance
    finally:
        bar.close()

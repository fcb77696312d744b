"""Presentation for the command line and the demo: sizes, times, values, consoles and tables.

``rich`` is optional (``pip install deltackpt[cli]``). With it, output is rich's tables and
colours; without it, the same text as plain aligned columns. Commands write rich markup
(``"[yellow]note:[/] ..."``) and build tables through :func:`new_table` / :func:`make_console`,
and never import rich themselves, so the two renderings cannot drift apart.
"""

from __future__ import annotations

import json
import math
import re
import sys
from datetime import datetime, timezone
from typing import IO, Any, Literal, Protocol

from deltackpt.errors import DeltackptError
from deltackpt.format.tree import unflatten
from deltackpt.options import console_columns

try:
    from rich.console import Console as _RichConsole
    from rich.markup import escape as _rich_escape
    from rich.table import Table as _RichTable

    HAVE_RICH = True
except ImportError:  # the plain-text fallback below
    HAVE_RICH = False

_UNITS = ("KiB", "MiB", "GiB", "TiB", "PiB")
Justify = Literal["default", "left", "center", "right", "full"]


def human_bytes(n: float) -> str:
    """1536 -> '1.5 KiB'; exact bytes below 1 KiB."""
    if abs(n) < 1024:
        return f"{int(n)} B"
    for unit in _UNITS:
        n /= 1024
        if abs(n) < 1024 or unit == _UNITS[-1]:
            return f"{n:.1f} {unit}"
    raise AssertionError("unreachable")


def local_time(dt: datetime) -> str:
    return dt.astimezone().strftime("%Y-%m-%d %H:%M:%S")


def shape_str(shape: tuple[int, ...]) -> str:
    return "[" + ", ".join(map(str, shape)) + "]"


def iso_utc(dt: datetime) -> str:
    """An aware datetime as ISO-8601 UTC, the form ``--json`` uses: ``2026-11-23T09:16:31.5Z``."""
    return dt.astimezone(timezone.utc).isoformat().replace("+00:00", "Z")


def _strict(obj: Any) -> Any:
    """``obj`` with non-finite floats as the strings ``"nan"``, ``"inf"``, ``"-inf"``."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return repr(obj)
    if isinstance(obj, dict):
        return {k: _strict(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_strict(v) for v in obj]
    return obj


def print_json(doc: Any, file: IO[str] | None = None) -> None:
    """Write ``doc`` as the one JSON document of a ``--json`` command: strict JSON (a NaN in
    user metadata becomes ``"nan"``), ASCII, two-space indented, keys in the order built."""
    print(json.dumps(_strict(doc), indent=2, allow_nan=False), file=file or sys.stdout)


def _short(value: Any, limit: int | None = 60) -> str:
    s = repr(value)
    return s if limit is None or len(s) <= limit else s[: limit - 1] + "…"


def _no_tensor(i: int) -> Any:
    raise AssertionError("a key holds no tensor")


def display_value(node: Any, limit: int | None = 60) -> str:
    """A non-tensor value of a manifest's tree: its repr (cut to ``limit`` characters unless
    ``limit`` is None), or what kind of object it is."""
    if isinstance(node, dict) and "pickle" in node:
        return "<pickled>"
    if isinstance(node, dict) and isinstance(node.get("rng"), dict):
        return f"<{node['rng'].get('type', 'rng')} state>"  # not the object's repr (an address)
    try:
        return _short(unflatten(node, _no_tensor, False), limit)
    except DeltackptError:
        return _short(node, limit)


def value_doc(path: str, node: Any) -> dict[str, Any]:
    """A non-tensor value for ``--json``: ``{"key", "type", "value", "repr"}``. ``type`` is the
    manifest's tag (``int``, ``str``, ``bool``, ``null``, ``float``, ``bytes``, ``size``,
    ``dtype``, ``device``, ``rng``, ``pickle``); ``value`` is its JSON form (a non-finite float as
    the string ``"nan"``/``"inf"``/``"-inf"``; ``null`` for bytes, rng and pickle); ``repr`` is
    Python's repr, uncut."""
    kind = "null" if node is None else type(node).__name__
    value: Any = node
    if isinstance(node, dict) and node:
        kind = next(k for k in node if k != "meta")
        raw = node[kind]
        if kind == "float":
            try:
                f = float.fromhex(raw)
                value = f if math.isfinite(f) else repr(f)
            except (TypeError, ValueError):
                value = None
        elif kind == "size":
            value = list(raw) if isinstance(raw, list) else None
        elif kind in ("dtype", "device"):
            value = raw if isinstance(raw, str) else None
        else:
            value = None
    elif isinstance(node, (dict, list)):  # malformed: not a value leaf
        kind, value = "unknown", None
    return {"key": path, "type": kind, "value": value, "repr": display_value(node, None)}


# ------------------------------------------------------------------------------------- markup

# rich's markup grammar: a tag is ``[`` + one of ``a-z#/@`` + anything up to ``]``; an odd run of
# backslashes before it makes it literal text.
_TAG = re.compile(r"((\\*)\[([a-z#/@][^[]*?)])")
_TAG_TEXT = re.compile(r"(\\*)(\[[a-z#/@][^[]*?])")


def _plain_escape(text: str) -> str:
    """Escape ``text`` so it is not read as markup (what ``rich.markup.escape`` does)."""
    text = _TAG_TEXT.sub(lambda m: f"{m.group(1)}{m.group(1)}\\{m.group(2)}", text)
    if text.endswith("\\") and not text.endswith("\\\\"):
        return text + "\\"
    return text


def strip_markup(text: str) -> str:
    """The text rich would print for ``text``, without its styles."""
    out: list[str] = []
    pos = 0
    for m in _TAG.finditer(text):
        full, slashes, _ = m.groups()
        out.append(text[pos : m.start()])
        pos = m.end()
        literal, escaped = divmod(len(slashes), 2)
        out.append("\\" * literal)
        if escaped:
            out.append(full[len(slashes) :])  # an escaped tag is text
    out.append(text[pos:])
    return "".join(out)


escape = _rich_escape if HAVE_RICH else _plain_escape


# ------------------------------------------------------------------------------------- tables


class PlainTable:
    """The subset of ``rich.table.Table`` the CLI uses, rendered as aligned plain-text columns."""

    def __init__(
        self, title: str | None = None, title_justify: Justify = "left", show_header: bool = True
    ) -> None:
        self.title = title
        self.show_header = show_header
        self._headers: list[str] = []
        self._right: list[bool] = []
        self._rows: list[list[str] | None] = []  # None: a section break

    def add_column(self, header: str = "", *, justify: str = "left", **_: Any) -> None:
        self._headers.append(strip_markup(header))
        self._right.append(justify == "right")

    def add_row(self, *cells: str) -> None:
        row = [strip_markup(c) for c in cells]
        self._rows.append(row + [""] * (len(self._headers) - len(row)))

    def add_section(self) -> None:
        self._rows.append(None)

    def render(self) -> str:
        rows = [r for r in self._rows if r is not None]
        shown = [self._headers] if self.show_header else []
        widths = [max(map(len, col)) for col in zip(*(shown + rows), strict=True)]
        if not widths:
            widths = [0] * len(self._headers)

        def line(cells: list[str]) -> str:
            parts = [
                c.rjust(w) if right else c.ljust(w)
                for c, w, right in zip(cells, widths, self._right, strict=True)
            ]
            return " │ ".join(parts).rstrip()

        rule = "─┼─".join("─" * w for w in widths)
        lines = [strip_markup(self.title)] if self.title else []
        if self.show_header:
            lines += [line(self._headers), rule]
        lines += [rule if r is None else line(r) for r in self._rows]
        return "\n".join(lines)


def new_table(
    title: str | None = None, *, title_justify: Justify = "left", show_header: bool = True
) -> Any:
    """A rich Table, or a :class:`PlainTable` without rich; both take the same calls."""
    if HAVE_RICH:
        return _RichTable(title=title, title_justify=title_justify, show_header=show_header)
    return PlainTable(title=title, title_justify=title_justify, show_header=show_header)


# ----------------------------------------------------------------------------------- consoles


class Console(Protocol):
    """What commands print to: a rich Console, or a :class:`PlainConsole`."""

    def print(self, *objects: Any, soft_wrap: bool | None = None) -> None: ...


class PlainConsole:
    """Prints markup strings without their styles, and :class:`PlainTable` s as text."""

    def __init__(self, file: IO[str] | None = None) -> None:
        self._file = file

    def print(self, *objects: Any, soft_wrap: bool | None = None) -> None:
        parts = [o.render() if isinstance(o, PlainTable) else strip_markup(str(o)) for o in objects]
        print(" ".join(parts), file=self._file or sys.stdout)


def default_console() -> Console:
    """rich's default Console (its own width and terminal detection), or a plain one."""
    return _RichConsole() if HAVE_RICH else PlainConsole()


def make_console(stderr: bool = False, file: IO[str] | None = None) -> Console:
    """A console on stdout (or stderr, or ``file``). Not a terminal: rich uses ``$COLUMNS``,
    default 120, so piped output is not cut to 80 columns."""
    f = file or (sys.stderr if stderr else sys.stdout)
    if not HAVE_RICH:
        return PlainConsole(f)
    width = None
    if not (hasattr(f, "isatty") and f.isatty()):
        width = console_columns(120)
    return _RichConsole(file=f, width=width, highlight=False, soft_wrap=False)

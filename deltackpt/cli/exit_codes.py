"""The exit codes of every ``deltackpt`` command, and which error maps to which, in one place.

=====  ==========================================================================================
code   meaning
=====  ==========================================================================================
0      success; ``verify`` found no damage; ``diff`` found the two snapshots equal
1      the command ran and found a problem: ``verify`` found damage, ``diff`` found differences
       (like ``diff(1)``), ``demo`` was not bit-exact
2      usage: a bad command line (unknown command or option, a bad value) or an argument the
       library refused (an invalid snapshot name, a gc of an object store without
       ``--no-concurrent-saves``, an export over existing files without ``--overwrite``)
3      not found or not valid: no store at STORE, no such snapshot or key, a damaged manifest or
       chunk that stopped the command (``verify`` reports damage with 1 instead), an input file
       to import that is missing or malformed
4      any other error: I/O (disk full, permission denied, an unreachable object store), a store
       locked by a running gc or save, an unexpected exception (its traceback goes to stderr)
130    interrupted (Ctrl-C)
=====  ==========================================================================================

Commands return 0 or 1 themselves and raise for everything else; ``main`` turns the exception
into its code with :func:`exit_code_for`.
"""

from __future__ import annotations

from deltackpt.errors import (
    CorruptChunkError,
    ImportFormatError,
    InvalidArgumentError,
    InvalidNameError,
    OutputExistsError,
    SnapshotNotFoundError,
    StateKeyError,
    StoreError,
    StoreIOError,
    StoreLockedError,
)

__all__ = [
    "ERROR",
    "EXIT_CODES",
    "INTERRUPTED",
    "NOT_FOUND",
    "OK",
    "PROBLEM",
    "USAGE",
    "epilog",
    "exit_code_for",
]

OK = 0
PROBLEM = 1
USAGE = 2
NOT_FOUND = 3
ERROR = 4
INTERRUPTED = 130

# (code, one line for --help and the README); the order they are listed in
EXIT_CODES: tuple[tuple[int, str], ...] = (
    (OK, "success (verify: no damage; diff: the snapshots are equal)"),
    (PROBLEM, "the command found a problem (verify: damage; diff: differences)"),
    (USAGE, "usage error: bad command line or argument value"),
    (NOT_FOUND, "store, snapshot, key or input file not found, or not valid (damaged)"),
    (ERROR, "other error: I/O, store locked, unexpected exception"),
    (INTERRUPTED, "interrupted (Ctrl-C)"),
)


def exit_code_for(e: BaseException) -> int:
    """The exit code for an exception that stopped a command (see the module's table)."""
    if isinstance(e, KeyboardInterrupt):
        return INTERRUPTED
    if isinstance(e, (StoreIOError, StoreLockedError)):  # before StoreError: they are ones
        return ERROR
    if isinstance(e, NotImplementedError) and isinstance(e, StoreError):
        return USAGE  # NoLockError: gc of an object store needs --no-concurrent-saves
    if isinstance(e, (InvalidArgumentError, InvalidNameError, OutputExistsError)):
        return USAGE  # OutputExistsError: pass --overwrite
    if isinstance(e, (SnapshotNotFoundError, StoreError, CorruptChunkError, StateKeyError)):
        return NOT_FOUND
    if isinstance(e, (ImportFormatError, FileNotFoundError, NotADirectoryError)):
        return NOT_FOUND  # an input file to import is missing or malformed
    return ERROR  # any other DeltackptError, OSError or unexpected exception


def epilog() -> str:
    """The exit-code table as text for ``deltackpt --help``."""
    return "exit codes:\n" + "\n".join(f"  {code:<4} {what}" for code, what in EXIT_CODES)

"""Tunables in one place: frozen option dataclasses and their environment overrides.

Nothing else in deltackpt reads ``os.environ``. Tests override knobs with :func:`overrides`.

=========================  ==============================================  ================
variable                   meaning                                          default
=========================  ==============================================  ================
DELTACKPT_THREADS          worker threads for hashing, encoding and I/O     min(4, cpus)
DELTACKPT_LOCK_TIMEOUT     seconds to wait for the store lock               600
DELTACKPT_FSYNC            0 skips fsync (benchmarks of page-cache speed)   1
DELTACKPT_MEMORY_BUDGET    bytes of staging buffers per store               RAM / 2
=========================  ==============================================  ================
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass, field, fields, replace
from typing import Any

from deltackpt.codecs import EncodePolicy

_OVERRIDES: dict[str, str] = {}


def _env(name: str, default: str) -> str:
    return _OVERRIDES.get(name, os.environ.get(name, default))


@contextlib.contextmanager
def overrides(**values: Any) -> Iterator[None]:
    """Temporarily set ``DELTACKPT_*`` knobs: ``with overrides(DELTACKPT_THREADS=1): ...``."""
    old = dict(_OVERRIDES)
    _OVERRIDES.update({k: str(v) for k, v in values.items()})
    try:
        yield
    finally:
        _OVERRIDES.clear()
        _OVERRIDES.update(old)


def default_threads() -> int:
    return max(1, int(_env("DELTACKPT_THREADS", str(min(4, os.cpu_count() or 1)))))


def default_lock_timeout() -> float:
    return float(_env("DELTACKPT_LOCK_TIMEOUT", "600"))


def default_fsync() -> bool:
    return _env("DELTACKPT_FSYNC", "1") not in ("0", "false", "no")


def default_memory_budget() -> int:
    value = _env("DELTACKPT_MEMORY_BUDGET", "")
    if value:
        return int(value)
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2
    except (ValueError, OSError):
        return 8 << 30


@dataclass(frozen=True)
class SaveOptions:
    """How a save runs. Chunk size lives in the store (STORE.json), not here: it must not change
    between saves or dedupe would stop matching."""

    allow_pickle: bool = False
    overwrite: bool = False
    threads: int = field(default_factory=default_threads)
    lock_timeout: float = field(default_factory=default_lock_timeout)
    fsync: bool = field(default_factory=default_fsync)
    encoding: EncodePolicy = field(default_factory=EncodePolicy)
    # xor deltas: a full chunk at least every K saves of a key, so a restore decodes at most K
    # payloads per chunk (measured: restore time grows ~linearly with the chain depth)
    keyframe_every: int = 4
    # Bytes of host staging buffers a store may hold (None: half the machine's RAM). xor deltas
    # need two copies of the state (this save and the bases); one copy for plain async saves;
    # a state larger than the budget is written from the live tensors and the call blocks.
    memory_budget: int | None = None

    @staticmethod
    def from_kwargs(base: SaveOptions | None, kwargs: dict[str, Any]) -> SaveOptions:
        return _apply(base or SaveOptions(), kwargs, "save")


@dataclass(frozen=True)
class LoadOptions:
    verify: bool = True  # re-hash every chunk read and compare with its digest
    strict: bool = True  # into=: keys, shapes and dtypes must match exactly
    allow_pickle: bool = False
    threads: int = field(default_factory=default_threads)

    @staticmethod
    def from_kwargs(base: LoadOptions | None, kwargs: dict[str, Any]) -> LoadOptions:
        return _apply(base or LoadOptions(), kwargs, "load")


def _apply(base: Any, kwargs: dict[str, Any], what: str) -> Any:
    known = {f.name for f in fields(base)}
    unknown = sorted(set(kwargs) - known)
    if unknown:
        raise TypeError(f"{what}() got unknown option(s) {unknown}; known options: {sorted(known)}")
    return replace(base, **kwargs) if kwargs else base

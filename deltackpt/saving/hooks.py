"""Fault-injection and observation points of the save steps (for tests and benchmarks).

The save code calls these at fixed places, so a test changes what it needs through one documented
object instead of patching module paths (which any file move breaks)::

    from deltackpt.saving.hooks import hooks

    with hooks.override(before_commit=fail_with_enospc):
        ...  # every save in this block fails right before its manifest is published

========================  =====================================================  ===============
hook                      called                                                 default
========================  =====================================================  ===============
``clock()``               for a manifest's ``created_ns`` (step 6, coordinator)  time.time_ns
``before_commit(name)``   right before the manifest is published (step 6,        no-op
                          coordinator); an OSError raised here is handled as a
                          failed publish (packs removed, StoreIOError)
``on_stage_copy(chunk)``  each time the hash pass copies a chunk into a staging  no-op
                          arena (step 2; any thread), or a save of device state
                          copies a changed chunk to the host (saving/on_device)
========================  =====================================================  ===============

Every kind of save (local, distributed, DCP's ``StoreWriter``) commits through
``saving/commit.py``, so ``clock`` and ``before_commit`` apply to all of them. Hooks are
process-wide; they are read at each call, never cached.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, fields
from typing import Any


def _nothing(*_: Any) -> None:
    return None


@dataclass
class SaveHooks:
    clock: Callable[[], int] = time.time_ns
    before_commit: Callable[[str], None] = _nothing
    on_stage_copy: Callable[[int], None] = _nothing

    @contextlib.contextmanager
    def override(self, **changes: Any) -> Iterator[SaveHooks]:
        """Set some hooks for the duration of a ``with`` block, then restore them."""
        known = {f.name for f in fields(self)}
        unknown = sorted(set(changes) - known)
        if unknown:
            raise TypeError(f"unknown save hook(s) {unknown}; known: {sorted(known)}")
        old = {k: getattr(self, k) for k in changes}
        for k, v in changes.items():
            setattr(self, k, v)
        try:
            yield self
        finally:
            for k, v in old.items():
                setattr(self, k, v)


hooks = SaveHooks()

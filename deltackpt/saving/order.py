"""Which order the blocking phase of an async save takes: hash first, or copy first.

An async save in a world of one without delta bases (an encoding without xor or patch deltas: the
default ``auto`` on a local store, ``fast-restore``; or deltas that do not fit ``memory_budget``;
the tiered checkpointer's local save) must, before it returns, hold a copy of every chunk the
store lacks. Two orders do that:

* **hash-first** (saving/stage.py ``hash_and_stage``): hash every chunk in place on the caller's
  thread and copy only the ones the store lacks. Blocking = hash of the state + copy of the
  changed bytes: ~0.5-0.7x a warm copy when nothing or little changed, 1.0-1.6x when everything
  did (256 MB fp32 into ``/dev/shm``, 2 cores, depending on the load);
* **copy-first** (saving/stage.py ``copy_state``): copy the whole state into the reused arena and
  return; the background job hashes the copies, dedupes against the store and writes the new
  chunks (the path a CUDA state takes). Blocking = one copy of the state (on the pool's threads
  and the caller's, in large pieces: 0.8x a single-threaded warm copy), whatever changed;
  the hashing moves behind the call (after a dense step the time to commit stays the same: the
  hash was paid on the caller's thread before; after a sparse one it grows by that copy).

Both commit the bytes of the state at the call (a copy is taken of everything written), with
digests of the bytes written, and write no chunk the store holds. Neither wins everywhere, so
:class:`StageOrder` picks per save from the previous save's share of new bytes: copy-first once
at least :data:`COPY_FIRST_AT` of the state was new (a dense step: every chunk changed), else
hash-first (the first save of a process, sparse or unchanged steps). A wrong guess costs one
save: ~0.8-1.2x instead of ~0.5-0.7x after a step that changed little, ~1.0-1.6x after a dense
step that followed a sparse one.

``DELTACKPT_STAGE_ORDER`` (``auto``, ``hash-first`` or ``copy-first``) fixes the order for the
stores a process opens (benchmarks, tests); ``saver_for(store).order.mode`` for one store.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from deltackpt.errors import InvalidArgumentError
from deltackpt.options import _env  # the one reader of DELTACKPT_* knobs (honours overrides())
from deltackpt.saving.plan import SavePlan

STAGE_ORDERS = ("auto", "hash-first", "copy-first")
ENV = "DELTACKPT_STAGE_ORDER"
# Share of the state's bytes new at the previous save from which copy-first is chosen. The work on
# the caller's thread: hash-first = hash of the state + copy of the new share f, copy-first = copy
# of the state. Measured (256 MB fp32 in /dev/shm, 2 cores, the orders interleaved save by save):
# one process, load ~1.7: hash-first 0.48x a warm copy at f = 0 rising to 1.02x at f = 1,
# copy-first 0.80-0.85x throughout, crossing at f ~0.6-0.7; two ranks on the 2 cores
# (benchmarks/bench_tiers.py): hash-first 0.6x (f ~0.03) and 1.4x (f = 1), copy-first ~1.16x:
# crossing near 0.65. Between 0.5 and 0.7 the two differ by under 0.1x.
COPY_FIRST_AT = 0.6


def check_order(mode: str, where: str = "stage order") -> str:
    if mode not in STAGE_ORDERS:
        raise InvalidArgumentError(
            f"{where}={mode!r} is invalid: expected one of {', '.join(STAGE_ORDERS)}. Use "
            "'auto' (the default: chosen per save from the previous save's changes), or "
            "'hash-first' / 'copy-first' to fix it"
        )
    return mode


def env_order() -> str:
    """The default order of new stores' saves: ``DELTACKPT_STAGE_ORDER`` or ``auto``."""
    raw = _env(ENV, "auto").strip()
    return check_order(raw, f"environment variable {ENV}")


@dataclass
class StageOrder:
    """Per store (kept by its StoreSaver): the order of the next async save's blocking phase."""

    mode: str = field(default_factory=env_order)
    changed: float | None = None  # share of bytes the last committed save found new; None: none

    def copy_first(self) -> bool:
        mode = check_order(self.mode)
        if mode != "auto":
            return mode == "copy-first"
        return self.changed is not None and self.changed >= COPY_FIRST_AT

    def learn(self, plan: SavePlan, digests: list[str], index: Mapping[str, object]) -> None:
        """After a committed save: the share of ``plan``'s bytes whose digest ``index`` (the
        store's chunks before the save) lacked."""
        total = new = 0
        for spec, d in zip(plan.chunks, digests, strict=True):
            total += spec.size
            if d not in index:
                new += spec.size
        self.changed = new / total if total else 0.0

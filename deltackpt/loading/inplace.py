"""Patches applied in place onto ``into``'s own bytes, with an undo log: the cheap path of an
incremental load (:mod:`deltackpt.loading.since`) for a chunk whose delta chain above the held
chunk is all ``patch`` payloads and which ``into`` holds as one tensor's bytes.

Why: a staged catch-up copies every patched chunk twice (into a fresh buffer, then back at
commit), and after an RL-like step every chunk changed a little, so those copies cost more than
the rest of the catch-up together (measured: 2 of 5 full passes over the state, at fresh-page
speed). Here only the changed elements are written, and their old values are kept: the result's
digest is checked right after, and on any failure every chunk patched so far gets its old
elements back, so ``into`` is as it was (the promise of a staged catch-up), unless the process
dies in between.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from deltackpt.errors import CodecError, CorruptChunkError
from deltackpt.format.changes import UINT, unpack_changes
from deltackpt.format.hashing import digest
from deltackpt.format.lindigest import changed_words, lin_shift, terms_at
from deltackpt.format.policy import PATCH

__all__ = ["InPlace", "apply_all", "eligible", "lift", "revert_all"]

#: A changed word's two linear-digest terms (read scattered, before and after) cost about as much
#: as hashing this many words of the chunk whole with xxh3 (measured here: ~6 ns against ~0.25 ns
#: per 8 bytes): a result whose patch touches more words than 1/LIN_WORD_COST of them is hashed
#: whole instead, which is cheaper there and checks every byte (held's untouched ones included).
LIN_WORD_COST = 24
#: The same for a changed element when the terms are summed right after the write, in C: ~7 ns
#: per element (four fmix64 rounds and a mispredicted branch per word) against ~0.25 ns per word
#: of xxh3. So a bf16 chunk is checked by the linear digest below ~0.9% of its elements changed
#: (RL steps at lr 1e-6 change ~1%: about the break-even), and hashed whole above.
LIN_FUSED_COST = 28

try:  # setup.py builds it; numpy fancy indexing below does the same
    from deltackpt._native import patch_apply as _native_apply
except ImportError:  # pragma: no cover - depends on the install
    _native_apply = None


@dataclass
class InPlace:
    """Held chunk ``b`` in ``view`` (into's bytes) patched up to target chunk ``d``."""

    d: str
    b: str
    view: np.ndarray  # flat uint8, writable, into's own bytes
    itemsize: int
    levels: list[tuple[np.ndarray, np.ndarray]]  # validated (indices, new values), oldest first
    where: str
    # (held chunk's, target chunk's) linear digests: the result is checked by updating the held
    # one from the words the levels touch (work in proportion to the change) instead of hashing
    # the whole chunk; None: hashed whole against ``d``
    lin: tuple[str, str] | None = None
    undo: list[tuple[np.ndarray, np.ndarray]] = field(default_factory=list)
    how: str = "digest"  # what apply() checked the result by

    def apply(self) -> bool:
        """Write every level's values (keeping the old ones); whether the result checks out."""
        if _native_apply is not None and len(self.levels) == 1:
            return self._apply_one()
        elems = self.view.view(UINT[self.itemsize])
        words = old = None
        if self.lin is not None:
            words = changed_words([idx for idx, _ in self.levels], self.itemsize)
            if words.size * LIN_WORD_COST < self.view.size // 8:
                old = terms_at(self.view, words)
        for idx, vals in self.levels:
            self.undo.append((idx, elems[idx]))  # fancy indexing: a copy of the old values
            elems[idx] = vals
        if self.lin is None or words is None or old is None:
            self.how = "digest"
            return digest(self.view) == self.d
        self.how = "linear digest"
        return lin_shift(self.lin[0], old, terms_at(self.view, words)) == self.lin[1]

    def _apply_one(self) -> bool:
        """One level in one C pass (``deltackpt._native.patch_apply``): old values kept, each
        touched word's linear-digest terms summed before and after while it is in cache."""
        idx, vals = self.levels[0]
        old = np.empty_like(vals)
        lin = self.lin is not None and idx.size * LIN_FUSED_COST < self.view.size // 8
        terms = np.zeros(4, np.uint64) if lin else None
        _native_apply(self.view, idx, np.ascontiguousarray(vals), self.itemsize, old, terms)
        self.undo.append((idx, old))
        if self.lin is None or terms is None:
            self.how = "digest"
            return digest(self.view) == self.d
        self.how = "linear digest"
        before, after = (int(terms[0]), int(terms[1])), (int(terms[2]), int(terms[3]))
        return lin_shift(self.lin[0], before, after) == self.lin[1]

    def revert(self) -> None:
        elems = self.view.view(UINT[self.itemsize])
        while self.undo:
            idx, old = self.undo.pop()
            elems[idx] = old


def revert_all(items: list[InPlace]) -> None:
    for p in items:
        p.revert()


def apply_all(
    items: list[InPlace],
    each: Callable[[Callable[[InPlace], Any], list[InPlace]], list[Any]],
    held: str,
    held_error: Callable[[str, str], Exception],
) -> None:
    """Apply every patch (through ``each``, a parallel map) and check every result; on any
    failure revert them all and raise. A result that does not check out is told apart once
    reverted: held bytes that do not hash to the held chunk's digest are ``held_error(chunk,
    their digest)`` (into does not hold ``held`` there), else a payload is corrupt
    (:class:`CorruptChunkError`)."""

    def one(p: InPlace) -> tuple[bool, BaseException | None]:
        try:
            return p.apply(), None
        except Exception as e:  # reverted below with the others
            return False, e

    results = each(one, items)
    for p, (ok, err) in zip(items, results, strict=True):
        if err is not None or not ok:
            revert_all(items)
            if err is not None:
                raise err
            if (was := digest(p.view)) != p.b:
                raise held_error(p.b, was)
            how = p.how
            raise CorruptChunkError(
                f"chunk {p.d} of {p.where}: patching {held!r}'s chunk {p.b} with "
                f"{len(p.levels)} delta(s) gives bytes whose {how} differs from {p.d}'s; a "
                "payload is corrupt. Nothing was kept (into is unchanged). Run `deltackpt "
                "verify`; load without since= to read it whole"
            )


def eligible(d: str, above: list[str], chunks: Any, view: np.ndarray, places: int) -> bool:
    """Chunk ``d`` can be patched in place: its chain above the held chunk is all ``patch``
    payloads of one element size dividing the chunk, the held chunk is a view of into's bytes
    (not a rebuilt copy), and the target wants ``d`` in that one place only."""
    k = chunks[d].itemsize
    return (
        places == 1
        and view.base is not None
        and view.flags.writeable
        and k in UINT
        and view.size % k == 0
        and all(chunks[c].codec == PATCH and chunks[c].itemsize == k for c in above)
    )


def lift(
    d: str,
    b: str,
    above: list[str],
    chunks: Any,
    view: np.ndarray,
    payload: Callable[[str], np.ndarray],
    where: str,
    lin: tuple[str, str] | None = None,
) -> InPlace:
    """The validated levels of an :func:`eligible` chain (read through ``payload``); ``lin``:
    see :class:`InPlace`."""
    k = chunks[d].itemsize
    try:
        levels = [unpack_changes(payload(c), k, view.size // k) for c in reversed(above)]
    except CodecError as e:
        raise CorruptChunkError(
            f"chunk {d} of {where}: its patches onto the held chunk {b} do not decode ({e}). "
            "Run `deltackpt verify`; load without since= to read it whole"
        ) from e
    return InPlace(d, b, view, k, levels, where, lin)

"""Do a tensor's saved pieces tile it exactly once? One rule for both sides of the format.

The loader (:mod:`deltackpt.format.validate`) refuses a manifest whose shards overlap or leave a
gap; a distributed save (:mod:`deltackpt.distributed.save_plan`) must refuse the same layout *before*
it commits, or ranks that disagree on a DTensor's placements publish a snapshot nobody can load.
Both call :func:`tiling_problem`, so what a save accepts is exactly what a load accepts.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, shape) in the global tensor


def tiling_problem(shape: Sequence[int], boxes: Sequence[Box]) -> tuple[str, int, int] | None:
    """None if ``boxes`` (each inside ``shape``) cover ``shape`` exactly once; else
    ``(reason, i, j)``: ``"cover V of N elements"`` (``i = j = -1``), or ``"pieces i and j
    overlap"`` naming two indices into ``boxes``. Empty boxes are ignored.

    Equal volume and no overlap == exact cover. The overlap test sweeps along dim 0: only pieces
    whose dim-0 ranges overlap are compared (linear for row sharding, small groups for grids)."""
    ndim = len(shape)
    volume = 0
    live: list[tuple[tuple[int, ...], tuple[int, ...], int]] = []
    for i, (offsets, size) in enumerate(boxes):
        n = math.prod(size)
        if n:
            volume += n
            live.append((tuple(offsets), tuple(size), i))
    numel = math.prod(shape)
    if volume != numel:
        return f"cover {volume} of {numel} elements", -1, -1
    live.sort()
    active: list[tuple[tuple[int, ...], tuple[int, ...], int]] = []
    for b in live:
        active = [a for a in active if a[0][0] + a[1][0] > b[0][0]] if ndim else active
        for a in active:
            if all(
                max(ao, bo) < min(ao + an, bo + bn)
                for ao, an, bo, bn in zip(a[0], a[1], b[0], b[1], strict=True)
            ):
                return f"pieces {a[2]} and {b[2]} overlap", a[2], b[2]
        active.append(b)
    return None

"""Parts of ``bench_async.py``: ``master.py`` (the trained state), ``systems.py`` (each
system's sequence of saves), ``kinds.py`` (one state kind: every system, then restores),
``loop.py`` (the training-loop slowdown) and ``report.py`` (the markdown).

``log`` and ``T_START`` are shared by all of them: seconds since the benchmark started."""

from __future__ import annotations

import time

import _common as C

T_START = time.perf_counter()
log = C.make_log(t0=T_START)

"""Parts of ``bench_dist.py``. Part 1, real ranks: ``rank.py`` (what every rank does: the state,
timing, collective byte counts, loads), ``dk_runs.py`` and ``dcp_runs.py`` (each system's saves),
``spawn.py`` (starting the ranks under a deadline and a memory floor). Part 2: ``sim.py`` (both
systems' planning at N simulated ranks). ``report.py`` renders both.

``log`` and ``T_START`` are shared by all of them: seconds since the benchmark (or rank) started.
"""

from __future__ import annotations

import time

import _common as C

T_START = time.perf_counter()
log = C.make_log(t0=T_START)

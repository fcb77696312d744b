"""Helpers of ``bench_sync.py``: full and dense delta rounds against the transport ceiling
(``mxn.py``), delta rounds after real optimizer steps (``steps.py``), the simulated plan
(``sim.py``), and the process job both round benchmarks run (``job.py``)."""

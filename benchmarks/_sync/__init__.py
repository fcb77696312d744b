"""Helpers of ``bench_sync.py`` for the MxN rounds (``mxn.py``) and the simulated plan
(``sim.py``)."""

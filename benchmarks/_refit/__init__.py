"""Helpers of ``bench_refit.py``: the simulated trainer (``trainer``) and the runs per store
(``runs``)."""

"""Parts of ``bench_saveload.py``: ``state.py`` (the state and its mutations), ``systems.py``
(torch, safetensors, DCP and deltackpt behind one interface), ``runs.py`` (the timed saves and
loads) and ``report.py`` (the markdown tables)."""

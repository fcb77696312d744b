"""The benchmarks' shared harness, one small module per concern (``_common.py`` re-exports it all).

* ``env``: paths, machine description, memory (rss, peak, MemAvailable), ports, logging;
* ``files``: fsync, du, page cache, file warm-up, removal;
* ``trees``: walking state trees, bit-exact comparisons;
* ``models``: the Qwen2-0.5B shapes and weights every benchmark uses;
* ``limits``: this machine's memcpy / xxh3 / disk ceilings, measured in the same run;
* ``report``: markdown tables, byte formatting, JSON output;
* ``stores``: what a deltackpt store holds (xor chains, codecs), through its public API.

Only ``stores`` imports deltackpt, so the rest also serves baselines that must not depend on it.
"""

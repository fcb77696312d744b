"""The benchmarks' shared helpers in one namespace: ``import _common as C``.

Everything is defined in the small modules of ``_harness/`` (see its ``__init__``); this module
only gathers them. Nothing here imports deltackpt except ``_harness.stores`` (lazily), so the
helpers also serve baselines that must not depend on it.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # _harness, also when imported by path

from _harness.env import (
    GB,
    OUT_DIR,
    REPO,
    MiB,
    code_fingerprint,
    free_port,
    machine_info,
    make_log,
    mem_available,
    rss,
    trim,
    vmhwm,
)
from _harness.files import (
    all_files,
    drop_caches,
    du_bytes,
    fsync_dir,
    fsync_file,
    fsync_tree,
    rmtree,
    warm_files,
)
from _harness.limits import measure_limits, median, timed
from _harness.models import contig_stride, qwen2_params, qwen2_scale, qwen2_shapes, qwen2_weights
from _harness.ranks import collect
from _harness.report import fmt_bytes, md_table, write_json, write_results
from _harness.trees import (
    bit_digests,
    bit_equal,
    compare,
    compare_digests,
    copy_into,
    flat_tensors,
    flat_values,
    iter_leaves,
    logical_bytes,
    map_tensors,
    tied_pairs,
    unique_tensors,
    zero_,
)

__all__ = [
    "GB",
    "OUT_DIR",
    "REPO",
    "MiB",
    "all_files",
    "bit_digests",
    "bit_equal",
    "code_fingerprint",
    "collect",
    "compare",
    "compare_digests",
    "contig_stride",
    "copy_into",
    "drop_caches",
    "du_bytes",
    "flat_tensors",
    "flat_values",
    "fmt_bytes",
    "free_port",
    "fsync_dir",
    "fsync_file",
    "fsync_tree",
    "iter_leaves",
    "logical_bytes",
    "machine_info",
    "make_log",
    "map_tensors",
    "md_table",
    "measure_limits",
    "median",
    "mem_available",
    "qwen2_params",
    "qwen2_scale",
    "qwen2_shapes",
    "qwen2_weights",
    "rmtree",
    "rss",
    "tied_pairs",
    "timed",
    "trim",
    "unique_tensors",
    "vmhwm",
    "warm_files",
    "write_json",
    "write_results",
    "zero_",
]

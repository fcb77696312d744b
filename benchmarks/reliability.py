"""Reliability trials: run the fault, hostile-input and bad-argument suites and tabulate them.

    python benchmarks/reliability.py [--fuzz-examples N] [--out RELIABILITY.table.md]

Runs the test files below in one pytest session (more fuzz examples than CI's 150 by default),
counts per category the test cases and their outcomes, and prints a markdown table: category,
what is tried, cases run, passed, violations (failed cases) and skipped (with why). A violation
is any test failure: an untyped error, a file touched outside the store, wrong bytes returned, a
snapshot lost, a bound exceeded.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from xml.etree import ElementTree

ROOT = Path(__file__).resolve().parent.parent

CATEGORIES: list[tuple[str, str, list[str]]] = [
    (
        "crash safety",
        "SIGKILL of saving, async-saving, gc-ing and deleting processes at random moments; "
        "failed saves; concurrent writers of one name",
        ["tests/store/test_crash.py", "tests/store/test_concurrency.py"],
    ),
    (
        "damaged chunks",
        "flipped bytes (raw/zstd), truncated and missing packs, corrupt keyframes under deltas, "
        "corrupt and truncated chunks inside merged reads",
        ["tests/store/test_corruption.py", "tests/loading/test_readpath.py"],
    ),
    (
        "hostile stores",
        "traversal and absolute pack ids, symlinked packs/snapshots/manifests/tmp, 25 crafted "
        "inconsistent manifests with valid digests, deep nesting, hypothesis-fuzzed manifests "
        "with valid digests (under an audit hook), hostile sizes with a peak-RSS bound, "
        "damage locality, format v1/v2 golden stores",
        ["tests/store/test_hostile.py", "tests/format/test_format.py"],
    ),
    (
        "bad arguments and full disks",
        "every bad option, path, URL, STORE.json and gc argument; ENOSPC on a small tmpfs",
        ["tests/test_bad_args.py"],
    ),
    (
        "retention and resume",
        "Checkpointer deletes only its own snapshots; RNG state round-trips without pickle; "
        "SIGKILL + resume with dropout is bit-identical; keep_last=K never holds more than K "
        "states on disk; in-place restore",
        ["tests/test_checkpointer.py"],
    ),
    (
        "weight-sync tampering",
        "bytes changed in the shared window after verification; dead peers",
        ["tests/sync/test_tamper.py", "tests/sync/test_fail.py", "tests/sync/test_patch_faults.py"],
    ),
]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fuzz-examples", type=int, default=1000)
    ap.add_argument("--out", type=Path, help="also write the table to this file")
    args = ap.parse_args()
    files = [f for _, _, fs in CATEGORIES for f in fs]
    missing = [f for f in files if not (ROOT / f).exists()]
    if missing:  # a renamed test file would make its category a silent row of 0 cases
        raise SystemExit(f"reliability.py: no such test file {missing}; update CATEGORIES")
    with tempfile.TemporaryDirectory() as tmp:
        xml = Path(tmp) / "junit.xml"
        env = dict(os.environ, DELTACKPT_FUZZ_EXAMPLES=str(args.fuzz_examples))
        t0 = time.perf_counter()
        subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not gpu",
             f"--junitxml={xml}", *files],
            cwd=ROOT, env=env, check=False,
        )  # fmt: skip
        seconds = time.perf_counter() - t0
        cases = list(ElementTree.parse(xml).getroot().iter("testcase"))
    lines = [
        f"fuzz examples per hostile-manifest fuzz test: {args.fuzz_examples}; wall time "
        f"{seconds:.0f} s; python {sys.version.split()[0]}",
        "",
        "| category | what is tried | cases | passed | violations | skipped |",
        "|---|---|---|---|---|---|",
    ]
    total_bad = 0
    for name, what, fs in CATEGORIES:
        mods = {f.removesuffix(".py").replace("/", ".") for f in fs}
        mine = [c for c in cases if c.get("classname", "").rsplit(".", 1)[0] in mods
                or c.get("classname", "") in mods]  # fmt: skip
        failed = sum(
            1 for c in mine if c.find("failure") is not None or c.find("error") is not None
        )
        skipped = [c for c in mine if c.find("skipped") is not None]
        why = "; ".join(sorted({(c.find("skipped").get("message") or "")[:60] for c in skipped}))
        total_bad += failed
        lines.append(
            f"| {name} | {what} | {len(mine)} | {len(mine) - failed - len(skipped)} | {failed} | "
            f"{len(skipped)}{f' ({why})' if why else ''} |"
        )
    table = "\n".join(lines)
    print(table)
    if args.out:
        args.out.write_text(table + "\n")
    return 1 if total_bad else 0


if __name__ == "__main__":
    raise SystemExit(main())

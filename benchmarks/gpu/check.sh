#!/usr/bin/env bash
# The prepared device check (issues 35 and 36), one command on one GPU machine, <= 8 minutes:
#   here:  bash benchmarks/gpu/wheels.sh
#   there: bash benchmarks/gpu/check.sh          (device run, carry [".whl"], timeout_s 540: the boxes sum to 515 s)
# 1. the gpu-marked tests; 2. benchmarks/bench_gpu.py (issue 35's table, limits in the same
# run), benchmarks/bench_gpu_sync.py (issue 36's), benchmarks/bench_sync_overhead.py (a round's
# host time per tensor, CUDA tensors), benchmarks/bench_digest.py (a device round's digests
# beside the device's copy) and benchmarks/bench_gpu_pause.py (a vLLM worker's commit into
# parameters on the GPU: the inference pause); 3. with SUITE_S=<seconds> (0 by default: a second
# call) the rest of the suite on 14 workers, stopped at its time box. Logs and figures go to
# $OUT (bench-out/gpu without one). GPU_TESTS_S, BENCH_S, SYNC_BENCH_S, OVERHEAD_S, DIGEST_S, FP8_S, PAUSE_S, PATCHES_S, SUITE_S override the time
# boxes (0 skips the step; PATCHES_S, bench_checkpoint_patches.py on the device, is 0 by default: give it
# ~60 s on the second call); SYNC_PROFILE: the sync round kind profiled into check.log ("" none). SYNC_ARGS: more arguments of bench_gpu_sync.py (e.g. "--gb 8": issue 36's size, ~4x the time). Without CUDA it runs too: the gpu tests skip and say why,
# the benchmark runs its CPU dry run.
# The ipc link's trainer holds a ring of two buckets per link by default; DELTACKPT_IPC_BUCKETS=none
# (one per bucket of the round, as before 2026-11-28) runs everything without it.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-bench-out/gpu}
mkdir -p "$OUT"
if ! python3 -c "import zstandard, jsonschema" 2>/dev/null && compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export DELTACKPT_TEST_FAILURES="$OUT/failures.log"  # each failure as it happens (tests/conftest.py)
# at most 8 files come back from $OUT: the machine, the build, the gpu tests and both benchmarks'
# output go to one check.log; the benchmarks write their .json and .md; suite.log; failures.log
LOG="$OUT/check.log"
python3 setup.py -q build_ext --inplace >>"$LOG" 2>&1 || echo "no C extension (numpy path)" | tee -a "$LOG"
{ nvidia-smi || true; python3 -c "import torch; print(torch.__version__, torch.cuda.is_available())"
  python3 -c "import triton; print('triton', triton.__version__)" || echo "no triton"; } \
  >>"$LOG" 2>&1
rc=0
# a box of 0 skips its step (a rerun that needs only some of them)
box() { [ "${1}" != 0 ]; }
# the gpu tests on 4 workers, a file per worker at a time (47 tests, a third of them starting
# processes that import torch with CUDA: one process took most of its box on the H100);
# GPU_TESTS_XDIST="-p no:xdist": one process, in order
gx=${GPU_TESTS_XDIST:-$(python3 -c "import xdist" 2>/dev/null && echo "-n 4 --dist loadfile")}
if box "${GPU_TESTS_S:-190}"; then
  timeout "${GPU_TESTS_S:-190}" python3 -m pytest -q -m gpu $gx -p no:cacheprovider -o addopts="-ra" \
    --durations=15 tests 2>&1 | tee -a "$LOG" || rc=1
fi
if box "${BENCH_S:-100}"; then
  timeout "${BENCH_S:-100}" python3 benchmarks/bench_gpu.py --out "$OUT" 2>&1 | tee -a "$LOG" || rc=1
fi
xdist=${SUITE_XDIST:-$(python3 -c "import xdist" 2>/dev/null && echo "-n 14")}
if box "${SYNC_BENCH_S:-120}"; then
  timeout "${SYNC_BENCH_S:-120}" python3 benchmarks/bench_gpu_sync.py --out "$OUT" \
    --profile "${SYNC_PROFILE-full_triton}" ${SYNC_ARGS:-} 2>&1 \
    | tee -a "$LOG" || rc=1
fi
if box "${OVERHEAD_S:-35}"; then  # a round's host time per tensor, CUDA tensors (issue 36's gap)
  dev=$(python3 -c "import torch; print('cuda:0' if torch.cuda.is_available() else 'cpu')")
  timeout "${OVERHEAD_S:-35}" python3 benchmarks/bench_sync_overhead.py --device "$dev" \
    --repeats 10 --profile full --out /tmp/overhead 2>&1 | tee -a "$LOG" || rc=1
  # where a full device round of 240 tensors spends its host time, each side (every other
  # full round profiled; the table's best is an unprofiled one)
  for side in trainer receiver; do
    head -n 40 "/tmp/overhead/bench_sync_overhead.ipc-240.$side.prof.txt" >>"$LOG" 2>/dev/null
  done
fi
if box "${DIGEST_S:-20}"; then  # device digests beside the fingerprints and a device copy
  timeout "${DIGEST_S:-20}" python3 benchmarks/bench_digest.py 2>&1 | tee -a "$LOG" || rc=1
fi
if box "${FP8_S:-15}"; then  # the trainer's FP8 quantize on the device (FP8 engines)
  dev=$(python3 -c "import torch; print('cuda:0' if torch.cuda.is_available() else 'cpu')")
  timeout "${FP8_S:-15}" python3 benchmarks/bench_fp8.py --device "$dev" --quantize-only \
    --scale 1 2>&1 | tee -a "$LOG" || rc=1
fi
if box "${PAUSE_S:-35}"; then  # a vLLM worker's commit on the device: in place, and reloads
  timeout "${PAUSE_S:-35}" python3 benchmarks/bench_gpu_pause.py --out /tmp/pause 2>&1 \
    | tee -a "$LOG" || rc=1  # its table in check.log (8 files come back at most)
fi
if box "${PATCHES_S:-0}"; then  # checkpoint patches for vLLM's sparse backend, found on the device
  dev=$(python3 -c "import torch; print('cuda' if torch.cuda.is_available() else 'cpu')")
  timeout "${PATCHES_S:-0}" python3 benchmarks/bench_checkpoint_patches.py --device "$dev" \
    --params "${PATCHES_PARAMS:-5e8}" --steps 3 --out /tmp/patches 2>&1 | tee -a "$LOG" || rc=1
fi
# SUITE_TESTS: test ids to run instead of the whole suite (e.g. those that failed last time);
# SUITE_MARK ("" runs gpu tests too), SUITE_XDIST ("-p no:xdist": one process, in order).
# Without SUITE_TESTS the suite runs in two parts within the box: first SUITE_FIRST (the tests
# no GPU machine has finished yet: BENCHMARKS.md, the H100 run of 2026-11-28), then the rest of tests/ without them
if box "${SUITE_S:-0}"; then
  first=${SUITE_FIRST-tests/saving/test_on_device.py tests/distributed/test_load_modes.py tests/distributed/test_disagreeing_ranks.py tests/distributed/test_tiers.py tests/distributed/test_tiers_dcp.py tests/distributed/test_peer_deadline.py}
  # where pytest-timeout has a session timeout, pytest stops itself 15 s before the box and
  # still prints its summary and slowest tests (what did not finish, and why, for next time)
  stop=$(python3 -m pytest --help 2>/dev/null | grep -c -- "--session-timeout")  # (reads it all)
  suite() {  # $1: seconds; the rest: what to run
    local s=$1; shift
    local own=()
    [ "${stop:-0}" -gt 0 ] && [ "$s" -gt 30 ] && own=(--session-timeout=$((s - 15)) --durations=30)
    timeout "$s" python3 -m pytest -v -m "${SUITE_MARK-not gpu}" $xdist -p no:cacheprovider -o addopts="-ra" -o timeout=120 \
      "${own[@]}" "$@" >>"$OUT/suite.log" 2>&1 || rc=1
  }
  : >"$OUT/suite.log"
  start=$(date +%s)
  if [ -n "${SUITE_TESTS:-}" ] || [ -z "$first" ]; then
    suite "${SUITE_S:-0}" ${SUITE_TESTS:-tests}
  else
    suite "${SUITE_S:-0}" $first
    left=$(( ${SUITE_S:-0} - ($(date +%s) - start) ))
    ignores=$(for p in $first; do printf -- "--ignore=%s " "$p"; done)
    [ "$left" -gt 5 ] && suite "$left" tests $ignores
  fi
  grep -E "(FAILED|ERROR)( |$)" "$OUT/suite.log" | grep -v "^\[gw.*PASSED" | tail -n 40; grep -E "^(=+ .*(passed|failed).*=+)$" "$OUT/suite.log"
fi
exit $rc

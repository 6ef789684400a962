#!/usr/bin/env bash
# The GPU checks of one change, in one device call: the whole test suite (the GPU tests and the tests against
# torch and transformers included) with one set of counts, then the timings table last (scripts/bench_gpu.py).
# Run from the repository root on the GPU machine:
#   bash scripts/gpu_check.sh [pytest args...]
# The exit status is pytest's, else bench_gpu.py's (SKIP_BENCH=1 leaves the table out); the logs and the
# table's JSON go to $OUT (default /tmp/gpu_check).
# Needs nvidia-smi (a GPU and its driver), pycuda, torch and transformers; where one is missing it says so in
# one line and exits 1. The lent GPU machines have torch and transformers but reach no package registry: pycuda
# comes from the wheels in ../shared/wheels (pycuda 2026.1 for CPython 3.12 and its pure-Python needs), carried
# into the repository as .whl/ and installed with
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/require.sh
require_commands "this runs on a machine with an NVIDIA GPU and its driver" nvidia-smi
require_modules "$CARRIED_WHEELS" pycuda.driver
require_modules "python3 -m pip install torch transformers" torch transformers
export PYTHONUNBUFFERED=1
out=${OUT:-/tmp/gpu_check}
mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm --format=csv,noheader
status=0
python3 -m pytest -q -p no:cacheprovider "$@" 2>&1 | tee "$out/pytest.log" || status=$?
if [ "${SKIP_BENCH:-0}" != "1" ]; then
  bench=0
  python3 scripts/bench_gpu.py --json "$out/bench.json" 2>&1 | tee "$out/bench.log" || bench=$?
  [ "$status" -ne 0 ] || status=$bench
fi
exit "$status"

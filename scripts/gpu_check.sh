#!/usr/bin/env bash
# The GPU checks of one change, in one device call: the whole test suite (GPU tests included),
# then the timings table last. Run from the repository root on the GPU machine:
#   bash scripts/gpu_check.sh [pytest args...]
# Needs pycuda: on the lent machines, install the carried wheels first (see README).
set -uo pipefail
export PYTHONUNBUFFERED=1
out=${OUT:-/tmp/gpu_check}
mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm --format=csv,noheader
python3 -m pytest -q -p no:cacheprovider "$@" 2>&1 | tee "$out/pytest.log"
status=${PIPESTATUS[0]}
if [ "${SKIP_BENCH:-0}" != "1" ]; then
  python3 scripts/bench_gpu.py --json "$out/bench.json" 2>&1 | tee "$out/bench.log"
fi
exit $status

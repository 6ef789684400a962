#!/usr/bin/env bash
# Multi-GPU checks on one host with 2 or more GPUs: NCCL is found, tests/gpu/test_multi_gpu.py (pytest
# arguments pass through, e.g. -k collectives), then the scaling benchmark (BENCH="--configs d12").
# The exit status is the first failing step's, the benchmark running even after failing tests. Needs nvidia-smi
# and pycuda (see scripts/gpu_check.sh's header for the carried wheels); where one is missing it says so in one
# line and exits 1.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/require.sh
require_commands "this runs on a machine with NVIDIA GPUs and their driver" nvidia-smi
require_modules "$CARRIED_WHEELS" pycuda.driver
export NCCL_NVLS_ENABLE=0  # NVLink multicast stays off (see llama/parallel/nccl.py)
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader
nvidia-smi topo -m | head -4
python3 -c "from llama.parallel import nccl; print('NCCL', nccl.version(), 'from', nccl.library_path())"
status=0
python3 -m pytest -q -p no:cacheprovider tests/gpu/test_multi_gpu.py "$@" || status=$?
bench=0
python3 scripts/bench_multi_gpu.py ${BENCH:-} || bench=$?
[ "$status" -ne 0 ] || status=$bench
exit "$status"

#!/usr/bin/env bash
# Multi-GPU checks on one host with 2 or more GPUs, in one go (about 9 minutes on 2 H100s): NCCL is found,
# tests/gpu/test_multi_gpu.py (pytest arguments pass through, e.g. -k collectives), then the 1B table of
# scripts/bench_multi_gpu.py (1 and 2 GPUs, ZeRO 1, 2 and 3; BENCH replaces its arguments, e.g.
# BENCH="--configs d12"), then Llama 3.1 8B at ZeRO-3 on 2 GPUs (BENCH_8B replaces its arguments; BENCH_8B=""
# skips it). Each phase prints its seconds. The exit status is the first failing step's, the benchmarks running
# even after failing tests. Needs nvidia-smi and pycuda (see scripts/gpu_check.sh's header for the carried
# wheels); where one is missing it says so in one line and exits 1.
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
phase() {  # phase NAME COMMAND...: run it, say how long it took, keep the first failure's status
    local began=$SECONDS code=0
    "${@:2}" || code=$?
    echo "== $1: $((SECONDS - began)) s, exit $code"
    [ "$status" -ne 0 ] || status=$code
}
phase "multi-GPU tests" python3 -m pytest -q -p no:cacheprovider tests/gpu/test_multi_gpu.py "$@"
# shellcheck disable=SC2086  # the arguments split on purpose
phase "1B table" python3 scripts/bench_multi_gpu.py ${BENCH---configs llama3.2-1b --gpus 1 2 --zero 1 2 3 --steps 8}
if [ -n "${BENCH_8B---configs llama3.1-8b --gpus 2 --steps 6}" ]; then
    # shellcheck disable=SC2086
    phase "8B at ZeRO-3" python3 scripts/bench_multi_gpu.py ${BENCH_8B---configs llama3.1-8b --gpus 2 --steps 6}
fi
exit "$status"

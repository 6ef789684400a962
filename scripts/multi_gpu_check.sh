#!/usr/bin/env bash
# Multi-GPU checks on one host with 2 or more GPUs: NCCL is found, tests/gpu/test_multi_gpu.py (pytest
# arguments pass through, e.g. -k collectives), then the scaling benchmark (BENCH="--configs d12").
set -uo pipefail
export NCCL_NVLS_ENABLE=0  # NVLink multicast stays off (see llama/parallel/nccl.py)
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader
nvidia-smi topo -m | head -4
python3 -c "from llama.parallel import nccl; print('NCCL', nccl.version(), 'from', nccl.library_path())"
python3 -m pytest -q -p no:cacheprovider tests/gpu/test_multi_gpu.py "$@"
python3 scripts/bench_multi_gpu.py ${BENCH:-}

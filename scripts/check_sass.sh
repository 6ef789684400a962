#!/usr/bin/env bash
# On the GPU machine: compile the production GEMM for sm_90a, count its HGMMA instructions and report
# ptxas's registers and spills per entry point (the issue-8 check that the tensor-core path is the
# wgmma one and nothing spills). Needs nvcc and cuobjdump (the CUDA toolkit); where one is missing it says
# so in one line and exits 1; it also exits 1 where the SASS holds no HGMMA.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/require.sh
require_commands "install the CUDA toolkit (12.0 or later, for sm_90a) and put its bin folder on PATH" nvcc cuobjdump
cubin=$(mktemp --suffix .cubin)
trap 'rm -f "$cubin"' EXIT
log=$(nvcc -cubin -std=c++17 -gencode=arch=compute_90a,code=sm_90a -Xptxas -v -I kernels -o "$cubin" \
    kernels/gemm_wgmma.cu 2>&1) || { echo "$log" >&2; exit 1; }
grep -E "Compiling entry|registers|spill" <<<"$log" | paste - - - | sed -E 's/ptxas info *: //g' | awk '{print "  " $0}'
sass=$(cuobjdump -sass "$cubin")
hgmma=$(grep -c HGMMA <<<"$sass" || true)
echo "HGMMA instructions in kernels/gemm_wgmma.cu's sm_90a SASS: $hgmma"
[ "$hgmma" -gt 0 ] || { echo "check_sass.sh: no HGMMA: the GEMM's tensor-core path is not the wgmma one" >&2; exit 1; }

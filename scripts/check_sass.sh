#!/usr/bin/env bash
# On the GPU machine: compile the production GEMM for sm_90a, count its HGMMA instructions and report
# ptxas's registers and spills per entry point (the issue-8 check that the tensor-core path is the
# wgmma one and nothing spills).
set -euo pipefail
cd "$(dirname "$0")/.."
cubin=$(mktemp --suffix .cubin)
nvcc -cubin -std=c++17 -gencode=arch=compute_90a,code=sm_90a -Xptxas -v -I kernels -o "$cubin" kernels/gemm_wgmma.cu \
    2>&1 | grep -E "Compiling entry|registers|spill" | paste - - - | sed -E 's/ptxas info *: //g' |
    awk '{print "  " $0}'
echo "HGMMA instructions in kernels/gemm_wgmma.cu's sm_90a SASS: $(cuobjdump -sass "$cubin" | grep -c HGMMA)"
rm -f "$cubin"

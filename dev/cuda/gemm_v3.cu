// GEMM v3 `wgmma3` adds, over v2: ping-pong consumers (each warpgroup owns a whole 128 x 128 tile, 2 x m64n128k16
// per k16; the two alternate tiles in an mbarrier-ordered sequence, so that one's epilogue overlaps the other's
// MMAs), 7 stages, split-K inside the kernel (any split count) chosen by a wave and reduce cost model
// (llama/ops/gemm_wgmma.py's splitk_splits3, which production's versions 5 and 8 use too). Its kernel is
// kernels/gemm_wgmma.cu's gemm_pingpong template without the staged epilogue (STAGED = false; production's version 5
// is the same template with it and one stage fewer); the entry points below are the rung's own. Launcher:
// dev/cuda/gemm_ladder.py.
#include "gemm_wgmma.cu"

#define PP_STAGES 7
#if KERNEL_ENTRY(gemm_wgmma3_nt)
GEMM_PINGPONG_ENTRY(gemm_wgmma3_nt, PP_STAGES, true, true, false, false)
#endif
#if KERNEL_ENTRY(gemm_wgmma3_nn)
GEMM_PINGPONG_ENTRY(gemm_wgmma3_nn, PP_STAGES, true, false, false, false)
#endif
#if KERNEL_ENTRY(gemm_wgmma3_tn)
GEMM_PINGPONG_ENTRY(gemm_wgmma3_tn, PP_STAGES, false, false, false, false)
#endif

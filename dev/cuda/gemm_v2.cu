// GEMM v2 `wgmma` adds, over v1 (kernels/gemm_mma.cu, mma.sync): Hopper's wgmma fed by TMA, one producer and two
// cooperative consumer warpgroups (each 64 rows of a 128 x BN tile, BN 128 or 256), mbarriers, setmaxnreg, a
// persistent grid in GROUP_M order, the epilogue stored from the registers. Its kernel is kernels/gemm_wgmma.cu's
// gemm_wgmma template without the staged epilogue (STAGED = false; production's version 6 is the same template with
// it, at these stage counts); the entry points below are the rung's own. Launcher: dev/cuda/gemm_ladder.py.
#include "gemm_wgmma.cu"

#if KERNEL_ENTRY(gemm_wgmma_nt_128x256)
GEMM_WGMMA_ENTRY(gemm_wgmma_nt_128x256, 256, 4, true, true, false, false)
#endif
#if KERNEL_ENTRY(gemm_wgmma_nn_128x256)
GEMM_WGMMA_ENTRY(gemm_wgmma_nn_128x256, 256, 4, true, false, false, false)
#endif
#if KERNEL_ENTRY(gemm_wgmma_tn_128x256)
GEMM_WGMMA_ENTRY(gemm_wgmma_tn_128x256, 256, 4, false, false, false, false)
#endif
#if KERNEL_ENTRY(gemm_wgmma_nt_128x128)
GEMM_WGMMA_ENTRY(gemm_wgmma_nt_128x128, 128, 6, true, true, false, false)
#endif
#if KERNEL_ENTRY(gemm_wgmma_nn_128x128)
GEMM_WGMMA_ENTRY(gemm_wgmma_nn_128x128, 128, 6, true, false, false, false)
#endif
#if KERNEL_ENTRY(gemm_wgmma_tn_128x128)
GEMM_WGMMA_ENTRY(gemm_wgmma_tn_128x128, 128, 6, false, false, false, false)
#endif

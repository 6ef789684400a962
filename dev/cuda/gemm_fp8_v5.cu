// FP8 GEMM v5: production's FP8 version 6 (kernels/gemm_wgmma.cu, gemm_wgmma6_fp8_128x<BN>) on version 5's
// ping-pong kernel instead (the same template switch: e4m3 operands, both K-major, k-blocks of 128 values, the rows'
// scales in the epilogue; split-K of weight gradients as bf16 version 5's). The plan takes version 6 on every FP8
// shape (its d768 weight gradients ran at 0.41-0.48 of torch._scaled_mm under this rung: dev/cuda/README.md).
// Launcher: dev/cuda/gemm_ladder.py.
#include "gemm_wgmma.cu"

#ifdef WGMMA_ENABLED
#define GEMM_WGMMA5_FP8_BODY                                                                              \
    FP8_EPILOGUE gemm_pingpong<PP5_STAGES, true, true, true, true>(maps, maps + 1, e, K, batches, splits, split_kb, \
                                                                   nullptr);
#else
#define GEMM_WGMMA5_FP8_BODY
#endif

#if KERNEL_ENTRY(gemm_wgmma5_fp8)
extern "C" __global__ void __launch_bounds__(WG_THREADS, 1) gemm_wgmma5_fp8(
    const CUtensorMap* maps, void* C, const float* row_scales, const float* col_scales, const float* cos,
    const float* sin, long long stride_c, int M, int N, int K, int batches, int splits, int split_kb, int ldc,
    int mode, int rope_T, int rope_cols, int head_dim, float alpha) {
    GEMM_WGMMA5_FP8_BODY
}
#endif

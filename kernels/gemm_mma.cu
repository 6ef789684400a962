// bf16 GEMM on tensor cores with mma.sync: the GEMM ladder's version 1, for every GPU from sm_80.
//
// C = alpha * op(A) @ op(B), fp32 accumulation; the epilogue (gemm_epilogue.cuh) stores bf16 or
// fp32, accumulates into fp32, or applies RoPE. Strided-batched over blockIdx.z. Row-major storage,
// and every layout the model needs, with no transpose kernels:
//   gemm_mma_nt: A (M, K), B (N, K)   forward   y = x @ W^T
//   gemm_mma_nn: A (M, K), B (K, N)   dX = dY @ W
//   gemm_mma_tn: A (K, M), B (K, N)   dW += dY^T @ x
// Requirements (checked by the launcher): leading dimensions multiples of 8 elements and 16-byte
// aligned base pointers, so that every 16-byte chunk of a row is aligned. M, N, K are arbitrary:
// chunks past an edge are zero-filled by cp.async, stores past an edge are skipped.
//
// Design: a CTA of 8 warps computes a BM x BN tile, stepping through K in BK = 64 slices held in a
// STAGES-deep cp.async ring in shared memory. Each slice is stored as rows of 16-byte chunks,
// XOR-swizzled by row (chunk ^ row % 8) so that ldmatrix reads 8 rows without bank conflicts.
// K-major operands load with ldmatrix, M- or N-major ones with ldmatrix.trans, so one kernel
// template covers all three layouts. Warps tile the CTA 2 (M) x 4 (N); each issues
// mma.m16n8k16 over its WM x WN sub-tile.
#include <cuda_bf16.h>
#include <stdint.h>

#include "gemm_epilogue.cuh"
#include "mma.cuh"

#define BK 64

// byte offset of element (r, c) in a tile of rows of L bf16 (L a multiple of 64), chunks swizzled
template <int L>
__device__ __forceinline__ uint32_t swizzled(int r, int c) {
    return r * L * 2 + ((((c >> 3) ^ (r & 7))) << 4) + (c & 7) * 2;
}

// Copies the ROWS x L tile at (row0, col0) of a (rows, cols) matrix with leading dimension ld.
template <int ROWS, int L, int THREADS>
__device__ __forceinline__ void load_tile(uint32_t tile, const __nv_bfloat16* G, long long ld, int row0, int col0,
                                          int rows, int cols) {
    constexpr int CHUNKS_PER_ROW = L / 8, CHUNKS = ROWS * CHUNKS_PER_ROW;
    static_assert(CHUNKS % THREADS == 0, "tile chunks must divide among the threads");
    #pragma unroll
    for (int i = 0; i < CHUNKS / THREADS; i++) {
        const int chunk = threadIdx.x + i * THREADS;
        const int r = chunk / CHUNKS_PER_ROW, c = (chunk % CHUNKS_PER_ROW) * 8;
        const int gr = row0 + r, gc = col0 + c;
        const __nv_bfloat16* src = G;
        int bytes = 0;
        if (gr < rows && gc < cols) {
            src = G + gr * ld + gc;
            bytes = min(8, cols - gc) * 2;
        }
        cp_async_16(tile + swizzled<L>(r, c), src, bytes);
    }
}

// A thread's accumulators: acc[mi][ni][0, 1] hold (row + 16 mi, col + 8 ni + {0, 1}), [2, 3] row + 8.
template <int MODE, int MI, int NI>
__device__ __forceinline__ void store_accumulators(const Epilogue& e, const float (&acc)[MI][NI][4], int batch, int row,
                                                   int col) {
    #pragma unroll
    for (int mi = 0; mi < MI; mi++)
        #pragma unroll
        for (int ni = 0; ni < NI; ni++) {
            epilogue_pair<MODE>(e, batch, row + 16 * mi, col + 8 * ni, acc[mi][ni][0], acc[mi][ni][1]);
            epilogue_pair<MODE>(e, batch, row + 16 * mi + 8, col + 8 * ni, acc[mi][ni][2], acc[mi][ni][3]);
        }
}

template <int BM, int BN, int STAGES, bool A_KMAJOR, bool B_KMAJOR>
__device__ __forceinline__ void gemm_mma(const __nv_bfloat16* A, const __nv_bfloat16* B, Epilogue e, int K,
                                         int lda, int ldb, long long stride_a, long long stride_b) {
    constexpr int WARPS_M = 2, WARPS_N = 4, THREADS = WARPS_M * WARPS_N * 32;
    constexpr int WM = BM / WARPS_M, WN = BN / WARPS_N, MI = WM / 16, NI = WN / 8;
    constexpr int A_TILE = BM * BK * 2, B_TILE = BN * BK * 2;  // bytes per stage
    extern __shared__ __align__(128) uint8_t smem[];
    const uint32_t a_smem = smem_address(smem), b_smem = a_smem + STAGES * A_TILE;

    const int tiles_m = (e.M + BM - 1) / BM, tiles_n = (e.N + BN - 1) / BN;
    int tm, tn;
    tile_coords(blockIdx.x, tiles_m, tiles_n, &tm, &tn);
    const int m0 = tm * BM, n0 = tn * BN, batch = blockIdx.z;
    A += batch * stride_a;
    B += batch * stride_b;
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int wm = (warp / WARPS_N) * WM, wn = (warp % WARPS_N) * WN;

    auto load_stage = [&](int stage, int kt) {
        const int k0 = kt * BK;
        if (A_KMAJOR) load_tile<BM, BK, THREADS>(a_smem + stage * A_TILE, A, lda, m0, k0, e.M, K);
        else          load_tile<BK, BM, THREADS>(a_smem + stage * A_TILE, A, lda, k0, m0, K, e.M);
        if (B_KMAJOR) load_tile<BN, BK, THREADS>(b_smem + stage * B_TILE, B, ldb, n0, k0, e.N, K);
        else          load_tile<BK, BN, THREADS>(b_smem + stage * B_TILE, B, ldb, k0, n0, K, e.N);
    };

    float acc[MI][NI][4] = {};
    const int KT = (K + BK - 1) / BK;
    #pragma unroll
    for (int s = 0; s < STAGES - 1; s++) {
        if (s < KT) load_stage(s, s);
        cp_async_commit();
    }
    for (int kt = 0; kt < KT; kt++) {
        cp_async_wait<STAGES - 2>();
        __syncthreads();  // slice kt is visible to all; slice kt - 1's stage is free to refill
        if (kt + STAGES - 1 < KT) load_stage((kt + STAGES - 1) % STAGES, kt + STAGES - 1);
        cp_async_commit();
        const uint32_t a_tile = a_smem + (kt % STAGES) * A_TILE, b_tile = b_smem + (kt % STAGES) * B_TILE;
        #pragma unroll
        for (int kk = 0; kk < BK; kk += 16) {
            uint32_t a[MI][4], b[NI][2];
            #pragma unroll
            for (int mi = 0; mi < MI; mi++) {
                const int m = wm + mi * 16;
                if (A_KMAJOR) {
                    ldmatrix_x4(a[mi], a_tile + swizzled<BK>(m + (lane & 15), kk + (lane >> 4) * 8));
                } else {
                    const int j = lane >> 3;
                    ldmatrix_x4_trans(a[mi], a_tile + swizzled<BM>(kk + (lane & 7) + (j >> 1) * 8, m + (j & 1) * 8));
                }
            }
            #pragma unroll
            for (int nj = 0; nj < NI / 2; nj++) {
                const int n = wn + nj * 16, j = lane >> 3;
                uint32_t r[4];
                if (B_KMAJOR) ldmatrix_x4(r, b_tile + swizzled<BK>(n + (lane & 7) + (j >> 1) * 8, kk + (j & 1) * 8));
                else ldmatrix_x4_trans(r, b_tile + swizzled<BN>(kk + (lane & 7) + (j & 1) * 8, n + (j >> 1) * 8));
                b[2 * nj][0] = r[0];
                b[2 * nj][1] = r[1];
                b[2 * nj + 1][0] = r[2];
                b[2 * nj + 1][1] = r[3];
            }
            #pragma unroll
            for (int mi = 0; mi < MI; mi++)
                #pragma unroll
                for (int ni = 0; ni < NI; ni++) mma_bf16(acc[mi][ni], a[mi], b[ni][0], b[ni][1]);
        }
    }
    cp_async_wait<0>();

    EPILOGUE_DISPATCH(e.mode, store_accumulators, e, acc, batch, m0 + wm + lane / 4, n0 + wn + 2 * (lane % 4))
}

// Each entry point below is guarded by KERNEL_ENTRY(name), so that a build unit may compile one alone
// (llama/runtime/kernel_build.py defines KERNEL_ENTRY on nvcc's command line); by default, every one.
#ifndef KERNEL_ENTRY
#define KERNEL_ENTRY(name) 1
#endif

// Entry points: gemm_mma_<layout>_<BM>x<BN>. Shared memory: STAGES * (BM + BN) * BK * 2 bytes.
#define GEMM_MMA_ENTRY(name, BM_, BN_, STAGES_, A_KMAJOR, B_KMAJOR)                                           \
    extern "C" __global__ void __launch_bounds__(256) name(                                                   \
        void* C, const __nv_bfloat16* A, const __nv_bfloat16* B, const float* cos, const float* sin,          \
        long long stride_a, long long stride_b, long long stride_c, int M, int N, int K, int lda, int ldb,    \
        int ldc, int mode, int rope_T, int rope_cols, int head_dim, float alpha) {                            \
        const Epilogue e = {C, cos, sin, stride_c, ldc, M, N, mode, alpha, rope_T, rope_cols, head_dim};      \
        gemm_mma<BM_, BN_, STAGES_, A_KMAJOR, B_KMAJOR>(A, B, e, K, lda, ldb, stride_a, stride_b);            \
    }

#if KERNEL_ENTRY(gemm_mma_nt_128x128)
GEMM_MMA_ENTRY(gemm_mma_nt_128x128, 128, 128, 4, true, true)
#endif
#if KERNEL_ENTRY(gemm_mma_nn_128x128)
GEMM_MMA_ENTRY(gemm_mma_nn_128x128, 128, 128, 4, true, false)
#endif
#if KERNEL_ENTRY(gemm_mma_tn_128x128)
GEMM_MMA_ENTRY(gemm_mma_tn_128x128, 128, 128, 4, false, false)
#endif
#if KERNEL_ENTRY(gemm_mma_nt_128x256)
GEMM_MMA_ENTRY(gemm_mma_nt_128x256, 128, 256, 3, true, true)
#endif
#if KERNEL_ENTRY(gemm_mma_nn_128x256)
GEMM_MMA_ENTRY(gemm_mma_nn_128x256, 128, 256, 3, true, false)
#endif
#if KERNEL_ENTRY(gemm_mma_tn_128x256)
GEMM_MMA_ENTRY(gemm_mma_tn_128x256, 128, 256, 3, false, false)
#endif

// Split-K's deterministic reduction: C (+)= alpha * sum over s of partial[s], in order s = 0, 1, ...
// partial (splits, n) fp32, C (n) fp32; accumulate adds onto C. Any GEMM version writes the partials.
#if KERNEL_ENTRY(gemm_splitk_reduce)
extern "C" __global__ void gemm_splitk_reduce(float* C, const float* partial, long long n, int splits,
                                              int accumulate, float alpha) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    float sum = 0.f;
    for (int s = 0; s < splits; s++) sum += partial[s * n + i];
    C[i] = accumulate ? C[i] + alpha * sum : alpha * sum;
}
#endif

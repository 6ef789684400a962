// Matmul, our cuBLAS: C = alpha * op(A) @ op(B) + beta * C in fp32, strided-batched.
//
// Row-major. op(A) is (M, K): A stored (M, K) with row stride lda, or (K, M) when transposed.
// op(B) is (K, N): B stored (K, N) with row stride ldb, or (N, K) when transposed. C (M, N), ldc.
// Batch z = blockIdx.z offsets A, B, C by z * stride_a / stride_b / stride_c.
// With beta == 0, C is written without being read (it may hold garbage or NaN).
//
// Tiling: a block of 256 threads computes a 128 x 128 tile of C, stepping through K 16 at a time.
// The A and B tiles are staged in shared memory (k-major, so the inner loop reads float4 rows),
// and the next tiles are loaded into registers while the current ones are multiplied.
// Each thread owns an 8 x 8 sub-tile: rows {ty*4 + i, 64 + ty*4 + i}, cols {tx*4 + j, 64 + tx*4 + j}.
// Entry points: matmul_nn, matmul_nt (B transposed), matmul_tn (A transposed).
#include "common.cuh"

#define BM 128
#define BN 128
#define BK 16
#define PAD 4
#define THREADS 256

template <bool TRANS>
__device__ __forceinline__ void load_tile(float (&reg)[8], const float* X, int ld, int rows, int cols,
                                          int row0, int k0, int tid) {
    // Loads the (BM x BK) slice of op(X) starting at (row0, k0): X is (rows, cols) untransposed
    // (row index along M/N, k along cols) or (cols, rows) stored transposed.
    #pragma unroll
    for (int i = 0; i < 8; i++) {
        int r, k;
        if (!TRANS) { k = tid % BK; r = tid / BK + 16 * i; }
        else        { r = tid % BM; k = tid / BM + 2 * i; }
        const int gr = row0 + r, gk = k0 + k;
        bool inside = gr < rows && gk < cols;
        reg[i] = inside ? (TRANS ? X[(long long)gk * ld + gr] : X[(long long)gr * ld + gk]) : 0.0f;
    }
}

template <bool TRANS>
__device__ __forceinline__ void store_tile(float (*S)[BM + PAD], const float (&reg)[8], int tid) {
    #pragma unroll
    for (int i = 0; i < 8; i++) {
        int r, k;
        if (!TRANS) { k = tid % BK; r = tid / BK + 16 * i; }
        else        { r = tid % BM; k = tid / BM + 2 * i; }
        S[k][r] = reg[i];
    }
}

// For B the "rows" of op(B)^T are the N columns of C: op(B)^T is (N, K), stored (N, K) when B is
// transposed and (K, N) otherwise, so B loads as an A-like operand with the opposite flag.
template <bool TRANS_A, bool TRANS_B>
__device__ void matmul_tile(float* C, const float* A, const float* B, int M, int N, int K, int lda, int ldb,
                            int ldc, long long stride_a, long long stride_b, long long stride_c,
                            float alpha, float beta) {
    __shared__ __align__(16) float As[BK][BM + PAD];
    __shared__ __align__(16) float Bs[BK][BN + PAD];
    const int tid = threadIdx.x, tx = tid % 16, ty = tid / 16;
    const int m0 = blockIdx.y * BM, n0 = blockIdx.x * BN;
    A += blockIdx.z * stride_a;
    B += blockIdx.z * stride_b;
    C += blockIdx.z * stride_c;

    float acc[8][8] = {};
    float a_reg[8], b_reg[8];
    load_tile<TRANS_A>(a_reg, A, lda, M, K, m0, 0, tid);
    load_tile<!TRANS_B>(b_reg, B, ldb, N, K, n0, 0, tid);
    store_tile<TRANS_A>(As, a_reg, tid);
    store_tile<!TRANS_B>(Bs, b_reg, tid);
    __syncthreads();

    for (int k0 = 0; k0 < K; k0 += BK) {
        const bool has_next = k0 + BK < K;
        if (has_next) {
            load_tile<TRANS_A>(a_reg, A, lda, M, K, m0, k0 + BK, tid);
            load_tile<!TRANS_B>(b_reg, B, ldb, N, K, n0, k0 + BK, tid);
        }
        #pragma unroll
        for (int k = 0; k < BK; k++) {
            float a[8], b[8];
            *(float4*)&a[0] = *(const float4*)&As[k][ty * 4];
            *(float4*)&a[4] = *(const float4*)&As[k][64 + ty * 4];
            *(float4*)&b[0] = *(const float4*)&Bs[k][tx * 4];
            *(float4*)&b[4] = *(const float4*)&Bs[k][64 + tx * 4];
            #pragma unroll
            for (int i = 0; i < 8; i++)
                #pragma unroll
                for (int j = 0; j < 8; j++) acc[i][j] = fmaf(a[i], b[j], acc[i][j]);
        }
        __syncthreads();
        if (has_next) {
            store_tile<TRANS_A>(As, a_reg, tid);
            store_tile<!TRANS_B>(Bs, b_reg, tid);
            __syncthreads();
        }
    }

    #pragma unroll
    for (int i = 0; i < 8; i++) {
        const int m = m0 + (i < 4 ? ty * 4 + i : 64 + ty * 4 + i - 4);
        if (m >= M) continue;
        #pragma unroll
        for (int j = 0; j < 8; j++) {
            const int n = n0 + (j < 4 ? tx * 4 + j : 64 + tx * 4 + j - 4);
            if (n >= N) continue;
            float* c = C + (long long)m * ldc + n;
            *c = beta == 0.0f ? alpha * acc[i][j] : alpha * acc[i][j] + beta * *c;
        }
    }
}

#define MATMUL_ENTRY(name, TA, TB)                                                                      \
    extern "C" __global__ void __launch_bounds__(THREADS) name(                                          \
        float* C, const float* A, const float* B, int M, int N, int K, int lda, int ldb, int ldc,        \
        long long stride_a, long long stride_b, long long stride_c, float alpha, float beta) {           \
        matmul_tile<TA, TB>(C, A, B, M, N, K, lda, ldb, ldc, stride_a, stride_b, stride_c, alpha, beta); \
    }

MATMUL_ENTRY(matmul_nn, false, false)
MATMUL_ENTRY(matmul_nt, false, true)
MATMUL_ENTRY(matmul_tn, true, false)

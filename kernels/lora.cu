// LoRA's small products beside a linear layer's GEMM (--lora; the twin llama/twins/lora.py, the layer
// llama/model/lora_linears.py). A GEMM of a block that adapts m targets (the fused qkv: q, k, v; w1/w3: gate, up;
// o and down alone) holds its adapters stacked: A (m r, IC), the targets' A's one under the other, and B (OC, r),
// their B's one under the other; output row (column of out) o belongs to target seg(o) = (o >= s1) + (o >= s2),
// s1 and s2 the first rows of the second and third targets (OC where there is none).
//
// lora_add_bf16: out (N, OC) bf16 += scale * sum_k xa[n, seg(o) * K + k] * w(o, k), k < K, with w(o, k) at
//   w[o * w_row + k * w_k] (bf16). The forward: out the base GEMM's output, xa = x A^T (N, m r), w = B (w_row = r,
//   w_k = 1), K = r; with RoPE (the QKV projection, whose base output the GEMM's epilogue rotated) the update of
//   each pair (o, o + 1) of the first rope_cols columns is rotated by the pair's angle at position n % rope_T
//   first, so that out holds rope(x W^T) + rope(scale * delta) = rope(x W^T + scale * delta) up to rounding.
//   The backward's dx: out = dx, xa = dxa (N, m r), w = A read transposed (w(i, k) = A[k, i]: w_row = 1, w_k = IC),
//   K = m r, one segment (s1 = s2 = OC), scale 1.
//   A block of LORA_THREADS threads takes LORA_COLUMNS columns (a pair a thread) and LORA_ROWS rows; it holds
//   its columns' w (K x LORA_COLUMNS) and its rows' xa (LORA_ROWS x m K) in shared memory as floats. Each out
//   value is read and written once (4 bytes a value over the pass: the floor is N * OC * 4 bytes at the copy
//   bandwidth), the sums in fp32, one rounding to bf16 at the end.
// lora_block_diagonal_bf16: out (OC, m r) = the block-diagonal spread of B (OC, r): row o's r values at columns
//   seg(o) r .. seg(o) r + r - 1, zeros elsewhere (the backward's dxa = dout @ that, one GEMM for the m targets).
// lora_take_blocks_f32: dB (OC, r) fp32 += c[o, seg(o) r + k] of c (OC, m r) fp32 (the backward's dB: the
//   block-diagonal part of dout^T xa, computed whole by one GEMM).
#include "bf16.cuh"
#include "rope.cuh"

#define LORA_THREADS 128
#define LORA_COLUMNS (2 * LORA_THREADS)  // a pair of columns a thread
#define LORA_ROWS 32
#define LORA_MAX_K 128  // K values of w a column holds in shared memory (r for the forward, m r for dx)

__device__ __forceinline__ int lora_segment(int o, int s1, int s2) { return (o >= s1) + (o >= s2); }

extern "C" __global__ void lora_add_bf16(bf16* out, const bf16* xa, const bf16* w, float scale, int N, int OC,
                                         int K, int segments, int s1, int s2, long long w_row, long long w_k,
                                         const float* cos, const float* sin, int rope_T, int rope_cols,
                                         int head_dim) {
    extern __shared__ float lora_shared[];
    float* w_s = lora_shared;                        // (K, LORA_COLUMNS)
    float* xa_s = lora_shared + K * LORA_COLUMNS;    // (LORA_ROWS, segments * K)
    const int col0 = blockIdx.x * LORA_COLUMNS, row0 = blockIdx.y * LORA_ROWS, XK = segments * K;
    for (int i = threadIdx.x; i < K * LORA_COLUMNS; i += LORA_THREADS) {
        const int k = i / LORA_COLUMNS, o = col0 + i % LORA_COLUMNS;
        w_s[i] = o < OC ? __bfloat162float(w[o * w_row + k * w_k]) : 0.0f;
    }
    for (int i = threadIdx.x; i < LORA_ROWS * XK; i += LORA_THREADS) {
        const int r = i / XK, n = row0 + r;
        xa_s[i] = n < N ? __bfloat162float(xa[(long long)n * XK + i % XK]) : 0.0f;
    }
    __syncthreads();
    const int c = 2 * threadIdx.x, o = col0 + c;
    if (o >= OC) return;
    const int base = lora_segment(o, s1, s2) * K;
    for (int r = 0; r < LORA_ROWS && row0 + r < N; r++) {
        const int n = row0 + r;
        float d0 = 0.0f, d1 = 0.0f;
        for (int k = 0; k < K; k++) {
            const float x = xa_s[r * XK + base + k];
            d0 += x * w_s[k * LORA_COLUMNS + c];
            d1 += x * w_s[k * LORA_COLUMNS + c + 1];
        }
        d0 *= scale;
        d1 *= scale;
        if (o < rope_cols) {
            const int entry = (n % rope_T) * (head_dim >> 1) + ((o % head_dim) >> 1);
            rope_rotate(d0, d1, cos[entry], sin[entry]);
        }
        __nv_bfloat162* p = reinterpret_cast<__nv_bfloat162*>(out + (long long)n * OC + o);
        const float2 v = __bfloat1622float2(*p);
        *p = __floats2bfloat162_rn(v.x + d0, v.y + d1);
    }
}

extern "C" __global__ void lora_block_diagonal_bf16(bf16* out, const bf16* b, int OC, int r, int segments, int s1,
                                                    int s2) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const int width = segments * r;
    if (i >= (long long)OC * width) return;
    const int o = i / width, j = i % width, start = lora_segment(o, s1, s2) * r;
    out[i] = j >= start && j < start + r ? b[o * r + j - start] : __float2bfloat16(0.0f);
}

extern "C" __global__ void lora_take_blocks_f32(float* db, const float* c, int OC, int r, int segments, int s1,
                                                int s2) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)OC * r) return;
    const int o = i / r, k = i % r;
    db[i] += c[(long long)o * segments * r + lora_segment(o, s1, s2) * r + k];
}

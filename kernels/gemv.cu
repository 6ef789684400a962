// Skinny GEMMs for decoding: out (B, N) = x (B, K) @ W^T for a batch of 1 to 16 sequences, W (N, K) bf16
// (Meta's (out, in) layout, the bf16 weights read once per token), fp32 accumulation on tensor cores.
// Decode is bound by reading W, so the kernel is built around that stream:
// - A tile is 32 rows of W, two m16 tiles of mma.sync m16n8k16 with the batch as the n8 (n16) side. Its
//   two halves are rows [r, r + 16) and [r + second, r + second + 16): second = 16 for contiguous rows,
//   F for gate+up (gate rows n.., up rows F + n..), so that SwiGLU's two operands meet in one tile.
// - Lane (g, t) = (lane / 4, lane % 4) loads 16 bytes (8 consecutive k) of rows g and g + 8 of each
//   half, and 16 bytes of x for batch rows g (and g + 8): the k order inside the mma's 16-wide
//   reduction is permuted (lane t's slots {2t, 2t+1, 2t+8, 2t+9} hold k = 8t + {0..3} in the first
//   mma and 8t + {4..7} in the second), the same for W and x, so no shuffles are needed.
// - Every block takes one tile and one of `splits` (1, 2, 4 or 8) equal ranges of K; its 4 warps take
//   UNROLL k-steps of 32 each in turn (UNROLL * 2 * 2 16-byte weight loads in flight per lane), and
//   add their results in warp order through shared memory.
// - With splits > 1 the blocks of a tile form one thread-block cluster (1, splits): after a cluster
//   barrier, block `rank` adds the rows it finishes (a 1/splits share of the tile) over the blocks'
//   shared memory in rank order and runs the epilogue on them. The order is fixed: deterministic.
// - Launched as a programmatic dependent (kernels/common.cuh): a block asks for the first
//   GEMV_PREFETCH_BYTES of each of its rows' K range to come to L2, then waits for the kernel before.
// - x is bf16 (B, K), or with NORM the fp32 residual stream (B, K) with its RMSNorm: the product is
//   rstd[b] * (bf16(x * weight[k]) @ W^T), rstd applied in the epilogue so that the main loop need not
//   wait for it. The stream's statistics come as sums of squares, `slots` partial sums per sequence,
//   squares (slots, B), from the kernel that wrote the stream; every block adds them in the same order:
//   rstd[b] = 1 / sqrt(sum / K + eps).
// Epilogues (one entry point each):
//   gemv_store:    out (B, N) fp32 = x @ W^T                              (the head's logits)
//   gemv_residual: x_out (B, N) fp32 += x @ W^T, and squares_out (tiles, B): each tile's sum of the
//                  squares of its rows, the next RMSNorm's statistics
//   gemv_swiglu:   out (B, F) bf16 = silu(gate) * up, [gate | up] = x @ W^T, W = w13 (2F, K)
//   gemv_qkv_rope: qkv = x @ W^T, W = wqkv ((H + 2KV) D, K); q and k rotated at position *position
//                  (RoPE, Meta's interleaved pairs, cos/sin (T_max, D/2)); q -> q_out (B, H, D) fp32,
//                  k and v -> k_cache, v_cache (B, KV, T_max, D) bf16 at position *position
// Requirements: K % 8 == 0, W, x 16-byte aligned rows; B <= 16; D even; splits > 1 only on sm_90.
#include <cstdint>
#include "bf16.cuh"
#include "mma.cuh"
#include "rope.cuh"
#include "swiglu.cuh"

#define GEMV_WARPS 4
#define GEMV_THREADS (GEMV_WARPS * 32)
#define GEMV_ROWS 32     // rows of W per tile
#define GEMV_MAX_BATCH 16
#define GEMV_MAX_SPLITS 8  // blocks of a tile's cluster (llama/ops/gemv.py reads it: MAX_SPLITS)
#define GEMV_UNROLL 4    // k-steps of 32 loaded before they are multiplied
#define GEMV_PREFETCH_BYTES 1024  // of each row's range, brought to L2 while the kernel before finishes
#define GEMV_SQUARES_AHEAD 4  // of the stream's sums of squares per lane, loaded before the main loop

enum GemvEpilogue { GEMV_STORE, GEMV_RESIDUAL, GEMV_SWIGLU, GEMV_QKV_ROPE };

struct GemvArgs {
    const bf16* w;          // (N_w, K): the weight rows
    const void* x;          // (B, K): bf16, or fp32 with norm_weight (the residual stream, normalized here)
    const float* norm_weight;  // (K,) or null
    const float* squares;   // (slots, B) with norm_weight: the stream's partial sums of squares
    int slots;
    float eps;
    int B, N, K, second;    // N: output rows (features); second: row offset of a tile's second half
    int splits;             // blocks per tile, a cluster
    // epilogue outputs
    float* out_f32;         // store: (B, N); residual: the stream x_out (B, N)
    bf16* out_bf16;         // swiglu: (B, F)
    float* squares_out;     // residual: (tiles, B)
    float* q_out;           // qkv_rope: (B, H, D)
    bf16* k_cache;
    bf16* v_cache;          // (B, KV, T_max, D)
    const float* cos_table;
    const float* sin_table; // (T_max, D/2)
    const int* position;
    int H, KV, D, T_max;
};

// 16 bytes of weights, streamed past L1 (read once per token)
__device__ __forceinline__ uint4 load_weights(const bf16* p) { return __ldcs(reinterpret_cast<const uint4*>(p)); }

// 8 values of x's row b from k, as bf16: the input as stored, or the fp32 stream times the RMSNorm's
// weight (its rstd is applied to the product, in the epilogue)
template <bool NORM>
__device__ __forceinline__ uint4 load_x(const GemvArgs& a, int b, int k) {
    if constexpr (NORM) {
        float v[8], w[8];
        load_f32x8(v, static_cast<const float*>(a.x) + (long long)b * a.K + k);
        load_f32x8(w, a.norm_weight + k);
#pragma unroll
        for (int j = 0; j < 8; j++) v[j] *= w[j];
        return pack_bf16x8(v);
    } else {
        return *reinterpret_cast<const uint4*>(static_cast<const bf16*>(a.x) + (long long)b * a.K + k);
    }
}

// The RMSNorm's statistics, in two halves around the main loop so that their loads wait beside the
// weights': warp w adds batch rows w, w + 4, ...; lane l the slots l, l + 32, ... of each (the first
// SQUARES_AHEAD of them loaded before the main loop), then the lanes' sums in a fixed tree; rstd (B,)
// in shared memory.
template <int NT>
__device__ __forceinline__ void load_squares(float (&ahead)[2 * NT][GEMV_SQUARES_AHEAD], const GemvArgs& a) {
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
#pragma unroll
    for (int r = 0; r < 2 * NT; r++)
#pragma unroll
        for (int i = 0; i < GEMV_SQUARES_AHEAD; i++) {
            const int b = warp + GEMV_WARPS * r, s = lane + 32 * i;
            ahead[r][i] = b < a.B && s < a.slots ? a.squares[(long long)s * a.B + b] : 0.0f;
        }
}

template <int NT>
__device__ void finish_rstd(float* rstd, const float (&ahead)[2 * NT][GEMV_SQUARES_AHEAD], const GemvArgs& a) {
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
#pragma unroll
    for (int r = 0; r < 2 * NT; r++) {
        const int b = warp + GEMV_WARPS * r;
        if (b >= a.B) break;
        float sum = 0.0f;
#pragma unroll
        for (int i = 0; i < GEMV_SQUARES_AHEAD; i++) sum += ahead[r][i];
        for (int s = lane + 32 * GEMV_SQUARES_AHEAD; s < a.slots; s += 32) sum += a.squares[(long long)s * a.B + b];
        sum = warp_sum(sum);
        if (lane == 0) rstd[b] = rsqrtf(sum / a.K + a.eps);
    }
    __syncthreads();
}

// The block's tile (GEMV_ROWS, GEMV_MAX_BATCH) fp32 over its K range, into `tile` (shared), rows in the
// order [first half | second half].
template <int NT, bool NORM>
__device__ void tile_product(float (*tile)[GEMV_MAX_BATCH], const GemvArgs& a, int row0, int k_begin, int k_end) {
    __shared__ float warp_tiles[GEMV_WARPS][GEMV_ROWS][GEMV_MAX_BATCH];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    const bf16* rows[2][2];  // [half][g, g + 8]
    bool row_ok[2][2];
#pragma unroll
    for (int m = 0; m < 2; m++)
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const int r = g + 8 * h;  // row inside the half
            row_ok[m][h] = row0 + r + (a.second == 16 ? 16 * m : 0) < a.N;  // its output feature exists
            rows[m][h] = a.w + (long long)(row0 + r + m * a.second) * a.K;
        }
    float acc[2][NT][4] = {};
    for (int k0 = k_begin + warp * 32 * GEMV_UNROLL; k0 < k_end; k0 += GEMV_WARPS * 32 * GEMV_UNROLL) {
        uint4 w[GEMV_UNROLL][2][2], x[GEMV_UNROLL][NT];
#pragma unroll
        for (int u = 0; u < GEMV_UNROLL; u++) {
            const int k = k0 + 32 * u + 8 * t;
            const bool k_ok = k < k_end;
#pragma unroll
            for (int m = 0; m < 2; m++)
#pragma unroll
                for (int h = 0; h < 2; h++)
                    w[u][m][h] = k_ok && row_ok[m][h] ? load_weights(rows[m][h] + k) : make_uint4(0, 0, 0, 0);
#pragma unroll
            for (int n = 0; n < NT; n++)
                x[u][n] = k_ok && g + 8 * n < a.B ? load_x<NORM>(a, g + 8 * n, k) : make_uint4(0, 0, 0, 0);
        }
#pragma unroll
        for (int u = 0; u < GEMV_UNROLL; u++)
#pragma unroll
            for (int m = 0; m < 2; m++)
#pragma unroll
                for (int n = 0; n < NT; n++) {
                    mma_bf16(acc[m][n], w[u][m][0].x, w[u][m][1].x, w[u][m][0].y, w[u][m][1].y, x[u][n].x,
                                 x[u][n].y);
                    mma_bf16(acc[m][n], w[u][m][0].z, w[u][m][1].z, w[u][m][0].w, w[u][m][1].w, x[u][n].z,
                                 x[u][n].w);
                }
    }
    // accumulators: acc[m][n][i] is row 16m + g + 8 (i / 2), batch 8n + 2t + i % 2
#pragma unroll
    for (int m = 0; m < 2; m++)
#pragma unroll
        for (int n = 0; n < NT; n++)
#pragma unroll
            for (int i = 0; i < 4; i++) warp_tiles[warp][16 * m + g + 8 * (i / 2)][8 * n + 2 * t + i % 2] = acc[m][n][i];
    __syncthreads();
    for (int e = threadIdx.x; e < GEMV_ROWS * GEMV_MAX_BATCH; e += GEMV_THREADS) {
        const int r = e / GEMV_MAX_BATCH, b = e % GEMV_MAX_BATCH;
        if (b >= 8 * NT) continue;
        float sum = 0.0f;
#pragma unroll
        for (int w = 0; w < GEMV_WARPS; w++) sum += warp_tiles[w][r][b];
        tile[r][b] = sum;
    }
}

// Row r of the tile (in [first half | second half] order) is finished by cluster block `owner`: rows are
// dealt in equal runs, except SwiGLU's, where a feature's gate row r and up row 16 + r go together.
__device__ __forceinline__ bool finishes_row(int r, int epilogue, int splits, int rank) {
    const int feature = epilogue == GEMV_SWIGLU ? r % 16 : r;
    const int features = epilogue == GEMV_SWIGLU ? 16 : GEMV_ROWS;
    return feature / (features / splits) == rank;
}

template <int NT, bool NORM, int EPILOGUE>
__device__ void gemv(const GemvArgs& a) {
    static_assert(NORM == (EPILOGUE != GEMV_RESIDUAL), "the residual GEMV reads bf16 x, the others the stream");
    __shared__ float tile[GEMV_ROWS][GEMV_MAX_BATCH];
    __shared__ float rstd[GEMV_MAX_BATCH];
    const int tile_index = blockIdx.x, rank = a.splits > 1 ? (int)cluster_rank() : 0;
    const int row0 = tile_index * (a.second == 16 ? GEMV_ROWS : 16);  // swiglu tiles cover 16 features
    const int chunk = ((a.K + a.splits - 1) / a.splits + 31) / 32 * 32;
    const int k_begin = min(a.K, rank * chunk), k_end = min(a.K, k_begin + chunk);
    // the weights do not depend on the kernel before: the first of each row's range heads for L2 before waiting
    if (threadIdx.x < GEMV_ROWS && k_begin < k_end) {
        const int r = threadIdx.x % 16, m = threadIdx.x / 16;
        if (row0 + r + (a.second == 16 ? 16 * m : 0) < a.N)
            prefetch_l2(a.w + (long long)(row0 + r + m * a.second) * a.K + k_begin,
                        min(GEMV_PREFETCH_BYTES, 2 * (k_end - k_begin)));
    }
    wait_for_previous_grid();
    allow_next_grid();
    float ahead[2 * NT][GEMV_SQUARES_AHEAD];
    if constexpr (NORM) load_squares<NT>(ahead, a);
    tile_product<NT, NORM>(tile, a, row0, k_begin, k_end);
    if (a.splits > 1) {  // this block's rows, added over the cluster's tiles in rank order
        cluster_barrier();
        float sums[GEMV_ROWS * GEMV_MAX_BATCH / GEMV_THREADS];
#pragma unroll
        for (int i = 0; i < GEMV_ROWS * GEMV_MAX_BATCH / GEMV_THREADS; i++) {
            const int e = threadIdx.x + i * GEMV_THREADS, r = e / GEMV_MAX_BATCH, b = e % GEMV_MAX_BATCH;
            sums[i] = 0.0f;
            if (b < a.B && finishes_row(r, EPILOGUE, a.splits, rank))
                for (int s = 0; s < a.splits; s++) sums[i] += cluster_load(&tile[r][b], s);
        }
        cluster_barrier();  // every block has read the others' tiles
#pragma unroll
        for (int i = 0; i < GEMV_ROWS * GEMV_MAX_BATCH / GEMV_THREADS; i++) {
            const int e = threadIdx.x + i * GEMV_THREADS;
            tile[e / GEMV_MAX_BATCH][e % GEMV_MAX_BATCH] = sums[i];
        }
    }
    __syncthreads();
    if constexpr (NORM) finish_rstd<NT>(rstd, ahead, a);  // the product of the unnormalized stream is scaled below
    if constexpr (EPILOGUE == GEMV_STORE || EPILOGUE == GEMV_RESIDUAL) {
        float squares = 0.0f;  // residual: this thread's part of the block's sum of squares of batch row b
        const int b = threadIdx.x % GEMV_MAX_BATCH;
        for (int e = threadIdx.x; e < GEMV_ROWS * GEMV_MAX_BATCH; e += GEMV_THREADS) {
            const int r = e / GEMV_MAX_BATCH, n = row0 + r;
            if (b >= a.B || n >= a.N || !finishes_row(r, EPILOGUE, a.splits, rank)) continue;
            float* out = a.out_f32 + (long long)b * a.N + n;
            const float v = EPILOGUE == GEMV_RESIDUAL ? *out + tile[r][b] : tile[r][b] * rstd[b];
            *out = v;
            squares += v * v;
        }
        if constexpr (EPILOGUE == GEMV_RESIDUAL) {
            // threads b, b + 16, ... hold batch row b's parts: add them in thread order, then the cluster's
            // blocks' sums in rank order (each block puts its sum in block 0's shared memory)
            __shared__ float parts[GEMV_THREADS];
            __shared__ float ranks[GEMV_MAX_SPLITS][GEMV_MAX_BATCH];
            parts[threadIdx.x] = squares;
            __syncthreads();
            if (threadIdx.x < a.B) {
                float sum = 0.0f;
                for (int i = threadIdx.x; i < GEMV_THREADS; i += GEMV_MAX_BATCH) sum += parts[i];
                if (a.splits > 1)
                    cluster_store(&ranks[rank][threadIdx.x], 0, sum);
                else
                    a.squares_out[(long long)tile_index * a.B + threadIdx.x] = sum;
            }
            if (a.splits > 1) {
                cluster_barrier();
                if (rank == 0 && threadIdx.x < a.B) {
                    float sum = 0.0f;
                    for (int s = 0; s < a.splits; s++) sum += ranks[s][threadIdx.x];
                    a.squares_out[(long long)tile_index * a.B + threadIdx.x] = sum;
                }
            }
        }
    } else if constexpr (EPILOGUE == GEMV_SWIGLU) {
        for (int e = threadIdx.x; e < 16 * GEMV_MAX_BATCH; e += GEMV_THREADS) {
            const int r = e / GEMV_MAX_BATCH, b = e % GEMV_MAX_BATCH, n = row0 + r;
            if (b >= a.B || n >= a.N || !finishes_row(r, EPILOGUE, a.splits, rank)) continue;
            const float gate = tile[r][b] * rstd[b], up = tile[16 + r][b] * rstd[b];
            a.out_bf16[(long long)b * a.N + n] = __float2bfloat16(swiglu_value(gate, up));
        }
    } else {  // GEMV_QKV_ROPE: rows (2j, 2j + 1) of a head are a pair
        const int p = *a.position, half = a.D / 2;
        for (int e = threadIdx.x; e < GEMV_ROWS / 2 * GEMV_MAX_BATCH; e += GEMV_THREADS) {
            const int r = 2 * (e / GEMV_MAX_BATCH), b = e % GEMV_MAX_BATCH, n = row0 + r;
            if (b >= a.B || n >= a.N || !finishes_row(r, EPILOGUE, a.splits, rank)) continue;
            const int slot = n / a.D, d = n % a.D;  // slot: query heads, then key heads, then value heads
            float y0 = tile[r][b] * rstd[b], y1 = tile[r + 1][b] * rstd[b];
            if (slot < a.H + a.KV) {
                rope_rotate(y0, y1, a.cos_table[(long long)p * half + d / 2],
                            a.sin_table[(long long)p * half + d / 2]);
            }
            if (slot < a.H) {
                float* q = a.q_out + ((long long)b * a.H + slot) * a.D + d;
                q[0] = y0;
                q[1] = y1;
            } else {
                const bool is_key = slot < a.H + a.KV;
                const int head = slot - a.H - (is_key ? 0 : a.KV);
                bf16* cache = (is_key ? a.k_cache : a.v_cache) + (((long long)b * a.KV + head) * a.T_max + p) * a.D + d;
                *reinterpret_cast<__nv_bfloat162*>(cache) = __floats2bfloat162_rn(y0, y1);
            }
        }
    }
}

// One entry point per (batch tiles, input, epilogue); the launcher picks by name. At least four blocks
// per multiprocessor (the launcher's splits count on it): the normalizing GEMVs are held to 128
// registers; the residual GEMV, uncapped, takes fewer (68 at b8, 108 at b16).
// Each entry point below is guarded by KERNEL_ENTRY(name), so that a build unit may compile one alone
// (llama/runtime/kernel_build.py defines KERNEL_ENTRY on nvcc's command line); by default, every one.
#ifndef KERNEL_ENTRY
#define KERNEL_ENTRY(name) 1
#endif

#define GEMV_ENTRY(NAME, NT, NORM, EPILOGUE) \
    extern "C" __global__ void __launch_bounds__(GEMV_THREADS, 4) NAME(GemvArgs a) { gemv<NT, NORM, EPILOGUE>(a); }
#define GEMV_RESIDUAL_ENTRY(NAME, NT) \
    extern "C" __global__ void __launch_bounds__(GEMV_THREADS) NAME(GemvArgs a) { gemv<NT, false, GEMV_RESIDUAL>(a); }

#if KERNEL_ENTRY(gemv_store_norm_b8)
GEMV_ENTRY(gemv_store_norm_b8, 1, true, GEMV_STORE)
#endif
#if KERNEL_ENTRY(gemv_store_norm_b16)
GEMV_ENTRY(gemv_store_norm_b16, 2, true, GEMV_STORE)
#endif
#if KERNEL_ENTRY(gemv_residual_b8)
GEMV_RESIDUAL_ENTRY(gemv_residual_b8, 1)
#endif
#if KERNEL_ENTRY(gemv_residual_b16)
GEMV_RESIDUAL_ENTRY(gemv_residual_b16, 2)
#endif
#if KERNEL_ENTRY(gemv_swiglu_norm_b8)
GEMV_ENTRY(gemv_swiglu_norm_b8, 1, true, GEMV_SWIGLU)
#endif
#if KERNEL_ENTRY(gemv_swiglu_norm_b16)
GEMV_ENTRY(gemv_swiglu_norm_b16, 2, true, GEMV_SWIGLU)
#endif
#if KERNEL_ENTRY(gemv_qkv_rope_norm_b8)
GEMV_ENTRY(gemv_qkv_rope_norm_b8, 1, true, GEMV_QKV_ROPE)
#endif
#if KERNEL_ENTRY(gemv_qkv_rope_norm_b16)
GEMV_ENTRY(gemv_qkv_rope_norm_b16, 2, true, GEMV_QKV_ROPE)
#endif

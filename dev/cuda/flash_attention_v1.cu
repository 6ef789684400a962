// v1 adds: FA2-style causal GQA flash attention on mma.sync m16n8k16 + ldmatrix + cp.async double buffering,
// online softmax in fp32 with exp2, deterministic backward (dK/dV kernel over kv tiles summing the group's
// query heads, separate dQ kernel recomputing S and P). Its kernels are below, exactly as they were in
// kernels/flash_attention.cu until version 2 replaced them, plus one dev-only variant to measure determinism:
//
// flash_attention_backward_dkdv_atomic_dq_d{64,128}: the dK/dV kernel that also adds each step's
//   dQ = dS K into dq_accum (B, T, H, D) fp32 with atomicAdd: NONDETERMINISTIC (the order of the float
//   additions varies from run to run). dq_accum must be zeroed first; then
// flash_attention_backward_dq_convert: dq_accum -> the dq slots of dqkv (bf16), scaled by 1/sqrt(D) and,
//   with cos/sin, rotated back by RoPE. Together they replace flash_attention_backward_dq_d{64,128}.
//
// ---- version 1, verbatim
// Flash attention in bf16, forward and backward: causal grouped-query attention with O(T) memory.
// Ladder version 1 (dev/cuda/flash_attention_v1.cu): FA2-style on mma.sync m16n8k16 (sm_80 and newer).
//
// Layouts (B batch, T time, H query heads, KV key/value heads, D head dim, 64 or 128):
//   qkv   (B, T, (H + 2*KV) * D) bf16: per token [q heads 0..H-1 | k heads 0..KV-1 | v heads 0..KV-1],
//         q and k already rotated by RoPE (the QKV projection's output, read in place: no split, no copy).
//         Query head h reads kv head h / (H / KV).
//   out   (B, T, H * D) bf16, ready for the output projection.
//   lse   (B, H, T) fp32: natural-log log-sum-exp of each row of scaled scores s = q.k / sqrt(D).
//   dout  (B, T, H * D) bf16; delta (B, H, T) fp32 = rowsum(dout * out), a scratch of the backward.
//   dqkv  (B, T, (H + 2*KV) * D) bf16, packed like qkv; dk, dv of a kv head summed over its query heads.
//   cos, sin (T_max, D/2) fp32, optional (null: none): dq and dk leave rotated back by RoPE's inverse
//         (pair (2i, 2i+1) of position t: (d0, d1) -> (d0 c + d1 s, -d0 s + d1 c)), so dqkv is the
//         gradient of the QKV projection's output before RoPE.
//
// flash_attention_forward_d{64,128}: one CTA per (query head, batch, 128-row query tile), heaviest
//   tiles first; 4 warps of 32 query rows. K/V tiles of 64 rows stream through double-buffered,
//   XOR-swizzled shared memory by cp.async; S = Q K^T and O += P V on tensor cores (ldmatrix, .trans
//   for V), online softmax in fp32 with exp2 and a log2(e)-prescaled scale. Tiles above the diagonal
//   are skipped, only the tiles that cross it are masked. Rows past T read zeros and are not stored.
// flash_attention_backward_delta: delta = rowsum(dout * out), one warp per (token, head).
// flash_attention_backward_dkdv_d{64,128}: one CTA per (kv head, batch, 128-row kv tile), 8 warps of
//   16 kv rows; loops over the group's query heads and the 64-row query tiles at and after the
//   diagonal: S^T = K Q^T, P^T = exp(S^T - lse), dV += P^T dO, dP^T = V dO^T,
//   dS^T = P^T (dP^T - delta), dK += dS^T Q. dK, dV accumulate in registers: deterministic.
// flash_attention_backward_dq_d{64,128}: one CTA per (query head, batch, 64-row query tile), 4 warps
//   of 16 rows; loops over kv tiles up to the diagonal, recomputing S and P: dQ += dS K. Deterministic.
#include <cuda_bf16.h>
#include <stdint.h>

#include "common.cuh"
#include "mma.cuh"
#include "rope.cuh"

typedef __nv_bfloat16 bf16;

#define LOG2E 1.4426950408889634f
#define LN2 0.6931471805599453f

// ---- PTX wrappers: kernels/mma.cuh

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
}

// ---- shared-memory tiles: (rows, D) bf16, row-major, each row padded by 8 values (16 bytes), so that the
// 8 rows of every ldmatrix 8x8 matrix start in distinct banks; every address is one per-lane base plus a
// compile-time offset.

template <int D>
__host__ __device__ constexpr int tile_bytes(int rows) { return rows * (D + 8) * 2; }

template <int D>
__device__ __forceinline__ uint32_t tile_address(uint32_t tile, int row, int col) {  // col: a multiple of 8
    return tile + 2 * (row * (D + 8) + col);
}

// rows [row0, row0 + ROWS) of one head (D columns at src; rows `stride` elements apart) -> tile;
// rows at or past T are zero-filled
template <int ROWS, int D, int THREADS>
__device__ __forceinline__ void load_tile(uint32_t tile, const bf16* src, int row0, int T, long long stride) {
    constexpr int CHUNKS = D / 8;
    static_assert(ROWS * CHUNKS % THREADS == 0, "tile chunks must divide among the threads");
#pragma unroll
    for (int i = 0; i < ROWS * CHUNKS / THREADS; ++i) {
        const int chunk = i * THREADS + threadIdx.x, r = chunk / CHUNKS, c = chunk % CHUNKS;
        const bool valid = row0 + r < T;
        cp_async_16(tile_address<D>(tile, r, c * 8), src + (valid ? (row0 + r) * stride + c * 8 : 0), valid ? 16 : 0);
    }
}

// ---- fragments (lane = 4 * g + t): A 16x16 row-major at (row0, col0) of a tile: a0 (g, 2t..), a1 (g+8, 2t..),
// a2 (g, 2t+8..), a3 (g+8, 2t+8..); B fragment pairs for two n8 tiles; C: c0,c1 (g, 2t..), c2,c3 (g+8, 2t..).

// A operand from a row-major tile (rows = M, columns = K)
template <int D>
__device__ __forceinline__ void load_a(uint32_t (&a)[4], uint32_t tile, int row0, int col0, int lane) {
    ldmatrix_x4(a, tile_address<D>(tile, row0 + (lane & 15), col0 + 8 * (lane >> 4)));
}

// B operands of n tiles n0..n0+7 (b[0], b[1]) and n0+8..n0+15 (b[2], b[3]) at k0..k0+15, from a tile
// whose rows are n and columns k (K in S = Q K^T, V in dP = dO V^T, Q and dO in the dkdv kernel)
template <int D>
__device__ __forceinline__ void load_b_nk(uint32_t (&b)[4], uint32_t tile, int n0, int k0, int lane) {
    ldmatrix_x4(b, tile_address<D>(tile, n0 + (lane & 7) + 8 * (lane >> 4), k0 + 8 * ((lane >> 3) & 1)));
}

// the same from a tile whose rows are k and columns n (V in O = P V, K in dQ = dS K, ...): transposed load
template <int D>
__device__ __forceinline__ void load_b_kn(uint32_t (&b)[4], uint32_t tile, int k0, int n0, int lane) {
    ldmatrix_x4_trans(b, tile_address<D>(tile, k0 + (lane & 15), n0 + 8 * (lane >> 4)));
}

// accumulator tiles 2j and 2j+1 (a 16x16 block of C) as the A operand of the next product, in bf16
__device__ __forceinline__ void c_to_a(uint32_t (&a)[4], const float (&c0)[4], const float (&c1)[4]) {
    a[0] = pack_bf16(c0[0], c0[1]);
    a[1] = pack_bf16(c0[2], c0[3]);
    a[2] = pack_bf16(c1[0], c1[1]);
    a[3] = pack_bf16(c1[2], c1[3]);
}

// acc (rows x N, N/8 accumulator tiles) += A (rows x K from a_frags or a tile) @ B (K x N, tile of n rows)
// with K = KSTEPS * 16 starting at column 16 * k_step0 of the B tile; used for S = Q K^T, dP = dO V^T,
// S^T = K Q^T and dP^T = V dO^T.
template <int D, int NT, int KSTEPS>
__device__ __forceinline__ void mma_abt(float acc[][4], const uint32_t a_frags[][4], uint32_t b_tile, int lane,
                                        int k_step0 = 0) {
#pragma unroll
    for (int kk = 0; kk < KSTEPS; ++kk) {
#pragma unroll
        for (int n = 0; n < NT; n += 2) {
            uint32_t b[4];
            load_b_nk<D>(b, b_tile, n * 8, (k_step0 + kk) * 16, lane);
            mma_bf16(acc[n], a_frags[kk], b[0], b[1]);
            mma_bf16(acc[n + 1], a_frags[kk], b[2], b[3]);
        }
    }
}

// acc (16 x D) += P (16 x 16*KSTEPS, accumulator tiles) @ B (tile of k rows, D columns)
template <int D, int KSTEPS>
__device__ __forceinline__ void mma_pb(float acc[][4], const float p[][4], uint32_t b_tile, int lane) {
#pragma unroll
    for (int kk = 0; kk < KSTEPS; ++kk) {
        uint32_t a[4];
        c_to_a(a, p[2 * kk], p[2 * kk + 1]);
#pragma unroll
        for (int n = 0; n < D / 8; n += 2) {
            uint32_t b[4];
            load_b_kn<D>(b, b_tile, kk * 16, n * 8, lane);
            mma_bf16(acc[n], a, b[0], b[1]);
            mma_bf16(acc[n + 1], a, b[2], b[3]);
        }
    }
}

// A fragments of a warp's 16 rows at row0 of a tile, all K = D columns
template <int D>
__device__ __forceinline__ void load_a_rows(uint32_t a[][4], uint32_t tile, int row0, int lane) {
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) load_a<D>(a[kk], tile, row0, kk * 16, lane);
}

// write a warp's 16 x D accumulator rows (times scale) as bf16 rows of `dst` (rows `stride` apart, first
// row at position pos0), rows at or past T skipped; with cos/sin, each pair (2i, 2i+1) rotated back by RoPE
template <int D>
__device__ __forceinline__ void store_rows(bf16* dst, long long stride, const float acc[][4], float scale, int pos0,
                                           int T, const float* cos_table, const float* sin_table, int lane) {
    const int g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const int pos = pos0 + g + 8 * half;
        if (pos >= T) continue;
#pragma unroll
        for (int n = 0; n < D / 8; ++n) {
            float d0 = acc[n][2 * half] * scale, d1 = acc[n][2 * half + 1] * scale;
            if (cos_table != nullptr) {
                const int pair = pos * (D / 2) + n * 4 + t;
                rope_rotate_back(d0, d1, cos_table[pair], sin_table[pair]);
            }
            *reinterpret_cast<uint32_t*>(dst + pos * stride + n * 8 + 2 * t) = pack_bf16(d0, d1);
        }
    }
}

// ---- forward

namespace fwd {
constexpr int WARPS = 4, THREADS = WARPS * 32, M_TILES = 2, BR = WARPS * M_TILES * 16;
template <int D>  // K/V tile rows: at D = 128 the scores must stay small in registers
__host__ __device__ constexpr int kv_rows() { return D == 64 ? 64 : 32; }
template <int D>  // Q, then K and V double-buffered
__host__ __device__ constexpr int shared_bytes() { return tile_bytes<D>(BR + 4 * kv_rows<D>()); }
}  // namespace fwd

template <int D>
__device__ __forceinline__ void flash_forward(bf16* out, float* lse, const bf16* qkv, int T, int H, int KV) {
    using namespace fwd;
    constexpr bool Q_IN_REGISTERS = D == 64;  // at D = 128 registers hold O and S only: Q A-fragments reload
    constexpr int BC = kv_rows<D>(), KSTEPS = D / 16, NT_S = BC / 8, NT_O = D / 8, TILE_KV = tile_bytes<D>(BC);
    extern __shared__ __align__(128) unsigned char shared[];
    const uint32_t sQ = smem_address(shared), sK = sQ + tile_bytes<D>(BR), sV = sK + 2 * TILE_KV;
    const int h = blockIdx.x, b = blockIdx.y, q0 = (gridDim.z - 1 - blockIdx.z) * BR;
    const int kv_head = h / (H / KV), warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const long long stride = (long long)(H + 2 * KV) * D;
    const bf16* q_src = qkv + (long long)b * T * stride + h * D;  // (T, D) rows of this head, stride apart
    const bf16* k_src = qkv + (long long)b * T * stride + (H + kv_head) * D;
    const bf16* v_src = k_src + KV * D;
    const int n_tiles = (min(q0 + BR, T) + BC - 1) / BC;
    const float scale_log2 = LOG2E / sqrtf((float)D);

    load_tile<BR, D, THREADS>(sQ, q_src, q0, T, stride);
    load_tile<BC, D, THREADS>(sK, k_src, 0, T, stride);
    load_tile<BC, D, THREADS>(sV, v_src, 0, T, stride);
    cp_async_commit();

    const int row_base = warp * M_TILES * 16;  // this warp's first row in the tile
    float o[M_TILES][NT_O][4] = {};
    float row_max[M_TILES][2], row_sum[M_TILES][2] = {};  // row_max in raw (unscaled) scores
#pragma unroll
    for (int mt = 0; mt < M_TILES; ++mt) row_max[mt][0] = row_max[mt][1] = -INFINITY;
    uint32_t q_frags[M_TILES][Q_IN_REGISTERS ? KSTEPS : 1][4];

    for (int j = 0; j < n_tiles; ++j) {
        const int kv0 = j * BC, buf = j & 1;
        if (j + 1 < n_tiles) {  // prefetch the next K, V tiles into the other buffer
            load_tile<BC, D, THREADS>(sK + (buf ^ 1) * TILE_KV, k_src, kv0 + BC, T, stride);
            load_tile<BC, D, THREADS>(sV + (buf ^ 1) * TILE_KV, v_src, kv0 + BC, T, stride);
            cp_async_commit();
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();
        const uint32_t k_tile = sK + buf * TILE_KV, v_tile = sV + buf * TILE_KV;
        if (Q_IN_REGISTERS && j == 0) {
#pragma unroll
            for (int mt = 0; mt < M_TILES; ++mt) load_a_rows<D>(q_frags[mt], sQ, row_base + mt * 16, lane);
        }

        // S = Q K^T (raw scores), this warp's 32 rows x BC keys
        float s[M_TILES][NT_S][4] = {};
#pragma unroll
        for (int kk = 0; kk < KSTEPS; ++kk) {
            uint32_t a[M_TILES][4];
#pragma unroll
            for (int mt = 0; mt < M_TILES; ++mt) {
                if constexpr (Q_IN_REGISTERS) {
#pragma unroll
                    for (int i = 0; i < 4; ++i) a[mt][i] = q_frags[mt][kk][i];
                } else {
                    load_a<D>(a[mt], sQ, row_base + mt * 16, kk * 16, lane);
                }
            }
#pragma unroll
            for (int n = 0; n < NT_S; n += 2) {
                uint32_t bk[4];
                load_b_nk<D>(bk, k_tile, n * 8, kk * 16, lane);
#pragma unroll
                for (int mt = 0; mt < M_TILES; ++mt) {
                    mma_bf16(s[mt][n], a[mt], bk[0], bk[1]);
                    mma_bf16(s[mt][n + 1], a[mt], bk[2], bk[3]);
                }
            }
        }

        if (kv0 + BC - 1 > q0) {  // the tile crosses the diagonal: mask keys after the query
#pragma unroll
            for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
                for (int n = 0; n < NT_S; ++n)
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const int row = q0 + row_base + mt * 16 + lane / 4 + 8 * (e >> 1);
                        const int col = kv0 + n * 8 + 2 * (lane % 4) + (e & 1);
                        if (col > row) s[mt][n][e] = -INFINITY;
                    }
        }

        // online softmax: every row sees key 0 in tile 0, so row_max is finite from the first tile on
#pragma unroll
        for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                float m = row_max[mt][half];
#pragma unroll
                for (int n = 0; n < NT_S; ++n) m = fmaxf(m, fmaxf(s[mt][n][2 * half], s[mt][n][2 * half + 1]));
                m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 1));  // the 4 lanes of a row
                m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 2));
                const float alpha = exp2f((row_max[mt][half] - m) * scale_log2), m_scaled = m * scale_log2;
                row_max[mt][half] = m;
                float sum = 0.0f;
#pragma unroll
                for (int n = 0; n < NT_S; ++n)
#pragma unroll
                    for (int e = 2 * half; e < 2 * half + 2; ++e) {
                        s[mt][n][e] = exp2f(fmaf(s[mt][n][e], scale_log2, -m_scaled));
                        sum += s[mt][n][e];
                    }
                row_sum[mt][half] = row_sum[mt][half] * alpha + sum;  // this lane's columns only
#pragma unroll
                for (int n = 0; n < NT_O; ++n) {
                    o[mt][n][2 * half] *= alpha;
                    o[mt][n][2 * half + 1] *= alpha;
                }
            }

        // O += P V
#pragma unroll
        for (int kk = 0; kk < BC / 16; ++kk) {
            uint32_t p[M_TILES][4];
#pragma unroll
            for (int mt = 0; mt < M_TILES; ++mt) c_to_a(p[mt], s[mt][2 * kk], s[mt][2 * kk + 1]);
#pragma unroll
            for (int n = 0; n < NT_O; n += 2) {
                uint32_t bv[4];
                load_b_kn<D>(bv, v_tile, kk * 16, n * 8, lane);
#pragma unroll
                for (int mt = 0; mt < M_TILES; ++mt) {
                    mma_bf16(o[mt][n], p[mt], bv[0], bv[1]);
                    mma_bf16(o[mt][n + 1], p[mt], bv[2], bv[3]);
                }
            }
        }
        __syncthreads();  // the next iteration's prefetch overwrites this buffer
    }

#pragma unroll
    for (int mt = 0; mt < M_TILES; ++mt) {
        float inv[2], row_lse[2];
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            float sum = row_sum[mt][half];
            sum += __shfl_xor_sync(0xffffffffu, sum, 1);
            sum += __shfl_xor_sync(0xffffffffu, sum, 2);
            inv[half] = 1.0f / sum;
            row_lse[half] = (row_max[mt][half] * scale_log2 + log2f(sum)) * LN2;
        }
        const int pos0 = q0 + row_base + mt * 16;
        float normalized[NT_O][4];
#pragma unroll
        for (int n = 0; n < NT_O; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) normalized[n][e] = o[mt][n][e] * inv[e >> 1];
        store_rows<D>(out + (long long)b * T * H * D + h * D, (long long)H * D, normalized, 1.0f, pos0, T, nullptr,
                      nullptr, lane);
        if (lane % 4 == 0) {
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                const int pos = pos0 + lane / 4 + 8 * half;
                if (pos < T) lse[((long long)b * H + h) * T + pos] = row_lse[half];
            }
        }
    }
}

extern "C" __global__ void __launch_bounds__(fwd::THREADS)
    flash_attention_forward_d64(bf16* out, float* lse, const bf16* qkv, int T, int H, int KV) {
    flash_forward<64>(out, lse, qkv, T, H, KV);
}

extern "C" __global__ void __launch_bounds__(fwd::THREADS)
    flash_attention_forward_d128(bf16* out, float* lse, const bf16* qkv, int T, int H, int KV) {
    flash_forward<128>(out, lse, qkv, T, H, KV);
}

// ---- backward

// delta (B, H, T) = rowsum(dout * out) over each head's D values; one warp per (b, t, h), rows = B * T * H
extern "C" __global__ void flash_attention_backward_delta(float* delta, const bf16* dout, const bf16* out, int rows,
                                                          int T, int H, int D) {
    const int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32, lane = threadIdx.x % 32;
    if (row >= rows) return;
    const long long base = (long long)row * D;
    float sum = 0.0f;
    for (int d = 2 * lane; d < D; d += 64) {
        const float2 g = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(dout + base + d));
        const float2 o = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(out + base + d));
        sum += g.x * o.x + g.y * o.y;
    }
    sum = warp_sum(sum);
    const int h = row % H, t = (row / H) % T, b = row / (H * T);
    if (lane == 0) delta[((long long)b * H + h) * T + t] = sum;
}

namespace bwd {
constexpr int KV_WARPS = 8, KV_THREADS = KV_WARPS * 32, BC = KV_WARPS * 16;  // dkdv kernel
constexpr int Q_WARPS = 4, Q_THREADS = Q_WARPS * 32, Q_ROWS = Q_WARPS * 16, Q_BC = 64;  // dq kernel
template <int D>  // query tile rows of the dkdv kernel (fewer at D = 128, where registers are short)
__host__ __device__ constexpr int q_rows() { return D == 64 ? 64 : 32; }
template <int D>  // K, V; Q, dO double-buffered; lse, delta double-buffered
__host__ __device__ constexpr int dkdv_shared_bytes() {
    return tile_bytes<D>(2 * BC + 4 * q_rows<D>()) + 4 * q_rows<D>() * 4;
}
template <int D>  // Q, dO; K, V double-buffered
__host__ __device__ constexpr int dq_shared_bytes() { return tile_bytes<D>(2 * Q_ROWS + 4 * Q_BC); }
}  // namespace bwd

// launch configuration, read by the host (llama/ops/flash_attention.py) from the module: per head dim (64, 128), for the
// forward, dkdv and dq kernels in turn: threads per CTA, rows per CTA (query, kv, query), shared bytes; then whether the
// forward is persistent (never here)
__constant__ int flash_attention_config[2][10] = {
    {fwd::THREADS, fwd::BR, fwd::shared_bytes<64>(), bwd::KV_THREADS, bwd::BC, bwd::dkdv_shared_bytes<64>(),
     bwd::Q_THREADS, bwd::Q_ROWS, bwd::dq_shared_bytes<64>(), 0},
    {fwd::THREADS, fwd::BR, fwd::shared_bytes<128>(), bwd::KV_THREADS, bwd::BC, bwd::dkdv_shared_bytes<128>(),
     bwd::Q_THREADS, bwd::Q_ROWS, bwd::dq_shared_bytes<128>(), 0},
};

// the step hook sees each step's dS^T; none here (dev/cuda/flash_attention_v1.cu hooks a nondeterministic
// dQ into it, to measure what the separate deterministic dQ kernel costs)
struct NoStepHook {
    template <int NT>
    __device__ __forceinline__ void operator()(const float (&)[NT][4], uint32_t, int, int) const {}
};

template <int D, typename StepHook = NoStepHook>
__device__ __forceinline__ void flash_backward_dkdv(bf16* dqkv, const bf16* dout, const bf16* qkv, const float* lse,
                                                    const float* delta, const float* cos_table,
                                                    const float* sin_table, int T, int H, int KV,
                                                    StepHook step_hook = StepHook()) {
    using namespace bwd;
    constexpr bool KV_IN_REGISTERS = D == 64;  // at D = 128 registers hold dK, dV, S, dP: K, V A-fragments reload
    constexpr int BQ = q_rows<D>(), KSTEPS = D / 16, NT_Q = BQ / 8, NT_D = D / 8, TILE_Q = tile_bytes<D>(BQ);
    extern __shared__ __align__(128) unsigned char shared[];
    const uint32_t sK = smem_address(shared), sV = sK + tile_bytes<D>(BC), sQ = sV + tile_bytes<D>(BC),
                   sdO = sQ + 2 * TILE_Q;
    float* s_lse = reinterpret_cast<float*>(shared + tile_bytes<D>(2 * BC) + 4 * TILE_Q);  // [2][BQ], log2 units
    float* s_delta = s_lse + 2 * BQ;                                                   // [2][BQ]
    const int kv_head = blockIdx.x, b = blockIdx.y, kv0 = blockIdx.z * BC, group = H / KV;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t4 = lane % 4;
    const long long stride = (long long)(H + 2 * KV) * D, out_stride = (long long)H * D;
    const bf16* k_src = qkv + (long long)b * T * stride + (H + kv_head) * D;
    const bf16* v_src = k_src + KV * D;
    const int first_q_tile = kv0 / BQ, n_q_tiles = (T + BQ - 1) / BQ - first_q_tile, steps = group * n_q_tiles;
    const float scale_log2 = LOG2E / sqrtf((float)D);

    // step i: query head kv_head * group + i / n_q_tiles, query tile first_q_tile + i % n_q_tiles
    auto q_head = [&](int i) { return kv_head * group + i / n_q_tiles; };
    auto q_start = [&](int i) { return (first_q_tile + i % n_q_tiles) * BQ; };
    auto load_q_tiles = [&](int i, int buf) {
        const int h = q_head(i);
        load_tile<BQ, D, KV_THREADS>(sQ + buf * TILE_Q, qkv + (long long)b * T * stride + h * D, q_start(i), T, stride);
        load_tile<BQ, D, KV_THREADS>(sdO + buf * TILE_Q, dout + (long long)b * T * out_stride + h * D, q_start(i), T,
                                     out_stride);
    };
    // threads < BQ fetch lse (log2 units, +inf past T: P = 0 there), threads BQ..2BQ-1 delta (0 past T)
    auto fetch_row_stats = [&](int i) {
        if (threadIdx.x >= 2 * BQ) return 0.0f;
        const int pos = q_start(i) + threadIdx.x % BQ;
        const long long at = ((long long)b * H + q_head(i)) * T + pos;
        if (threadIdx.x < BQ) return pos < T ? lse[at] * LOG2E : INFINITY;
        return pos < T ? delta[at] : 0.0f;
    };
    auto store_row_stats = [&](float value, int buf) {
        if (threadIdx.x < BQ) s_lse[buf * BQ + threadIdx.x] = value;
        else if (threadIdx.x < 2 * BQ) s_delta[buf * BQ + threadIdx.x - BQ] = value;
    };

    load_tile<BC, D, KV_THREADS>(sK, k_src, kv0, T, stride);
    load_tile<BC, D, KV_THREADS>(sV, v_src, kv0, T, stride);
    load_q_tiles(0, 0);
    cp_async_commit();
    store_row_stats(fetch_row_stats(0), 0);

    const int row_base = warp * 16, kv_row = kv0 + row_base + g;  // this lane's kv rows: kv_row, kv_row + 8
    float dk[NT_D][4] = {}, dv[NT_D][4] = {};
    uint32_t k_frags[KV_IN_REGISTERS ? KSTEPS : 1][4], v_frags[KV_IN_REGISTERS ? KSTEPS : 1][4];

    for (int i = 0; i < steps; ++i) {
        const int buf = i & 1, q0 = q_start(i);
        float next_stats = 0.0f;
        if (i + 1 < steps) {
            load_q_tiles(i + 1, buf ^ 1);
            cp_async_commit();
            next_stats = fetch_row_stats(i + 1);
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();
        const uint32_t q_tile = sQ + buf * TILE_Q, do_tile = sdO + buf * TILE_Q;
        const float* lse2 = s_lse + buf * BQ;
        const float* dlt = s_delta + buf * BQ;
        if (KV_IN_REGISTERS && i == 0) {
            load_a_rows<D>(k_frags, sK, row_base, lane);
            load_a_rows<D>(v_frags, sV, row_base, lane);
        }

        // S^T = K Q^T (16 kv rows x BQ queries), then P^T = exp(S^T - lse), zero where query < key
        float s[NT_Q][4] = {};
        if constexpr (KV_IN_REGISTERS) {
            mma_abt<D, NT_Q, KSTEPS>(s, k_frags, q_tile, lane);
        } else {
#pragma unroll
            for (int kk = 0; kk < KSTEPS; ++kk) {
                uint32_t a[1][4];
                load_a<D>(a[0], sK, row_base, kk * 16, lane);
                mma_abt<D, NT_Q, 1>(s, a, q_tile, lane, kk);
            }
        }
        const bool crosses_diagonal = q0 < kv0 + BC - 1;
#pragma unroll
        for (int n = 0; n < NT_Q; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int col = n * 8 + 2 * t4 + (e & 1);
                s[n][e] = exp2f(fmaf(s[n][e], scale_log2, -lse2[col]));
                if (crosses_diagonal && q0 + col < kv_row + 8 * (e >> 1)) s[n][e] = 0.0f;
            }

        // dV += P^T dO
        mma_pb<D, BQ / 16>(dv, s, do_tile, lane);

        // dP^T = V dO^T, then dS^T = P^T (dP^T - delta)
        float dp[NT_Q][4] = {};
        if constexpr (KV_IN_REGISTERS) {
            mma_abt<D, NT_Q, KSTEPS>(dp, v_frags, do_tile, lane);
        } else {
#pragma unroll
            for (int kk = 0; kk < KSTEPS; ++kk) {
                uint32_t a[1][4];
                load_a<D>(a[0], sV, row_base, kk * 16, lane);
                mma_abt<D, NT_Q, 1>(dp, a, do_tile, lane, kk);
            }
        }
#pragma unroll
        for (int n = 0; n < NT_Q; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) dp[n][e] = s[n][e] * (dp[n][e] - dlt[n * 8 + 2 * t4 + (e & 1)]);

        // dK += dS^T Q
        mma_pb<D, BQ / 16>(dk, dp, q_tile, lane);
        step_hook(dp, sK, q_head(i), q0);  // dS^T, the K tile, query head and first query of this step

        if (i + 1 < steps) store_row_stats(next_stats, buf ^ 1);
        __syncthreads();  // the next iteration's prefetch overwrites this buffer
    }

    const long long kv_base = (long long)b * T * stride;
    store_rows<D>(dqkv + kv_base + (H + kv_head) * D, stride, dk, rsqrtf((float)D), kv0 + row_base, T, cos_table,
                  sin_table, lane);
    store_rows<D>(dqkv + kv_base + (H + KV + kv_head) * D, stride, dv, 1.0f, kv0 + row_base, T, nullptr, nullptr,
                  lane);
}

extern "C" __global__ void __launch_bounds__(bwd::KV_THREADS)
    flash_attention_backward_dkdv_d64(bf16* dqkv, const bf16* dout, const bf16* qkv, const float* lse,
                                      const float* delta, const float* cos_table, const float* sin_table, int T,
                                      int H, int KV) {
    flash_backward_dkdv<64>(dqkv, dout, qkv, lse, delta, cos_table, sin_table, T, H, KV);
}

extern "C" __global__ void __launch_bounds__(bwd::KV_THREADS)
    flash_attention_backward_dkdv_d128(bf16* dqkv, const bf16* dout, const bf16* qkv, const float* lse,
                                       const float* delta, const float* cos_table, const float* sin_table, int T,
                                       int H, int KV) {
    flash_backward_dkdv<128>(dqkv, dout, qkv, lse, delta, cos_table, sin_table, T, H, KV);
}

template <int D>
__device__ __forceinline__ void flash_backward_dq(bf16* dqkv, const bf16* dout, const bf16* qkv, const float* lse,
                                                  const float* delta, const float* cos_table, const float* sin_table,
                                                  int T, int H, int KV) {
    using namespace bwd;
    constexpr bool A_IN_REGISTERS = D == 64;  // Q, dO A-fragments kept in registers, else reloaded
    constexpr int KSTEPS = D / 16, NT_K = Q_BC / 8, NT_D = D / 8, TILE_KV = tile_bytes<D>(Q_BC);
    extern __shared__ __align__(128) unsigned char shared[];
    const uint32_t sQ = smem_address(shared), sdO = sQ + tile_bytes<D>(Q_ROWS), sK = sdO + tile_bytes<D>(Q_ROWS),
                   sV = sK + 2 * TILE_KV;
    const int h = blockIdx.x, b = blockIdx.y, q0 = (gridDim.z - 1 - blockIdx.z) * Q_ROWS;
    const int kv_head = h / (H / KV), warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t4 = lane % 4;
    const long long stride = (long long)(H + 2 * KV) * D, out_stride = (long long)H * D;
    const bf16* k_src = qkv + (long long)b * T * stride + (H + kv_head) * D;
    const bf16* v_src = k_src + KV * D;
    const int n_tiles = (min(q0 + Q_ROWS, T) + Q_BC - 1) / Q_BC;
    const float scale_log2 = LOG2E / sqrtf((float)D);

    load_tile<Q_ROWS, D, Q_THREADS>(sQ, qkv + (long long)b * T * stride + h * D, q0, T, stride);
    load_tile<Q_ROWS, D, Q_THREADS>(sdO, dout + (long long)b * T * out_stride + h * D, q0, T, out_stride);
    load_tile<Q_BC, D, Q_THREADS>(sK, k_src, 0, T, stride);
    load_tile<Q_BC, D, Q_THREADS>(sV, v_src, 0, T, stride);
    cp_async_commit();

    const int row_base = warp * 16, row = q0 + row_base + g;  // this lane's rows: row, row + 8
    float lse2[2], dlt[2];
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const int pos = row + 8 * half;
        const long long at = ((long long)b * H + h) * T + pos;
        lse2[half] = pos < T ? lse[at] * LOG2E : 0.0f;
        dlt[half] = pos < T ? delta[at] : 0.0f;
    }
    float dq[NT_D][4] = {};
    uint32_t q_frags[A_IN_REGISTERS ? KSTEPS : 1][4], do_frags[A_IN_REGISTERS ? KSTEPS : 1][4];

    for (int j = 0; j < n_tiles; ++j) {
        const int kv0 = j * Q_BC, buf = j & 1;
        if (j + 1 < n_tiles) {
            load_tile<Q_BC, D, Q_THREADS>(sK + (buf ^ 1) * TILE_KV, k_src, kv0 + Q_BC, T, stride);
            load_tile<Q_BC, D, Q_THREADS>(sV + (buf ^ 1) * TILE_KV, v_src, kv0 + Q_BC, T, stride);
            cp_async_commit();
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();
        const uint32_t k_tile = sK + buf * TILE_KV, v_tile = sV + buf * TILE_KV;
        if (A_IN_REGISTERS && j == 0) {
            load_a_rows<D>(q_frags, sQ, row_base, lane);
            load_a_rows<D>(do_frags, sdO, row_base, lane);
        }

        // S = Q K^T, P = exp(S - lse), zero after the diagonal
        float s[NT_K][4] = {};
        if constexpr (A_IN_REGISTERS) {
            mma_abt<D, NT_K, KSTEPS>(s, q_frags, k_tile, lane);
        } else {
#pragma unroll
            for (int kk = 0; kk < KSTEPS; ++kk) {
                uint32_t a[1][4];
                load_a<D>(a[0], sQ, row_base, kk * 16, lane);
                mma_abt<D, NT_K, 1>(s, a, k_tile, lane, kk);
            }
        }
        const bool crosses_diagonal = kv0 + Q_BC - 1 > q0;
#pragma unroll
        for (int n = 0; n < NT_K; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                s[n][e] = exp2f(fmaf(s[n][e], scale_log2, -lse2[e >> 1]));
                if (crosses_diagonal && kv0 + n * 8 + 2 * t4 + (e & 1) > row + 8 * (e >> 1)) s[n][e] = 0.0f;
            }

        // dP = dO V^T, dS = P (dP - delta)
        float dp[NT_K][4] = {};
        if constexpr (A_IN_REGISTERS) {
            mma_abt<D, NT_K, KSTEPS>(dp, do_frags, v_tile, lane);
        } else {
#pragma unroll
            for (int kk = 0; kk < KSTEPS; ++kk) {
                uint32_t a[1][4];
                load_a<D>(a[0], sdO, row_base, kk * 16, lane);
                mma_abt<D, NT_K, 1>(dp, a, v_tile, lane, kk);
            }
        }
#pragma unroll
        for (int n = 0; n < NT_K; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) dp[n][e] = s[n][e] * (dp[n][e] - dlt[e >> 1]);

        // dQ += dS K
        mma_pb<D, Q_BC / 16>(dq, dp, k_tile, lane);
        __syncthreads();
    }

    store_rows<D>(dqkv + (long long)b * T * stride + h * D, stride, dq, rsqrtf((float)D), q0 + row_base, T, cos_table,
                  sin_table, lane);
}

extern "C" __global__ void __launch_bounds__(bwd::Q_THREADS)
    flash_attention_backward_dq_d64(bf16* dqkv, const bf16* dout, const bf16* qkv, const float* lse,
                                    const float* delta, const float* cos_table, const float* sin_table, int T, int H,
                                    int KV) {
    flash_backward_dq<64>(dqkv, dout, qkv, lse, delta, cos_table, sin_table, T, H, KV);
}

extern "C" __global__ void __launch_bounds__(bwd::Q_THREADS)
    flash_attention_backward_dq_d128(bf16* dqkv, const bf16* dout, const bf16* qkv, const float* lse,
                                     const float* delta, const float* cos_table, const float* sin_table, int T, int H,
                                     int KV) {
    flash_backward_dq<128>(dqkv, dout, qkv, lse, delta, cos_table, sin_table, T, H, KV);
}

// ---- dev-only: the atomic-dQ backward

// the dQ of one dK/dV step: dS^T (this warp's 16 kv rows x BQ queries) goes to shared memory as bf16,
// then dQ (BQ x D) = dS (BQ x BC) K (BC x D) split over the 8 warps (16 query rows x D / GROUPS columns
// each) and added to dq_accum with atomics
template <int D>
struct AtomicDq {
    float* dq_accum;  // (B, T, H, D) fp32
    int T, H;

    template <int NT>
    __device__ __forceinline__ void operator()(const float (&ds)[NT][4], uint32_t k_tile, int h, int q0) const {
        using namespace bwd;
        constexpr int BQ = q_rows<D>(), M_TILES = BQ / 16, GROUPS = KV_WARPS / M_TILES, NT_W = D / 8 / GROUPS;
        constexpr int DS_STRIDE = BQ + 8;  // padded rows of the (BC, BQ) bf16 dS^T tile
        static_assert(NT == BQ / 8 && NT_W % 2 == 0, "dS^T tile shape");
        extern __shared__ __align__(128) unsigned char shared[];
        const uint32_t sdS = smem_address(shared) + dkdv_shared_bytes<D>();
        const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t4 = lane % 4;
#pragma unroll
        for (int n = 0; n < NT; ++n)
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                const uint32_t at = sdS + 2 * ((warp * 16 + g + 8 * half) * DS_STRIDE + n * 8 + 2 * t4);
                const uint32_t pair = pack_bf16(ds[n][2 * half], ds[n][2 * half + 1]);
                asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(at), "r"(pair));
            }
        __syncthreads();

        const int m0 = (warp % M_TILES) * 16, n_first = (warp / M_TILES) * NT_W;
        float acc[NT_W][4] = {};
#pragma unroll
        for (int kk = 0; kk < BC / 16; ++kk) {
            uint32_t a[4];  // dS rows m0.. (queries), columns kk*16.. (keys), from the transposed tile
            ldmatrix_x4_trans(a, sdS + 2 * ((kk * 16 + (lane & 7) + 8 * (lane >> 4)) * DS_STRIDE + m0 +
                                            8 * ((lane >> 3) & 1)));
#pragma unroll
            for (int n = 0; n < NT_W; n += 2) {
                uint32_t b[4];
                load_b_kn<D>(b, k_tile, kk * 16, (n_first + n) * 8, lane);
                mma_bf16(acc[n], a, b[0], b[1]);
                mma_bf16(acc[n + 1], a, b[2], b[3]);
            }
        }
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const int pos = q0 + m0 + g + 8 * half;
            if (pos >= T) continue;
            float* row = dq_accum + (((long long)blockIdx.y * T + pos) * H + h) * D + n_first * 8 + 2 * t4;
#pragma unroll
            for (int n = 0; n < NT_W; ++n) {
                atomicAdd(row + n * 8, acc[n][2 * half]);
                atomicAdd(row + n * 8 + 1, acc[n][2 * half + 1]);
            }
        }
    }
};

// dynamic shared memory of the atomic variant: the dK/dV kernel's, then the (BC, BQ + 8) bf16 dS^T tile
__constant__ int flash_attention_atomic_dq_shared[2] = {
    bwd::dkdv_shared_bytes<64>() + bwd::BC * (bwd::q_rows<64>() + 8) * 2,
    bwd::dkdv_shared_bytes<128>() + bwd::BC * (bwd::q_rows<128>() + 8) * 2,
};

extern "C" __global__ void __launch_bounds__(bwd::KV_THREADS)
    flash_attention_backward_dkdv_atomic_dq_d64(bf16* dqkv, const bf16* dout, const bf16* qkv, const float* lse,
                                                const float* delta, const float* cos_table, const float* sin_table,
                                                float* dq_accum, int T, int H, int KV) {
    flash_backward_dkdv<64>(dqkv, dout, qkv, lse, delta, cos_table, sin_table, T, H, KV, AtomicDq<64>{dq_accum, T, H});
}

extern "C" __global__ void __launch_bounds__(bwd::KV_THREADS)
    flash_attention_backward_dkdv_atomic_dq_d128(bf16* dqkv, const bf16* dout, const bf16* qkv, const float* lse,
                                                 const float* delta, const float* cos_table, const float* sin_table,
                                                 float* dq_accum, int T, int H, int KV) {
    flash_backward_dkdv<128>(dqkv, dout, qkv, lse, delta, cos_table, sin_table, T, H, KV,
                             AtomicDq<128>{dq_accum, T, H});
}

// one thread per pair (2i, 2i+1) of dq_accum (B, T, H, D): scale, rotate back (with cos/sin), store as bf16
extern "C" __global__ void flash_attention_backward_dq_convert(bf16* dqkv, const float* dq_accum,
                                                               const float* cos_table, const float* sin_table, int B,
                                                               int T, int H, int KV, int D) {
    const long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const int half = D / 2;
    if (idx >= (long long)B * T * H * half) return;
    const int pair = idx % half, h = (idx / half) % H;
    const long long token = idx / ((long long)half * H);  // b * T + t
    const int t = token % T;
    const float scale = rsqrtf((float)D);
    float d0 = dq_accum[2 * idx] * scale, d1 = dq_accum[2 * idx + 1] * scale;
    if (cos_table != nullptr) rope_rotate_back(d0, d1, cos_table[t * half + pair], sin_table[t * half + pair]);
    *reinterpret_cast<__nv_bfloat162*>(dqkv + token * (H + 2 * KV) * D + h * D + 2 * pair) =
        __floats2bfloat162_rn(d0, d1);
}

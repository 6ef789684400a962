// Flash attention in bf16, forward and backward: causal grouped-query attention with O(T) memory.
// Ladder version 2 (dev/cuda/flash_attention_v2.cu; v1 in dev/cuda/flash_attention_v1.cu): FA2-style on
// mma.sync m16n8k16 (sm_80 and newer); kernels/flash_attention_wgmma.cu (v3) is the one on Hopper.
// Layouts and the shared pieces: flash_attention.cuh.
//
// flash_attention_forward_d{64,128}: one CTA per (query head, batch, 128-row query tile), heaviest
//   tiles first; 4 warps of 32 query rows. K/V tiles of 64 (D = 64) or 32 (D = 128) rows stream through
//   double-buffered, padded shared memory by cp.async; S = Q K^T and O += P V on tensor cores (ldmatrix,
//   .trans for V), online softmax in fp32 with exp2 and a log2(e)-prescaled scale. Tiles above the
//   diagonal are skipped (per warp), only the tiles that cross it are masked. Rows past T read zeros and
//   are not stored.
// flash_attention_backward_delta: delta = rowsum(dout * out), one warp per (token, head).
// flash_attention_backward_dkdv_d{64,128}: one CTA per (kv head, batch, kv tile of 128 (D = 64) or 64
//   (D = 128) rows), 4 warps of 32 or 16 kv rows, two CTAs per SM; loops over the group's query heads and
//   the 32-row query tiles at and after the diagonal: S^T = K Q^T, P^T = exp(S^T - lse), dV += P^T dO,
//   dP^T = V dO^T, dS^T = P^T (dP^T - delta), dK += dS^T Q. dK, dV accumulate in registers: deterministic.
// flash_attention_backward_dq_d{64,128}: one CTA per (query head, batch, 128-row query tile), heaviest
//   first, 4 warps of 32 rows; loops over 32-row kv tiles up to the diagonal, recomputing S and P:
//   dQ += dS K. Deterministic. Both backward kernels hold P and dS as bf16 pairs (the precision of the
//   products they feed).
// Document mask (every entry point's last two parameters, doc_start and doc_end (B, T) int32 from
//   kernels/document_mask.cu; null: plain causal, the same arithmetic): query q sees key k iff
//   doc_start[b, q] <= k <= q. The forward and dQ kernels start their kv loop at the tile holding their first
//   row's doc_start, the dK/dV kernel ends its query loop with the tile holding doc_end[b, its last key] - 1;
//   warps skip tiles wholly before their rows' documents, and only tiles that cross a document start are masked
//   elementwise. In the forward a row may see no key of its first tiles: its running max stays -inf and counts
//   as 0 in the exponentials (no NaN).
#include "flash_attention.cuh"
#include "mma.cuh"

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

// acc (MT m16 tiles of rows x NT n8 tiles) += A (the rows' A fragments, K = 16 * KSTEPS) @ B^T, B^T from a
// tile of n rows starting at column 16 * k_step0; each B fragment is loaded once for all MT m-tiles. Used for
// S = Q K^T, dP = dO V^T, S^T = K Q^T and dP^T = V dO^T.
template <int D, int MT, int NT, int KSTEPS>
__device__ __forceinline__ void mma_abt(float (&acc)[MT][NT][4], const uint32_t (&a_frags)[MT][KSTEPS][4],
                                        uint32_t b_tile, int lane, int k_step0 = 0) {
#pragma unroll
    for (int kk = 0; kk < KSTEPS; ++kk) {
#pragma unroll
        for (int n = 0; n < NT; n += 2) {
            uint32_t b[4];
            load_b_nk<D>(b, b_tile, n * 8, (k_step0 + kk) * 16, lane);
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                mma_bf16(acc[mt][n], a_frags[mt][kk], b[0], b[1]);
                mma_bf16(acc[mt][n + 1], a_frags[mt][kk], b[2], b[3]);
            }
        }
    }
}

// the same with the A fragments read from a row-major tile (rows row0.., 16 per m-tile), one k-step at a time
template <int D, int MT, int NT>
__device__ __forceinline__ void mma_abt_from_tile(float (&acc)[MT][NT][4], uint32_t a_tile, int row0,
                                                  uint32_t b_tile, int lane) {
#pragma unroll 1  // not unrolled: the compiler would hoist every k-step's A loads and spill at MT = 2
    for (int kk = 0; kk < D / 16; ++kk) {
        uint32_t a[MT][1][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) load_a<D>(a[mt][0], a_tile, row0 + mt * 16, kk * 16, lane);
        mma_abt<D, MT, NT, 1>(acc, a, b_tile, lane, kk);
    }
}

// acc (MT m16 tiles x D) += P (MT m16 tiles x 16 * KSTEPS) @ B (tile of k rows, D columns), P given as bf16 pairs
// in accumulator layout: p[mt][n][half] = (c[2 * half], c[2 * half + 1]) of accumulator tile n
template <int D, int MT, int KSTEPS>
__device__ __forceinline__ void mma_pb(float (&acc)[MT][D / 8][4], const uint32_t (&p)[MT][2 * KSTEPS][2],
                                       uint32_t b_tile, int lane) {
#pragma unroll
    for (int kk = 0; kk < KSTEPS; ++kk) {
        uint32_t a[MT][4];  // as c_to_a: tiles 2kk (columns 0-7 of the k-step) and 2kk + 1 (columns 8-15)
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
            a[mt][0] = p[mt][2 * kk][0];
            a[mt][1] = p[mt][2 * kk][1];
            a[mt][2] = p[mt][2 * kk + 1][0];
            a[mt][3] = p[mt][2 * kk + 1][1];
        }
#pragma unroll
        for (int n = 0; n < D / 8; n += 2) {
            uint32_t b[4];
            load_b_kn<D>(b, b_tile, kk * 16, n * 8, lane);
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                mma_bf16(acc[mt][n], a[mt], b[0], b[1]);
                mma_bf16(acc[mt][n + 1], a[mt], b[2], b[3]);
            }
        }
    }
}

// A fragments of a warp's 16 rows at row0 of a tile, all K = D columns
template <int D>
__device__ __forceinline__ void load_a_rows(uint32_t a[][4], uint32_t tile, int row0, int lane) {
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) load_a<D>(a[kk], tile, row0, kk * 16, lane);
}

// ---- the document mask: doc_start (B, T) int32 (kernels/document_mask.cu), each query's first visible key;
// null: plain causal. Rows are nondecreasing in doc_start, so a run of rows sees no key before its first row's start.

// A warp of the forward or dQ kernel holds the document starts of its 32 rows row0.. one per lane (registers are
// short around the scores), lane i the start of row row0 + i (rows past T: row T-1's; they are never stored)
__device__ __forceinline__ int lane_row_start(const int* doc_start, int row0, int T, int lane) {
    return doc_start[min(row0 + lane, T - 1)];
}

// raw scores s of the warp's 32 rows (m-tile mt, lane: rows mt * 16 + g, +8) x keys kv0.. (n8 tile n, lane:
// columns kv0 + n * 8 + 2t, +1): -inf where the key is before the row's document (row_start: lane_row_start's)
template <int MT, int NT>
__device__ __forceinline__ void mask_before_document(float (&s)[MT][NT][4], int row_start, int kv0, int lane) {
    static_assert(MT * 16 == 32, "one row per lane");
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const int start = __shfl_sync(0xffffffffu, row_start, mt * 16 + lane / 4 + 8 * half);
#pragma unroll
            for (int n = 0; n < NT; ++n)
#pragma unroll
                for (int e = 2 * half; e < 2 * half + 2; ++e)
                    if (kv0 + n * 8 + 2 * (lane % 4) + (e & 1) < start) s[mt][n][e] = -INFINITY;
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
__device__ __forceinline__ void flash_forward(bf16* out, float* lse, const bf16* qkv, int T, int H, int KV,
                                              const int* doc_start) {
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
    const bool masked = doc_start != nullptr;
    const int* row_doc_start = masked ? doc_start + (long long)b * T : nullptr;  // the batch row's
    const int first_tile = masked ? row_doc_start[q0] / BC : 0;  // the tile of the smallest document start
    const float scale_log2 = LOG2E / sqrtf((float)D);

    load_tile<BR, D, THREADS>(sQ, q_src, q0, T, stride);
    load_tile<BC, D, THREADS>(sK + (first_tile & 1) * TILE_KV, k_src, first_tile * BC, T, stride);  // tile j: buffer j & 1
    load_tile<BC, D, THREADS>(sV + (first_tile & 1) * TILE_KV, v_src, first_tile * BC, T, stride);
    cp_async_commit();

    const int row_base = warp * M_TILES * 16;  // this warp's first row in the tile
    const int row_start = masked ? lane_row_start(row_doc_start, q0 + row_base, T, lane) : 0;
    float o[M_TILES][NT_O][4] = {};
    float row_max[M_TILES][2], row_sum[M_TILES][2] = {};  // row_max in raw (unscaled) scores
#pragma unroll
    for (int mt = 0; mt < M_TILES; ++mt) row_max[mt][0] = row_max[mt][1] = -INFINITY;
    uint32_t q_frags[M_TILES][Q_IN_REGISTERS ? KSTEPS : 1][4];

    for (int j = first_tile; j < n_tiles; ++j) {
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
        if (Q_IN_REGISTERS && j == first_tile) {
#pragma unroll
            for (int mt = 0; mt < M_TILES; ++mt) load_a_rows<D>(q_frags[mt], sQ, row_base + mt * 16, lane);
        }

        // else every key of the tile is after this warp's rows, or before their documents
        if (kv0 <= q0 + row_base + M_TILES * 16 - 1 && (!masked || kv0 + BC > __shfl_sync(0xffffffffu, row_start, 0))) {
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

            // the tile crosses a document start of the warp's rows: mask keys before it
            if (masked && kv0 < __shfl_sync(0xffffffffu, row_start, 31))
                mask_before_document<M_TILES, NT_S>(s, row_start, kv0, lane);
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

            // online softmax. Causal: every row sees key 0 in tile 0, so row_max is finite from the first tile on.
            // Masked: a row may see no key of its first tiles; while its max is -inf its exponentials and its
            // rescale factor count as 0 (as FA2's), not exp(-inf - -inf) = NaN
#pragma unroll
            for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
                for (int half = 0; half < 2; ++half) {
                    float m = row_max[mt][half];
#pragma unroll
                    for (int n = 0; n < NT_S; ++n) m = fmaxf(m, fmaxf(s[mt][n][2 * half], s[mt][n][2 * half + 1]));
                    m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 1));  // the 4 lanes of a row
                    m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 2));
                    const float m_safe = masked && m == -INFINITY ? 0.0f : m;  // exponentials of -inf: 0
                    const float alpha = exp2f((row_max[mt][half] - m_safe) * scale_log2), m_scaled = m_safe * scale_log2;
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

// doc_start, doc_end (B, T): the document mask (the forward and dQ read doc_start, dK/dV both); null: plain causal.
// One code path for both, branching on the pointer (warp-uniform): as two instantiations in one kernel, inlined or
// not, ptxas spilled at D = 128 and moved the plain causal kernel's registers.
extern "C" __global__ void __launch_bounds__(fwd::THREADS)
    flash_attention_forward_d64(bf16* out, float* lse, const bf16* qkv, int T, int H, int KV, const int* doc_start,
                                const int* doc_end) {
    flash_forward<64>(out, lse, qkv, T, H, KV, doc_start);
}

extern "C" __global__ void __launch_bounds__(fwd::THREADS)
    flash_attention_forward_d128(bf16* out, float* lse, const bf16* qkv, int T, int H, int KV, const int* doc_start,
                                 const int* doc_end) {
    flash_forward<128>(out, lse, qkv, T, H, KV, doc_start);
}

// ---- backward

namespace bwd {
// dkdv kernel: 4 warps of KV_M_TILES * 16 kv rows; 32-row query tiles
constexpr int KV_WARPS = 4, KV_THREADS = KV_WARPS * 32, BQ = 32;
template <int D>  // kv rows per warp / 16: two at D = 64; one at D = 128, where dK and dV alone take 128 registers
__host__ __device__ constexpr int kv_m_tiles() { return D == 64 ? 2 : 1; }
template <int D>
__host__ __device__ constexpr int kv_rows() { return KV_WARPS * kv_m_tiles<D>() * 16; }
template <int D>  // K, V; Q, dO double-buffered; lse, delta and the document starts double-buffered
__host__ __device__ constexpr int dkdv_shared_bytes() { return tile_bytes<D>(2 * kv_rows<D>() + 4 * BQ) + 6 * BQ * 4; }
// dq kernel: 4 warps of 32 query rows; 32-row K/V tiles
constexpr int Q_WARPS = 4, Q_THREADS = Q_WARPS * 32, Q_M_TILES = 2, Q_ROWS = Q_WARPS * Q_M_TILES * 16, Q_BC = 32;
template <int D>  // Q, dO; K, V double-buffered
__host__ __device__ constexpr int dq_shared_bytes() { return tile_bytes<D>(2 * Q_ROWS + 4 * Q_BC); }
}  // namespace bwd

// launch configuration, read by the host (llama/ops/flash_attention.py) from the module: per head dim (64, 128), for the
// forward, dkdv and dq kernels in turn: threads per CTA, rows per CTA (query, kv, query), shared bytes; then whether the
// forward is persistent (never here)
__constant__ int flash_attention_config[2][10] = {
    {fwd::THREADS, fwd::BR, fwd::shared_bytes<64>(), bwd::KV_THREADS, bwd::kv_rows<64>(), bwd::dkdv_shared_bytes<64>(),
     bwd::Q_THREADS, bwd::Q_ROWS, bwd::dq_shared_bytes<64>(), 0},
    {fwd::THREADS, fwd::BR, fwd::shared_bytes<128>(), bwd::KV_THREADS, bwd::kv_rows<128>(),
     bwd::dkdv_shared_bytes<128>(), bwd::Q_THREADS, bwd::Q_ROWS, bwd::dq_shared_bytes<128>(), 0},
};

template <int D>
__device__ __forceinline__ void flash_backward_dkdv(bf16* dqkv, const bf16* dout, const bf16* qkv, const float* lse,
                                                    const float* delta, const float* cos_table,
                                                    const float* sin_table, int T, int H, int KV,
                                                    const int* doc_start, const int* doc_end) {
    using namespace bwd;
    constexpr int MT = kv_m_tiles<D>(), BC = kv_rows<D>(), NT_Q = BQ / 8, NT_D = D / 8, TILE_Q = tile_bytes<D>(BQ);
    extern __shared__ __align__(128) unsigned char shared[];
    const uint32_t sK = smem_address(shared), sV = sK + tile_bytes<D>(BC), sQ = sV + tile_bytes<D>(BC),
                   sdO = sQ + 2 * TILE_Q;
    float* s_lse = reinterpret_cast<float*>(shared + tile_bytes<D>(2 * BC) + 4 * TILE_Q);  // [2][BQ], log2 units
    float* s_delta = s_lse + 2 * BQ;                                                   // [2][BQ]
    int* s_doc_start = reinterpret_cast<int*>(s_delta + 2 * BQ);                       // [2][BQ], masked only
    const int kv_head = blockIdx.x, b = blockIdx.y, kv0 = blockIdx.z * BC, group = H / KV;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t4 = lane % 4;
    const long long stride = (long long)(H + 2 * KV) * D, out_stride = (long long)H * D;
    const bf16* k_src = qkv + (long long)b * T * stride + (H + kv_head) * D;
    const bf16* v_src = k_src + KV * D;
    // the queries after the last key's document see none of the tile's keys
    const bool masked = doc_start != nullptr;
    const long long row_doc = (long long)b * T;  // the batch row's doc_start, doc_end (read only when masked)
    const int q_end = masked ? doc_end[row_doc + min(kv0 + BC, T) - 1] : T;
    const int first_q_tile = kv0 / BQ, n_q_tiles = (q_end + BQ - 1) / BQ - first_q_tile, steps = group * n_q_tiles;
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
    static_assert(2 * BQ <= KV_THREADS, "one thread per lse and delta value");
    auto fetch_row_stats = [&](int i) {
        if (threadIdx.x >= 2 * BQ) return 0.0f;
        const int pos = q_start(i) + threadIdx.x % BQ;
        const long long at = ((long long)b * H + q_head(i)) * T + pos;
        if (threadIdx.x < BQ) return pos < T ? lse[at] * LOG2E : INFINITY;
        return pos < T ? delta[at] : 0.0f;
    };
    static_assert(3 * BQ <= KV_THREADS, "one thread per document start");
    auto store_row_stats = [&](float value, int buf, int i) {  // threads 2BQ..3BQ-1: the document starts (0 past T)
        if (threadIdx.x < BQ) s_lse[buf * BQ + threadIdx.x] = value;
        else if (threadIdx.x < 2 * BQ) s_delta[buf * BQ + threadIdx.x - BQ] = value;
        else if (masked && threadIdx.x < 3 * BQ) {
            const int pos = q_start(i) + threadIdx.x - 2 * BQ;
            s_doc_start[buf * BQ + threadIdx.x - 2 * BQ] = pos < T ? doc_start[row_doc + pos] : 0;
        }
    };

    load_tile<BC, D, KV_THREADS>(sK, k_src, kv0, T, stride);
    load_tile<BC, D, KV_THREADS>(sV, v_src, kv0, T, stride);
    load_q_tiles(0, 0);
    cp_async_commit();
    store_row_stats(fetch_row_stats(0), 0, 0);

    const int row_base = warp * MT * 16;  // this warp's first kv row in the tile; m-tile mt, lane: rows +mt*16+g, +8
    float dk[MT][NT_D][4] = {}, dv[MT][NT_D][4] = {};

    for (int i = 0; i < steps; ++i) {
        const int buf = i & 1, q0 = q_start(i);
        if (i + 1 < steps) {  // buffer buf ^ 1 was last read before the previous step's closing barrier
            load_q_tiles(i + 1, buf ^ 1);
            cp_async_commit();
            store_row_stats(fetch_row_stats(i + 1), buf ^ 1, i + 1);
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();
        const uint32_t q_tile = sQ + buf * TILE_Q, do_tile = sdO + buf * TILE_Q;
        const float* lse2 = s_lse + buf * BQ;
        const float* dlt = s_delta + buf * BQ;
        const int* q_doc_start = s_doc_start + buf * BQ;

        // else every query of the tile is before this warp's kv rows, or its document starts after them
        if (q0 + BQ - 1 >= kv0 + row_base && (!masked || q_doc_start[0] < kv0 + row_base + MT * 16)) {
            // S^T = K Q^T (MT * 16 kv rows x BQ queries), then P^T = exp(S^T - lse), zero where query < key
            // P^T is kept as bf16 pairs (the precision of the dV product), which also forms dS^T: registers for MT = 2
            float s[MT][NT_Q][4] = {};
            mma_abt_from_tile<D, MT, NT_Q>(s, sK, row_base, q_tile, lane);
            const bool crosses_diagonal = q0 < kv0 + row_base + MT * 16 - 1;
            if (masked && q_doc_start[min(BQ, T - q0) - 1] > kv0 + row_base) {  // a query's document starts later
#pragma unroll
                for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                    for (int n = 0; n < NT_Q; ++n)
#pragma unroll
                        for (int e = 0; e < 4; ++e)  // P^T = 0 where the key is before the query's document
                            if (kv0 + row_base + mt * 16 + g + 8 * (e >> 1) < q_doc_start[n * 8 + 2 * t4 + (e & 1)])
                                s[mt][n][e] = -INFINITY;
            }
            uint32_t p[MT][NT_Q][2];
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int n = 0; n < NT_Q; ++n) {
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const int col = n * 8 + 2 * t4 + (e & 1), kv_row = kv0 + row_base + mt * 16 + g + 8 * (e >> 1);
                        s[mt][n][e] = exp2f(fmaf(s[mt][n][e], scale_log2, -lse2[col]));
                        if (crosses_diagonal && q0 + col < kv_row) s[mt][n][e] = 0.0f;
                    }
                    p[mt][n][0] = pack_bf16(s[mt][n][0], s[mt][n][1]);
                    p[mt][n][1] = pack_bf16(s[mt][n][2], s[mt][n][3]);
                }

            // dV += P^T dO
            mma_pb<D, MT, BQ / 16>(dv, p, do_tile, lane);

            // dP^T = V dO^T, then dS^T = P^T (dP^T - delta), also as bf16 pairs
            float dp[MT][NT_Q][4] = {};
            mma_abt_from_tile<D, MT, NT_Q>(dp, sV, row_base, do_tile, lane);
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int n = 0; n < NT_Q; ++n)
#pragma unroll
                    for (int half = 0; half < 2; ++half) {
                        const float2 pp = unpack_bf16(p[mt][n][half]), dl = *reinterpret_cast<const float2*>(
                                                                           dlt + n * 8 + 2 * t4);
                        p[mt][n][half] = pack_bf16(pp.x * (dp[mt][n][2 * half] - dl.x),
                                                   pp.y * (dp[mt][n][2 * half + 1] - dl.y));
                    }

            // dK += dS^T Q
            mma_pb<D, MT, BQ / 16>(dk, p, q_tile, lane);
        }

        __syncthreads();  // the next iteration's prefetch overwrites this buffer
    }

    const long long kv_base = (long long)b * T * stride;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
        const int pos0 = kv0 + row_base + mt * 16;
        store_rows<D>(dqkv + kv_base + (H + kv_head) * D, stride, dk[mt], rsqrtf((float)D), pos0, T, cos_table,
                      sin_table, lane);
        store_rows<D>(dqkv + kv_base + (H + KV + kv_head) * D, stride, dv[mt], 1.0f, pos0, T, nullptr, nullptr, lane);
    }
}

extern "C" __global__ void __launch_bounds__(bwd::KV_THREADS, 2)
    flash_attention_backward_dkdv_d64(bf16* dqkv, const bf16* dout, const bf16* qkv, const float* lse,
                                      const float* delta, const float* cos_table, const float* sin_table, int T,
                                      int H, int KV, const int* doc_start, const int* doc_end) {
    flash_backward_dkdv<64>(dqkv, dout, qkv, lse, delta, cos_table, sin_table, T, H, KV, doc_start, doc_end);
}

extern "C" __global__ void __launch_bounds__(bwd::KV_THREADS, 2)
    flash_attention_backward_dkdv_d128(bf16* dqkv, const bf16* dout, const bf16* qkv, const float* lse,
                                       const float* delta, const float* cos_table, const float* sin_table, int T,
                                       int H, int KV, const int* doc_start, const int* doc_end) {
    flash_backward_dkdv<128>(dqkv, dout, qkv, lse, delta, cos_table, sin_table, T, H, KV, doc_start, doc_end);
}

template <int D>
__device__ __forceinline__ void flash_backward_dq(bf16* dqkv, const bf16* dout, const bf16* qkv, const float* lse,
                                                  const float* delta, const float* cos_table, const float* sin_table,
                                                  int T, int H, int KV, const int* doc_start) {
    using namespace bwd;
    constexpr bool A_IN_REGISTERS = D == 64;  // Q, dO A-fragments kept in registers, else reloaded
    constexpr int MT = Q_M_TILES, KSTEPS = D / 16, NT_K = Q_BC / 8, NT_D = D / 8, TILE_KV = tile_bytes<D>(Q_BC);
    extern __shared__ __align__(128) unsigned char shared[];
    const uint32_t sQ = smem_address(shared), sdO = sQ + tile_bytes<D>(Q_ROWS), sK = sdO + tile_bytes<D>(Q_ROWS),
                   sV = sK + 2 * TILE_KV;
    const int h = blockIdx.x, b = blockIdx.y, q0 = (gridDim.z - 1 - blockIdx.z) * Q_ROWS;
    const int kv_head = h / (H / KV), warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t4 = lane % 4;
    const long long stride = (long long)(H + 2 * KV) * D, out_stride = (long long)H * D;
    const bf16* k_src = qkv + (long long)b * T * stride + (H + kv_head) * D;
    const bf16* v_src = k_src + KV * D;
    const int n_tiles = (min(q0 + Q_ROWS, T) + Q_BC - 1) / Q_BC;
    const bool masked = doc_start != nullptr;
    const int* row_doc_start = masked ? doc_start + (long long)b * T : nullptr;  // the batch row's
    const int first_tile = masked ? row_doc_start[q0] / Q_BC : 0;  // the tile of the smallest document start
    const float scale_log2 = LOG2E / sqrtf((float)D);

    load_tile<Q_ROWS, D, Q_THREADS>(sQ, qkv + (long long)b * T * stride + h * D, q0, T, stride);
    load_tile<Q_ROWS, D, Q_THREADS>(sdO, dout + (long long)b * T * out_stride + h * D, q0, T, out_stride);
    load_tile<Q_BC, D, Q_THREADS>(sK + (first_tile & 1) * TILE_KV, k_src, first_tile * Q_BC, T, stride);  // buffer j & 1
    load_tile<Q_BC, D, Q_THREADS>(sV + (first_tile & 1) * TILE_KV, v_src, first_tile * Q_BC, T, stride);
    cp_async_commit();

    const int row_base = warp * MT * 16, row = q0 + row_base + g;  // m-tile mt, lane: rows row + mt*16, +8
    const int row_start = masked ? lane_row_start(row_doc_start, q0 + row_base, T, lane) : 0;
    float lse2[MT][2], dlt[MT][2];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const int pos = row + mt * 16 + 8 * half;
            const long long at = ((long long)b * H + h) * T + pos;
            lse2[mt][half] = pos < T ? lse[at] * LOG2E : 0.0f;
            dlt[mt][half] = pos < T ? delta[at] : 0.0f;
        }
    float dq[MT][NT_D][4] = {};
    uint32_t q_frags[MT][A_IN_REGISTERS ? KSTEPS : 1][4], do_frags[MT][A_IN_REGISTERS ? KSTEPS : 1][4];

    for (int j = first_tile; j < n_tiles; ++j) {
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
        if (A_IN_REGISTERS && j == first_tile) {
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                load_a_rows<D>(q_frags[mt], sQ, row_base + mt * 16, lane);
                load_a_rows<D>(do_frags[mt], sdO, row_base + mt * 16, lane);
            }
        }

        // else every key of the tile is after this warp's rows, or before their documents
        if (kv0 <= q0 + row_base + MT * 16 - 1 && (!masked || kv0 + Q_BC > __shfl_sync(0xffffffffu, row_start, 0))) {
            // S = Q K^T, P = exp(S - lse), zero after the diagonal and before the document
            // P is kept as bf16 pairs (as in the dK/dV kernel, where it also feeds dV: the same dS in both)
            float s[MT][NT_K][4] = {};
            if constexpr (A_IN_REGISTERS) mma_abt<D, MT, NT_K, KSTEPS>(s, q_frags, k_tile, lane);
            else mma_abt_from_tile<D, MT, NT_K>(s, sQ, row_base, k_tile, lane);
            const bool crosses_diagonal = kv0 + Q_BC - 1 > q0 + row_base;
            if (masked && kv0 < __shfl_sync(0xffffffffu, row_start, 31))
                mask_before_document<MT, NT_K>(s, row_start, kv0, lane);
            uint32_t p[MT][NT_K][2];
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int n = 0; n < NT_K; ++n) {
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        s[mt][n][e] = exp2f(fmaf(s[mt][n][e], scale_log2, -lse2[mt][e >> 1]));
                        if (crosses_diagonal && kv0 + n * 8 + 2 * t4 + (e & 1) > row + mt * 16 + 8 * (e >> 1))
                            s[mt][n][e] = 0.0f;
                    }
                    p[mt][n][0] = pack_bf16(s[mt][n][0], s[mt][n][1]);
                    p[mt][n][1] = pack_bf16(s[mt][n][2], s[mt][n][3]);
                }

            // dP = dO V^T, dS = P (dP - delta), as bf16 pairs
            float dp[MT][NT_K][4] = {};
            if constexpr (A_IN_REGISTERS) mma_abt<D, MT, NT_K, KSTEPS>(dp, do_frags, v_tile, lane);
            else mma_abt_from_tile<D, MT, NT_K>(dp, sdO, row_base, v_tile, lane);
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int n = 0; n < NT_K; ++n)
#pragma unroll
                    for (int half = 0; half < 2; ++half) {
                        const float2 pp = unpack_bf16(p[mt][n][half]);
                        p[mt][n][half] = pack_bf16(pp.x * (dp[mt][n][2 * half] - dlt[mt][half]),
                                                   pp.y * (dp[mt][n][2 * half + 1] - dlt[mt][half]));
                    }

            // dQ += dS K
            mma_pb<D, MT, Q_BC / 16>(dq, p, k_tile, lane);
        }
        __syncthreads();
    }

    bf16* dq_dst = dqkv + (long long)b * T * stride + h * D;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
        store_rows<D>(dq_dst, stride, dq[mt], rsqrtf((float)D), q0 + row_base + mt * 16, T, cos_table, sin_table, lane);
}

extern "C" __global__ void __launch_bounds__(bwd::Q_THREADS, 2)
    flash_attention_backward_dq_d64(bf16* dqkv, const bf16* dout, const bf16* qkv, const float* lse,
                                    const float* delta, const float* cos_table, const float* sin_table, int T, int H,
                                    int KV, const int* doc_start, const int* doc_end) {
    flash_backward_dq<64>(dqkv, dout, qkv, lse, delta, cos_table, sin_table, T, H, KV, doc_start);
}

extern "C" __global__ void __launch_bounds__(bwd::Q_THREADS, 2)
    flash_attention_backward_dq_d128(bf16* dqkv, const bf16* dout, const bf16* qkv, const float* lse,
                                     const float* delta, const float* cos_table, const float* sin_table, int T, int H,
                                     int KV, const int* doc_start, const int* doc_end) {
    flash_backward_dq<128>(dqkv, dout, qkv, lse, delta, cos_table, sin_table, T, H, KV, doc_start);
}

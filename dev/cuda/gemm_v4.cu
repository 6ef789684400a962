// GEMM v4 `wgmma4` adds, over v2 and v3: thread-block clusters of 2 CTAs along N (`__cluster_dims__`), each CTA a
// 256 x 128 tile with cooperative consumers; the pair's 256 rows of A loaded half by each CTA and multicast to both
// (`.multicast::cluster`), so that a CTA reads 32 KB from L2 per 256 x 128 x 64 product (v3: per 128 x 128 x 64); a
// stage is free once the consumers of both CTAs released it (remote mbarrier arrives, 16 per stage). No gain over
// v2 (dev/cuda/README.md): the register epilogue, not the operands' bandwidth, was the gap. Its kernel, gemm_cluster,
// and the cluster's PTX wrappers are this rung's own; the rest is kernels/gemm_wgmma.cu's. Launcher:
// dev/cuda/gemm_ladder.py.
#include "gemm_wgmma.cu"

#ifdef WGMMA_ENABLED

// Thread-block clusters (the rank and the barrier are common.cuh's cluster_rank, cluster_barrier): a box
// multicast into the same shared-memory offset of every CTA in cta_mask (each CTA's mbarrier at offset `bar`
// receives the bytes it got), and an arrival on the mbarrier at offset `bar` of CTA `cta`.
__device__ __forceinline__ void tma_load_multicast(uint32_t dst, const CUtensorMap* map, int c0, int c1, int c2,
                                                   uint32_t bar, uint16_t cta_mask) {
    asm volatile(
        "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster"
        " [%0], [%1, {%2, %3, %4}], [%5], %6;\n"
        ::"r"(dst), "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(bar), "h"(cta_mask)
        : "memory");
}
__device__ __forceinline__ void mbarrier_arrive_cluster(uint32_t bar, uint32_t cta) {
    asm volatile(
        "{\n.reg .b32 remote;\n"
        "mapa.shared::cluster.u32 remote, %0, %1;\n"
        "mbarrier.arrive.shared::cluster.b64 _, [remote];\n}\n" ::"r"(bar), "r"(cta) : "memory");
}

// Version 4: clusters of two CTAs along N with the shared A tile multicast. The pair covers 256 x 256 of C:
// both CTAs take the same 256 rows of A, each its own 128 columns of B (CTA rank r: columns n0 + 128 r).
// Each CTA loads half of A's 256 x 64 slice (rows 128 r ..) and multicasts it into both CTAs' stage, so a
// CTA reads 32 KB from L2 per k-block for a 256 x 128 x 64 product where version 3 reads 32 KB for
// 128 x 128 x 64. Consumers cooperate: warpgroup w takes rows 128 w .. 128 w + 127 of the CTA's tile
// (2 x m64n128k16 per k16, as version 3). A stage is written by both CTAs' producers, so it is free only
// once the consumers of both CTAs released it: every consumer warp arrives on its own CTA's empty[s] and
// on its partner's (16 arrivals).
#define CL_BM 256

template <int STAGES, bool A_KMAJOR, bool B_KMAJOR>
__device__ __forceinline__ void gemm_cluster(const CUtensorMap* map_a, const CUtensorMap* map_b, Epilogue e, int K,
                                             int batches) {
    constexpr int A_BYTES = CL_BM * WG_BK * 2, B_BYTES = PP_BN * WG_BK * 2, STAGE_BYTES = A_BYTES + B_BYTES;
    extern __shared__ __align__(1024) uint8_t smem_raw[];
    const uint32_t base = (smem_address(smem_raw) + 1023) & ~1023u;  // swizzled tiles start on 1 KB
    const uint32_t full = base + STAGES * STAGE_BYTES, empty = full + STAGES * 8;
    const uint32_t rank = cluster_rank(), partner = rank ^ 1;
    const int tiles_m = (e.M + CL_BM - 1) / CL_BM, pairs_n = (e.N + 2 * PP_BN - 1) / (2 * PP_BN);
    const int tiles = tiles_m * pairs_n, units = tiles * batches, KT = (K + WG_BK - 1) / WG_BK;
    const int cluster = blockIdx.x / 2, clusters = gridDim.x / 2;
    const int warpgroup = threadIdx.x / 128;

    if (threadIdx.x == 0) {
        for (int s = 0; s < STAGES; s++) {
            mbarrier_init(full + 8 * s, 1);
            mbarrier_init(empty + 8 * s, 16);  // one arrival per consumer warp of both CTAs
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    cluster_barrier();  // the partner's barriers exist before anything arrives on them

    if (warpgroup == 0) {  // producer: the pair's units in the same order in both CTAs
        asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n");
        if (threadIdx.x == 0) {
            int stage = 0, phase = 0;
            for (int unit = cluster; unit < units; unit += clusters) {
                int tm, tp;
                tile_coords(unit % tiles, tiles_m, pairs_n, &tm, &tp);
                const int batch = unit / tiles, m0 = tm * CL_BM, n0 = (2 * tp + rank) * PP_BN;
                for (int kt = 0; kt < KT; kt++) {
                    mbarrier_wait(empty + 8 * stage, phase ^ 1);
                    const uint32_t a = base + stage * STAGE_BYTES, b = a + A_BYTES, bar = full + 8 * stage;
                    mbarrier_expect_tx(bar, STAGE_BYTES);  // our half of A, the partner's half, our B
                    const int k0 = kt * WG_BK, rows = m0 + rank * 128;
                    if (A_KMAJOR) {
                        tma_load_multicast(a + rank * 16384, map_a, k0, rows, batch, bar, 3);
                    } else {
                        tma_load_multicast(a + rank * 16384, map_a, rows, k0, batch, bar, 3);
                        tma_load_multicast(a + rank * 16384 + 8192, map_a, rows + 64, k0, batch, bar, 3);
                    }
                    load_b_kblock_128<B_KMAJOR>(b, map_b, k0, n0, batch, bar);
                    if (++stage == STAGES) { stage = 0; phase ^= 1; }
                }
            }
        }
    } else {  // consumers: warpgroup 1 takes rows 0-127 of the CTA's 256 x 128 tile, warpgroup 2 rows 128-255
        asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n");
        const int half = warpgroup - 1, t = threadIdx.x % 128, warp = t / 32, lane = t % 32;
        int stage = 0, phase = 0;
        float d0[64], d1[64];
        for (int unit = cluster; unit < units; unit += clusters) {
            int tm, tp;
            tile_coords(unit % tiles, tiles_m, pairs_n, &tm, &tp);
            const int batch = unit / tiles, m0 = tm * CL_BM, n0 = (2 * tp + rank) * PP_BN;
            int previous = -1;
            for (int kt = 0; kt < KT; kt++) {
                mbarrier_wait(full + 8 * stage, phase);
                const uint32_t a = base + stage * STAGE_BYTES + half * 16384, b = base + stage * STAGE_BYTES + A_BYTES;
                wgmma_fence();
                mma_kblock_128x128<A_KMAJOR, B_KMAJOR>(d0, d1, a, b, kt > 0);
                wgmma_commit();
                wgmma_wait<1>();  // the previous slice's wgmmas are done: release its stage in both CTAs
                if (previous >= 0 && lane == 0) {
                    mbarrier_arrive(empty + 8 * previous);
                    mbarrier_arrive_cluster(empty + 8 * previous, partner);
                }
                previous = stage;
                if (++stage == STAGES) { stage = 0; phase ^= 1; }
            }
            wgmma_wait<0>();
            accumulator_fence(d0);
            accumulator_fence(d1);
            if (lane == 0) {
                mbarrier_arrive(empty + 8 * previous);
                mbarrier_arrive_cluster(empty + 8 * previous, partner);
            }
            const int row = m0 + half * 128 + warp * 16 + lane / 4, col = n0 + 2 * (lane % 4);
            EPILOGUE_DISPATCH(e.mode, store_tile, e, d0, d1, batch, row, col)
        }
    }
    cluster_barrier();  // no CTA leaves while its partner may still arrive on its barriers
}

#endif  // WGMMA_ENABLED

// Version 4 entry points gemm_wgmma4_<layout>: clusters of 2 CTAs (launch an even grid), each CTA a 256 x 128
// tile, A multicast. Shared memory CL_STAGES * 48 KB + 1024 + 16 * CL_STAGES.
#define CL_STAGES 4
#ifdef WGMMA_ENABLED
#define CLUSTER_PAIR __cluster_dims__(2, 1, 1)
#define GEMM_WGMMA4_BODY(A_KMAJOR, B_KMAJOR)                                                              \
    const Epilogue e = {C, cos, sin, stride_c, ldc, M, N, mode, alpha, rope_T, rope_cols, head_dim};      \
    gemm_cluster<CL_STAGES, A_KMAJOR, B_KMAJOR>(maps, maps + 1, e, K, batches);
#else
#define GEMM_WGMMA4_BODY(A_KMAJOR, B_KMAJOR)
#define CLUSTER_PAIR
#endif
#define GEMM_WGMMA4_ENTRY(name, A_KMAJOR, B_KMAJOR)                                                           \
    extern "C" __global__ void CLUSTER_PAIR __launch_bounds__(WG_THREADS, 1) name(               \
        const CUtensorMap* maps, void* C, const float* cos, const float* sin, long long stride_c, int M, int N, \
        int K, int batches, int ldc, int mode, int rope_T, int rope_cols, int head_dim, float alpha) {        \
        GEMM_WGMMA4_BODY(A_KMAJOR, B_KMAJOR)                                                                  \
    }

#if KERNEL_ENTRY(gemm_wgmma4_nt)
GEMM_WGMMA4_ENTRY(gemm_wgmma4_nt, true, true)
#endif
#if KERNEL_ENTRY(gemm_wgmma4_nn)
GEMM_WGMMA4_ENTRY(gemm_wgmma4_nn, true, false)
#endif
#if KERNEL_ENTRY(gemm_wgmma4_tn)
GEMM_WGMMA4_ENTRY(gemm_wgmma4_tn, false, false)
#endif

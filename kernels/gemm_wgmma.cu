// bf16 GEMM with wgmma fed by TMA on Hopper (sm_90a): the GEMM ladder's version 2, production on H100/H200.
//
// Same contract as gemm_mma.cu: C = alpha * op(A) @ op(B), fp32 accumulation, the shared epilogue
// (gemm_epilogue.cuh), strided-batched, layouts nt (forward), nn (dX), tn (dW), no transposes.
// A and B arrive as TMA tensor maps (3D: inner, rows, batch), encoded by llama/ops/gemm_wgmma.py and read
// from global memory (passed by value through PyCUDA's packed argument buffer, every argument after
// them reached the kernel as zero: measured on an H200); tiles past an edge are zero-filled by TMA.
//
// Design (after pranjalssh/fast.cu and DeepGEMM; our own code):
// - CTA = 3 warpgroups. Warpgroup 0 is the producer: one thread issues the TMA loads of each
//   BK = 64 slice into a STAGES-deep ring of shared memory, 128-byte swizzled. Warpgroups 1 and 2
//   are consumers: each owns 64 rows of the 128 x BN tile and runs wgmma.m64nBNk16 from shared
//   memory, accumulating BN / 2 fp32 registers per thread. setmaxnreg moves registers from the
//   producer (40) to the consumers (232).
// - Synchronization by raw mbarriers: full[s] (the producer's expect_tx, completed by TMA bytes) and
//   empty[s] (one arrival per consumer warp once its wgmmas on stage s are done). Consumers keep one
//   wgmma group in flight and release the previous stage.
// - Persistent grid: one CTA per SM walks the tiles in GROUP_M order (L2 reuse); the producer
//   runs ahead into the next tile while the consumers store the last one.
// - Operand layouts: K-major tiles are one box {64 (K), rows}; M- or N-major tiles are boxes of
//   {64 (M or N), 64 (K)}, one per 64-wide slab, 8 KB apart. wgmma reads either through its
//   transpose immediates (descriptor LBO = slab distance 8192 B, SBO = 8-row distance 1024 B).
#include <cuda.h>
#include <cuda_bf16.h>
#include <stdint.h>

#include "gemm_epilogue.cuh"

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define GEMM_WGMMA_ENABLED 1
#endif

#define WG_BM 128
#define WG_BK 64
#define WG_THREADS 384

#ifdef GEMM_WGMMA_ENABLED

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
    return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void mbarrier_init(uint32_t bar, int count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count));
}
__device__ __forceinline__ void mbarrier_expect_tx(uint32_t bar, int bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbarrier_arrive(uint32_t bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void mbarrier_wait(uint32_t bar, int parity) {
    asm volatile(
        "{\n.reg .pred P;\nWAIT_%=:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 P, [%0], %1;\n"
        "@!P bra WAIT_%=;\n}\n" ::"r"(bar), "r"(parity) : "memory");
}

// one box of a 3D tensor map into shared memory, completing on bar
__device__ __forceinline__ void tma_load(uint32_t dst, const CUtensorMap* map, int c0, int c1, int c2, uint32_t bar) {
    asm volatile(
        "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], [%5];\n"
        ::"r"(dst), "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(bar) : "memory");
}

// shared-memory matrix descriptor, 128-byte swizzle: K-major tiles step 8-row groups by 1024 B
// (LBO unused); M/N-major tiles also step 64-wide slabs by LBO = 8192 B
template <bool KMAJOR>
__device__ __forceinline__ uint64_t smem_descriptor(uint32_t addr) {
    constexpr uint64_t lbo = KMAJOR ? 16 : WG_BK * 128;
    return (1ull << 62) | ((1024ull >> 4) << 32) | ((lbo >> 4) << 16) | ((addr & 0x3FFFF) >> 4);
}
// bytes to advance the descriptor by one k16 step inside a 64-deep slice
template <bool KMAJOR>
__device__ __forceinline__ uint32_t k16_step() { return KMAJOR ? 32 : 16 * 128; }

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory"); }

template <int TRANS_A, int TRANS_B>
__device__ __forceinline__ void wgmma_m64n128k16(float (&d)[64], uint64_t desc_a, uint64_t desc_b, int scale_d) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {"
        "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"
        "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,"
        "%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,"
        "%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63"
        "}, %64, %65, p, 1, 1, %67, %68;\n}\n"
        :
          "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
          "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
          "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
          "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
          "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "l"(desc_a), "l"(desc_b), "r"(scale_d), "n"(TRANS_A), "n"(TRANS_B));
}

template <int TRANS_A, int TRANS_B>
__device__ __forceinline__ void wgmma_m64n256k16(float (&d)[128], uint64_t desc_a, uint64_t desc_b, int scale_d) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {"
        "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"
        "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,"
        "%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,"
        "%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63,"
        "%64,%65,%66,%67,%68,%69,%70,%71,%72,%73,%74,%75,%76,%77,%78,%79,"
        "%80,%81,%82,%83,%84,%85,%86,%87,%88,%89,%90,%91,%92,%93,%94,%95,"
        "%96,%97,%98,%99,%100,%101,%102,%103,%104,%105,%106,%107,%108,%109,%110,%111,"
        "%112,%113,%114,%115,%116,%117,%118,%119,%120,%121,%122,%123,%124,%125,%126,%127"
        "}, %128, %129, p, 1, 1, %131, %132;\n}\n"
        :
          "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
          "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
          "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
          "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
          "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]),
          "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]),
          "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]),
          "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]),
          "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]),
          "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]),
          "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]),
          "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]),
          "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
        : "l"(desc_a), "l"(desc_b), "r"(scale_d), "n"(TRANS_A), "n"(TRANS_B));
}

// A consumer thread's accumulators: register 4j + {0, 1} holds (row, col + 8j + {0, 1}),
// 4j + {2, 3} holds row + 8 (the m64nNk16 fragment layout).
template <int MODE, int R>
__device__ __forceinline__ void store_accumulators(const Epilogue& e, const float (&d)[R], int batch, int row, int col) {
    #pragma unroll
    for (int j = 0; j < R / 4; j++) {
        epilogue_pair<MODE>(e, batch, row, col + 8 * j, d[4 * j], d[4 * j + 1]);
        epilogue_pair<MODE>(e, batch, row + 8, col + 8 * j, d[4 * j + 2], d[4 * j + 3]);
    }
}

template <int BN, int STAGES, bool A_KMAJOR, bool B_KMAJOR>
__device__ __forceinline__ void gemm_wgmma(const CUtensorMap* map_a, const CUtensorMap* map_b, Epilogue e, int K,
                                           int batches) {
    constexpr int A_BYTES = WG_BM * WG_BK * 2, B_BYTES = BN * WG_BK * 2, STAGE_BYTES = A_BYTES + B_BYTES;
    extern __shared__ __align__(1024) uint8_t smem_raw[];
    const uint32_t base = (smem_addr(smem_raw) + 1023) & ~1023u;  // swizzled tiles start on 1 KB
    const uint32_t full = base + STAGES * STAGE_BYTES, empty = full + STAGES * 8;
    const int tiles_m = (e.M + WG_BM - 1) / WG_BM, tiles_n = (e.N + BN - 1) / BN;
    const int tiles = tiles_m * tiles_n, total = tiles * batches, KT = (K + WG_BK - 1) / WG_BK;
    const int warpgroup = threadIdx.x / 128;

    if (threadIdx.x == 0) {
        for (int s = 0; s < STAGES; s++) {
            mbarrier_init(full + 8 * s, 1);
            mbarrier_init(empty + 8 * s, 8);  // one arrival per consumer warp
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();

    if (warpgroup == 0) {  // producer
        asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n");
        if (threadIdx.x == 0) {
            int stage = 0, phase = 0;
            for (int tile = blockIdx.x; tile < total; tile += gridDim.x) {
                int tm, tn;
                tile_coords(tile % tiles, tiles_m, tiles_n, &tm, &tn);
                const int batch = tile / tiles, m0 = tm * WG_BM, n0 = tn * BN;
                for (int kt = 0; kt < KT; kt++) {
                    mbarrier_wait(empty + 8 * stage, phase ^ 1);
                    const uint32_t a = base + stage * STAGE_BYTES, b = a + A_BYTES, bar = full + 8 * stage;
                    mbarrier_expect_tx(bar, STAGE_BYTES);
                    const int k0 = kt * WG_BK;
                    if (A_KMAJOR) {
                        tma_load(a, map_a, k0, m0, batch, bar);
                    } else {
                        tma_load(a, map_a, m0, k0, batch, bar);
                        tma_load(a + 8192, map_a, m0 + 64, k0, batch, bar);
                    }
                    if (B_KMAJOR) {
                        tma_load(b, map_b, k0, n0, batch, bar);
                    } else {
                        #pragma unroll
                        for (int j = 0; j < BN / 64; j++) tma_load(b + j * 8192, map_b, n0 + 64 * j, k0, batch, bar);
                    }
                    if (++stage == STAGES) { stage = 0; phase ^= 1; }
                }
            }
        }
    } else {  // consumers: warpgroup 1 takes rows 0-63 of the tile, warpgroup 2 rows 64-127
        asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n");
        const int half = warpgroup - 1, t = threadIdx.x % 128, warp = t / 32, lane = t % 32;
        int stage = 0, phase = 0;
        float d[BN / 2];
        for (int tile = blockIdx.x; tile < total; tile += gridDim.x) {
            int tm, tn;
            tile_coords(tile % tiles, tiles_m, tiles_n, &tm, &tn);
            const int batch = tile / tiles, m0 = tm * WG_BM, n0 = tn * BN;
            int previous = -1;
            for (int kt = 0; kt < KT; kt++) {
                mbarrier_wait(full + 8 * stage, phase);
                const uint32_t a = base + stage * STAGE_BYTES + half * 8192, b = base + stage * STAGE_BYTES + A_BYTES;
                wgmma_fence();
                #pragma unroll
                for (int k = 0; k < WG_BK / 16; k++) {
                    const uint64_t da = smem_descriptor<A_KMAJOR>(a + k * k16_step<A_KMAJOR>());
                    const uint64_t db = smem_descriptor<B_KMAJOR>(b + k * k16_step<B_KMAJOR>());
                    if (BN == 256) wgmma_m64n256k16<!A_KMAJOR, !B_KMAJOR>(*(float(*)[128])d, da, db, kt > 0 || k > 0);
                    else           wgmma_m64n128k16<!A_KMAJOR, !B_KMAJOR>(*(float(*)[64])d, da, db, kt > 0 || k > 0);
                }
                wgmma_commit();
                wgmma_wait<1>();  // the previous slice's wgmmas are done: release its stage
                if (previous >= 0 && lane == 0) mbarrier_arrive(empty + 8 * previous);
                previous = stage;
                if (++stage == STAGES) { stage = 0; phase ^= 1; }
            }
            wgmma_wait<0>();
            if (previous >= 0 && lane == 0) mbarrier_arrive(empty + 8 * previous);
            const int row = m0 + half * 64 + warp * 16 + lane / 4, col = n0 + 2 * (lane % 4);
            EPILOGUE_DISPATCH(e.mode, store_accumulators, e, d, batch, row, col)
        }
    }
}

// Version 3: ping-pong consumers. Each consumer warpgroup owns a whole 128 x 128 tile (two
// m64n128k16 per k16 step, 2 x 64 accumulators per thread); the CTA's work units alternate between the
// two warpgroups, and an order barrier lets a warpgroup start a unit's MMAs only once the other has
// issued all of the previous unit's, so one warpgroup's epilogue runs while the other's MMAs do.
// Work unit = (batch, split, tile): with splits > 1 (split-K, batch 1), split s takes k-blocks
// [s * split_kb, min(KT, (s + 1) * split_kb)) and writes its partial product to C's batch s.
#define PP_BN 128

// the k-blocks of work unit `split` (the launcher makes every split non-empty)
__device__ __forceinline__ int unit_kblocks(int split, int split_kb, int KT) {
    return min(split_kb, KT - split * split_kb);
}

// keeps the compiler from moving reads of the accumulators above the wgmma wait before it
template <int R>
__device__ __forceinline__ void accumulator_fence(float (&d)[R]) {
    #pragma unroll
    for (int i = 0; i < R; i++) asm volatile("" : "+f"(d[i])::"memory");
}

template <int MODE>
__device__ __forceinline__ void store_tile(const Epilogue& e, const float (&d0)[64], const float (&d1)[64], int batch,
                                           int row, int col) {
    store_accumulators<MODE>(e, d0, batch, row, col);
    store_accumulators<MODE>(e, d1, batch, row + 64, col);
}

template <int STAGES, bool A_KMAJOR, bool B_KMAJOR>
__device__ __forceinline__ void gemm_pingpong(const CUtensorMap* map_a, const CUtensorMap* map_b, Epilogue e, int K,
                                              int batches, int splits, int split_kb) {
    constexpr int A_BYTES = WG_BM * WG_BK * 2, B_BYTES = PP_BN * WG_BK * 2, STAGE_BYTES = A_BYTES + B_BYTES;
    extern __shared__ __align__(1024) uint8_t smem_raw[];
    const uint32_t base = (smem_addr(smem_raw) + 1023) & ~1023u;  // swizzled tiles start on 1 KB
    const uint32_t full = base + STAGES * STAGE_BYTES, empty = full + STAGES * 8, order = empty + STAGES * 8;
    const int tiles_m = (e.M + WG_BM - 1) / WG_BM, tiles_n = (e.N + PP_BN - 1) / PP_BN;
    const int tiles = tiles_m * tiles_n, units = tiles * batches * splits, KT = (K + WG_BK - 1) / WG_BK;
    const int warpgroup = threadIdx.x / 128;

    if (threadIdx.x == 0) {
        for (int s = 0; s < STAGES; s++) {
            mbarrier_init(full + 8 * s, 1);
            mbarrier_init(empty + 8 * s, 4);  // one arrival per warp of the consumer that used the stage
        }
        mbarrier_init(order, 4);      // order[c]: consumer c may start its next unit (one arrival per warp)
        mbarrier_init(order + 8, 4);
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();

    if (warpgroup == 0) {  // producer: every unit of this CTA, in order, through the one ring
        asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n");
        if (threadIdx.x == 0) {
            int stage = 0, phase = 0;
            for (int unit = blockIdx.x; unit < units; unit += gridDim.x) {
                int tm, tn;
                tile_coords(unit % tiles, tiles_m, tiles_n, &tm, &tn);
                const int split = (unit / tiles) % splits, batch = unit / tiles / splits;
                const int m0 = tm * WG_BM, n0 = tn * PP_BN, kb0 = split * split_kb;
                const int kblocks = unit_kblocks(split, split_kb, KT);
                for (int kt = 0; kt < kblocks; kt++) {
                    mbarrier_wait(empty + 8 * stage, phase ^ 1);
                    const uint32_t a = base + stage * STAGE_BYTES, b = a + A_BYTES, bar = full + 8 * stage;
                    mbarrier_expect_tx(bar, STAGE_BYTES);
                    const int k0 = (kb0 + kt) * WG_BK;
                    if (A_KMAJOR) {
                        tma_load(a, map_a, k0, m0, batch, bar);
                    } else {
                        tma_load(a, map_a, m0, k0, batch, bar);
                        tma_load(a + 8192, map_a, m0 + 64, k0, batch, bar);
                    }
                    if (B_KMAJOR) {
                        tma_load(b, map_b, k0, n0, batch, bar);
                    } else {
                        tma_load(b, map_b, n0, k0, batch, bar);
                        tma_load(b + 8192, map_b, n0 + 64, k0, batch, bar);
                    }
                    if (++stage == STAGES) { stage = 0; phase ^= 1; }
                }
            }
        }
    } else {  // consumer c = 0, 1 takes this CTA's units number c, c + 2, c + 4, ...
        asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n");
        const int c = warpgroup - 1, t = threadIdx.x % 128, warp = t / 32, lane = t % 32;
        const uint32_t my_turn = order + 8 * c, other_turn = order + 8 * (1 - c);
        int consumed = 0;  // k-blocks of this CTA's units before the current one: the ring position
        float d0[64], d1[64];
        for (int unit = blockIdx.x, i = 0; unit < units; unit += gridDim.x, i++) {
            const int split = (unit / tiles) % splits;
            const int kblocks = unit_kblocks(split, split_kb, KT);
            if ((i & 1) != c) {  // the other consumer's unit: skip its k-blocks in the ring
                consumed += kblocks;
                continue;
            }
            int tm, tn;
            tile_coords(unit % tiles, tiles_m, tiles_n, &tm, &tn);
            const int m0 = tm * WG_BM, n0 = tn * PP_BN, out_batch = unit / tiles;
            // Unit i waits until every warp of the other consumer has issued unit i - 1's MMAs (the
            // ((i - 1) / 2)-th phase of my_turn). Besides the overlap, this is what keeps the ring safe:
            // all of unit i - 1's stages have landed, so no full[s] this unit waits on is two phases behind.
            if (i > 0) mbarrier_wait(my_turn, ((i - 1) >> 1) & 1);
            int stage = consumed % STAGES, phase = (consumed / STAGES) & 1, previous = -1;
            consumed += kblocks;
            for (int kt = 0; kt < kblocks; kt++) {
                mbarrier_wait(full + 8 * stage, phase);
                const uint32_t a = base + stage * STAGE_BYTES, b = a + A_BYTES;
                wgmma_fence();
                #pragma unroll
                for (int k = 0; k < WG_BK / 16; k++) {
                    const uint64_t db = smem_descriptor<B_KMAJOR>(b + k * k16_step<B_KMAJOR>());
                    const uint64_t da0 = smem_descriptor<A_KMAJOR>(a + k * k16_step<A_KMAJOR>());
                    const uint64_t da1 = smem_descriptor<A_KMAJOR>(a + 8192 + k * k16_step<A_KMAJOR>());
                    wgmma_m64n128k16<!A_KMAJOR, !B_KMAJOR>(d0, da0, db, kt > 0 || k > 0);
                    wgmma_m64n128k16<!A_KMAJOR, !B_KMAJOR>(d1, da1, db, kt > 0 || k > 0);
                }
                wgmma_commit();
                wgmma_wait<1>();  // the previous slice's wgmmas are done: release its stage
                if (previous >= 0 && lane == 0) mbarrier_arrive(empty + 8 * previous);
                previous = stage;
                if (++stage == STAGES) { stage = 0; phase ^= 1; }
            }
            if (lane == 0) mbarrier_arrive(other_turn);  // all MMAs issued: the other consumer's turn
            wgmma_wait<0>();
            accumulator_fence(d0);
            accumulator_fence(d1);
            if (lane == 0) mbarrier_arrive(empty + 8 * previous);
            const int row = m0 + warp * 16 + lane / 4, col = n0 + 2 * (lane % 4);
            EPILOGUE_DISPATCH(e.mode, store_tile, e, d0, d1, out_batch, row, col)
        }
    }
}

#endif  // GEMM_WGMMA_ENABLED

// Entry points gemm_wgmma_<layout>_128x<BN>; shared memory STAGES * (128 + BN) * 64 * 2 + 1024 + 16 * STAGES.
// On anything but sm_90a they compile to nothing and the launcher never selects them.
#ifdef GEMM_WGMMA_ENABLED
#define GEMM_WGMMA_BODY(BN_, STAGES_, A_KMAJOR, B_KMAJOR)                                                 \
    const Epilogue e = {C, cos, sin, stride_c, ldc, M, N, mode, alpha, rope_T, rope_cols, head_dim};      \
    gemm_wgmma<BN_, STAGES_, A_KMAJOR, B_KMAJOR>(maps, maps + 1, e, K, batches);
#else
#define GEMM_WGMMA_BODY(BN_, STAGES_, A_KMAJOR, B_KMAJOR)
#endif
#define GEMM_WGMMA_ENTRY(name, BN_, STAGES_, A_KMAJOR, B_KMAJOR)                                              \
    extern "C" __global__ void __launch_bounds__(WG_THREADS, 1) name(                                         \
        const CUtensorMap* maps, void* C,                                                                     \
        const float* cos, const float* sin, long long stride_c, int M, int N, int K, int batches, int ldc,    \
        int mode, int rope_T, int rope_cols, int head_dim, float alpha) {                                     \
        GEMM_WGMMA_BODY(BN_, STAGES_, A_KMAJOR, B_KMAJOR)                                                     \
    }

GEMM_WGMMA_ENTRY(gemm_wgmma_nt_128x256, 256, 4, true, true)
GEMM_WGMMA_ENTRY(gemm_wgmma_nn_128x256, 256, 4, true, false)
GEMM_WGMMA_ENTRY(gemm_wgmma_tn_128x256, 256, 4, false, false)
GEMM_WGMMA_ENTRY(gemm_wgmma_nt_128x128, 128, 6, true, true)
GEMM_WGMMA_ENTRY(gemm_wgmma_nn_128x128, 128, 6, true, false)
GEMM_WGMMA_ENTRY(gemm_wgmma_tn_128x128, 128, 6, false, false)

// Version 3 entry points gemm_wgmma3_<layout>: 128 x 128 tiles, ping-pong consumers, split-K in the kernel
// (splits = 1: plain batches). Shared memory PP_STAGES * 32 KB + 1024 + 16 * PP_STAGES + 16.
#define PP_STAGES 7
#ifdef GEMM_WGMMA_ENABLED
#define GEMM_WGMMA3_BODY(A_KMAJOR, B_KMAJOR)                                                              \
    const Epilogue e = {C, cos, sin, stride_c, ldc, M, N, mode, alpha, rope_T, rope_cols, head_dim};      \
    gemm_pingpong<PP_STAGES, A_KMAJOR, B_KMAJOR>(maps, maps + 1, e, K, batches, splits, split_kb);
#else
#define GEMM_WGMMA3_BODY(A_KMAJOR, B_KMAJOR)
#endif
#define GEMM_WGMMA3_ENTRY(name, A_KMAJOR, B_KMAJOR)                                                           \
    extern "C" __global__ void __launch_bounds__(WG_THREADS, 1) name(                                         \
        const CUtensorMap* maps, void* C, const float* cos, const float* sin, long long stride_c, int M, int N, \
        int K, int batches, int splits, int split_kb, int ldc, int mode, int rope_T, int rope_cols,             \
        int head_dim, float alpha) {                                                                          \
        GEMM_WGMMA3_BODY(A_KMAJOR, B_KMAJOR)                                                                  \
    }

GEMM_WGMMA3_ENTRY(gemm_wgmma3_nt, true, true)
GEMM_WGMMA3_ENTRY(gemm_wgmma3_nn, true, false)
GEMM_WGMMA3_ENTRY(gemm_wgmma3_tn, false, false)

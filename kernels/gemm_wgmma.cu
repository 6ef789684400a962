// bf16 GEMM with wgmma fed by TMA on Hopper (sm_90a): the versions of the GEMM ladder (dev/cuda/README.md) that the
// plan runs on H100/H200: version 5 or 6 per shape, their twins 8 or 7 on several GPUs, version 6 in FP8
// (llama/run/plan.py GemmChooser). The ladder's other rungs on these templates (versions 2 to 4, FP8's version 5) are
// entry points in dev/cuda/gemm_v<N>.cu, which include this file.
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
//   runs ahead into the next tile while the consumers store the last one. Versions 7 and 8 claim each
//   next tile from a global counter instead of taking every gridDim.x-th (WorkUnits).
// - Operand layouts: K-major tiles are one box {64 (K), rows}; M- or N-major tiles are boxes of
//   {64 (M or N), 64 (K)}, one per 64-wide slab, 8 KB apart. wgmma reads either through its
//   transpose immediates (descriptor LBO = slab distance 8192 B, SBO = 8-row distance 1024 B).
// - FP8 (e4m3, --dtype fp8): the same kernels with FP8 = true take both operands K-major (FP8 wgmma reads
//   nothing else) in k-blocks of 128 values, 128 bytes per row as bf16's 64, so the swizzle, the descriptors and
//   the stage sizes are bf16's; each k32 wgmma takes the 32 bytes a bf16 k16 does. The epilogue multiplies by
//   the rows' scales (gemm_epilogue.cuh).
#include <cuda_bf16.h>

#include "gemm_epilogue.cuh"
#include "wgmma.cuh"

#define WG_BM 128
#define WG_BK 64
#define WG_BK_BYTES 128  // a k-block row: 64 bf16 or 128 FP8 values
#define WG_THREADS 384

#ifdef WGMMA_ENABLED

// GEMM operand descriptors: K-major tiles step 8-row groups by 1024 B; M/N-major tiles also step
// 64-wide slabs by LBO = 8192 B (64 k-rows of 128 B)
template <bool KMAJOR>
__device__ __forceinline__ uint64_t smem_descriptor(uint32_t addr) {
    return matrix_descriptor(addr, KMAJOR ? 16 : WG_BK * 128);
}
// bytes to advance the descriptor by one k16 step inside a 64-deep slice
template <bool KMAJOR>
__device__ __forceinline__ uint32_t k16_step() { return KMAJOR ? 32 : 16 * 128; }

// the k-block's values: WG_BK_BYTES of bf16 or of FP8
template <bool FP8>
__device__ __forceinline__ constexpr int kblock_values() { return FP8 ? WG_BK_BYTES : WG_BK; }

// one k-step (k16 bf16 or k32 FP8, 32 bytes of each row) of a 64 x N accumulator from shared memory
template <bool FP8, int N, bool A_KMAJOR, bool B_KMAJOR>
__device__ __forceinline__ void wgmma_kstep(float (&d)[N / 2], uint64_t da, uint64_t db, int scale_d) {
    if constexpr (FP8) {
        static_assert(A_KMAJOR && B_KMAJOR, "FP8 wgmma reads K-major operands only");
        if constexpr (N == 256) wgmma_m64n256k32_e4m3(d, da, db, scale_d);
        else wgmma_m64n128k32_e4m3(d, da, db, scale_d);
    } else {
        wgmma_ss<N, !A_KMAJOR, !B_KMAJOR>(d, da, db, scale_d);
    }
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

// The staged epilogue (versions 5 to 8): the registers' layout writes 16 bytes per row per store instruction
// (a warp's store touches 8 rows), so v2's and v3's epilogues are bound by the number of memory requests,
// not bytes. Here
// each consumer warp passes its 16 rows of an m64 half through its own 8 x 132 fp32 staging rows, eight
// rows at a time (the fragment's rows r, then r + 8): float2 writes (each bank twice, the least 256 bytes
// take), then each staged row leaves as one coalesced segment, a float4 per lane (epilogue_quad).
#define STAGING_LD 132
#define STAGING_BYTES (2 * 4 * 8 * STAGING_LD * 4)  // two consumer warpgroups of four warps

template <int MODE>
__device__ __forceinline__ void store_half_staged(const Epilogue& e, const float (&d)[64], int batch, int row0,
                                                  int col0, float* staging) {
    const int lane = threadIdx.x % 32;
    #pragma unroll
    for (int h = 0; h < 2; h++) {
        #pragma unroll
        for (int j = 0; j < 16; j++)
            *(float2*)&staging[(lane / 4) * STAGING_LD + 8 * j + 2 * (lane % 4)] =
                make_float2(d[4 * j + 2 * h], d[4 * j + 2 * h + 1]);
        __syncwarp();
        #pragma unroll
        for (int r = 0; r < 8; r++)
            epilogue_quad<MODE>(e, batch, row0 + 8 * h + r, col0 + 4 * lane,
                                *(const float4*)&staging[r * STAGING_LD + 4 * lane]);
        __syncwarp();
    }
}

// row0: the warp's first row of the tile (m0 + 16 * warp), col0: the tile's first column
template <int MODE>
__device__ __forceinline__ void store_tile_staged(const Epilogue& e, const float (&d0)[64], const float (&d1)[64],
                                                  int batch, int row0, int col0, float* staging) {
    store_half_staged<MODE>(e, d0, batch, row0, col0, staging);
    store_half_staged<MODE>(e, d1, batch, row0 + 64, col0, staging);
}

// version 6: a warp's 16 rows of an m64nBN accumulator, 128 columns at a time
template <int MODE, int R>
__device__ __forceinline__ void store_accumulators_staged(const Epilogue& e, const float (&d)[R], int batch, int row0,
                                                          int col0, float* staging) {
    #pragma unroll
    for (int h = 0; h < R / 64; h++)
        store_half_staged<MODE>(e, *(const float(*)[64])(d + 64 * h), batch, row0, col0 + 128 * h, staging);
}

// The work units (tiles, or version 5's split-K units) a persistent CTA runs, in order: its first is blockIdx.x.
// Static (versions 2-6): then every gridDim.x-th. Dynamic (versions 7 and 8): claimed as they come, so that CTAs
// that start late (multiprocessors held by another kernel, e.g. NCCL's) leave their share to the running ones.
// The producer thread claims each next unit as gridDim.x + an atomicAdd on a global counter and passes it to the
// consumer warpgroups through a ring of UNIT_SLOTS shared-memory slots (full: the producer's arrival; empty: one
// arrival per consumer warp, since every consumer reads every unit); a unit >= units tells them to stop. Each
// CTA's producer makes exactly one failing claim, so a launch (grid <= units) makes `units` claims: the last
// (value units - 1) sets the counter back to 0 for the next launch, which on the same stream starts after it.
#define UNIT_SLOTS 8
#define UNIT_RING_BYTES (UNIT_SLOTS * 20)  // per slot: full and empty mbarriers, the unit

template <bool DYNAMIC>
struct WorkUnits {
    unsigned int* counter;  // versions 7 and 8: zero at launch, left at zero
    uint32_t ring;          // UNIT_SLOTS full mbarriers, UNIT_SLOTS empty ones, the slots
    int* slots;
    int units;

    __device__ __forceinline__ WorkUnits(unsigned int* counter, uint32_t ring, int units)
        : counter(counter), ring(ring), units(units) {
        extern __shared__ __align__(1024) uint8_t smem_raw[];
        slots = (int*)(smem_raw + (ring + 16 * UNIT_SLOTS - smem_address(smem_raw)));
    }
    __device__ __forceinline__ uint32_t full(int slot) const { return ring + 8 * slot; }
    __device__ __forceinline__ uint32_t empty(int slot) const { return ring + 8 * (UNIT_SLOTS + slot); }

    __device__ __forceinline__ void init() const {  // thread 0, with the other mbarriers
        if (DYNAMIC) {
            for (int s = 0; s < UNIT_SLOTS; s++) {
                mbarrier_init(full(s), 1);
                mbarrier_init(empty(s), 8);  // one arrival per consumer warp
            }
        }
    }
    // producer thread: the unit after `unit`
    __device__ __forceinline__ int next(int unit) const {
        if (!DYNAMIC) return unit + gridDim.x;
        const unsigned int claim = atomicAdd(counter, 1u);
        if (claim == units - 1) *counter = 0;  // the launch's last claim
        return gridDim.x + claim;
    }
    // producer thread: hands the CTA's i-th unit (or the end) to the consumers
    __device__ __forceinline__ void publish(int i, int unit) const {
        if (DYNAMIC) {
            const int slot = i % UNIT_SLOTS;
            mbarrier_wait(empty(slot), ((i / UNIT_SLOTS) & 1) ^ 1);
            slots[slot] = unit;
            mbarrier_arrive(full(slot));  // releases the write to the consumers' wait
        }
    }
    // consumer thread: the CTA's i-th unit
    __device__ __forceinline__ int unit(int i, int lane) const {
        if (!DYNAMIC) return blockIdx.x + i * gridDim.x;
        const int slot = i % UNIT_SLOTS;
        mbarrier_wait(full(slot), (i / UNIT_SLOTS) & 1);
        const int unit = slots[slot];
        __syncwarp();  // every lane has read the slot before it is given back
        if (lane == 0) mbarrier_arrive(empty(slot));
        return unit;
    }
};

template <int BN, int STAGES, bool A_KMAJOR, bool B_KMAJOR, bool STAGED, bool FP8 = false, bool DYNAMIC = false>
__device__ __forceinline__ void gemm_wgmma(const CUtensorMap* map_a, const CUtensorMap* map_b, Epilogue e, int K,
                                           int batches, unsigned int* counter) {
    constexpr int BK = kblock_values<FP8>();
    constexpr int A_BYTES = WG_BM * WG_BK * 2, B_BYTES = BN * WG_BK * 2, STAGE_BYTES = A_BYTES + B_BYTES;
    extern __shared__ __align__(1024) uint8_t smem_raw[];
    const uint32_t base = (smem_address(smem_raw) + 1023) & ~1023u;  // swizzled tiles start on 1 KB
    const uint32_t staging = base + STAGES * STAGE_BYTES;  // version 6: the warps' epilogue rows
    const uint32_t full = staging + (STAGED ? STAGING_BYTES : 0), empty = full + STAGES * 8;
    const int tiles_m = (e.M + WG_BM - 1) / WG_BM, tiles_n = (e.N + BN - 1) / BN;
    const int tiles = tiles_m * tiles_n, total = tiles * batches, KT = (K + BK - 1) / BK;
    const int warpgroup = threadIdx.x / 128;
    const WorkUnits<DYNAMIC> work(counter, empty + STAGES * 8, total);  // version 7: claimed tiles

    if (threadIdx.x == 0) {
        for (int s = 0; s < STAGES; s++) {
            mbarrier_init(full + 8 * s, 1);
            mbarrier_init(empty + 8 * s, 8);  // one arrival per consumer warp
        }
        work.init();
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();

    if (warpgroup == 0) {  // producer
        asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n");
        if (threadIdx.x == 0) {
            int stage = 0, phase = 0;
            for (int tile = blockIdx.x, i = 0;; tile = work.next(tile), i++) {
                work.publish(i, tile);
                if (tile >= total) break;
                int tm, tn;
                tile_coords(tile % tiles, tiles_m, tiles_n, &tm, &tn);
                const int batch = tile / tiles, m0 = tm * WG_BM, n0 = tn * BN;
                for (int kt = 0; kt < KT; kt++) {
                    mbarrier_wait(empty + 8 * stage, phase ^ 1);
                    const uint32_t a = base + stage * STAGE_BYTES, b = a + A_BYTES, bar = full + 8 * stage;
                    mbarrier_expect_tx(bar, STAGE_BYTES);
                    const int k0 = kt * BK;
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
        for (int i = 0;; i++) {
            const int tile = work.unit(i, lane);
            if (tile >= total) break;
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
                    wgmma_kstep<FP8, BN, A_KMAJOR, B_KMAJOR>(d, da, db, kt > 0 || k > 0);
                }
                wgmma_commit();
                wgmma_wait<1>();  // the previous slice's wgmmas are done: release its stage
                if (previous >= 0 && lane == 0) mbarrier_arrive(empty + 8 * previous);
                previous = stage;
                if (++stage == STAGES) { stage = 0; phase ^= 1; }
            }
            wgmma_wait<0>();
            if (previous >= 0 && lane == 0) mbarrier_arrive(empty + 8 * previous);
            if (STAGED) {
                float* rows = (float*)(smem_raw + (staging - smem_address(smem_raw))) + (4 * half + warp) * 8 * STAGING_LD;
                EPILOGUE_DISPATCH(e.mode, store_accumulators_staged, e, d, batch, m0 + half * 64 + warp * 16, n0, rows)
            } else {
                const int row = m0 + half * 64 + warp * 16 + lane / 4, col = n0 + 2 * (lane % 4);
                EPILOGUE_DISPATCH(e.mode, store_accumulators, e, d, batch, row, col)
            }
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

template <int MODE>
__device__ __forceinline__ void store_tile(const Epilogue& e, const float (&d0)[64], const float (&d1)[64], int batch,
                                           int row, int col) {
    store_accumulators<MODE>(e, d0, batch, row, col);
    store_accumulators<MODE>(e, d1, batch, row + 64, col);
}

// B's 128 columns n0.. of the k-block at k0 (versions 3, 5, 8): one K-major box, or two N-major 64 x 64 slabs 8 KB apart
template <bool B_KMAJOR>
__device__ __forceinline__ void load_b_kblock_128(uint32_t b, const CUtensorMap* map_b, int k0, int n0, int batch,
                                                  uint32_t bar) {
    if (B_KMAJOR) {
        tma_load(b, map_b, k0, n0, batch, bar);
    } else {
        tma_load(b, map_b, n0, k0, batch, bar);
        tma_load(b + 8192, map_b, n0 + 64, k0, batch, bar);
    }
}

// One 64-deep k-block into a warpgroup's 128 x 128 accumulators (versions 3, 5, 8): rows 0-63 of A at a, rows 64-127
// at a + 8192 (one 64-row slab further, K- or M-major alike), B at b; the first k16 step overwrites unless
// accumulate.
template <bool A_KMAJOR, bool B_KMAJOR, bool FP8 = false>
__device__ __forceinline__ void mma_kblock_128x128(float (&d0)[64], float (&d1)[64], uint32_t a, uint32_t b,
                                                   bool accumulate) {
    #pragma unroll
    for (int k = 0; k < WG_BK / 16; k++) {
        const uint64_t db = smem_descriptor<B_KMAJOR>(b + k * k16_step<B_KMAJOR>());
        const uint64_t da0 = smem_descriptor<A_KMAJOR>(a + k * k16_step<A_KMAJOR>());
        const uint64_t da1 = smem_descriptor<A_KMAJOR>(a + 8192 + k * k16_step<A_KMAJOR>());
        wgmma_kstep<FP8, 128, A_KMAJOR, B_KMAJOR>(d0, da0, db, accumulate || k > 0);
        wgmma_kstep<FP8, 128, A_KMAJOR, B_KMAJOR>(d1, da1, db, accumulate || k > 0);
    }
}

template <int STAGES, bool A_KMAJOR, bool B_KMAJOR, bool STAGED, bool FP8 = false, bool DYNAMIC = false>
__device__ __forceinline__ void gemm_pingpong(const CUtensorMap* map_a, const CUtensorMap* map_b, Epilogue e, int K,
                                              int batches, int splits, int split_kb, unsigned int* counter) {
    constexpr int BK = kblock_values<FP8>();
    constexpr int A_BYTES = WG_BM * WG_BK * 2, B_BYTES = PP_BN * WG_BK * 2, STAGE_BYTES = A_BYTES + B_BYTES;
    extern __shared__ __align__(1024) uint8_t smem_raw[];
    const uint32_t base = (smem_address(smem_raw) + 1023) & ~1023u;  // swizzled tiles start on 1 KB
    const uint32_t staging = base + STAGES * STAGE_BYTES;  // version 5: the warps' epilogue rows
    const uint32_t full = staging + (STAGED ? STAGING_BYTES : 0), empty = full + STAGES * 8, order = empty + STAGES * 8;
    const int tiles_m = (e.M + WG_BM - 1) / WG_BM, tiles_n = (e.N + PP_BN - 1) / PP_BN;
    const int tiles = tiles_m * tiles_n, units = tiles * batches * splits, KT = (K + BK - 1) / BK;
    const int warpgroup = threadIdx.x / 128;
    const WorkUnits<DYNAMIC> work(counter, order + 16, units);  // version 8: claimed units

    if (threadIdx.x == 0) {
        for (int s = 0; s < STAGES; s++) {
            mbarrier_init(full + 8 * s, 1);
            mbarrier_init(empty + 8 * s, 4);  // one arrival per warp of the consumer that used the stage
        }
        mbarrier_init(order, 4);      // order[c]: consumer c may start its next unit (one arrival per warp)
        mbarrier_init(order + 8, 4);
        work.init();
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();

    if (warpgroup == 0) {  // producer: every unit of this CTA, in order, through the one ring
        asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n");
        if (threadIdx.x == 0) {
            int stage = 0, phase = 0;
            for (int unit = blockIdx.x, i = 0;; unit = work.next(unit), i++) {
                work.publish(i, unit);
                if (unit >= units) break;
                int tm, tn;
                tile_coords(unit % tiles, tiles_m, tiles_n, &tm, &tn);
                const int split = (unit / tiles) % splits, batch = unit / tiles / splits;
                const int m0 = tm * WG_BM, n0 = tn * PP_BN, kb0 = split * split_kb;
                const int kblocks = unit_kblocks(split, split_kb, KT);
                for (int kt = 0; kt < kblocks; kt++) {
                    mbarrier_wait(empty + 8 * stage, phase ^ 1);
                    const uint32_t a = base + stage * STAGE_BYTES, b = a + A_BYTES, bar = full + 8 * stage;
                    mbarrier_expect_tx(bar, STAGE_BYTES);
                    const int k0 = (kb0 + kt) * BK;
                    if (A_KMAJOR) {
                        tma_load(a, map_a, k0, m0, batch, bar);
                    } else {
                        tma_load(a, map_a, m0, k0, batch, bar);
                        tma_load(a + 8192, map_a, m0 + 64, k0, batch, bar);
                    }
                    load_b_kblock_128<B_KMAJOR>(b, map_b, k0, n0, batch, bar);
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
        for (int i = 0;; i++) {
            const int unit = work.unit(i, lane);  // both consumers read every unit: its k-blocks move the ring
            if (unit >= units) break;
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
                mma_kblock_128x128<A_KMAJOR, B_KMAJOR, FP8>(d0, d1, a, b, kt > 0);
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
            if (STAGED) {
                float* rows = (float*)(smem_raw + (staging - smem_address(smem_raw))) + (4 * c + warp) * 8 * STAGING_LD;
                EPILOGUE_DISPATCH(e.mode, store_tile_staged, e, d0, d1, out_batch, m0 + warp * 16, n0, rows)
            } else {
                const int row = m0 + warp * 16 + lane / 4, col = n0 + 2 * (lane % 4);
                EPILOGUE_DISPATCH(e.mode, store_tile, e, d0, d1, out_batch, row, col)
            }
        }
    }
}

#endif  // WGMMA_ENABLED

// Each entry point below is guarded by KERNEL_ENTRY(name), so that a build unit may compile one alone
// (llama/runtime/kernel_build.py defines KERNEL_ENTRY on nvcc's command line); by default, every one.
#ifndef KERNEL_ENTRY
#define KERNEL_ENTRY(name) 1
#endif

// The cooperative entry points (gemm_wgmma; the ladder's version 2, dev/cuda/gemm_v2.cu, is this macro without the
// staged epilogue); shared memory STAGES * (128 + BN) * 64 * 2 + 1024 + 16 * STAGES. counter: version 7's tile
// counter (WorkUnits), unused by the others. On anything but sm_90a they compile to nothing and the launcher never
// selects them.
#ifdef WGMMA_ENABLED
#define GEMM_WGMMA_BODY(BN_, STAGES_, A_KMAJOR, B_KMAJOR, STAGED_, DYNAMIC_)                              \
    const Epilogue e = {C, cos, sin, stride_c, ldc, M, N, mode, alpha, rope_T, rope_cols, head_dim};      \
    gemm_wgmma<BN_, STAGES_, A_KMAJOR, B_KMAJOR, STAGED_, false, DYNAMIC_>(maps, maps + 1, e, K, batches, counter);
#else
#define GEMM_WGMMA_BODY(BN_, STAGES_, A_KMAJOR, B_KMAJOR, STAGED_, DYNAMIC_)
#endif
#define GEMM_WGMMA_ENTRY(name, BN_, STAGES_, A_KMAJOR, B_KMAJOR, STAGED_, DYNAMIC_)                           \
    extern "C" __global__ void __launch_bounds__(WG_THREADS, 1) name(                                         \
        const CUtensorMap* maps, void* C, unsigned int* counter,                                              \
        const float* cos, const float* sin, long long stride_c, int M, int N, int K, int batches, int ldc,    \
        int mode, int rope_T, int rope_cols, int head_dim, float alpha) {                                     \
        GEMM_WGMMA_BODY(BN_, STAGES_, A_KMAJOR, B_KMAJOR, STAGED_, DYNAMIC_)                                  \
    }

// Version 6 entry points gemm_wgmma6_<layout>_128x<BN>: version 2 with the staged epilogue (version 2's stage
// counts; the staging rows fit beside them). Shared memory as above + STAGING_BYTES.
#if KERNEL_ENTRY(gemm_wgmma6_nt_128x256)
GEMM_WGMMA_ENTRY(gemm_wgmma6_nt_128x256, 256, 4, true, true, true, false)
#endif
#if KERNEL_ENTRY(gemm_wgmma6_nn_128x256)
GEMM_WGMMA_ENTRY(gemm_wgmma6_nn_128x256, 256, 4, true, false, true, false)
#endif
#if KERNEL_ENTRY(gemm_wgmma6_tn_128x256)
GEMM_WGMMA_ENTRY(gemm_wgmma6_tn_128x256, 256, 4, false, false, true, false)
#endif
#if KERNEL_ENTRY(gemm_wgmma6_nt_128x128)
GEMM_WGMMA_ENTRY(gemm_wgmma6_nt_128x128, 128, 6, true, true, true, false)
#endif
#if KERNEL_ENTRY(gemm_wgmma6_nn_128x128)
GEMM_WGMMA_ENTRY(gemm_wgmma6_nn_128x128, 128, 6, true, false, true, false)
#endif
#if KERNEL_ENTRY(gemm_wgmma6_tn_128x128)
GEMM_WGMMA_ENTRY(gemm_wgmma6_tn_128x128, 128, 6, false, false, true, false)
#endif

// Version 7 entry points gemm_wgmma7_<layout>_128x<BN>: version 6 with dynamic tile claiming (WorkUnits; counter:
// one zeroed uint32, left at zero). Shared memory as version 6's + UNIT_RING_BYTES.
#if KERNEL_ENTRY(gemm_wgmma7_nt_128x256)
GEMM_WGMMA_ENTRY(gemm_wgmma7_nt_128x256, 256, 4, true, true, true, true)
#endif
#if KERNEL_ENTRY(gemm_wgmma7_nn_128x256)
GEMM_WGMMA_ENTRY(gemm_wgmma7_nn_128x256, 256, 4, true, false, true, true)
#endif
#if KERNEL_ENTRY(gemm_wgmma7_tn_128x256)
GEMM_WGMMA_ENTRY(gemm_wgmma7_tn_128x256, 256, 4, false, false, true, true)
#endif
#if KERNEL_ENTRY(gemm_wgmma7_nt_128x128)
GEMM_WGMMA_ENTRY(gemm_wgmma7_nt_128x128, 128, 6, true, true, true, true)
#endif
#if KERNEL_ENTRY(gemm_wgmma7_nn_128x128)
GEMM_WGMMA_ENTRY(gemm_wgmma7_nn_128x128, 128, 6, true, false, true, true)
#endif
#if KERNEL_ENTRY(gemm_wgmma7_tn_128x128)
GEMM_WGMMA_ENTRY(gemm_wgmma7_tn_128x128, 128, 6, false, false, true, true)
#endif

// Ping-pong entry points (128 x 128 tiles, ping-pong consumers, split-K in the kernel; splits = 1: plain batches):
// version 5 gemm_wgmma5_<layout>, version 3 (dev/cuda/gemm_v3.cu) with the staged epilogue and one stage fewer for
// its rows, shared memory PP5_STAGES * 32 KB + STAGING_BYTES + 1024 + 16 * PP5_STAGES + 16; version 8
// gemm_wgmma8_<layout>, version 5 with dynamic claiming of its work units (split-K ones too: each writes its own
// partials), shared memory version 5's + UNIT_RING_BYTES. counter as the cooperative entries'.
#define PP5_STAGES 6
#ifdef WGMMA_ENABLED
#define GEMM_PINGPONG_BODY(STAGES_, A_KMAJOR, B_KMAJOR, STAGED_, DYNAMIC_)                                \
    const Epilogue e = {C, cos, sin, stride_c, ldc, M, N, mode, alpha, rope_T, rope_cols, head_dim};      \
    gemm_pingpong<STAGES_, A_KMAJOR, B_KMAJOR, STAGED_, false, DYNAMIC_>(maps, maps + 1, e, K, batches, splits, \
                                                                          split_kb, counter);
#else
#define GEMM_PINGPONG_BODY(STAGES_, A_KMAJOR, B_KMAJOR, STAGED_, DYNAMIC_)
#endif
#define GEMM_PINGPONG_ENTRY(name, STAGES_, A_KMAJOR, B_KMAJOR, STAGED_, DYNAMIC_)                              \
    extern "C" __global__ void __launch_bounds__(WG_THREADS, 1) name(                                         \
        const CUtensorMap* maps, void* C, unsigned int* counter, const float* cos, const float* sin,          \
        long long stride_c, int M, int N, int K, int batches, int splits, int split_kb, int ldc, int mode,    \
        int rope_T, int rope_cols, int head_dim, float alpha) {                                               \
        GEMM_PINGPONG_BODY(STAGES_, A_KMAJOR, B_KMAJOR, STAGED_, DYNAMIC_)                                    \
    }

#if KERNEL_ENTRY(gemm_wgmma5_nt)
GEMM_PINGPONG_ENTRY(gemm_wgmma5_nt, PP5_STAGES, true, true, true, false)
#endif
#if KERNEL_ENTRY(gemm_wgmma5_nn)
GEMM_PINGPONG_ENTRY(gemm_wgmma5_nn, PP5_STAGES, true, false, true, false)
#endif
#if KERNEL_ENTRY(gemm_wgmma5_tn)
GEMM_PINGPONG_ENTRY(gemm_wgmma5_tn, PP5_STAGES, false, false, true, false)
#endif
#if KERNEL_ENTRY(gemm_wgmma8_nt)
GEMM_PINGPONG_ENTRY(gemm_wgmma8_nt, PP5_STAGES, true, true, true, true)
#endif
#if KERNEL_ENTRY(gemm_wgmma8_nn)
GEMM_PINGPONG_ENTRY(gemm_wgmma8_nn, PP5_STAGES, true, false, true, true)
#endif
#if KERNEL_ENTRY(gemm_wgmma8_tn)
GEMM_PINGPONG_ENTRY(gemm_wgmma8_tn, PP5_STAGES, false, false, true, true)
#endif

// FP8 entry points gemm_wgmma6_fp8_128x<BN> (both operands K-major, the nt layout only; row_scales (M,) and
// col_scales (N,) fp32): version 6's kernel, the same stages and shared memory. (Version 5's, the FP8 rung the plan
// does not pick: dev/cuda/gemm_fp8_v5.cu.)
#ifdef WGMMA_ENABLED
#define FP8_EPILOGUE                                                                                      \
    Epilogue e = {C, cos, sin, stride_c, ldc, M, N, mode, alpha, rope_T, rope_cols, head_dim};            \
    e.row_scales = row_scales;                                                                            \
    e.col_scales = col_scales;
#define GEMM_WGMMA6_FP8_BODY(BN_, STAGES_)                                                                \
    FP8_EPILOGUE gemm_wgmma<BN_, STAGES_, true, true, true, true>(maps, maps + 1, e, K, batches, nullptr);
#else
#define GEMM_WGMMA6_FP8_BODY(BN_, STAGES_)
#endif
#define GEMM_WGMMA6_FP8_ENTRY(name, BN_, STAGES_)                                                             \
    extern "C" __global__ void __launch_bounds__(WG_THREADS, 1) name(                                         \
        const CUtensorMap* maps, void* C, const float* row_scales, const float* col_scales, const float* cos,  \
        const float* sin, long long stride_c, int M, int N, int K, int batches, int ldc, int mode, int rope_T,   \
        int rope_cols, int head_dim, float alpha) {                                                           \
        GEMM_WGMMA6_FP8_BODY(BN_, STAGES_)                                                                    \
    }
#if KERNEL_ENTRY(gemm_wgmma6_fp8_128x256)
GEMM_WGMMA6_FP8_ENTRY(gemm_wgmma6_fp8_128x256, 256, 4)
#endif
#if KERNEL_ENTRY(gemm_wgmma6_fp8_128x128)
GEMM_WGMMA6_FP8_ENTRY(gemm_wgmma6_fp8_128x128, 128, 6)
#endif

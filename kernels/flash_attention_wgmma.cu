// Flash attention in bf16 on Hopper (sm_90a): wgmma fed by TMA, warp-specialized. The build llama/run/plan.py runs on
// H100/H200 (flash_attention.cu, v2 on mma.sync, everywhere else): ladder version 6's forward at D = 64 (persistent
// CTAs, the consumers in ping-pong), version 3's forward at D = 128 and version 3's backward at both (dev/cuda/
// flash_attention_v3.cu to v6.cu include this file and pick their forward through its two hooks, below; v4 adds the
// entry points of the fused-dQ backward, whose switch is the dK/dV kernel's DqMode). Same
// contract and layouts (flash_attention.cuh); each entry point takes, first, a pointer to the TMA maps that
// llama/ops/flash_attention.py encodes: qkv, then dout (backward), each (inner = columns, T, B) in boxes of 64
// columns x 64 rows, 128-byte swizzled; rows past T arrive as zeros.
//
// Every kernel: a CTA of 3 warpgroups. Warpgroup 0 produces: one thread issues the TMA loads into shared memory,
// completing on mbarriers. Warpgroups 1 and 2 consume, each owning 64 rows of the CTA's tile, with wgmma.m64nNk16:
// S-like products read both operands from shared memory (K-major); the products by P or dS take those from
// registers (the accumulator layout, packed to bf16) and read the other operand MN-major. setmaxnreg moves
// registers from the producer to the consumers, out of the 168 per thread of a 384-thread CTA: 24 -> 240, or
// 40 -> 232 in dK/dV (whose producer also copies lse and delta; at 24 it spills). A tile of R rows x D columns
// sits in shared memory as D/64 slabs of R rows x 128 bytes (slab s at s * R * 128 B).
//
// flash_attention_forward_d{64,128}: work items (query head, batch, 128-row query tile), heaviest first: a CTA each
//   (D = 128), or a CTA per SM looping over them (D = 64, Q double-buffered). 128-row K and V tiles through a
//   2-stage ring with separate barriers. Per kv tile: S = Q K^T, the causal mask on the diagonal tile, online
//   softmax in fp32 (exp2, log2(e)-prescaled), O += P V. Within a warpgroup the next tile's S is issued with this
//   tile's P V, and the next tile's softmax runs under P V; at D = 64 the two consumers also take turns issuing
//   (one's softmax under the other's GEMMs). Every schedule computes the same bits.
// flash_attention_backward_dkdv_d{64,128}: CTA per (kv head, batch, 128-row kv tile); K, V once; 64-row Q and
//   dO tiles of every query head of the group, from the diagonal on, through a ring, with their lse and delta
//   (and doc_start, masked; copied in by the producer's second warp). S^T = K Q^T and dP^T = V dO^T, P^T = exp(S^T - lse) (zero
//   where query < key), dV += P^T dO, dS^T = P^T (dP^T - delta), dK += dS^T Q. dK, dV sum in registers
//   over the group: deterministic. The next step's S^T and dP^T are issued while this step's dK and dV run.
// flash_attention_backward_dq_d{64,128}: CTA per (query head, batch, 128-row query tile), heaviest first; Q and
//   dO once; K, V tiles of 128 (D = 64) or 64 (D = 128) rows through a ring: S = Q K^T, dP = dO V^T,
//   P = exp(S - lse), dS = P (dP - delta), dQ += dS K. Deterministic (no atomics).
// P and dS enter their products as bf16 (the precision wgmma reads); both backward kernels form dS from the
// bf16 P, as the v2 kernels do.
//
// Document mask (optional, the entry points' last two arguments; both null: plain causal): doc_start, doc_end
// (B, T) int32, the first position of t's document and one past its last; query q sees key k iff
// doc_start[q] <= k <= q. Each kernel body is built twice, masked and plain, and the entry point picks one from
// the pointer. Tiles wholly outside the documents are skipped, never loaded: the forward and dQ kernels start
// their kv loop (the producer's loads and the consumers' steps alike) at the tile holding doc_start of the query
// tile's first row (the smallest start); the dK/dV kernels stop their query loop after the tile holding
// doc_end[last key of the kv tile] - 1 (every kv tile keeps its diagonal queries). In a tile whose first key lies
// before the document start of a warpgroup's last row (dK/dV: before the largest start of the query tile, copied
// into the ring with lse and delta), keys before each row's start are masked like those after the diagonal. A
// forward row may see no key of its first tiles: its running max stays -inf and its P and rescale are 0 there.
#define FLASH_DELTA_ENTRY_GUARDED  // defined below, under its guard
#include "flash_attention.cuh"
#include "wgmma.cuh"

namespace fa3 {
constexpr int THREADS = 384;
constexpr int FWD_ROWS = 128, FWD_KV_ROWS = 128, FWD_STAGES = 2;
constexpr int DKDV_KV_ROWS = 128, DKDV_Q_ROWS = 64;
constexpr int DQ_ROWS = 128, DQ_STAGES = 2;
template <int D>  // the dkdv ring: as deep as shared memory allows
__host__ __device__ constexpr int dkdv_stages() { return D == 64 ? 4 : 2; }
template <int D>
__host__ __device__ constexpr int dq_kv_rows() { return D == 64 ? 128 : 64; }
template <int D>
__host__ __device__ constexpr int tile_bytes(int rows) { return rows * D * 2; }
// Q per Q buffer; K and V per stage; barriers (q_full per Q buffer, k_full, k_empty, v_full, v_empty, and where a
// CTA takes several work items q_empty per Q buffer)
template <int D, typename Work>
__host__ __device__ constexpr int forward_shared() {
    return 1024 + tile_bytes<D>(Work::Q_BUFFERS * FWD_ROWS + 2 * FWD_STAGES * FWD_KV_ROWS) +
           8 * (Work::Q_BUFFERS * (Work::PERSISTENT ? 2 : 1) + 4 * FWD_STAGES);
}
// a dkdv stage: Q, dO, then lse, delta and (masked) doc_start of its 64 rows, padded to 1 KB
template <int D>
__host__ __device__ constexpr int dkdv_stage_bytes() { return 2 * tile_bytes<D>(DKDV_Q_ROWS) + 1024; }
static_assert(3 * DKDV_Q_ROWS * 4 <= 1024, "a dkdv stage's lse, delta and doc_start fit its 1 KB");
// the fused backward's dQ: dS^T tiles (128 kv rows x 64 queries, bf16, two buffers) and the fp32 partial dQ of a
// query tile staged for its bulk reduce-add (two buffers at D = 64, one at D = 128, where shared memory ends)
constexpr int DS_BYTES = DKDV_KV_ROWS * DKDV_Q_ROWS * 2;
template <int D>
__host__ __device__ constexpr int dq_tile_bytes() { return DKDV_Q_ROWS * D * 4; }
template <int D>
__host__ __device__ constexpr int dq_buffers() { return D == 64 ? 2 : 1; }
template <int D, bool FUSED>
__host__ __device__ constexpr int dq_bytes() { return FUSED ? 2 * DS_BYTES + dq_buffers<D>() * dq_tile_bytes<D>() : 0; }
// K, V; the stages; with FUSED the dS^T and dQ buffers; barriers (kv_full, full, empty, with FUSED dq_full, dq_empty)
template <int D, bool FUSED>
__host__ __device__ constexpr int dkdv_shared() {
    return 1024 + 2 * tile_bytes<D>(DKDV_KV_ROWS) + dkdv_stages<D>() * dkdv_stage_bytes<D>() + dq_bytes<D, FUSED>() +
           8 * (1 + 2 * dkdv_stages<D>() + (FUSED ? 2 * dq_buffers<D>() : 0));
}
template <int D>  // Q, dO; K and V per stage; barriers (qo_full, full, empty)
__host__ __device__ constexpr int dq_shared() {
    return 1024 + 2 * tile_bytes<D>(DQ_ROWS) + 2 * DQ_STAGES * tile_bytes<D>(dq_kv_rows<D>()) + 8 * (1 + 2 * DQ_STAGES);
}
}  // namespace fa3

// Which work items, (query tile, head, batch), a forward CTA takes, in what order, and how many Q buffers it rotates
// through. What the forward asks of one: Q_BUFFERS; PERSISTENT (a CTA may take several items: it releases each Q
// buffer and its producer waits for that); h, b, q0 of the current item and count, the CTA's items before it;
// last(), whether the current item is the CTA's last; next(), to the next item, false if there is none. Both are
// constructed from (T, H, B).
//
// One item per CTA, its block's: the grid is (H, B, query tiles), launched heaviest first (the last query tiles,
// with the most kv tiles). Ladder v3 to v5.
struct OneItemPerCta {
    static constexpr int Q_BUFFERS = 1;
    static constexpr bool PERSISTENT = false;
    int h, b, q0, count;
    __device__ OneItemPerCta(int, int, int)
        : h(blockIdx.x), b(blockIdx.y), q0((gridDim.z - 1 - blockIdx.z) * fa3::FWD_ROWS), count(0) {}
    __device__ bool last() const { return true; }
    __device__ bool next() { return false; }
};

// Persistent (ladder v6): the grid is G = gridDim.x CTAs (one per SM, at most one per item), CTA i taking items i,
// i + G, i + 2G, ... of a (B, T, H) problem in v3's launch order: heaviest first, head fastest, then batch. The
// static stride keeps it deterministic; each row's operations are v3's in v3's order. Q is double-buffered so that
// the next item's Q and first K, V tiles load under this item's last P V and epilogue.
template <int ROWS>
struct PersistentItems {
    static constexpr int Q_BUFFERS = 2;
    static constexpr bool PERSISTENT = true;
    int H, heads_batches, items, item, h, b, q0, count;
    __device__ PersistentItems(int T, int H, int B)
        : H(H), heads_batches(H * B), items(H * B * ((T + ROWS - 1) / ROWS)), item(blockIdx.x), count(0) {
        locate();
    }
    __device__ bool last() const { return item + (int)gridDim.x >= items; }
    __device__ bool next() {
        item += gridDim.x;
        count++;
        if (item >= items) return false;
        locate();
        return true;
    }
    // item k: head k % H, batch k / H % B, the query tile (items / (H B) - 1 - k / (H B)), heaviest first
    __device__ void locate() {
        h = item % H;
        b = item / H % (heads_batches / H);
        q0 = (items / heads_batches - 1 - item / heads_batches) * ROWS;
    }
};

template <bool C, typename A, typename B>
struct Choose { using type = A; };
template <typename A, typename B>
struct Choose<false, A, B> { using type = B; };

// The forward's work items at head dim D: persistent at D = 64, where it is measured 1.09-1.17x faster (the prologue
// and epilogue of 31 waves hidden); one per CTA at D = 128, where the persistent build measured 0.79x (dev/cuda/
// README.md). A ladder rung defines FLASH_FORWARD_WORK(D) (and FLASH_FORWARD_SCHEDULE(D), below) before including
// this file.
#ifndef FLASH_FORWARD_WORK
#define FLASH_FORWARD_WORK(D) typename Choose<D == 64, PersistentItems<fa3::FWD_ROWS>, OneItemPerCta>::type
#endif
template <int D>
using ForwardWork = FLASH_FORWARD_WORK(D);

// launch configuration, read by the host as flash_attention.cu's: per head dim (64, 128), for the forward, dkdv and
// dq kernels in turn: threads per CTA, rows per CTA (query, kv, query), shared bytes; then whether the forward is
// persistent (its grid a CTA per SM)
__constant__ int flash_attention_config[2][10] = {
    {fa3::THREADS, fa3::FWD_ROWS, fa3::forward_shared<64, ForwardWork<64>>(), fa3::THREADS, fa3::DKDV_KV_ROWS,
     fa3::dkdv_shared<64, false>(), fa3::THREADS, fa3::DQ_ROWS, fa3::dq_shared<64>(), ForwardWork<64>::PERSISTENT},
    {fa3::THREADS, fa3::FWD_ROWS, fa3::forward_shared<128, ForwardWork<128>>(), fa3::THREADS, fa3::DKDV_KV_ROWS,
     fa3::dkdv_shared<128, false>(), fa3::THREADS, fa3::DQ_ROWS, fa3::dq_shared<128>(), ForwardWork<128>::PERSISTENT},
};

#ifdef WGMMA_ENABLED

namespace fa3 {
constexpr int CONSUMER_ROWS = 64;  // rows of a tile per consumer warpgroup (wgmma's m64)
constexpr int LAUNCH_REGISTERS = 65536 / THREADS / 8 * 8;  // a thread's at launch (__launch_bounds__(THREADS, 1))
}

// rows [row0, row0 + ROWS) x columns [col0, col0 + D) of batch b of a map -> the tile at dst, in 64 x 64 boxes
template <int ROWS, int D>
__device__ __forceinline__ void load_tile(uint32_t dst, const CUtensorMap* map, int col0, int row0, int b,
                                          uint32_t bar) {
    #pragma unroll
    for (int s = 0; s < D / 64; s++)
        #pragma unroll
        for (int r = 0; r < ROWS; r += 64) tma_load(dst + s * ROWS * 128 + r * 128, map, col0 + 64 * s, row0 + r, b, bar);
}

// descriptor of rows [row, row + 64 or N) of a ROWS-row tile read K-major (K = the D columns), at k-step kk
template <int ROWS>
__device__ __forceinline__ uint64_t k_major(uint32_t tile, int row, int kk) {
    return matrix_descriptor(tile + (kk / 4) * ROWS * 128 + row * 128 + (kk % 4) * 32, 16);
}

// descriptor of a ROWS-row tile read MN-major as a B operand (K = its rows, N = the D columns), at k-step kk
template <int ROWS>
__device__ __forceinline__ uint64_t mn_major(uint32_t tile, int kk) {
    return matrix_descriptor(tile + kk * 16 * 128, ROWS * 128);
}

// accumulator tiles 2kk and 2kk + 1 of d, packed to bf16: the A operand of k-step kk
template <int R>
__device__ __forceinline__ void pack_a(uint32_t (&a)[R / 8][4], const float (&d)[R]) {
    #pragma unroll
    for (int kk = 0; kk < R / 8; kk++)
        #pragma unroll
        for (int i = 0; i < 4; i++) a[kk][i] = pack_bf16(d[8 * kk + 2 * i], d[8 * kk + 2 * i + 1]);
}

__device__ __forceinline__ void barriers_ready() {
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}

// the document starts (starts: doc_start's row of the batch) of a consumer thread's rows row and row + 8, and of its
// warpgroup's last row, first_row + 63: the largest of the warpgroup's; rows past T read row T - 1's
__device__ __forceinline__ void load_starts(int (&start)[2], int& last_start, const int* starts, int row, int first_row,
                                            int T) {
    start[0] = starts[min(row, T - 1)];
    start[1] = starts[min(row + 8, T - 1)];
    last_start = starts[min(first_row + fa3::CONSUMER_ROWS - 1, T - 1)];
}

// ---- forward

// How the forward's warpgroups share an SM: the registers setmaxnreg gives the producer and each consumer (out of
// the 168 x 384 of a CTA), and the order in which the two consumers issue their GEMMs. Consumer c calls take(first)
// before issuing a turn's GEMMs (S_0; then S_{j+1} with P_j V_j) and pass(last) after; both consumers of a CTA take
// the same number of turns.
//
// Independent (ladder v3, v4): each consumer issues once its operands are in.
struct IndependentConsumers {
    static constexpr int PRODUCER_REGISTERS = 24, CONSUMER_REGISTERS = 240;
    __device__ explicit IndependentConsumers(int) {}
    __device__ void take(bool) const {}
    __device__ void pass(bool) const {}
};

// Ping-pong (ladder v5, v6; FA3's inter-warpgroup schedule): consumer c's turn is named barrier TURN_BARRIER + c.
// Consumer 0 takes the first turn; then each waits for the other's pass, so that one consumer's softmax runs while
// the other's GEMMs hold the tensor cores. Consumer 1 does not pass its last turn (no turn follows it), so that no
// arrival is left when the CTA exits. The consumer index is broadcast from lane 0 so that ptxas knows it is
// warp-uniform (uniform predicates, and the ids immediates: no general register held, where D = 128 has none to
// spare). Producer 40 registers: at 24 its TMA loop spills at D = 128.
namespace fa3 {
// named barriers 2 (consumer 0's turn) and 3 (consumer 1's); 0 is __syncthreads and 1 the fused backward's dS^T
constexpr int TURN_BARRIER = 2, CONSUMER_THREADS = 256;
}  // namespace fa3
struct PingPongConsumers {
    static constexpr int PRODUCER_REGISTERS = 40, CONSUMER_REGISTERS = 232;
    int consumer;
    __device__ explicit PingPongConsumers(int c) : consumer(__shfl_sync(0xffffffffu, c, 0)) {}
    __device__ void take(bool first) const {
        if (consumer == 0 && !first) named_barrier_sync(fa3::TURN_BARRIER, fa3::CONSUMER_THREADS);
        if (consumer == 1) named_barrier_sync(fa3::TURN_BARRIER + 1, fa3::CONSUMER_THREADS);
    }
    __device__ void pass(bool last) const {
        if (consumer == 0) named_barrier_arrive(fa3::TURN_BARRIER + 1, fa3::CONSUMER_THREADS);
        if (consumer == 1 && !last) named_barrier_arrive(fa3::TURN_BARRIER, fa3::CONSUMER_THREADS);
    }
};

// The schedule at head dim D: ping-pong with the persistent work at D = 64; independent at D = 128 (v3's forward).
#ifndef FLASH_FORWARD_SCHEDULE
#define FLASH_FORWARD_SCHEDULE(D) typename Choose<D == 64, PingPongConsumers, IndependentConsumers>::type
#endif
template <int D>
using ForwardSchedule = FLASH_FORWARD_SCHEDULE(D);

// The forward: per work item (ForwardWork<D>), the producer loads Q into the item's Q buffer and the kv tiles
// through the rings; the consumers run the item's tiles and store its rows. The rings' positions and every barrier's
// phase run on across a CTA's items (counted in kv tiles and items): nothing is initialized twice.
template <int D, bool MASKED>
__device__ __forceinline__ void flash_forward_wgmma(const CUtensorMap* map, bf16* out, float* lse, int T, int H, int KV,
                                                    const int* doc_start, ForwardWork<D> work) {
    using namespace fa3;
    using Schedule = ForwardSchedule<D>;
    using Work = ForwardWork<D>;
    static_assert((Schedule::PRODUCER_REGISTERS + 2 * Schedule::CONSUMER_REGISTERS) * 128 <= LAUNCH_REGISTERS * THREADS,
                  "setmaxnreg.inc would wait for registers that the producer's .dec never frees: the CTA would hang");
    static_assert(forward_shared<D, Work>() <= 227 * 1024, "more shared memory than an sm_90 CTA may have");
    constexpr int BR = FWD_ROWS, BC = FWD_KV_ROWS, STAGES = FWD_STAGES, TILE = tile_bytes<D>(BC);
    constexpr int QB = Work::Q_BUFFERS, Q_TILE = tile_bytes<D>(BR);
    extern __shared__ __align__(1024) uint8_t smem_raw[];
    const uint32_t sQ = (smem_address(smem_raw) + 1023) & ~1023u, sK = sQ + QB * Q_TILE, sV = sK + STAGES * TILE;
    const uint32_t q_full = sV + STAGES * TILE, k_full = q_full + 8 * QB, k_empty = k_full + 8 * STAGES,
                   v_full = k_empty + 8 * STAGES, v_empty = v_full + 8 * STAGES, q_empty = v_empty + 8 * STAGES;
    const int warpgroup = threadIdx.x / 128;
    // the current item's kv head and kv tiles, first_tile .. the diagonal's: with a mask, from the one holding the
    // document start of the item's first row
    int kv_head, first_tile, n_tiles;
    auto locate_item = [&] {
        kv_head = work.h / (H / KV);
        first_tile = MASKED ? doc_start[(long long)work.b * T + work.q0] / BC : 0;
        n_tiles = (min(work.q0 + BR, T) + BC - 1) / BC - first_tile;
    };
    auto next_item = [&] {  // to the CTA's next item, if any
        if (!work.next()) return false;
        locate_item();
        return true;
    };
    locate_item();

    if (threadIdx.x == 0) {
        for (int q = 0; q < QB; q++) {
            mbarrier_init(q_full + 8 * q, 1);
            if constexpr (Work::PERSISTENT) mbarrier_init(q_empty + 8 * q, 8);  // one arrival per consumer warp
        }
        for (int s = 0; s < STAGES; s++) {
            mbarrier_init(k_full + 8 * s, 1);
            mbarrier_init(k_empty + 8 * s, 8);  // one arrival per consumer warp
            mbarrier_init(v_full + 8 * s, 1);
            mbarrier_init(v_empty + 8 * s, 8);
        }
        barriers_ready();
    }
    __syncthreads();

    if (warpgroup == 0) {
        asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(Schedule::PRODUCER_REGISTERS));
        if (threadIdx.x == 0) {
            int loaded = 0;  // kv tiles loaded for the CTA's earlier items: where the rings stand
            do {
                const int qb = work.count % QB;
                if constexpr (Work::PERSISTENT) mbarrier_wait(q_empty + 8 * qb, ((work.count / QB) & 1) ^ 1);
                mbarrier_expect_tx(q_full + 8 * qb, Q_TILE);
                load_tile<BR, D>(sQ + qb * Q_TILE, map, work.h * D, work.q0, work.b, q_full + 8 * qb);
                for (int j = 0; j < n_tiles; j++) {
                    const int s = (loaded + j) % STAGES, phase = ((loaded + j) / STAGES) & 1;
                    mbarrier_wait(k_empty + 8 * s, phase ^ 1);
                    mbarrier_expect_tx(k_full + 8 * s, TILE);
                    load_tile<BC, D>(sK + s * TILE, map, (H + kv_head) * D, (first_tile + j) * BC, work.b,
                                     k_full + 8 * s);
                    mbarrier_wait(v_empty + 8 * s, phase ^ 1);
                    mbarrier_expect_tx(v_full + 8 * s, TILE);
                    load_tile<BC, D>(sV + s * TILE, map, (H + KV + kv_head) * D, (first_tile + j) * BC, work.b,
                                     v_full + 8 * s);
                }
                loaded += n_tiles;
            } while (next_item());
        }
        return;
    }

    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(Schedule::CONSUMER_REGISTERS));
    const int c = warpgroup - 1, warp = threadIdx.x % 128 / 32, lane = threadIdx.x % 32;
    const float scale_log2 = LOG2E / sqrtf((float)D);
    const Schedule turns(c);
    int consumed = 0;  // kv tiles of the CTA's earlier items: where the rings stand
    do {
        const int first_row = work.q0 + CONSUMER_ROWS * c, row = first_row + 16 * warp + lane / 4;  // and row + 8
        const int qb = work.count % QB;
        const uint32_t sQ_item = sQ + qb * Q_TILE;
        // the CTA's first turn (consumer 0 takes it without waiting) and its last (consumer 1 does not pass it)
        const bool first_item = work.count == 0, last_item = work.last();
        int start[2], last_start;  // MASKED: the document starts of this thread's rows and of the warpgroup's last row
        if constexpr (MASKED) load_starts(start, last_start, doc_start + (long long)work.b * T, row, first_row, T);
        float o[D / 2], s[BC / 2], row_max[2] = {-INFINITY, -INFINITY}, row_sum[2] = {0.0f, 0.0f}, alpha[2];
        uint32_t p[BC / 16][4];
        #pragma unroll
        for (int i = 0; i < D / 2; i++) o[i] = 0.0f;
        accumulator_fence(o);  // the zeros are set before any wgmma is in flight (else ptxas serializes them)
        // kv tile j of the item in the rings: its stage and the parity of its barriers' phase
        auto stage = [&](int j) { return (consumed + j) % STAGES; };
        auto parity = [&](int j) { return ((consumed + j) / STAGES) & 1; };

        auto issue_s = [&](int j) {  // S = Q K_j^T (this warpgroup's 64 rows), in its turn
            mbarrier_wait(k_full + 8 * stage(j), parity(j));
            turns.take(first_item && j == 0);
            wgmma_fence();
            #pragma unroll
            for (int kk = 0; kk < D / 16; kk++)
                wgmma_ss<BC, 0, 0>(s, k_major<BR>(sQ_item, CONSUMER_ROWS * c, kk),
                                   k_major<BC>(sK + stage(j) * TILE, 0, kk), kk > 0);
            wgmma_commit();
        };
        // tile j's scores (complete in s): release K_j (and after the item's last S its Q buffer), mask, and the
        // online softmax in place (s becomes P); alpha rescales what O holds
        auto softmax = [&](int j) {
            accumulator_fence(s);
            if (lane == 0) mbarrier_arrive(k_empty + 8 * stage(j));
            if constexpr (Work::PERSISTENT)
                if (lane == 0 && j + 1 == n_tiles) mbarrier_arrive(q_empty + 8 * qb);
            const int kv0 = (first_tile + j) * BC;
            if (kv0 + BC - 1 > first_row) {  // the tile crosses the diagonal: keys after the query masked
                #pragma unroll
                for (int i = 0; i < BC / 2; i++)
                    if (kv0 + 8 * (i / 4) + 2 * (lane % 4) + (i & 1) > row + 8 * ((i >> 1) & 1)) s[i] = -INFINITY;
            }
            if (MASKED && kv0 < last_start) {  // the tile starts before a row's document: keys before it masked
                #pragma unroll
                for (int i = 0; i < BC / 2; i++)
                    if (kv0 + 8 * (i / 4) + 2 * (lane % 4) + (i & 1) < start[(i >> 1) & 1]) s[i] = -INFINITY;
            }
            #pragma unroll
            for (int half = 0; half < 2; half++) {
                float m = row_max[half];
                #pragma unroll
                for (int n = 0; n < BC / 8; n++) m = fmaxf(m, fmaxf(s[4 * n + 2 * half], s[4 * n + 2 * half + 1]));
                m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 1));
                m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 2));
                // Unmasked, every row sees key 0 in tile 0 and its max is finite from then on. Masked, a row may see
                // no key of its first tiles: its max stays -inf, and exp2 of -inf - 0 makes its P and alpha 0
                const float m_finite = MASKED && m == -INFINITY ? 0.0f : m;
                alpha[half] = exp2f((row_max[half] - m_finite) * scale_log2);
                row_max[half] = m;
                const float m_scaled = m_finite * scale_log2;
                float sum = 0.0f;
                #pragma unroll
                for (int n = 0; n < BC / 8; n++)
                    #pragma unroll
                    for (int e = 2 * half; e < 2 * half + 2; e++) {
                        s[4 * n + e] = exp2f(fmaf(s[4 * n + e], scale_log2, -m_scaled));
                        sum += s[4 * n + e];
                    }
                row_sum[half] = row_sum[half] * alpha[half] + sum;  // this lane's columns only
            }
        };

        // Per tile j: issue S_{j+1}, rescale O, issue O += P_j V_j; tile j + 1's softmax then runs while P_j V_j does
        mbarrier_wait(q_full + 8 * qb, (work.count / QB) & 1);
        issue_s(0);
        turns.pass(last_item && n_tiles == 1);
        wgmma_wait<0>();
        softmax(0);
        pack_a<BC / 2>(p, s);
        auto issue_pv = [&](int j) {  // O = O * alpha + P_j V_j
            #pragma unroll
            for (int i = 0; i < D / 2; i++) o[i] *= alpha[(i >> 1) & 1];
            mbarrier_wait(v_full + 8 * stage(j), parity(j));
            wgmma_fence();
            #pragma unroll
            for (int kk = 0; kk < BC / 16; kk++) wgmma_rs<D, 1>(o, p[kk], mn_major<BC>(sV + stage(j) * TILE, kk), 1);
            wgmma_commit();
        };
        auto finish_pv = [&](int j) {  // P_j V_j done: O and p are free again, and V_j
            wgmma_wait<0>();
            accumulator_fence(o);
            if (lane == 0) mbarrier_arrive(v_empty + 8 * stage(j));
        };
        // (each branch holds its own waits: ptxas serializes the wgmmas when it cannot pair a wait with its groups)
        for (int j = 0; j + 1 < n_tiles; j++) {
            issue_s(j + 1);
            issue_pv(j);
            turns.pass(last_item && j + 2 == n_tiles);
            wgmma_wait<1>();  // S_{j+1}
            softmax(j + 1);
            finish_pv(j);
            pack_a<BC / 2>(p, s);
        }
        issue_pv(n_tiles - 1);
        finish_pv(n_tiles - 1);

        float inv[2], row_lse[2];
        #pragma unroll
        for (int half = 0; half < 2; half++) {
            float sum = row_sum[half];
            sum += __shfl_xor_sync(0xffffffffu, sum, 1);
            sum += __shfl_xor_sync(0xffffffffu, sum, 2);
            inv[half] = 1.0f / sum;
            row_lse[half] = (row_max[half] * scale_log2 + log2f(sum)) * LN2;
        }
        #pragma unroll
        for (int i = 0; i < D / 2; i++) o[i] *= inv[(i >> 1) & 1];
        store_rows<D>(out + (long long)work.b * T * H * D + work.h * D, (long long)H * D,
                      reinterpret_cast<const float(*)[4]>(o), 1.0f, first_row + 16 * warp, T, nullptr, nullptr, lane);
        if (lane % 4 == 0) {
            #pragma unroll
            for (int half = 0; half < 2; half++)
                if (row + 8 * half < T) lse[((long long)work.b * H + work.h) * T + row + 8 * half] = row_lse[half];
        }
        consumed += n_tiles;
    } while (next_item());
}

// ---- backward: dK, dV (and, fused, dQ)

// How the dK/dV kernel treats dQ: SEPARATE (the entry points below) leaves it to the dQ kernel; ORDERED and UNORDERED
// (the ladder's v4, dev/cuda/flash_attention_v4.cu) also form each step's dQ partial (dS K) and add it into an fp32
// buffer, ORDERED in a fixed order of kv tiles (deterministic), UNORDERED as the CTAs come (opt-in, for measuring
// what the order costs).
enum class DqMode { SEPARATE, ORDERED, UNORDERED };

namespace fa3 {
// the fused dQ buffer: per (batch, query head, 64-row query tile) one tile of 64 x D floats, stored as the two
// consumer warpgroups' m64n(D/2) accumulators, warpgroup c's columns [c D/2, (c + 1) D/2): float4 i4 of thread t
// (its registers 4 i4 .. 4 i4 + 3) at 4 (i4 * 128 + t) in warpgroup c's half (conflict-free stores, coalesced loads)
template <int D>
__device__ __forceinline__ int dq_offset(int c, int i4, int t) { return c * (DKDV_Q_ROWS * D / 2) + 4 * (i4 * 128 + t); }

__device__ __forceinline__ void wait_for_count(const int* counter, int target) {
    int value;
    do asm volatile("ld.acquire.gpu.global.b32 %0, [%1];\n" : "=r"(value) : "l"(counter) : "memory");
    while (value != target);
}
__device__ __forceinline__ void release_increment(int* counter) {
    asm volatile("fence.acq_rel.gpu;\nred.relaxed.gpu.global.add.s32 [%0], 1;\n" ::"l"(counter) : "memory");
}
}  // namespace fa3

template <int D, DqMode MODE, bool MASKED>
__device__ __forceinline__ void flash_backward_dkdv_wgmma(const CUtensorMap* maps, bf16* dqkv, const float* lse,
                                                          const float* delta, const float* cos_table,
                                                          const float* sin_table, int T, int H, int KV,
                                                          float* dq_accum, int* dq_counts, const int* doc_start,
                                                          const int* doc_end) {
    using namespace fa3;
    constexpr bool FUSED = MODE != DqMode::SEPARATE;
    constexpr int BC = DKDV_KV_ROWS, BQ = DKDV_Q_ROWS, STAGES = dkdv_stages<D>(), STAGE = dkdv_stage_bytes<D>();
    constexpr int QTILE = tile_bytes<D>(BQ), DQ_BUFFERS = dq_buffers<D>(), DQ_TILE = dq_tile_bytes<D>();
    extern __shared__ __align__(1024) uint8_t smem_raw[];
    const uint32_t sK = (smem_address(smem_raw) + 1023) & ~1023u, sV = sK + tile_bytes<D>(BC), ring = sV + tile_bytes<D>(BC);
    const uint32_t sdS = ring + STAGES * STAGE, sdQ = sdS + 2 * DS_BYTES;  // FUSED only
    const uint32_t kv_full = ring + STAGES * STAGE + dq_bytes<D, FUSED>(), full = kv_full + 8, empty = full + 8 * STAGES;
    const uint32_t dq_full = empty + 8 * STAGES, dq_empty = dq_full + 8 * DQ_BUFFERS;  // FUSED only
    float* ring_generic = reinterpret_cast<float*>(smem_raw + (ring - smem_address(smem_raw)));
    float* dq_generic = reinterpret_cast<float*>(smem_raw + (sdQ - smem_address(smem_raw)));
    // ORDERED: a CTA takes its work in the order CTAs start (a counter after the tiles' counts), shortest kv tiles
    // first, so that it only ever waits for CTAs that started before it
    __shared__ int claimed;
    if (threadIdx.x == 0) {
        mbarrier_init(kv_full, 1);
        for (int s = 0; s < STAGES; s++) {
            mbarrier_init(full + 8 * s, 1 + 32);  // the TMA thread, and each lane of the warp copying lse, delta
            mbarrier_init(empty + 8 * s, 8);
        }
        if constexpr (FUSED)
            for (int s = 0; s < DQ_BUFFERS; s++) {
                mbarrier_init(dq_full + 8 * s, 256);  // every consumer thread, after its stores
                mbarrier_init(dq_empty + 8 * s, 1);   // the thread adding the buffer into dq_accum
            }
        barriers_ready();
        if constexpr (MODE == DqMode::ORDERED)
            claimed = atomicAdd(dq_counts + gridDim.x * gridDim.y * ((T + DKDV_Q_ROWS - 1) / DKDV_Q_ROWS) * (H / KV), 1);
    }
    __syncthreads();
    constexpr bool CLAIMED = MODE == DqMode::ORDERED;
    const int kv_tile = CLAIMED ? gridDim.z - 1 - claimed / (gridDim.x * gridDim.y) : blockIdx.z;
    const int kv_head = CLAIMED ? claimed % gridDim.x : blockIdx.x, b = CLAIMED ? claimed / gridDim.x % gridDim.y : blockIdx.y;
    const int kv0 = kv_tile * BC, group = H / KV;
    // query tiles from the diagonal's to the one holding the last query that sees a key of this tile: T - 1, or
    // with a mask the last of the document of the tile's last key
    const int q_end = MASKED ? doc_end[(long long)b * T + min(kv0 + BC, T) - 1] : T;
    const int q_tiles = (T + BQ - 1) / BQ, first_q_tile = kv0 / BQ, n_q_tiles = (q_end + BQ - 1) / BQ - first_q_tile;
    const int steps = group * n_q_tiles, warpgroup = threadIdx.x / 128;
    // step i: query head kv_head * group + i / n_q_tiles, query tile first_q_tile + i % n_q_tiles
    auto q_head = [&](int i) { return kv_head * group + i / n_q_tiles; };
    auto q_start = [&](int i) { return (first_q_tile + i % n_q_tiles) * BQ; };
    // a stage's lse (log2 units, +inf past T: P = 0 there), delta (0 past T) and, masked, doc_start (rows past T:
    // row T - 1's, so that the last is the largest), BQ floats or ints each after Q and dO
    auto stage_lse = [&](int s) { return ring_generic + (s * STAGE + 2 * QTILE) / 4; };
    auto stage_starts = [&](int s) { return reinterpret_cast<int*>(stage_lse(s) + 2 * BQ); };


    if (warpgroup == 0) {
        asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n");
        const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
        if (threadIdx.x == 0) {
            mbarrier_expect_tx(kv_full, 2 * tile_bytes<D>(BC));
            load_tile<BC, D>(sK, maps, (H + kv_head) * D, kv0, b, kv_full);
            load_tile<BC, D>(sV, maps, (H + KV + kv_head) * D, kv0, b, kv_full);
            for (int i = 0; i < steps; i++) {
                const int s = i % STAGES, h = q_head(i), q0 = q_start(i);
                mbarrier_wait(empty + 8 * s, ((i / STAGES) & 1) ^ 1);
                mbarrier_expect_tx(full + 8 * s, 2 * QTILE);
                load_tile<BQ, D>(ring + s * STAGE, maps, h * D, q0, b, full + 8 * s);
                load_tile<BQ, D>(ring + s * STAGE + QTILE, maps + 1, h * D, q0, b, full + 8 * s);
            }
        } else if (warp == 1) {
            for (int i = 0; i < steps; i++) {
                const int s = i % STAGES, q0 = q_start(i);
                mbarrier_wait(empty + 8 * s, ((i / STAGES) & 1) ^ 1);
                float* stats = stage_lse(s);
                const long long at = ((long long)b * H + q_head(i)) * T + q0;
                #pragma unroll
                for (int r = lane; r < BQ; r += 32) {
                    stats[r] = q0 + r < T ? lse[at + r] * LOG2E : INFINITY;
                    stats[BQ + r] = q0 + r < T ? delta[at + r] : 0.0f;
                    if constexpr (MASKED) stage_starts(s)[r] = doc_start[(long long)b * T + min(q0 + r, T - 1)];
                }
                mbarrier_arrive(full + 8 * s);
            }
        } else if (FUSED && threadIdx.x == 64) {
            // each step's dQ partial into dq_accum by one bulk reduce-add; ORDERED: a query tile takes the partials
            // of its kv tiles from the last down, each CTA waiting for the tile's count to reach its turn
            const int n_kv_tiles = gridDim.z;
            auto tile = [&](int i) { return ((long long)b * H + q_head(i)) * q_tiles + first_q_tile + i % n_q_tiles; };
            for (int i = 0; i < steps; i++) {
                const int s = i % DQ_BUFFERS, m = first_q_tile + i % n_q_tiles;
                mbarrier_wait(dq_full + 8 * s, (i / DQ_BUFFERS) & 1);
                if constexpr (MODE == DqMode::ORDERED) {
                    const int last_kv_tile = min(((m + 1) * BQ - 1) / BC, n_kv_tiles - 1);
                    wait_for_count(dq_counts + tile(i), last_kv_tile - kv_tile);
                }
                bulk_reduce_add_f32(dq_accum + tile(i) * (BQ * D), sdQ + s * DQ_TILE, DQ_TILE);
                bulk_commit();
                bulk_wait_read<0>();  // the buffer is free
                mbarrier_arrive(dq_empty + 8 * s);
                if constexpr (MODE == DqMode::ORDERED) {  // step i - 1's add is complete: the next kv tile's turn
                    if (i > 0) {
                        bulk_wait<1>();
                        release_increment(dq_counts + tile(i - 1));
                    }
                }
            }
            bulk_wait<0>();
            if (MODE == DqMode::ORDERED && steps > 0) release_increment(dq_counts + tile(steps - 1));
        }
        return;
    }

    asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n");
    const int c = warpgroup - 1, warp = threadIdx.x % 128 / 32, lane = threadIdx.x % 32, t = threadIdx.x % 128;
    const int first_kv = kv0 + CONSUMER_ROWS * c, kv_row = first_kv + 16 * warp + lane / 4;  // and kv_row + 8
    const float scale_log2 = LOG2E / sqrtf((float)D);
    float dk[D / 2], dv[D / 2], st[BQ / 2], dpt[BQ / 2], dq[D / 4];
    uint32_t pt[BQ / 16][4], dst[BQ / 16][4];
    #pragma unroll
    for (int i = 0; i < D / 2; i++) dk[i] = dv[i] = 0.0f;
    accumulator_fence(dk);  // the zeros are set before any wgmma is in flight (else ptxas serializes them)
    accumulator_fence(dv);

    // FUSED: step j's dQ partial (complete in dq) into its staging buffer, handed to the adding thread
    auto stage_dq = [&](int j) {
        const int s = j % DQ_BUFFERS;
        mbarrier_wait(dq_empty + 8 * s, ((j / DQ_BUFFERS) & 1) ^ 1);
        float* staged = dq_generic + s * (DQ_TILE / 4);
        #pragma unroll
        for (int i4 = 0; i4 < D / 16; i4++)
            *reinterpret_cast<float4*>(staged + dq_offset<D>(c, i4, t)) =
                make_float4(dq[4 * i4], dq[4 * i4 + 1], dq[4 * i4 + 2], dq[4 * i4 + 3]);
        fence_proxy_async();
        mbarrier_arrive(dq_full + 8 * s);
    };

    mbarrier_wait(kv_full, 0);
    for (int i = 0; i < steps; i++) {
        const int s = i % STAGES, q0 = q_start(i);
        const uint32_t sQ = ring + s * STAGE, sdO = sQ + QTILE;
        const float* stats = stage_lse(s);
        mbarrier_wait(full + 8 * s, (i / STAGES) & 1);
        wgmma_fence();
        #pragma unroll
        for (int kk = 0; kk < D / 16; kk++)
            wgmma_ss<BQ, 0, 0>(st, k_major<BC>(sK, CONSUMER_ROWS * c, kk), k_major<BQ>(sQ, 0, kk), kk > 0);
        wgmma_commit();
        #pragma unroll
        for (int kk = 0; kk < D / 16; kk++)
            wgmma_ss<BQ, 0, 0>(dpt, k_major<BC>(sV, CONSUMER_ROWS * c, kk), k_major<BQ>(sdO, 0, kk), kk > 0);
        wgmma_commit();
        wgmma_wait<1>();  // S^T, and the previous step's dK, dV (and dQ), are done: release that step's stage
        accumulator_fence(st);
        if (i > 0 && lane == 0) mbarrier_arrive(empty + 8 * ((i - 1) % STAGES));

        // P^T = exp(S^T - lse), zero where the query comes before the key or (masked) the key before the query's
        // document
        const int* starts = stage_starts(s);
        const bool crosses_diagonal = q0 < first_kv + CONSUMER_ROWS - 1;
        const bool crosses_start = MASKED && starts[BQ - 1] > first_kv;
        #pragma unroll
        for (int n = 0; n < BQ / 8; n++) {
            const float2 l2 = *reinterpret_cast<const float2*>(stats + 8 * n + 2 * (lane % 4));
            #pragma unroll
            for (int e = 0; e < 4; e++) {
                const int col = 8 * n + 2 * (lane % 4) + (e & 1);
                float v = exp2f(fmaf(st[4 * n + e], scale_log2, -((e & 1) ? l2.y : l2.x)));
                if (crosses_diagonal && q0 + col < kv_row + 8 * (e >> 1)) v = 0.0f;
                st[4 * n + e] = v;
            }
        }
        if (crosses_start) {
            #pragma unroll
            for (int n = 0; n < BQ / 8; n++) {
                const int2 start = *reinterpret_cast<const int2*>(starts + 8 * n + 2 * (lane % 4));
                #pragma unroll
                for (int e = 0; e < 4; e++)
                    if (kv_row + 8 * (e >> 1) < ((e & 1) ? start.y : start.x)) st[4 * n + e] = 0.0f;
            }
        }
        pack_a<BQ / 2>(pt, st);
        wgmma_fence();
        #pragma unroll
        for (int kk = 0; kk < BQ / 16; kk++) wgmma_rs<D, 1>(dv, pt[kk], mn_major<BQ>(sdO, kk), 1);
        wgmma_commit();

        wgmma_wait<1>();  // dP^T done (dV may still run)
        accumulator_fence(dpt);
        // dS^T = P^T (dP^T - delta), with P^T as the bf16 that dV used
        #pragma unroll
        for (int kk = 0; kk < BQ / 16; kk++)
            #pragma unroll
            for (int i2 = 0; i2 < 4; i2++) {
                const int n = 2 * kk + i2 / 2, e = 2 * (i2 % 2);  // accumulator tile n, elements e, e + 1
                const float2 pp = unpack_bf16(pt[kk][i2]);
                const float2 dl = *reinterpret_cast<const float2*>(stats + BQ + 8 * n + 2 * (lane % 4));
                dst[kk][i2] = pack_bf16(pp.x * (dpt[4 * n + e] - dl.x), pp.y * (dpt[4 * n + e + 1] - dl.y));
            }
        if constexpr (FUSED) {
            // this warpgroup's 64 rows of dS^T into the tile (128 kv rows x 64 queries, 128-byte swizzled rows)
            const uint32_t tile = sdS + (i % 2) * DS_BYTES;
            #pragma unroll
            for (int kk = 0; kk < BQ / 16; kk++)
                #pragma unroll
                for (int i2 = 0; i2 < 4; i2++) {
                    const int r = CONSUMER_ROWS * c + 16 * warp + lane / 4 + 8 * (i2 % 2), chunk = 2 * kk + i2 / 2;
                    asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(tile + r * 128 + ((chunk ^ (r % 8)) << 4) +
                                                                    4 * (lane % 4)),
                                 "r"(dst[kk][i2]) : "memory");
                }
            fence_proxy_async();
            // dQ partial (64 queries x this warpgroup's D/2 columns) = dS K, over both warpgroups' dS^T rows; issued
            // before dK so that it can leave while dK runs (ptxas serializes the wgmmas if dq is read a step later)
            named_barrier_sync(1, 256);
            const uint32_t k_columns = sK + (D == 64 ? 64 * c : c * BC * 128);
            wgmma_fence();
            #pragma unroll
            for (int kk = 0; kk < BC / 16; kk++)
                wgmma_ss<D / 2, 1, 1>(dq, mn_major<BC>(tile, kk), mn_major<BC>(k_columns, kk), kk > 0);
            wgmma_commit();
        }
        wgmma_fence();
        #pragma unroll
        for (int kk = 0; kk < BQ / 16; kk++) wgmma_rs<D, 1>(dk, dst[kk], mn_major<BQ>(sQ, kk), 1);
        wgmma_commit();
        if constexpr (FUSED) {
            wgmma_wait<1>();  // dQ (dK may still run)
            accumulator_fence(dq);
            stage_dq(i);
        }
        // at D = 128 the registers do not hold this step's P^T, dS^T while the next step's products start
        if constexpr (D == 128) wgmma_wait<0>();
    }
    wgmma_wait<0>();
    accumulator_fence(dk);
    accumulator_fence(dv);

    const long long stride = (long long)(H + 2 * KV) * D, base = (long long)b * T * stride;
    store_rows<D>(dqkv + base + (H + kv_head) * D, stride, reinterpret_cast<const float(*)[4]>(dk), rsqrtf((float)D),
                  first_kv + 16 * warp, T, cos_table, sin_table, lane);
    store_rows<D>(dqkv + base + (H + KV + kv_head) * D, stride, reinterpret_cast<const float(*)[4]>(dv), 1.0f,
                  first_kv + 16 * warp, T, nullptr, nullptr, lane);
}

// ---- backward: dQ

template <int D, bool MASKED>
__device__ __forceinline__ void flash_backward_dq_wgmma(const CUtensorMap* maps, bf16* dqkv, const float* lse,
                                                        const float* delta, const float* cos_table,
                                                        const float* sin_table, int T, int H, int KV,
                                                        const int* doc_start) {
    using namespace fa3;
    constexpr int BR = DQ_ROWS, BC = dq_kv_rows<D>(), STAGES = DQ_STAGES, TILE = tile_bytes<D>(BC);
    extern __shared__ __align__(1024) uint8_t smem_raw[];
    const uint32_t sQ = (smem_address(smem_raw) + 1023) & ~1023u, sdO = sQ + tile_bytes<D>(BR), ring = sdO + tile_bytes<D>(BR);
    const uint32_t qo_full = ring + 2 * STAGES * TILE, full = qo_full + 8, empty = full + 8 * STAGES;
    const int h = blockIdx.x, b = blockIdx.y, q0 = (gridDim.z - 1 - blockIdx.z) * BR, kv_head = h / (H / KV);
    const int warpgroup = threadIdx.x / 128;
    // kv tiles first_tile .. the diagonal's: with a mask, from the one holding the first row's document start
    const int first_tile = MASKED ? doc_start[(long long)b * T + q0] / BC : 0;
    const int n_tiles = (min(q0 + BR, T) + BC - 1) / BC - first_tile;

    if (threadIdx.x == 0) {
        mbarrier_init(qo_full, 1);
        for (int s = 0; s < STAGES; s++) {
            mbarrier_init(full + 8 * s, 1);
            mbarrier_init(empty + 8 * s, 8);
        }
        barriers_ready();
    }
    __syncthreads();

    if (warpgroup == 0) {
        asm volatile("setmaxnreg.dec.sync.aligned.u32 24;\n");
        if (threadIdx.x == 0) {
            mbarrier_expect_tx(qo_full, 2 * tile_bytes<D>(BR));
            load_tile<BR, D>(sQ, maps, h * D, q0, b, qo_full);
            load_tile<BR, D>(sdO, maps + 1, h * D, q0, b, qo_full);
            for (int j = 0; j < n_tiles; j++) {
                const int s = j % STAGES;
                mbarrier_wait(empty + 8 * s, ((j / STAGES) & 1) ^ 1);
                mbarrier_expect_tx(full + 8 * s, 2 * TILE);
                const int kv0 = (first_tile + j) * BC;
                load_tile<BC, D>(ring + 2 * s * TILE, maps, (H + kv_head) * D, kv0, b, full + 8 * s);
                load_tile<BC, D>(ring + (2 * s + 1) * TILE, maps, (H + KV + kv_head) * D, kv0, b, full + 8 * s);
            }
        }
        return;
    }

    asm volatile("setmaxnreg.inc.sync.aligned.u32 240;\n");
    const int c = warpgroup - 1, warp = threadIdx.x % 128 / 32, lane = threadIdx.x % 32;
    const int first_row = q0 + CONSUMER_ROWS * c, row = first_row + 16 * warp + lane / 4;  // and row + 8
    const float scale_log2 = LOG2E / sqrtf((float)D);
    float lse2[2], dlt[2];
    #pragma unroll
    for (int half = 0; half < 2; half++) {
        const int pos = row + 8 * half;
        const long long at = ((long long)b * H + h) * T + pos;
        lse2[half] = pos < T ? lse[at] * LOG2E : 0.0f;
        dlt[half] = pos < T ? delta[at] : 0.0f;
    }
    int start[2], last_start;  // MASKED: the document starts of this thread's rows and of the warpgroup's last row
    if constexpr (MASKED) load_starts(start, last_start, doc_start + (long long)b * T, row, first_row, T);
    float dq[D / 2], s_acc[BC / 2], dp[BC / 2];
    uint32_t ds[BC / 16][4];
    #pragma unroll
    for (int i = 0; i < D / 2; i++) dq[i] = 0.0f;
    accumulator_fence(dq);  // the zeros are set before any wgmma is in flight (else ptxas serializes them)

    mbarrier_wait(qo_full, 0);
    for (int j = 0; j < n_tiles; j++) {
        const int s = j % STAGES, kv0 = (first_tile + j) * BC;
        const uint32_t sK = ring + 2 * s * TILE, sV = sK + TILE;
        mbarrier_wait(full + 8 * s, (j / STAGES) & 1);
        wgmma_fence();
        #pragma unroll
        for (int kk = 0; kk < D / 16; kk++)
            wgmma_ss<BC, 0, 0>(s_acc, k_major<BR>(sQ, CONSUMER_ROWS * c, kk), k_major<BC>(sK, 0, kk), kk > 0);
        wgmma_commit();
        #pragma unroll
        for (int kk = 0; kk < D / 16; kk++)
            wgmma_ss<BC, 0, 0>(dp, k_major<BR>(sdO, CONSUMER_ROWS * c, kk), k_major<BC>(sV, 0, kk), kk > 0);
        wgmma_commit();
        wgmma_wait<1>();  // S, and the previous tile's dQ, are done: release that tile's stage
        accumulator_fence(s_acc);
        if (j > 0 && lane == 0) mbarrier_arrive(empty + 8 * ((j - 1) % STAGES));

        // P = exp(S - lse), zero after the diagonal and (masked) before the row's document, rounded to bf16 (as
        // the dK/dV kernel's)
        const bool crosses_diagonal = kv0 + BC - 1 > first_row, crosses_start = MASKED && kv0 < last_start;
        #pragma unroll
        for (int i = 0; i < BC / 2; i++) {
            float v = exp2f(fmaf(s_acc[i], scale_log2, -lse2[(i >> 1) & 1]));
            if (crosses_diagonal && kv0 + 8 * (i / 4) + 2 * (lane % 4) + (i & 1) > row + 8 * ((i >> 1) & 1)) v = 0.0f;
            if (crosses_start && kv0 + 8 * (i / 4) + 2 * (lane % 4) + (i & 1) < start[(i >> 1) & 1]) v = 0.0f;
            s_acc[i] = v;
        }
        wgmma_wait<0>();  // dP
        accumulator_fence(dp);
        #pragma unroll
        for (int kk = 0; kk < BC / 16; kk++)
            #pragma unroll
            for (int i2 = 0; i2 < 4; i2++) {
                const int at = 8 * kk + 2 * i2, half = i2 % 2;  // accumulator elements at, at + 1 (row + 8 * half)
                const float2 pp = unpack_bf16(pack_bf16(s_acc[at], s_acc[at + 1]));
                ds[kk][i2] = pack_bf16(pp.x * (dp[at] - dlt[half]), pp.y * (dp[at + 1] - dlt[half]));
            }
        wgmma_fence();
        #pragma unroll
        for (int kk = 0; kk < BC / 16; kk++) wgmma_rs<D, 1>(dq, ds[kk], mn_major<BC>(sK, kk), 1);
        wgmma_commit();
    }
    wgmma_wait<0>();
    accumulator_fence(dq);
    const long long stride = (long long)(H + 2 * KV) * D;
    store_rows<D>(dqkv + (long long)b * T * stride + h * D, stride, reinterpret_cast<const float(*)[4]>(dq),
                  rsqrtf((float)D), first_row + 16 * warp, T, cos_table, sin_table, lane);
}

// The document mask: each body is built twice, MASKED and plain causal, and the entry point picks one per launch from
// doc_start (null: plain causal), so that the plain path has no test of the mask in its loops
template <bool B>
struct Masked {
    static constexpr bool value = B;
};
template <typename Body>
__device__ __forceinline__ void masked_or_causal(const int* doc_start, Body body) {
    if (doc_start != nullptr) body(Masked<true>{});
    else body(Masked<false>{});
}

#define FLASH_BODY(call) call;
#else
#define FLASH_BODY(call)
#endif  // WGMMA_ENABLED
// an entry point's body `call`, which names MASKED, in its two builds
#define FLASH_MASKED_BODY(call) \
    FLASH_BODY(masked_or_causal(doc_start, [&](auto masked) { constexpr bool MASKED = decltype(masked)::value; call; }))

// Entry points: the maps first, then flash_attention.cu's arguments (its qkv, dout, qkv pointers are unused here:
// the maps carry them), so that one launcher drives both builds; they end with the document mask's doc_start, doc_end
// (flash_attention.cuh; both null: plain causal). On anything but sm_90a they compile to nothing and the plan never
// selects this build. The forward also takes the batch count after KV (a persistent grid does not carry it). (The
// fused backward's entry points, DqMode::ORDERED and UNORDERED, are the ladder's v4: dev/cuda/flash_attention_v4.cu.)
#define FLASH_FORWARD_ENTRY(D)                                                                                    \
    extern "C" __global__ void __launch_bounds__(fa3::THREADS, 1) flash_attention_forward_d##D(                  \
        const CUtensorMap* maps, bf16* out, float* lse, const bf16* qkv, int T, int H, int KV, int B,             \
        const int* doc_start, const int* doc_end) {                                                               \
        FLASH_MASKED_BODY((flash_forward_wgmma<D, MASKED>(maps, out, lse, T, H, KV, doc_start,                    \
                                                          ForwardWork<D>(T, H, B))))                              \
    }
#define FLASH_BACKWARD_ENTRY(name, D, call)                                                                       \
    extern "C" __global__ void __launch_bounds__(fa3::THREADS, 1) flash_attention_backward_##name##_d##D(        \
        const CUtensorMap* maps, bf16* dqkv, const bf16* dout, const bf16* qkv, const float* lse,                 \
        const float* delta, const float* cos_table, const float* sin_table, int T, int H, int KV,                 \
        const int* doc_start, const int* doc_end) {                                                               \
        FLASH_MASKED_BODY(call)                                                                                   \
    }
#define FLASH_DKDV_ENTRY(D)                                                                                       \
    FLASH_BACKWARD_ENTRY(dkdv, D, (flash_backward_dkdv_wgmma<D, DqMode::SEPARATE, MASKED>(                        \
                                      maps, dqkv, lse, delta, cos_table, sin_table, T, H, KV, nullptr, nullptr,   \
                                      doc_start, doc_end)))
#define FLASH_DQ_ENTRY(D)                                                                                         \
    FLASH_BACKWARD_ENTRY(dq, D, (flash_backward_dq_wgmma<D, MASKED>(maps, dqkv, lse, delta, cos_table, sin_table, \
                                                                    T, H, KV, doc_start)))

// Each entry point is guarded by KERNEL_ENTRY(name), so that a build unit compiles one alone and the seven compile in
// parallel (llama/runtime/kernel_build.py defines KERNEL_ENTRY on nvcc's command line); by default, every one.
#ifndef KERNEL_ENTRY
#define KERNEL_ENTRY(name) 1
#endif
#if KERNEL_ENTRY(flash_attention_backward_delta)
FLASH_DELTA_ENTRY
#endif
#if KERNEL_ENTRY(flash_attention_forward_d64)
FLASH_FORWARD_ENTRY(64)
#endif
#if KERNEL_ENTRY(flash_attention_backward_dkdv_d64)
FLASH_DKDV_ENTRY(64)
#endif
#if KERNEL_ENTRY(flash_attention_backward_dq_d64)
FLASH_DQ_ENTRY(64)
#endif
#if KERNEL_ENTRY(flash_attention_forward_d128)
FLASH_FORWARD_ENTRY(128)
#endif
#if KERNEL_ENTRY(flash_attention_backward_dkdv_d128)
FLASH_DKDV_ENTRY(128)
#endif
#if KERNEL_ENTRY(flash_attention_backward_dq_d128)
FLASH_DQ_ENTRY(128)
#endif

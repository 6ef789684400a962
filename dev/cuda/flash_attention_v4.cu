// v4 adds, over v3 (kernels/flash_attention_wgmma.cu, included here with v3's forward: its dK/dV kernel with the
// switch DqMode::ORDERED or UNORDERED; the entry points below, the dQ store kernel and the fused kernel's launch
// table are the rung's own, launched by dev/cuda/flash_attention_ladder.py):
// - dQ inside the dK/dV kernel, as FA3: each step's dS^T goes to shared memory (both consumer warpgroups' 64 rows),
//   each warpgroup forms D/2 columns of the 64 x D partial dQ = dS K by wgmma (A = dS^T read MN-major), stages it
//   in fp32, and a producer thread adds the tile into an fp32 buffer with one bulk reduce-add; a small kernel
//   turns the buffer into bf16 dQ with the inverse RoPE. The separate dQ kernel and its recomputation of S and
//   dP (2 of v3's 7 products) go.
// - Deterministic: the adds into a query tile come in a fixed order, kv tiles from the last down, through a
//   per-tile count (the CTAs launched shortest first, so a CTA only waits for earlier ones); the opt-in
//   unordered variant (the ladder's backward(deterministic=False)) drops the waits and launches heaviest first.
// Predicted (H100, against v3): backward 1.25-1.35x at T >= 2048 (5 products instead of 7; the dQ adds cost
// L2 traffic of ~T/256 x the dQ bytes), forward unchanged; determinism costs 0-10% (the shortest-first order's
// tail).
#define FLASH_FORWARD_WORK(D) OneItemPerCta
#define FLASH_FORWARD_SCHEDULE(D) IndependentConsumers
#include "flash_attention_wgmma.cu"

// the fused kernel's launch configuration, read by the ladder's launcher: per head dim (64, 128), threads per CTA,
// kv rows per CTA, shared bytes
__constant__ int flash_attention_fused_config[2][3] = {
    {fa3::THREADS, fa3::DKDV_KV_ROWS, fa3::dkdv_shared<64, true>()},
    {fa3::THREADS, fa3::DKDV_KV_ROWS, fa3::dkdv_shared<128, true>()},
};

#ifdef WGMMA_ENABLED
// dQ of the fused backward: dq_accum (its per-tile layout: fa3::dq_offset) times 1/sqrt(D), rotated back, as bf16 into
// dqkv. CTA of 128 threads per (query head, batch, 64-row query tile); thread t rebuilds the m64nD accumulator that a
// warpgroup's thread t would hold and stores it as the dQ kernel does.
template <int D>
__device__ __forceinline__ void flash_backward_dq_store(bf16* dqkv, const float* dq_accum, const float* cos_table,
                                                        const float* sin_table, int T, int H, int KV) {
    using namespace fa3;
    const int h = blockIdx.x, b = blockIdx.y, m = blockIdx.z, t = threadIdx.x, warp = t / 32, lane = t % 32;
    const float* tile = dq_accum + (((long long)b * H + h) * gridDim.z + m) * (DKDV_Q_ROWS * D);
    float acc[D / 8][4];
    #pragma unroll
    for (int n = 0; n < D / 8; n++)
        *reinterpret_cast<float4*>(acc[n]) = *reinterpret_cast<const float4*>(tile + dq_offset<D>(n / (D / 16), n % (D / 16), t));
    const long long stride = (long long)(H + 2 * KV) * D;
    store_rows<D>(dqkv + (long long)b * T * stride + h * D, stride, acc, rsqrtf((float)D), m * DKDV_Q_ROWS + 16 * warp,
                  T, cos_table, sin_table, lane);
}
#endif  // WGMMA_ENABLED

// Entry points (flash_attention_wgmma.cu's, with the fused backward's dQ buffer and its per-tile counts after KV:
// ORDERED's counts zeroed, with the buffer, before each launch; dq_store ends at KV, no document mask)
#define FLASH_FUSED_ENTRY(name, D, MODE)                                                                          \
    extern "C" __global__ void __launch_bounds__(fa3::THREADS, 1) flash_attention_backward_##name##_d##D(        \
        const CUtensorMap* maps, bf16* dqkv, const bf16* dout, const bf16* qkv, const float* lse,                 \
        const float* delta, const float* cos_table, const float* sin_table, int T, int H, int KV,                 \
        float* dq_accum, int* dq_counts, const int* doc_start, const int* doc_end) {                              \
        FLASH_MASKED_BODY((flash_backward_dkdv_wgmma<D, MODE, MASKED>(maps, dqkv, lse, delta, cos_table, sin_table, \
                                                                      T, H, KV, dq_accum, dq_counts, doc_start,   \
                                                                      doc_end)))                                  \
    }
#define FLASH_DQ_STORE_ENTRY(D)                                                                                   \
    extern "C" __global__ void __launch_bounds__(128) flash_attention_backward_dq_store_d##D(                    \
        bf16* dqkv, const float* dq_accum, const float* cos_table, const float* sin_table, int T, int H, int KV) { \
        FLASH_BODY(flash_backward_dq_store<D>(dqkv, dq_accum, cos_table, sin_table, T, H, KV))                    \
    }

FLASH_FUSED_ENTRY(fused, 64, DqMode::ORDERED)
FLASH_FUSED_ENTRY(fused_unordered, 64, DqMode::UNORDERED)
FLASH_DQ_STORE_ENTRY(64)
FLASH_FUSED_ENTRY(fused, 128, DqMode::ORDERED)
FLASH_FUSED_ENTRY(fused_unordered, 128, DqMode::UNORDERED)
FLASH_DQ_STORE_ENTRY(128)

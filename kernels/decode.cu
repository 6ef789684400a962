// Generation with a KV cache: the kernels of a decode step that are not GEMVs (kernels/gemv.cu) and the
// prefill's cache write. llama/model/gpu_decoder.py strings them together.
// A step takes n new tokens per sequence at the absolute positions p .. p + n - 1, p = *position read
// from device memory (so that one captured CUDA graph serves every decode step). Per layer the cache
// holds every position's rotated keys and its values, k_cache and v_cache (B, KV, T_max, D) bf16.
//
// embed_tokens:     x (B, C) fp32 = wte[tokens] (wte (V, C) bf16), and squares (B,) = sum of x^2 per row, the
//                   statistics of the first RMSNorm (one slot of kernels/gemv.cu's squares).
// last_residual:    x (B, C) fp32 = h + branch at position n - 1 of each sequence (h, branch (B, n, C) bf16:
//                   the prefill's last residual add), and squares (B,) of x for the final RMSNorm.
// cache_write:      k and v of the packed projection qkv (B, n, (H + 2KV) D) bf16 (k rotated) -> the caches
//                   at positions p .. p + n - 1. One thread per 8 values.
// decode_attention: out (B, n, H D) bf16 = causal attention of query i (position p + i) over cached keys
//                   0 .. p + i: softmax(q . k / sqrt(D)) @ v; query head h reads kv head h / (H / KV).
//                   q (b, i, h, :) at q + (b n + i) q_stride + h D, fp32 (a decode step's) or bf16 (the
//                   packed projection of a prefill chunk). Flash-decoding: grid (max splits, H, B n); the
//                   keys are cut into splits = min(max splits, ceil(keys / min_keys)) equal ranges (the
//                   blocks past them return at once). Block (s, h, bi) takes query head h over range s: a
//                   key's D / 8 16-byte vectors sit on D / 8 lanes (rounded up to a power of two), so a
//                   warp scores 32 / span keys at once (the dot product added across those lanes by
//                   shuffles) and keeps an online softmax per lane in registers, updated once per UNROLL
//                   keys; the lanes' states are merged by a butterfly, the warps' in warp order through
//                   shared memory. A block per query head (not per kv head): a short cache gives each
//                   block little to do, and the GQA group's blocks read their keys from L2. With splits > 1
//                   each block writes (max, sum, unnormalized output) to `partial`, and the last block of
//                   (h, bi) to arrive combines the splits in split order: deterministic. Needs D a multiple
//                   of 8, at most ATT_MAX_D.
// advance:          after the sampler wrote ids (B,): history (B, T_max) at p + 1 = ids, *position += 1.
#include <cstdint>
#include "bf16.cuh"

#define ATT_WARPS 8
#define ATT_THREADS (ATT_WARPS * 32)
#define ATT_UNROLL 4   // keys per lane loaded before they are scored
#define ATT_MAX_D 128
#define ATT_MAX_SPLITS 64

extern "C" __global__ void embed_tokens(float* x, float* squares, const int* tokens, const bf16* wte, int C) {
    wait_for_previous_grid();
    allow_next_grid();
    const int b = blockIdx.x;  // one block per sequence
    const bf16* row = wte + (long long)tokens[b] * C;
    float sum = 0.0f;
    for (int c = threadIdx.x; c < C; c += blockDim.x) {
        const float v = __bfloat162float(row[c]);
        x[(long long)b * C + c] = v;
        sum += v * v;
    }
    sum = block_sum(sum);
    if (threadIdx.x == 0) squares[b] = sum;
}

extern "C" __global__ void last_residual(float* x, float* squares, const bf16* h, const bf16* branch, int n, int C) {
    const int b = blockIdx.x;
    const long long last = ((long long)b * n + n - 1) * C;
    float sum = 0.0f;
    for (int c = threadIdx.x; c < C; c += blockDim.x) {
        const float v = __bfloat162float(h[last + c]) + __bfloat162float(branch[last + c]);
        x[(long long)b * C + c] = v;
        sum += v * v;
    }
    sum = block_sum(sum);
    if (threadIdx.x == 0) squares[b] = sum;
}

extern "C" __global__ void cache_write(bf16* k_cache, bf16* v_cache, const bf16* qkv, const int* position, int B,
                                       int n, int H, int KV, int D, int T_max) {
    const int vectors = D / 8;  // per head
    long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (long long)B * n * 2 * KV * vectors) return;
    const int vec = idx % vectors;
    idx /= vectors;
    const int slot = idx % (2 * KV);  // key heads, then value heads
    idx /= 2 * KV;
    const int i = idx % n, b = idx / n, t = *position + i;
    const uint4 v = *reinterpret_cast<const uint4*>(qkv + (((long long)b * n + i) * (H + 2 * KV) + H + slot) * D + 8 * vec);
    bf16* cache = slot < KV ? k_cache : v_cache;
    const int head = slot % KV;
    *reinterpret_cast<uint4*>(cache + (((long long)b * KV + head) * T_max + t) * D + 8 * vec) = v;
}

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(bf16 v) { return __bfloat162float(v); }

// Online-softmax state over some keys: running max, sum of exp(score - max), and this lane's 8 dimensions
// of the output, unnormalized.
struct SoftmaxState {
    float max, sum, acc[8];
};

// state = state (+) other, the two halves' keys together: the same bits in both operand orders
__device__ __forceinline__ void merge_softmax(SoftmaxState& s, float other_max, float other_sum, const float* other_acc) {
    const float m = fmaxf(s.max, other_max);
    if (m == -INFINITY) return;  // both empty
    const float a = expf(s.max - m), b = expf(other_max - m);
    s.sum = s.sum * a + other_sum * b;
#pragma unroll
    for (int j = 0; j < 8; j++) s.acc[j] = s.acc[j] * a + other_acc[j] * b;
    s.max = m;
}

template <typename QT>
__device__ void decode_attention(bf16* out, float* partial, unsigned int* counters, const QT* q, int q_stride,
                                 const bf16* k_cache, const bf16* v_cache, const int* position, int n, int H, int KV,
                                 int D, int T_max, int min_keys) {
    __shared__ float warp_acc[ATT_WARPS][ATT_MAX_D];
    __shared__ float warp_maxes[ATT_WARPS], warp_sums[ATT_WARPS], weights[ATT_MAX_SPLITS];
    __shared__ float block_max, total;
    wait_for_previous_grid();
    allow_next_grid();
    const int split = blockIdx.x, h = blockIdx.y, bi = blockIdx.z, kv = h / (H / KV);
    const int b = bi / n, i = bi % n, tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    const int length = *position + i + 1;  // keys 0 .. p + i
    const int splits = min((int)gridDim.x, (length + min_keys - 1) / min_keys);  // the ranges in use this time
    if (split >= splits) return;
    const int chunk = (length + splits - 1) / splits;
    const int begin = split * chunk, end = min(length, begin + chunk);
    // lane = (key slot, 8 dimensions): a key's D / 8 vectors on `span` lanes (a power of two), 32 / span keys at once
    int span = 1;
    while (span < D / 8) span *= 2;
    const int slots = 32 / span, slot = lane / span, vec = lane % span;
    const bool has_dims = vec < D / 8;
    const float scale = rsqrtf((float)D);
    float qv[8];
#pragma unroll
    for (int j = 0; j < 8; j++)
        qv[j] = has_dims ? to_float(q[((long long)b * n + i) * q_stride + h * D + 8 * vec + j]) * scale : 0.0f;
    SoftmaxState st;
    st.max = -INFINITY, st.sum = 0.0f;
#pragma unroll
    for (int j = 0; j < 8; j++) st.acc[j] = 0.0f;
    const long long base = ((long long)b * KV + kv) * T_max * D;
    const bf16* keys = k_cache + base + 8 * vec;
    const bf16* values = v_cache + base + 8 * vec;
    // key (step, u) of this lane: begin + ((step * UNROLL + u) * WARPS + warp) * slots + slot
    for (int first = begin + warp * slots; first < end; first += ATT_WARPS * slots * ATT_UNROLL) {
        uint4 k_raw[ATT_UNROLL], v_raw[ATT_UNROLL];
#pragma unroll
        for (int u = 0; u < ATT_UNROLL; u++) {
            const int key = first + u * ATT_WARPS * slots + slot;
            const bool ok = key < end && has_dims;
            k_raw[u] = ok ? *reinterpret_cast<const uint4*>(keys + (long long)key * D) : make_uint4(0, 0, 0, 0);
            v_raw[u] = ok ? *reinterpret_cast<const uint4*>(values + (long long)key * D) : make_uint4(0, 0, 0, 0);
        }
        // the UNROLL keys' scores (the dot product added across the key's lanes), then one online-softmax update
        float scores[ATT_UNROLL];
#pragma unroll
        for (int u = 0; u < ATT_UNROLL; u++) {
            float k8[8];
            unpack_bf16x8(k8, k_raw[u]);
            scores[u] = 0.0f;
#pragma unroll
            for (int j = 0; j < 8; j++) scores[u] += qv[j] * k8[j];
        }
        for (int offset = 1; offset < span; offset *= 2)
#pragma unroll
            for (int u = 0; u < ATT_UNROLL; u++) scores[u] += __shfl_xor_sync(0xffffffffu, scores[u], offset);
        float m = st.max;
#pragma unroll
        for (int u = 0; u < ATT_UNROLL; u++)
            if (first + u * ATT_WARPS * slots + slot < end) m = fmaxf(m, scores[u]);
        if (m == -INFINITY) continue;  // no key for this lane yet
        const float correction = expf(st.max - m);
        st.sum *= correction;
#pragma unroll
        for (int j = 0; j < 8; j++) st.acc[j] *= correction;
#pragma unroll
        for (int u = 0; u < ATT_UNROLL; u++) {
            if (first + u * ATT_WARPS * slots + slot >= end) continue;
            const float p = expf(scores[u] - m);
            float v8[8];
            unpack_bf16x8(v8, v_raw[u]);
            st.sum += p;
#pragma unroll
            for (int j = 0; j < 8; j++) st.acc[j] += p * v8[j];
        }
        st.max = m;
    }
    // the warp's key slots merged (butterfly over the slot bits of the lane), then the warps in order
    for (int offset = span; offset < 32; offset *= 2) {
        float other_acc[8];
#pragma unroll
        for (int j = 0; j < 8; j++) other_acc[j] = __shfl_xor_sync(0xffffffffu, st.acc[j], offset);
        const float other_max = __shfl_xor_sync(0xffffffffu, st.max, offset);
        const float other_sum = __shfl_xor_sync(0xffffffffu, st.sum, offset);
        merge_softmax(st, other_max, other_sum, other_acc);
    }
    if (slot == 0 && has_dims)
#pragma unroll
        for (int j = 0; j < 8; j++) warp_acc[warp][8 * vec + j] = st.acc[j];
    if (lane == 0) warp_maxes[warp] = st.max, warp_sums[warp] = st.sum;
    __syncthreads();
    if (tid == 0) {  // the block's max and sum; the warps' weights exp(max_w - max)
        float m = -INFINITY, sum = 0.0f;
        for (int w = 0; w < ATT_WARPS; w++) m = fmaxf(m, warp_maxes[w]);
        for (int w = 0; w < ATT_WARPS; w++) {
            weights[w] = warp_maxes[w] == -INFINITY ? 0.0f : expf(warp_maxes[w] - m);
            sum += weights[w] * warp_sums[w];
        }
        block_max = m, total = sum;
    }
    __syncthreads();
    const int record = D + 2;  // a split's record in `partial`: output (D), max, sum
    float* mine = partial + (((long long)bi * H + h) * gridDim.x + split) * record;
    bf16* result = out + ((long long)bi * H + h) * D;
    for (int d = tid; d < D; d += ATT_THREADS) {
        float o = 0.0f;
#pragma unroll
        for (int w = 0; w < ATT_WARPS; w++) o += weights[w] * warp_acc[w][d];
        if (splits == 1)
            result[d] = __float2bfloat16(o / total);
        else
            mine[d] = o;
    }
    if (splits == 1) return;
    if (tid == 0) mine[D] = block_max, mine[D + 1] = total;
    if (!arrive_last(counters + (long long)bi * H + h, splits)) return;
    // the last block: the splits' weights exp(max_s - max), then each dimension's sum over the splits in order
    __syncthreads();  // weights and total are rewritten
    const float* all = partial + ((long long)bi * H + h) * gridDim.x * record;
    if (warp == 0) {
        float m = -INFINITY;  // an empty split's max is -inf: its weight is 0
        for (int s = lane; s < splits; s += 32) m = fmaxf(m, __ldcg(all + s * record + D));
        m = warp_max(m);
        float sum = 0.0f;
        for (int s = lane; s < splits; s += 32) {
            const float w = expf(__ldcg(all + s * record + D) - m);
            weights[s] = w;
            sum += w * __ldcg(all + s * record + D + 1);
        }
        sum = warp_sum(sum);
        if (lane == 0) total = sum;
    }
    __syncthreads();
    for (int d = tid; d < D; d += ATT_THREADS) {
        float o = 0.0f;
#pragma unroll 8
        for (int s = 0; s < splits; s++) o += weights[s] * __ldcg(all + s * record + d);
        result[d] = __float2bfloat16(o / total);
    }
}

extern "C" __global__ void __launch_bounds__(ATT_THREADS) decode_attention_f32q(
        bf16* out, float* partial, unsigned int* counters, const float* q, int q_stride, const bf16* k_cache,
        const bf16* v_cache, const int* position, int n, int H, int KV, int D, int T_max, int min_keys) {
    decode_attention(out, partial, counters, q, q_stride, k_cache, v_cache, position, n, H, KV, D, T_max, min_keys);
}

extern "C" __global__ void __launch_bounds__(ATT_THREADS) decode_attention_bf16q(
        bf16* out, float* partial, unsigned int* counters, const bf16* q, int q_stride, const bf16* k_cache,
        const bf16* v_cache, const int* position, int n, int H, int KV, int D, int T_max, int min_keys) {
    decode_attention(out, partial, counters, q, q_stride, k_cache, v_cache, position, n, H, KV, D, T_max, min_keys);
}

extern "C" __global__ void advance(int* history, int* position, const int* ids, int B, int T_max) {
    wait_for_previous_grid();
    allow_next_grid();
    const int p = *position;
    for (int b = threadIdx.x; b < B; b += blockDim.x)
        if (p + 1 < T_max) history[(long long)b * T_max + p + 1] = ids[b];
    __syncthreads();  // every thread has read the position
    if (threadIdx.x == 0) *position = p + 1;
}

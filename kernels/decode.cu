// Generation with a KV cache: the kernels that differ from training (llama/model/gpu_decoder.py strings them
// together with the training kernels for the matmuls, norms and SwiGLU).
// A forward step takes n new tokens per sequence at the absolute positions p0 .. p0 + n - 1
// (prefill: n = prompt length, p0 = 0; decode: n = 1, p0 = tokens so far). Per layer the cache holds
// every position's rotated keys and its values, k_cache and v_cache (B, KV, T_max, D), in bf16 or fp32
// (the _bf16 / _f32 entry points). All arithmetic is fp32.
//
// rope_kv_write:   qkv (B, n, (H + 2*KV) * D) fp32, per new token H query heads, KV key heads, KV value
//                  heads -> q (B, H, n, D) fp32 rotated; k rotated and v written into the cache at
//                  positions p0 .. p0 + n - 1. RoPE as in rope.cu (Meta's interleaved pairs), with
//                  cos/sin (T_max, D/2) of t * freq_i. One thread per pair: B * n * (H + 2*KV) * D/2 threads.
// decode_attention: out (B, n, H * D) = causal attention of query i (position p0 + i) over the cached
//                  keys 0 .. p0 + i: softmax(q . k / sqrt(D)) @ v. Query head h reads kv head
//                  h / (H / KV). One block per (i, h, b); the keys go by in tiles of blockDim, one key
//                  per thread, with a running max and sum (online softmax); for p @ v, thread t owns
//                  dimension t % D of key group t / D, and the groups are summed at the end, in a fixed
//                  order (deterministic). Needs D <= blockDim; dynamic shared memory
//                  D + blockDim + (blockDim / D) * D floats.
// last_positions:  out (B, C) = x (B, n, C) at position n - 1 of each sequence (the rows the logits need).
#include <cuda_bf16.h>
#include "common.cuh"

__device__ __forceinline__ float2 load_pair(const float* p) { return *reinterpret_cast<const float2*>(p); }
__device__ __forceinline__ float2 load_pair(const __nv_bfloat16* p) {
    return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(p));
}
__device__ __forceinline__ void store_pair(float* p, float a, float b) { *reinterpret_cast<float2*>(p) = make_float2(a, b); }
__device__ __forceinline__ void store_pair(__nv_bfloat16* p, float a, float b) {
    *reinterpret_cast<__nv_bfloat162*>(p) = __floats2bfloat162_rn(a, b);
}
__device__ __forceinline__ float load_one(const float* p) { return *p; }
__device__ __forceinline__ float load_one(const __nv_bfloat16* p) { return __bfloat162float(*p); }

template <typename T>
__device__ void rope_kv_write(float* q, T* k_cache, T* v_cache, const float* qkv, const float* cos_table,
                              const float* sin_table, int B, int n, int H, int KV, int D, int p0, int T_max) {
    const int slots = H + 2 * KV, half = D / 2;
    long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (long long)B * n * slots * half) return;
    const int pair = idx % half;
    idx /= half;
    const int slot = idx % slots;
    idx /= slots;
    const int i = idx % n, b = idx / n, t = p0 + i;
    const float2 x = load_pair(qkv + (((long long)b * n + i) * slots + slot) * D + 2 * pair);
    float y0 = x.x, y1 = x.y;
    if (slot < H + KV) {
        const float c = cos_table[(long long)t * half + pair], s = sin_table[(long long)t * half + pair];
        y0 = x.x * c - x.y * s;
        y1 = x.x * s + x.y * c;
    }
    if (slot < H) {
        store_pair(q + (((long long)b * H + slot) * n + i) * D + 2 * pair, y0, y1);
    } else {
        T* cache = slot < H + KV ? k_cache : v_cache;
        const int head = slot < H + KV ? slot - H : slot - H - KV;
        store_pair(cache + (((long long)b * KV + head) * T_max + t) * D + 2 * pair, y0, y1);
    }
}

template <typename T>
__device__ void decode_attention(float* out, const float* q, const T* k_cache, const T* v_cache, int n, int H,
                                 int KV, int D, int p0, int T_max) {
    extern __shared__ float shared[];
    const int i = blockIdx.x, h = blockIdx.y, b = blockIdx.z, tid = threadIdx.x, tile = blockDim.x;
    const int len = p0 + i + 1;  // keys 0 .. p0 + i
    const int kv_head = h / (H / KV);
    const int groups = tile / D, d = tid % D, group = tid / D;
    const float scale = rsqrtf((float)D);
    float* q_row = shared;                // (D,)
    float* probs = shared + D;            // (tile,)
    float* partial = probs + tile;        // (groups, D)
    const float* q_in = q + (((long long)b * H + h) * n + i) * D;
    for (int c = tid; c < D; c += tile) q_row[c] = q_in[c];
    __syncthreads();
    const long long base = ((long long)b * KV + kv_head) * T_max * D;
    const T* keys = k_cache + base;
    const T* values = v_cache + base;
    float running_max = -INFINITY, running_sum = 0.0f, acc = 0.0f;
    for (int start = 0; start < len; start += tile) {
        const int j = start + tid;
        float score = -INFINITY;
        if (j < len) {
            float dot = 0.0f;
            for (int c = 0; c < D; c += 2) {
                const float2 k = load_pair(keys + (long long)j * D + c);
                dot += q_row[c] * k.x + q_row[c + 1] * k.y;
            }
            score = dot * scale;
        }
        const float new_max = fmaxf(running_max, block_max(score));
        const float p = j < len ? expf(score - new_max) : 0.0f;
        probs[tid] = p;
        const float correction = expf(running_max - new_max);  // 0 on the first tile
        running_sum = running_sum * correction + block_sum(p);  // block_sum synchronizes: probs is complete
        acc *= correction;
        running_max = new_max;
        if (group < groups) {
            const int count = min(tile, len - start);
            for (int jj = group; jj < count; jj += groups)
                acc += probs[jj] * load_one(values + (long long)(start + jj) * D + d);
        }
        __syncthreads();  // probs is rewritten by the next tile
    }
    if (group < groups) partial[group * D + d] = acc;
    __syncthreads();
    if (tid < D) {
        float sum = 0.0f;
        for (int g = 0; g < groups; g++) sum += partial[g * D + tid];
        out[(((long long)b * n + i) * H + h) * D + tid] = sum / running_sum;
    }
}

extern "C" __global__ void rope_kv_write_bf16(float* q, __nv_bfloat16* k_cache, __nv_bfloat16* v_cache,
                                              const float* qkv, const float* cos_table, const float* sin_table,
                                              int B, int n, int H, int KV, int D, int p0, int T_max) {
    rope_kv_write(q, k_cache, v_cache, qkv, cos_table, sin_table, B, n, H, KV, D, p0, T_max);
}

extern "C" __global__ void rope_kv_write_f32(float* q, float* k_cache, float* v_cache, const float* qkv,
                                             const float* cos_table, const float* sin_table, int B, int n, int H,
                                             int KV, int D, int p0, int T_max) {
    rope_kv_write(q, k_cache, v_cache, qkv, cos_table, sin_table, B, n, H, KV, D, p0, T_max);
}

extern "C" __global__ void decode_attention_bf16(float* out, const float* q, const __nv_bfloat16* k_cache,
                                                 const __nv_bfloat16* v_cache, int n, int H, int KV, int D, int p0,
                                                 int T_max) {
    decode_attention(out, q, k_cache, v_cache, n, H, KV, D, p0, T_max);
}

extern "C" __global__ void decode_attention_f32(float* out, const float* q, const float* k_cache,
                                                const float* v_cache, int n, int H, int KV, int D, int p0,
                                                int T_max) {
    decode_attention(out, q, k_cache, v_cache, n, H, KV, D, p0, T_max);
}

extern "C" __global__ void last_positions(float* out, const float* x, int B, int n, int C) {
    const long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;  // over out (B, C)
    if (idx >= (long long)B * C) return;
    const long long b = idx / C, c = idx % C;
    out[idx] = x[(b * n + n - 1) * C + c];
}

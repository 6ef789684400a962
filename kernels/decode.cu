// Generation with a KV cache: the kernels of a decode step that are not GEMVs (kernels/gemv.cu) and the
// prefill's cache write. llama/model/gpu_decoder.py strings them together.
// A step takes n new tokens per sequence at the absolute positions p .. p + n - 1, p = *position read
// from device memory (so that one captured CUDA graph serves every decode step). Per layer the cache
// holds every position's rotated keys and its values, k_cache and v_cache (B, KV, T_max, D) bf16.
//
// embed_tokens:     x (B, C) fp32 = wte[tokens] (wte (V, C) bf16), and rstd (B,) of x for the first RMSNorm.
// last_residual:    x (B, C) fp32 = h + branch at position n - 1 of each sequence (h, branch (B, n, C) bf16:
//                   the prefill's last residual add), and rstd (B,) of x for the final RMSNorm.
// cache_write:      k and v of the packed projection qkv (B, n, (H + 2KV) D) bf16 (k rotated) -> the caches
//                   at positions p .. p + n - 1. One thread per 8 values.
// decode_attention: out (B, n, H D) bf16 = causal attention of query i (position p + i) over cached keys
//                   0 .. p + i: softmax(q . k / sqrt(D)) @ v; query head h reads kv head h / (H / KV).
//                   q (b, i, h, :) at q + (b n + i) q_stride + h D, fp32 (a decode step's) or bf16 (the
//                   packed projection of a prefill chunk). Flash-decoding: grid (splits, KV, B n); block
//                   (s, kv, bi) takes the G = H / KV query heads of kv head kv over the s-th of `splits`
//                   (at most ATT_MAX_SPLITS) equal ranges of the keys, in tiles of ATT_TILE keys with an
//                   online softmax: a thread scores a whole key (16-byte loads), then thread t accumulates
//                   p @ v for 8 dimensions of key group t / (D / 8), groups added in order. With splits > 1
//                   each block writes (max, sum, unnormalized output) per head to `partial`, and the last
//                   block of (kv, bi) to arrive combines the splits in split order: deterministic.
//                   Needs D a multiple of 8, at most ATT_MAX_D.
// advance:          after the sampler wrote ids (B,): history (B, T_max) at p + 1 = ids, *position += 1.
// to_bf16:          out (n,) bf16 = in (n,) fp32 rounded to nearest even (the decoder's copy of fp32 weights).
#include <cstdint>
#include "bf16.cuh"

#define ATT_THREADS 128
#define ATT_TILE 128   // keys scored at once
#define ATT_MAX_HEADS 8  // query heads per kv head
#define ATT_MAX_D 128
#define ATT_MAX_SPLITS 64

// x (C,) fp32 of one row is written by the block; every thread gets 1 / sqrt(mean(x^2) + eps)
__device__ __forceinline__ float row_rstd(float squares, int C, float eps) {
    return rsqrtf(block_sum(squares) / C + eps);
}

extern "C" __global__ void embed_tokens(float* x, float* rstd, const int* tokens, const bf16* wte, int C, float eps) {
    const int b = blockIdx.x;  // one block per sequence
    const bf16* row = wte + (long long)tokens[b] * C;
    float squares = 0.0f;
    for (int c = threadIdx.x; c < C; c += blockDim.x) {
        const float v = __bfloat162float(row[c]);
        x[(long long)b * C + c] = v;
        squares += v * v;
    }
    const float r = row_rstd(squares, C, eps);
    if (threadIdx.x == 0) rstd[b] = r;
}

extern "C" __global__ void last_residual(float* x, float* rstd, const bf16* h, const bf16* branch, int n, int C,
                                         float eps) {
    const int b = blockIdx.x;
    const long long last = ((long long)b * n + n - 1) * C;
    float squares = 0.0f;
    for (int c = threadIdx.x; c < C; c += blockDim.x) {
        const float v = __bfloat162float(h[last + c]) + __bfloat162float(branch[last + c]);
        x[(long long)b * C + c] = v;
        squares += v * v;
    }
    const float r = row_rstd(squares, C, eps);
    if (threadIdx.x == 0) rstd[b] = r;
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

template <typename QT>
__device__ void decode_attention(bf16* out, float* partial, unsigned int* counters, const QT* q, int q_stride,
                                 const bf16* k_cache, const bf16* v_cache, const int* position, int n, int H, int KV,
                                 int D, int T_max) {
    __shared__ float q_rows[ATT_MAX_HEADS][ATT_MAX_D];  // scaled by 1 / sqrt(D)
    __shared__ float probs[ATT_MAX_HEADS][ATT_TILE];
    __shared__ float running_max[ATT_MAX_HEADS], running_sum[ATT_MAX_HEADS], correction[ATT_MAX_HEADS];
    __shared__ float group_acc[ATT_THREADS * 8 * ATT_MAX_HEADS];  // (groups, G, D): groups * D = 8 * threads
    __shared__ float split_weight[ATT_MAX_HEADS][ATT_MAX_SPLITS];
    const int split = blockIdx.x, splits = gridDim.x, kv = blockIdx.y, bi = blockIdx.z;
    const int b = bi / n, i = bi % n, G = H / KV, tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    const int length = *position + i + 1;  // keys 0 .. p + i
    const int chunk = (length + splits - 1) / splits;
    const int begin = min(length, split * chunk), end = min(length, begin + chunk);
    const float scale = rsqrtf((float)D);
    for (int e = tid; e < G * D; e += ATT_THREADS)
        q_rows[e / D][e % D] = to_float(q[((long long)b * n + i) * q_stride + (kv * G + e / D) * D + e % D]) * scale;
    if (tid < G) running_max[tid] = -INFINITY, running_sum[tid] = 0.0f;
    const long long base = ((long long)b * KV + kv) * T_max * D;
    const bf16* keys = k_cache + base;
    const bf16* values = v_cache + base;
    // p @ v: thread t owns 8 dimensions (vector t % vectors) of key group t / vectors
    const int vectors = D / 8, groups = ATT_THREADS / vectors, vec = tid % vectors, group = tid / vectors;
    float acc[ATT_MAX_HEADS][8] = {};
    __syncthreads();
    for (int start = begin; start < end; start += ATT_TILE) {
        const int count = min(ATT_TILE, end - start);
        if (tid < count) {  // a thread scores key start + tid
            const bf16* key = keys + (long long)(start + tid) * D;
            float dot[ATT_MAX_HEADS] = {};
#pragma unroll 4
            for (int c = 0; c < D; c += 8) {
                float k8[8];
                load_bf16x8(k8, key + c);
#pragma unroll
                for (int g = 0; g < ATT_MAX_HEADS; g++)
                    if (g < G)
#pragma unroll
                        for (int j = 0; j < 8; j++) dot[g] += q_rows[g][c + j] * k8[j];
            }
#pragma unroll
            for (int g = 0; g < ATT_MAX_HEADS; g++)
                if (g < G) probs[g][tid] = dot[g];
        }
        __syncthreads();
        for (int g = warp; g < G; g += ATT_THREADS / 32) {  // online softmax, a warp per head
            float m = running_max[g];
            for (int jj = lane; jj < count; jj += 32) m = fmaxf(m, probs[g][jj]);
            m = warp_max(m);
            float sum = 0.0f;
            for (int jj = lane; jj < count; jj += 32) {
                const float p = expf(probs[g][jj] - m);
                probs[g][jj] = p;
                sum += p;
            }
            sum = warp_sum(sum);
            if (lane == 0) {
                correction[g] = expf(running_max[g] - m);  // 0 on the first tile
                running_sum[g] = running_sum[g] * correction[g] + sum;
                running_max[g] = m;
            }
        }
        __syncthreads();
        if (group < groups) {
#pragma unroll
            for (int g = 0; g < ATT_MAX_HEADS; g++)
#pragma unroll
                for (int j = 0; j < 8; j++) acc[g][j] *= g < G ? correction[g] : 0.0f;
#pragma unroll 2
            for (int jj = group; jj < count; jj += groups) {
                float v8[8];
                load_bf16x8(v8, values + (long long)(start + jj) * D + 8 * vec);
#pragma unroll
                for (int g = 0; g < ATT_MAX_HEADS; g++)
                    if (g < G)
#pragma unroll
                        for (int j = 0; j < 8; j++) acc[g][j] += probs[g][jj] * v8[j];
            }
        }
        __syncthreads();  // probs and the corrections are rewritten by the next tile
    }
    if (group < groups)
#pragma unroll
        for (int g = 0; g < ATT_MAX_HEADS; g++)
            if (g < G)
#pragma unroll
                for (int j = 0; j < 8; j++) group_acc[(group * G + g) * D + 8 * vec + j] = acc[g][j];
    __syncthreads();
    // this block's (max, sum, output) per head; the output of head g, dimension e % D is the key groups' sum
    const int record = D + 2;  // a split's record per head in `partial`: output (D), max, sum
    float* mine = partial + (((long long)bi * KV + kv) * splits + split) * G * record;
    for (int e = tid; e < G * D; e += ATT_THREADS) {
        const int g = e / D;
        float o = 0.0f;
        for (int k = 0; k < groups; k++) o += group_acc[(k * G + g) * D + e % D];
        if (splits == 1)
            out[((long long)bi * H + kv * G + g) * D + e % D] = __float2bfloat16(o / running_sum[g]);
        else
            mine[g * record + e % D] = o;
    }
    if (splits == 1) return;
    if (tid < G) mine[tid * record + D] = running_max[tid], mine[tid * record + D + 1] = running_sum[tid];
    if (!arrive_last(counters + (long long)bi * KV + kv, splits)) return;
    // the last block: a warp per head finds the splits' weights exp(max_s - max), then every thread adds
    // the splits' outputs for its (head, dimension) in split order
    const float* all = partial + ((long long)bi * KV + kv) * splits * G * record;
    __shared__ float total[ATT_MAX_HEADS];
    for (int g = warp; g < G; g += ATT_THREADS / 32) {
        float m = -INFINITY;  // an empty split's max is -inf: its weight is 0
        for (int s = lane; s < splits; s += 32) m = fmaxf(m, __ldcg(all + (s * G + g) * record + D));
        m = warp_max(m);
        float sum = 0.0f;
        for (int s = lane; s < splits; s += 32) {
            const float w = expf(__ldcg(all + (s * G + g) * record + D) - m);
            split_weight[g][s] = w;
            sum += w * __ldcg(all + (s * G + g) * record + D + 1);
        }
        sum = warp_sum(sum);
        if (lane == 0) total[g] = sum;
    }
    __syncthreads();
    for (int e = tid; e < G * D; e += ATT_THREADS) {
        const int g = e / D;
        float o = 0.0f;
#pragma unroll 8
        for (int s = 0; s < splits; s++) o += split_weight[g][s] * __ldcg(all + (s * G + g) * record + e % D);
        out[((long long)bi * H + kv * G + g) * D + e % D] = __float2bfloat16(o / total[g]);
    }
}

extern "C" __global__ void __launch_bounds__(ATT_THREADS) decode_attention_f32q(
        bf16* out, float* partial, unsigned int* counters, const float* q, int q_stride, const bf16* k_cache,
        const bf16* v_cache, const int* position, int n, int H, int KV, int D, int T_max) {
    decode_attention(out, partial, counters, q, q_stride, k_cache, v_cache, position, n, H, KV, D, T_max);
}

extern "C" __global__ void __launch_bounds__(ATT_THREADS) decode_attention_bf16q(
        bf16* out, float* partial, unsigned int* counters, const bf16* q, int q_stride, const bf16* k_cache,
        const bf16* v_cache, const int* position, int n, int H, int KV, int D, int T_max) {
    decode_attention(out, partial, counters, q, q_stride, k_cache, v_cache, position, n, H, KV, D, T_max);
}

extern "C" __global__ void advance(int* history, int* position, const int* ids, int B, int T_max) {
    const int p = *position;
    for (int b = threadIdx.x; b < B; b += blockDim.x)
        if (p + 1 < T_max) history[(long long)b * T_max + p + 1] = ids[b];
    __syncthreads();  // every thread has read the position
    if (threadIdx.x == 0) *position = p + 1;
}

extern "C" __global__ void to_bf16(bf16* out, const float* in, long long n) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        out[i] = __float2bfloat16(in[i]);
}

// RoPE (Meta's interleaved pairs) fused with the split of the qkv projection into heads.
// qkv (B, T, (H + 2*KV) * D): per position, H query heads, then KV key heads, then KV value heads.
// rope_forward:  q (B, H, T, D), k (B, KV, T, D) rotated; v (B, KV, T, D) copied.
//   Pair i of position t: (x0, x1) -> (x0 cos - x1 sin, x0 sin + x1 cos), cos/sin (T_max, D/2)
//   holding cos(t * freq_i) and sin(t * freq_i) with Llama 3.1's scaled frequencies.
// rope_backward: dqkv from dq, dk, dv, rotating back by the negative angle.
// One thread per pair of one head slot: B * T * (H + 2*KV) * D/2 threads.
#include "common.cuh"
#include "rope.cuh"

struct PairIndex {
    int b, t, slot, i;
};

__device__ __forceinline__ PairIndex pair_index(long long idx, int T, int slots, int half) {
    PairIndex p;
    p.i = idx % half;
    idx /= half;
    p.slot = idx % slots;
    idx /= slots;
    p.t = idx % T;
    p.b = idx / T;
    return p;
}

// where the pair lives in the head-major q, k or v tensor, and whether it rotates
__device__ __forceinline__ float* head_pair(float* q, float* k, float* v, PairIndex p, int T, int H, int KV, int D,
                                            bool* rotate) {
    *rotate = p.slot < H + KV;
    if (p.slot < H) return q + (((long long)p.b * H + p.slot) * T + p.t) * D + 2 * p.i;
    if (p.slot < H + KV) return k + (((long long)p.b * KV + p.slot - H) * T + p.t) * D + 2 * p.i;
    return v + (((long long)p.b * KV + p.slot - H - KV) * T + p.t) * D + 2 * p.i;
}

extern "C" __global__ void rope_forward(float* q, float* k, float* v, const float* qkv, const float* cos_table,
                                        const float* sin_table, int B, int T, int H, int KV, int D) {
    const int slots = H + 2 * KV, half = D / 2;
    const long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (long long)B * T * slots * half) return;
    const PairIndex p = pair_index(idx, T, slots, half);
    const float* in = qkv + (((long long)p.b * T + p.t) * slots + p.slot) * D + 2 * p.i;
    bool rotate;
    float* out = head_pair(q, k, v, p, T, H, KV, D, &rotate);
    float x0 = in[0], x1 = in[1];
    if (rotate) {
        rope_rotate(x0, x1, cos_table[p.t * half + p.i], sin_table[p.t * half + p.i]);
        out[0] = x0;
        out[1] = x1;
    } else {  // v: copied
        out[0] = x0;
        out[1] = x1;
    }
}

extern "C" __global__ void rope_backward(float* dqkv, const float* dq, const float* dk, const float* dv,
                                         const float* cos_table, const float* sin_table, int B, int T, int H,
                                         int KV, int D) {
    const int slots = H + 2 * KV, half = D / 2;
    const long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (long long)B * T * slots * half) return;
    const PairIndex p = pair_index(idx, T, slots, half);
    bool rotate;
    const float* in = head_pair(const_cast<float*>(dq), const_cast<float*>(dk), const_cast<float*>(dv), p, T, H, KV,
                                D, &rotate);
    float* out = dqkv + (((long long)p.b * T + p.t) * slots + p.slot) * D + 2 * p.i;
    float d0 = in[0], d1 = in[1];
    if (rotate) {
        rope_rotate_back(d0, d1, cos_table[p.t * half + p.i], sin_table[p.t * half + p.i]);
        out[0] = d0;
        out[1] = d1;
    } else {  // v: copied
        out[0] = d0;
        out[1] = d1;
    }
}

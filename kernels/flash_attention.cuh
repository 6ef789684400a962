// What the flash attention builds share (flash_attention.cu on mma.sync, flash_attention_wgmma.cu on Hopper):
// the layouts, the bf16 pair helpers, the row store with the fused inverse RoPE, and the backward's delta.
//
// Layouts (B batch, T time, H query heads, KV key/value heads, D head dim, 64 or 128):
//   qkv   (B, T, (H + 2*KV) * D) bf16: per token [q heads 0..H-1 | k heads 0..KV-1 | v heads 0..KV-1],
//         q and k already rotated by RoPE (the QKV projection's output, read in place: no split, no copy).
//         Query head h reads kv head h / (H / KV).
//   out   (B, T, H * D) bf16, ready for the output projection.
//   lse   (B, H, T) fp32: natural-log log-sum-exp of each row of scaled scores s = q.k / sqrt(D).
//   dout  (B, T, H * D) bf16; delta (B, H, T) fp32 = rowsum(dout * out), a scratch of the backward.
//   dqkv  (B, T, (H + 2*KV) * D) bf16, packed like qkv; dk, dv of a kv head summed over its query heads.
//   cos, sin (T_max, D/2) fp32, optional (null: none): dq and dk leave rotated back by RoPE's inverse
//         (pair (2i, 2i+1) of position t: (d0, d1) -> (d0 c + d1 s, -d0 s + d1 c)), so dqkv is the
//         gradient of the QKV projection's output before RoPE.
#pragma once
#include <cuda_bf16.h>
#include <stdint.h>

#include "common.cuh"
#include "rope.cuh"

typedef __nv_bfloat16 bf16;

#define LOG2E 1.4426950408889634f
#define LN2 0.6931471805599453f

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
}

__device__ __forceinline__ float2 unpack_bf16(uint32_t pair) {
    return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&pair));
}

// write a warp's 16 x D accumulator rows (times scale) as bf16 rows of `dst` (rows `stride` apart, first
// row at position pos0), rows at or past T skipped; with cos/sin, each pair (2i, 2i+1) rotated back by RoPE
template <int D>
__device__ __forceinline__ void store_rows(bf16* dst, long long stride, const float acc[][4], float scale, int pos0,
                                           int T, const float* cos_table, const float* sin_table, int lane) {
    const int g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const int pos = pos0 + g + 8 * half;
        if (pos >= T) continue;
#pragma unroll
        for (int n = 0; n < D / 8; ++n) {
            float d0 = acc[n][2 * half] * scale, d1 = acc[n][2 * half + 1] * scale;
            if (cos_table != nullptr) {
                const int pair = pos * (D / 2) + n * 4 + t;
                rope_rotate_back(d0, d1, cos_table[pair], sin_table[pair]);
            }
            *reinterpret_cast<uint32_t*>(dst + pos * stride + n * 8 + 2 * t) = pack_bf16(d0, d1);
        }
    }
}

// ---- backward

// delta (B, H, T) = rowsum(dout * out) over each head's D values; one warp per (b, t, h), rows = B * T * H
__device__ __forceinline__ void flash_backward_delta(float* delta, const bf16* dout, const bf16* out, int rows, int T,
                                                     int H, int D) {
    const int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32, lane = threadIdx.x % 32;
    if (row >= rows) return;
    const long long base = (long long)row * D;
    float sum = 0.0f;
    for (int d = 2 * lane; d < D; d += 64) {
        const float2 g = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(dout + base + d));
        const float2 o = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(out + base + d));
        sum += g.x * o.x + g.y * o.y;
    }
    sum = warp_sum(sum);
    const int h = row % H, t = (row / H) % T, b = row / (H * T);
    if (lane == 0) delta[((long long)b * H + h) * T + t] = sum;
}
#define FLASH_DELTA_ENTRY                                                                                          \
    extern "C" __global__ void flash_attention_backward_delta(float* delta, const bf16* dout, const bf16* out,    \
                                                              int rows, int T, int H, int D) {                     \
        flash_backward_delta(delta, dout, out, rows, T, H, D);                                                     \
    }
// the entry point here, unless the including file defines it itself (flash_attention_wgmma.cu: under its build
// unit's guard, llama/runtime/kernel_build.py)
#ifndef FLASH_DELTA_ENTRY_GUARDED
FLASH_DELTA_ENTRY
#endif


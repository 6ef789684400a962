// Helpers for the bf16 mixed-precision kernels.
// - 16-byte vectors: 8 bf16 in one uint4, converted to and from 8 floats (float to bf16 rounds to
//   nearest even). The kernels compute in fp32 and move memory in these vectors.
// - row_sum: a sum over the threads of one row of a 2D block (threadIdx.y picks the row).
// - sum_partial_rows: out (C,) = or += the rows of partial (P, C) added in order, a block's last step.
// - arrive_last: the handshake that lets the last block of a launch (or of a group of blocks) finish
//   a reduction over the others' partial results, so a deterministic reduction takes one launch.
#pragma once
#include <cuda_bf16.h>
#include "common.cuh"

typedef __nv_bfloat16 bf16;

__device__ __forceinline__ void unpack_bf16x8(float out[8], uint4 raw) {
    const __nv_bfloat162* pairs = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
    for (int k = 0; k < 4; k++) {
        const float2 f = __bfloat1622float2(pairs[k]);
        out[2 * k] = f.x;
        out[2 * k + 1] = f.y;
    }
}

__device__ __forceinline__ uint4 pack_bf16x8(const float in[8]) {
    uint4 raw;
    __nv_bfloat162* pairs = reinterpret_cast<__nv_bfloat162*>(&raw);
#pragma unroll
    for (int k = 0; k < 4; k++) pairs[k] = __floats2bfloat162_rn(in[2 * k], in[2 * k + 1]);
    return raw;
}

// p must be 16-byte aligned
__device__ __forceinline__ void load_bf16x8(float out[8], const bf16* p) {
    unpack_bf16x8(out, *reinterpret_cast<const uint4*>(p));
}

__device__ __forceinline__ void store_bf16x8(bf16* p, const float in[8]) {
    *reinterpret_cast<uint4*>(p) = pack_bf16x8(in);
}

// 8 consecutive floats, as two 16-byte vectors
__device__ __forceinline__ void load_f32x8(float out[8], const float* p) {
    const float4 a = reinterpret_cast<const float4*>(p)[0], b = reinterpret_cast<const float4*>(p)[1];
    out[0] = a.x, out[1] = a.y, out[2] = a.z, out[3] = a.w, out[4] = b.x, out[5] = b.y, out[6] = b.z, out[7] = b.w;
}

__device__ __forceinline__ void store_f32x8(float* p, const float in[8]) {
    reinterpret_cast<float4*>(p)[0] = make_float4(in[0], in[1], in[2], in[3]);
    reinterpret_cast<float4*>(p)[1] = make_float4(in[4], in[5], in[6], in[7]);
}

// the same through L2 only (__ldcg): for partial results that other blocks of this launch wrote
__device__ __forceinline__ void load_f32x8_l2(float out[8], const float* p) {
    const float4 a = __ldcg(reinterpret_cast<const float4*>(p)), b = __ldcg(reinterpret_cast<const float4*>(p) + 1);
    out[0] = a.x, out[1] = a.y, out[2] = a.z, out[3] = a.w, out[4] = b.x, out[5] = b.y, out[6] = b.z, out[7] = b.w;
}

// Sum over the threads of row threadIdx.y of the block, in a fixed order; every thread of the row
// gets it. blockDim.x must be a multiple of 32 and every thread of the block must call it.
template <typename T>
__device__ __forceinline__ T row_sum(T v) {
    __shared__ T partial[32];
    const int warps_per_row = blockDim.x / 32, lane = threadIdx.x % 32;
    v = warp_sum(v);
    __syncthreads();  // partial[] may still be read by an earlier call
    if (lane == 0) partial[threadIdx.y * warps_per_row + threadIdx.x / 32] = v;
    __syncthreads();
    T total = T(0);
    for (int w = 0; w < warps_per_row; w++) total += partial[threadIdx.y * warps_per_row + w];
    return total;
}

#define PARTIAL_ROWS_IN_FLIGHT 4  // partial rows loaded before they are added (in order), so L2 latency overlaps

// out (C,) = (or +=) the sum of the P rows of partial (P, C) in order; all threads of the block
__device__ void sum_partial_rows(float* out, const float* partial, int P, int C, bool accumulate) {
    const int threads = blockDim.x * blockDim.y;
    for (int c = (threadIdx.y * blockDim.x + threadIdx.x) * 8; c < C; c += threads * 8) {
        float sum[8] = {};
        for (int p0 = 0; p0 < P; p0 += PARTIAL_ROWS_IN_FLIGHT) {
            float v[PARTIAL_ROWS_IN_FLIGHT][8];
#pragma unroll
            for (int u = 0; u < PARTIAL_ROWS_IN_FLIGHT; u++)
                if (p0 + u < P) load_f32x8_l2(v[u], partial + (long long)(p0 + u) * C + c);
#pragma unroll
            for (int u = 0; u < PARTIAL_ROWS_IN_FLIGHT; u++)
                if (p0 + u < P)
                    for (int k = 0; k < 8; k++) sum[k] += v[u][k];
        }
        if (accumulate) {
            float o[8];
            load_f32x8(o, out + c);
            for (int k = 0; k < 8; k++) sum[k] += o[k];
        }
        store_f32x8(out + c, sum);
    }
}

// True in the block that arrives last at `counter` among `blocks` arrivals. Every thread of the block
// calls it after writing the partial results that the last block will read (with __ldcg). The counter
// wraps back to zero on the last arrival, so it is ready for the next launch; it must be zero before
// the first one (allocate it zeroed).
__device__ __forceinline__ bool arrive_last(unsigned int* counter, unsigned int blocks) {
    __shared__ bool last;
    __threadfence();  // this block's partial results are visible device-wide before it is counted
    __syncthreads();
    if (threadIdx.x == 0 && threadIdx.y == 0) last = atomicInc(counter, blocks - 1) == blocks - 1;
    __syncthreads();
    return last;
}

// Helpers shared by the kernels: warp and block reductions.
// Block reductions need blockDim.x to be a multiple of 32 (at most 1024); every thread gets the result.
#pragma once
#include <cuda_runtime.h>
#include <math.h>

template <typename T>
__device__ __forceinline__ T warp_sum(T v) {
    for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
    for (int offset = 16; offset > 0; offset >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
    return v;
}

// sum over the block, in a fixed order (deterministic for a fixed block size); float or double
template <typename T>
__device__ __forceinline__ T block_sum(T v) {
    __shared__ T partial[32];
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    v = warp_sum(v);
    __syncthreads();  // partial[] may still be read by an earlier call
    if (lane == 0) partial[warp] = v;
    __syncthreads();
    return warp_sum(lane < blockDim.x / 32 ? partial[lane] : T(0));
}

__device__ __forceinline__ float block_max(float v) {
    __shared__ float partial[32];
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    v = warp_max(v);
    __syncthreads();
    if (lane == 0) partial[warp] = v;
    __syncthreads();
    return warp_max(lane < blockDim.x / 32 ? partial[lane] : -INFINITY);
}

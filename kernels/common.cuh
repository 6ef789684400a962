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

// Programmatic dependent launch (sm_90). A kernel launched with dependent=True (llama/runtime/cuda.py) may start
// while the kernel before it on the stream is still running: until wait_for_previous_grid() returns it
// must not read what that kernel writes (it may read weights, or prefetch them), and after it the
// earlier kernel's writes are visible. allow_next_grid() lets the next dependent launch start its own
// blocks early; call it after waiting, so that launches run at most one kernel ahead. Both are no-ops
// for a kernel launched the ordinary way, and on GPUs before sm_90.
__device__ __forceinline__ void wait_for_previous_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void allow_next_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// Start bringing `bytes` (a multiple of 16) from p (16-byte aligned) into L2, without waiting (sm_90).
__device__ __forceinline__ void prefetch_l2(const void* p, unsigned int bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p), "r"(bytes) : "memory");
#endif
}

// Thread-block clusters (sm_90; a launch with a cluster shape, llama/runtime/cuda.py's cluster=): this block's
// rank in its cluster, a barrier of all the cluster's threads (writes to shared memory before it are
// seen by every block of the cluster after it), and a float read from (written to) the shared memory
// of block `rank` at the address that `p` has in this block. Not available before sm_90 (launch
// without clusters there).
__device__ __forceinline__ unsigned int cluster_rank() {
    unsigned int rank = 0;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(rank));
#endif
    return rank;
}

__device__ __forceinline__ void cluster_barrier() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("barrier.cluster.arrive.release;\nbarrier.cluster.wait.acquire;" ::: "memory");
#endif
}

__device__ __forceinline__ float cluster_load(const float* p, unsigned int rank) {
    float v = 0.0f;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    const unsigned int local = static_cast<unsigned int>(__cvta_generic_to_shared(p));
    asm volatile("{\n.reg .b32 remote;\nmapa.shared::cluster.u32 remote, %1, %2;\nld.shared::cluster.f32 %0, [remote];\n}"
                 : "=f"(v) : "r"(local), "r"(rank) : "memory");
#endif
    return v;
}

__device__ __forceinline__ void cluster_store(float* p, unsigned int rank, float v) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    const unsigned int local = static_cast<unsigned int>(__cvta_generic_to_shared(p));
    asm volatile("{\n.reg .b32 remote;\nmapa.shared::cluster.u32 remote, %0, %1;\nst.shared::cluster.f32 [remote], %2;\n}"
                 :: "r"(local), "r"(rank), "f"(v) : "memory");
#endif
}

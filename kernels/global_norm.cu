// Global gradient norm, deterministic: a fixed grid of blocks sums squares over grid-stride slices
// of the flat buffer into partial (gridDim.x,), then one block adds the partials in a fixed order.
// global_norm_partial: partial[block] = sum of x^2 over this block's slice of x (n,).
// global_norm_finish:  out[0] = sum of partial (P,); AdamW reads it on the device to clip.
#include "common.cuh"

extern "C" __global__ void global_norm_partial(float* partial, const float* x, long long n) {
    float acc = 0.0f;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        acc += x[i] * x[i];
    acc = block_sum(acc);
    if (threadIdx.x == 0) partial[blockIdx.x] = acc;
}

extern "C" __global__ void global_norm_finish(float* out, const float* partial, int P) {
    float acc = 0.0f;
    for (int i = threadIdx.x; i < P; i += blockDim.x) acc += partial[i];
    acc = block_sum(acc);
    if (threadIdx.x == 0) out[0] = acc;
}

// Global gradient norm, deterministic: a fixed grid of blocks sums squares over grid-stride slices
// of the flat buffer into partial (gridDim.x,), then one block adds the partials in a fixed order.
// global_norm_partial: partial[block] = sum of x^2 over this block's slice of x (n,).
// global_norm_finish:  out[0] = sum of partial (P,); AdamW reads it on the device to clip.
//
// global_norm_squared_bf16: the same sum in one launch (x 16-byte aligned, int64 n). Each thread sums squares
//   over a grid-stride slice of float4 vectors, 4 loads in flight, 16 squares at a time in fp32 and
//   those in double; the block adds its threads' sums in double into partial[block], and the last
//   block to finish (counter: zero before and after the launch) adds the partials in a fixed order
//   into out[0]. The grid is fixed (ops.NORM_BLOCKS), so the result is the same on every GPU.
//   The n % 4 tail goes to block 0.
//
// clip_norm_estimate: the squared norm the optimizer in the backward clips group g's update by: the sum of
//   this step's squared norms of the groups g..n-1 the backward has finished (current) and of the last
//   step's of the others (previous (n,), zeros before the first step). One thread, in a fixed order:
//   llama/optim.py's clip_norm_estimate.
#include "bf16.cuh"

#define GRAD_NORM_UNROLL 4

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

extern "C" __global__ void __launch_bounds__(256) global_norm_squared_bf16(float* out, double* partial, unsigned int* counter,
                                                                   const float* x, long long n) {
    const float4* x4 = reinterpret_cast<const float4*>(x);
    const long long vectors = n / 4, stride = (long long)gridDim.x * blockDim.x;
    double acc = 0.0;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < vectors; i += GRAD_NORM_UNROLL * stride) {
        float4 v[GRAD_NORM_UNROLL];
#pragma unroll
        for (int u = 0; u < GRAD_NORM_UNROLL; u++)
            v[u] = i + u * stride < vectors ? x4[i + u * stride] : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        float sum = 0.0f;  // 16 squares in fp32, then into the double
#pragma unroll
        for (int u = 0; u < GRAD_NORM_UNROLL; u++)
            sum += v[u].x * v[u].x + v[u].y * v[u].y + v[u].z * v[u].z + v[u].w * v[u].w;
        acc += sum;
    }
    if (blockIdx.x == 0 && threadIdx.x < n - vectors * 4) {
        const float t = x[vectors * 4 + threadIdx.x];
        acc += t * t;
    }
    const double block_total = block_sum(acc);
    if (threadIdx.x == 0) partial[blockIdx.x] = block_total;
    if (!arrive_last(counter, gridDim.x)) return;
    double total = 0.0;
    for (int b = threadIdx.x; b < gridDim.x; b += blockDim.x) total += __ldcg(partial + b);
    total = block_sum(total);
    if (threadIdx.x == 0) out[0] = (float)total;
}

extern "C" __global__ void clip_norm_estimate(float* out, const float* current, const float* previous, int g, int n) {
    if (threadIdx.x != 0) return;
    float finished = 0.0f, unfinished_last = 0.0f;
    for (int i = g; i < n; i++) finished += current[i];
    for (int i = 0; i < g; i++) unfinished_last += previous[i];
    out[0] = finished + unfinished_last;
}

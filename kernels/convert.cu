// Precision conversions: the gradients reduce-scattered in bf16 (--reduce-dtype bf16, llama/parallel/zero.py) are
// rounded from fp32 before the collective and widened back into the fp32 shard after it; the decoder rounds its
// bf16 copy of fp32 weights (llama/model/gpu_decoder.py).
// round_to_bf16: out (n,) bf16 = x (n,) fp32, rounded to nearest even.
// widen_bf16: out (n,) fp32 = x (n,) bf16, or out += x with accumulate (a later micro-batch's reduction).
#include "common.cuh"
#include "bf16.cuh"

extern "C" __global__ void round_to_bf16(bf16* out, const float* x, long long n) {
    const long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx < n) out[idx] = __float2bfloat16_rn(x[idx]);
}

extern "C" __global__ void widen_bf16(float* out, const bf16* x, long long n, int accumulate) {
    const long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx < n) out[idx] = (accumulate ? out[idx] : 0.0f) + __bfloat162float(x[idx]);
}

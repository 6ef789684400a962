// SwiGLU: gate_up (N, 2F) holds [gate | up] per row (the fused w1 | w3 projection).
// swiglu_forward:  out (N, F) = silu(gate) * up, silu(g) = g * sigmoid(g).
// swiglu_backward: dgate_up (N, 2F): dgate = dout * up * s * (1 + g * (1 - s)), dup = dout * silu(g).
#include "common.cuh"

extern "C" __global__ void swiglu_forward(float* out, const float* gate_up, int N, int F) {
    const long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (long long)N * F) return;
    const long long n = idx / F, f = idx % F;
    const float g = gate_up[n * 2 * F + f], u = gate_up[n * 2 * F + F + f];
    out[idx] = g / (1.0f + expf(-g)) * u;
}

extern "C" __global__ void swiglu_backward(float* dgate_up, const float* dout, const float* gate_up, int N, int F) {
    const long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (long long)N * F) return;
    const long long n = idx / F, f = idx % F;
    const float g = gate_up[n * 2 * F + f], u = gate_up[n * 2 * F + F + f];
    const float s = 1.0f / (1.0f + expf(-g)), d = dout[idx];
    dgate_up[n * 2 * F + f] = d * u * s * (1.0f + g * (1.0f - s));
    dgate_up[n * 2 * F + F + f] = d * g * s;
}

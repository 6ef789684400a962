// SwiGLU: gate_up (N, 2F) holds [gate | up] per row (the fused w1 | w3 projection).
// swiglu_forward:  out (N, F) = silu(gate) * up, silu(g) = g * sigmoid(g).
// swiglu_backward: dgate_up (N, 2F): dgate = dout * up * s * (1 + g * (1 - s)), dup = dout * silu(g).
// bf16 versions (F a multiple of 8): one thread per 8 columns f..f+7 of one row, reading gate and up
// (and dout) and writing out (or dgate and dup) in 16-byte vectors; fp32 math.
#include "bf16.cuh"
#include "swiglu.cuh"

extern "C" __global__ void swiglu_forward(float* out, const float* gate_up, int N, int F) {
    const long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (long long)N * F) return;
    const long long n = idx / F, f = idx % F;
    const float g = gate_up[n * 2 * F + f], u = gate_up[n * 2 * F + F + f];
    out[idx] = swiglu_value(g, u);
}

extern "C" __global__ void swiglu_backward(float* dgate_up, const float* dout, const float* gate_up, int N, int F) {
    const long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (long long)N * F) return;
    const long long n = idx / F, f = idx % F;
    const float g = gate_up[n * 2 * F + f], u = gate_up[n * 2 * F + F + f];
    swiglu_gradients(g, u, dout[idx], dgate_up[n * 2 * F + f], dgate_up[n * 2 * F + F + f]);
}

extern "C" __global__ void swiglu_forward_bf16(bf16* out, const bf16* gate_up, int N, int F) {
    const long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const int vectors_per_row = F / 8;
    if (idx >= (long long)N * vectors_per_row) return;
    const long long n = idx / vectors_per_row, f = idx % vectors_per_row * 8;
    float g[8], u[8], o[8];
    load_bf16x8(g, gate_up + n * 2 * F + f);
    load_bf16x8(u, gate_up + n * 2 * F + F + f);
    for (int k = 0; k < 8; k++) o[k] = swiglu_value(g[k], u[k]);
    store_bf16x8(out + n * F + f, o);
}

extern "C" __global__ void swiglu_backward_bf16(bf16* dgate_up, const bf16* dout, const bf16* gate_up, int N, int F) {
    const long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const int vectors_per_row = F / 8;
    if (idx >= (long long)N * vectors_per_row) return;
    const long long n = idx / vectors_per_row, f = idx % vectors_per_row * 8;
    float g[8], u[8], d[8], dg[8], du[8];
    load_bf16x8(g, gate_up + n * 2 * F + f);
    load_bf16x8(u, gate_up + n * 2 * F + F + f);
    load_bf16x8(d, dout + n * F + f);
    for (int k = 0; k < 8; k++) swiglu_gradients(g[k], u[k], d[k], dg[k], du[k]);
    store_bf16x8(dgate_up + n * 2 * F + f, dg);
    store_bf16x8(dgate_up + n * 2 * F + F + f, du);
}

// SwiGLU's arithmetic, one definition for every kernel that computes it (swiglu.cu's four kernels and the
// decode GEMV's SwiGLU epilogue, gemv.cu): fp32, the same operations in the same order.
#pragma once

// silu(g) * u, silu(g) = g * sigmoid(g)
__device__ __forceinline__ float swiglu_value(float g, float u) { return g / (1.0f + expf(-g)) * u; }

// the gradients of silu(g) * u for an output gradient d: dg = d * u * s * (1 + g * (1 - s)), du = d * silu(g)
__device__ __forceinline__ void swiglu_gradients(float g, float u, float d, float& dg, float& du) {
    const float s = 1.0f / (1.0f + expf(-g));
    dg = d * u * s * (1.0f + g * (1.0f - s));
    du = d * g * s;
}

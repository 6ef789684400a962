// RoPE's rotation (Meta's interleaved pairs), defined once for every kernel that rotates: rope.cu (the fp32
// path's split of the qkv projection), gemm_epilogue.cuh (the bf16 QKV projection's epilogue), gemv.cu (the
// decoder's QKV GEMV) and flash_attention.cuh (the backward's fused inverse).
// Pair i of position t: (x0, x1) -> (x0 c - x1 s, x0 s + x1 c), c = cos(t * freq_i), s = sin(t * freq_i),
// read from the (T_max, D/2) tables at t * D/2 + i. The inverse rotates by the negative angle.
#pragma once

__device__ __forceinline__ void rope_rotate(float& x0, float& x1, float c, float s) {
    const float r0 = x0 * c - x1 * s, r1 = x0 * s + x1 * c;
    x0 = r0;
    x1 = r1;
}

__device__ __forceinline__ void rope_rotate_back(float& d0, float& d1, float c, float s) {
    const float r0 = d0 * c + d1 * s, r1 = d1 * c - d0 * s;
    d0 = r0;
    d1 = r1;
}

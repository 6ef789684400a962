// The bf16 GEMMs' shared epilogue: what happens to each pair of adjacent accumulator columns
// (col, col + 1) of row `row`, col even. Both the mma.sync and the wgmma kernels hold their
// fp32 accumulators as such pairs, so a fused epilogue is one more mode here, not a new kernel.
//
// Modes (a run-time switch, uniform across the grid):
//   EPILOGUE_BF16      C (bf16) = alpha * acc
//   EPILOGUE_F32       C (fp32) = alpha * acc
//   EPILOGUE_ACC_F32   C (fp32) += alpha * acc   (weight gradients summed over micro-batches)
//   EPILOGUE_ROPE_BF16 C (bf16) = RoPE(alpha * acc) on the first rope_cols columns, plain bf16 after:
//                      the QKV projection, rows = tokens b * T + t (position t = row % rope_T),
//                      columns = heads of head_dim, pairs (2i, 2i + 1) rotated by cos/sin (T, D/2).
// FP8 GEMMs (row-wise scaling) also multiply acc by row_scales[row] * col_scales[col] first: the scales of
// A's rows and B's rows that their FP8 casts were divided by (powers of two: the product is exact).
#pragma once
#include <cuda_bf16.h>
#include <stdint.h>

#include "rope.cuh"

#define EPILOGUE_BF16 0
#define EPILOGUE_F32 1
#define EPILOGUE_ACC_F32 2
#define EPILOGUE_ROPE_BF16 3

struct Epilogue {
    void* C;
    const float* cos;      // (rope_T, head_dim / 2), ROPE mode only
    const float* sin;
    long long stride_c;    // elements between batches
    int ldc, M, N, mode;
    float alpha;
    int rope_T, rope_cols, head_dim;
    const float* row_scales = nullptr;  // (M,) and (N,), FP8 GEMMs only
    const float* col_scales = nullptr;
};

// alpha, times the FP8 scales of (row, col) when there are any
__device__ __forceinline__ float output_scale(const Epilogue& e, int row, int col) {
    return e.row_scales ? e.alpha * e.row_scales[row] * e.col_scales[col] : e.alpha;
}

// RoPE in the epilogue: the cos/sin table entry of the pair (col, col + 1) of token row (position row % rope_T,
// col even), and the rotation of a pair by it
__device__ __forceinline__ int rope_entry(const Epilogue& e, int row, int col) {
    return (row % e.rope_T) * (e.head_dim >> 1) + ((col % e.head_dim) >> 1);
}
__device__ __forceinline__ void rotate_pair(const Epilogue& e, int entry, float& v0, float& v1) {
    rope_rotate(v0, v1, e.cos[entry], e.sin[entry]);
}

template <int MODE>
__device__ __forceinline__ void epilogue_pair(const Epilogue& e, int batch, int row, int col, float v0, float v1) {
    if (row >= e.M || col >= e.N) return;
    const bool both = col + 1 < e.N;
    v0 *= output_scale(e, row, col);
    v1 *= both ? output_scale(e, row, col + 1) : 0.f;
    // a pair store is aligned when every row and batch starts at an even element
    const bool paired = both && !(e.ldc & 1) && !(e.stride_c & 1);
    const long long offset = batch * e.stride_c + (long long)row * e.ldc + col;
    if (MODE == EPILOGUE_F32 || MODE == EPILOGUE_ACC_F32) {
        float* c = (float*)e.C + offset;
        if (paired) {
            float2 old = MODE == EPILOGUE_ACC_F32 ? *(float2*)c : make_float2(0.f, 0.f);
            *(float2*)c = make_float2(old.x + v0, old.y + v1);
        } else {
            c[0] = MODE == EPILOGUE_ACC_F32 ? c[0] + v0 : v0;
            if (both) c[1] = MODE == EPILOGUE_ACC_F32 ? c[1] + v1 : v1;
        }
        return;
    }
    if (MODE == EPILOGUE_ROPE_BF16 && col < e.rope_cols) rotate_pair(e, rope_entry(e, row, col), v0, v1);
    __nv_bfloat16* c = (__nv_bfloat16*)e.C + offset;
    if (paired) {
        *(__nv_bfloat162*)c = __floats2bfloat162_rn(v0, v1);
    } else {
        c[0] = __float2bfloat16_rn(v0);
        if (both) c[1] = __float2bfloat16_rn(v1);
    }
}

// The same for four adjacent columns col .. col + 3 (col % 4 == 0) as one vector access: the staged
// epilogue's row writes. Needs N, ldc and stride_c multiples of 4 and C 16-byte aligned (ops.gemm checks
// 8 and 16 bytes) and, for RoPE, a head_dim multiple of 4 (the two pairs share a head).
template <int MODE>
__device__ __forceinline__ void epilogue_quad(const Epilogue& e, int batch, int row, int col, float4 v) {
    if (row >= e.M || col >= e.N) return;
    if (e.row_scales) {
        const float4 s = *(const float4*)(e.col_scales + col);
        const float r = e.alpha * e.row_scales[row];
        v = make_float4(v.x * (r * s.x), v.y * (r * s.y), v.z * (r * s.z), v.w * (r * s.w));
    } else {
        v = make_float4(v.x * e.alpha, v.y * e.alpha, v.z * e.alpha, v.w * e.alpha);
    }
    const long long offset = batch * e.stride_c + (long long)row * e.ldc + col;
    if (MODE == EPILOGUE_F32 || MODE == EPILOGUE_ACC_F32) {
        float4* c = (float4*)((float*)e.C + offset);
        if (MODE == EPILOGUE_ACC_F32) {
            const float4 old = *c;
            v = make_float4(old.x + v.x, old.y + v.y, old.z + v.z, old.w + v.w);
        }
        *c = v;
        return;
    }
    if (MODE == EPILOGUE_ROPE_BF16 && col < e.rope_cols) {
        const int entry = rope_entry(e, row, col);  // the second pair is the next entry: same head
        rotate_pair(e, entry, v.x, v.y);
        rotate_pair(e, entry + 1, v.z, v.w);
    }
    __nv_bfloat162 lo = __floats2bfloat162_rn(v.x, v.y), hi = __floats2bfloat162_rn(v.z, v.w);
    *(uint2*)((__nv_bfloat16*)e.C + offset) = make_uint2(*(uint32_t*)&lo, *(uint32_t*)&hi);
}

// Runs STORE<MODE>(args...) with the epilogue mode as a compile-time constant, so that each mode's
// store loop is specialized and the accumulators stay in registers.
#define EPILOGUE_DISPATCH(mode, STORE, ...)                           \
    switch (mode) {                                                   \
        case EPILOGUE_BF16: STORE<EPILOGUE_BF16>(__VA_ARGS__); break; \
        case EPILOGUE_F32: STORE<EPILOGUE_F32>(__VA_ARGS__); break;   \
        case EPILOGUE_ACC_F32: STORE<EPILOGUE_ACC_F32>(__VA_ARGS__); break; \
        default: STORE<EPILOGUE_ROPE_BF16>(__VA_ARGS__); break;       \
    }

// Tile order: tiles walk down GROUP_M rows of tiles before moving right, so that a wave of CTAs
// shares A rows and B columns in L2.
#define GROUP_M 8
__device__ __forceinline__ void tile_coords(int tile, int tiles_m, int tiles_n, int* tm, int* tn) {
    const int per_group = GROUP_M * tiles_n, group = tile / per_group;
    const int first_m = group * GROUP_M, rows = min(tiles_m - first_m, GROUP_M);
    *tm = first_m + (tile % per_group) % rows;
    *tn = (tile % per_group) / rows;
}

// FP8 casts of --dtype fp8's GEMM operands: a bf16 matrix x (R, C), row-major, to float8 e4m3fn with one
// power-of-two scale 2^e per row, or per column (the GEMM's K along the other axis), exactly as the twin
// llama/twins/fp8.py:quantize_fp8: e is the least integer with amax <= 448 * 2^e (0 for a slice of
// zeros), and each value is x * 2^-e (exact) rounded to nearest even, saturating at +-448. x is finite.
//
// fp8_amax:  row_amax (R,) and/or col_amax (C,) = max |x| of each row / column, as the uint32 bits of
//            the non-negative floats (ordered as the floats are), combined with atomicMax: max is exact
//            and order-independent, so the result is deterministic. Either pointer may be null. Both
//            must be zero before the launch. Block (32, FP8_AMAX_ROW_WARPS): each thread 8 columns (a
//            16-byte load), a warp 256 columns of a row; grid (ceil(R / FP8_AMAX_ROWS), ceil(C / 256)),
//            a block FP8_AMAX_ROWS rows, reduced in the block, then one atomicMax per row and column.
//            tensor != 0 (tensor-wise scaling): the max of all of x into row_amax[0] instead, one atomicMax
//            per block; col_amax must be null.
// fp8_cast:  from the amax, as requested (pointers of outputs not wanted are null):
//            q_rows (R, C) fp8 and row_scales (R,) fp32, the scale of each row;
//            q_cols (C, R) fp8 = the cast of x's transpose, and col_scales (C,) fp32, the scale of each
//            column of x. One block of 256 threads per FP8_TILE x FP8_TILE tile of x, grid
//            (ceil(R / FP8_TILE), ceil(C / FP8_TILE)): each thread loads 16 columns of one row of the
//            tile and writes their 16 bytes of q_rows; the tile goes through shared memory (bf16,
//            swizzled) so that each thread writes 16 bytes of a q_cols row (16 rows of x's column).
//            The blocks of the first tile column write row_scales, those of the first tile row col_scales.
//            tensor != 0: every row and column takes its scale from row_amax[0] = col_amax[0] (x's amax).
// fp8_cast_rows_<V>: q_rows and row_scales in one pass over x, for the row-wise cast alone with C at most
//            V * 256 * 8 (V = 1, 2, 4 or FP8_ROW_VECTORS; the launcher takes the least that holds C): one
//            block of 256 threads per row holds the row in registers (V 16-byte vectors of 8 columns a
//            thread), takes its amax through the warps and shared memory, and writes its scale and 8 bytes a
//            vector. The same bits as fp8_amax + fp8_cast (max is exact); x is read once instead of twice, and
//            no amax scratch.
//
// x 16-byte aligned with C a multiple of 8; q_rows needs C, q_cols R a multiple of 16 (16-byte rows,
// 16-byte aligned). fp8 bytes as llama.runtime.cuda.FP8 (ml_dtypes.float8_e4m3fn).
#include <cuda_fp8.h>
#include "bf16.cuh"

#define FP8_AMAX_ROWS 64      // rows of x per fp8_amax block
#define FP8_AMAX_ROW_WARPS 8  // blockDim.y of fp8_amax: warps, each one row at a time
#define FP8_TILE 64           // fp8_cast's tile of x: FP8_TILE rows, FP8_TILE columns
#define FP8_ROW_VECTORS 8     // fp8_cast_rows_<V>: V, 16-byte vectors of a row per thread, at most this

// e of the scale 2^e for a slice's amax (the bits of a non-negative float): with amax = m * 2^E,
// m in [1, 2), amax <= 448 * 2^e = 1.75 * 2^(e + 8) first holds at e = E - 8 if m <= 1.75, else E - 7.
__device__ __forceinline__ int fp8_exponent(unsigned int amax) {
    if (amax == 0) return 0;
    int E;
    unsigned int fraction;  // m's 23 bits after the point
    if (amax >= 0x00800000u) {
        E = (int)(amax >> 23) - 127;
        fraction = amax & 0x007FFFFFu;
    } else {  // a denormal: normalize its leading bit into the implicit one's place
        const int shift = __clz(amax) - 8;
        E = -126 - shift;
        fraction = (amax << shift) & 0x007FFFFFu;
    }
    return fraction <= 0x00600000u ? E - 8 : E - 7;
}

// x * 2^-e, exact (its value is at most 448): a product with 2^-e where that is a normal float
__device__ __forceinline__ float fp8_unscale(float x, int e) {
    return e >= -127 ? x * __int_as_float((127 - e) << 23) : ldexpf(x, -e);
}

// 8 values scaled by 2^-e and rounded to nearest even into e4m3 (SATFINITE saturates at +-448), as 8 bytes
__device__ __forceinline__ uint2 pack_fp8x8(const float v[8], int e) {
    uint2 raw;
    __nv_fp8x2_storage_t* pairs = reinterpret_cast<__nv_fp8x2_storage_t*>(&raw);
#pragma unroll
    for (int k = 0; k < 4; k++)
        pairs[k] = __nv_cvt_float2_to_fp8x2(make_float2(fp8_unscale(v[2 * k], e), fp8_unscale(v[2 * k + 1], e)),
                                            __NV_SATFINITE, __NV_E4M3);
    return raw;
}

// 16 values as pack_fp8x8 casts them, as 16 bytes
__device__ __forceinline__ uint4 pack_fp8x16(const float v[16], int e) {
    const uint2 lo = pack_fp8x8(v, e), hi = pack_fp8x8(v + 8, e);
    return make_uint4(lo.x, lo.y, hi.x, hi.y);
}

extern "C" __global__ void __launch_bounds__(32 * FP8_AMAX_ROW_WARPS) fp8_amax(
    unsigned int* row_amax, unsigned int* col_amax, const bf16* x, int R, int C, int tensor) {
    __shared__ uint4 slice_max[FP8_AMAX_ROW_WARPS][32];  // each warp's column maxima
    const int c = (blockIdx.y * 32 + threadIdx.x) * 8;
    const int first = blockIdx.x * FP8_AMAX_ROWS, last = min(R, first + FP8_AMAX_ROWS);
    // |x| of bf16 is its bits without the sign, ordered as the values are: __vmaxu2 takes the maxima of
    // the two 16-bit halves of a word at once, so col[k] holds columns c + 2k (low half) and c + 2k + 1
    uint4 col = {};
    unsigned int warp_max = 0;  // tensor-wise: this warp's max over its rows (bf16 bits)
    for (int row = first + threadIdx.y; row < last; row += FP8_AMAX_ROW_WARPS) {
        uint4 v = {};
        if (c < C) v = *reinterpret_cast<const uint4*>(x + (long long)row * C + c);
        v.x &= 0x7FFF7FFFu, v.y &= 0x7FFF7FFFu, v.z &= 0x7FFF7FFFu, v.w &= 0x7FFF7FFFu;
        col.x = __vmaxu2(col.x, v.x), col.y = __vmaxu2(col.y, v.y), col.z = __vmaxu2(col.z, v.z);
        col.w = __vmaxu2(col.w, v.w);
        if (row_amax != nullptr) {
            const unsigned int pair = __vmaxu2(__vmaxu2(v.x, v.y), __vmaxu2(v.z, v.w));
            const unsigned int m = __reduce_max_sync(0xffffffffu, max(pair & 0xFFFFu, pair >> 16));
            if (tensor) warp_max = max(warp_max, m);
            else if (threadIdx.x == 0) atomicMax(row_amax + row, m << 16);  // bf16 bits -> float bits
        }
    }
    if (tensor) {  // the block's max from its warps' (through shared memory), then one atomicMax
        unsigned int* warp_maxima = reinterpret_cast<unsigned int*>(slice_max);
        if (threadIdx.x == 0) warp_maxima[threadIdx.y] = warp_max;
        __syncthreads();
        if (threadIdx.x == 0 && threadIdx.y == 0) {
            unsigned int m = 0;
            for (int y = 0; y < FP8_AMAX_ROW_WARPS; y++) m = max(m, warp_maxima[y]);
            if (m != 0) atomicMax(row_amax, m << 16);
        }
        return;
    }
    if (col_amax == nullptr) return;
    slice_max[threadIdx.y][threadIdx.x] = col;
    __syncthreads();
    // thread t < 128 takes word t % 4 of lane t / 4's columns, over the warps
    const int t = threadIdx.y * 32 + threadIdx.x, lane = t / 4, word = t % 4;
    const int column = (blockIdx.y * 32 + lane) * 8 + 2 * word;
    if (t >= 128 || column >= C) return;
    unsigned int m = 0;
    for (int y = 0; y < FP8_AMAX_ROW_WARPS; y++)
        m = __vmaxu2(m, reinterpret_cast<const unsigned int*>(&slice_max[y][lane])[word]);
    atomicMax(col_amax + column, (m & 0xFFFFu) << 16);
    atomicMax(col_amax + column + 1, (m >> 16) << 16);
}

// element (row, col) of the shared tile: its 16-byte chunks (8 columns) of each row permuted by
// (row ^ row / 16) % 8, so that neither the row-wise stores nor the column-wise loads conflict in banks
__device__ __forceinline__ int tile_index(int row, int col) {
    return row * FP8_TILE + (((col / 8) ^ (row ^ (row >> 4))) & 7) * 8 + col % 8;
}

extern "C" __global__ void __launch_bounds__(256) fp8_cast(
    unsigned char* q_rows, float* row_scales, unsigned char* q_cols, float* col_scales, const bf16* x,
    const unsigned int* row_amax, const unsigned int* col_amax, int R, int C, int tensor) {
    __shared__ __align__(16) bf16 tile[FP8_TILE * FP8_TILE];  // (FP8_TILE, FP8_TILE), swizzled (tile_index)
    __shared__ int row_exponent[FP8_TILE], col_exponent[FP8_TILE];
    const int r0 = blockIdx.x * FP8_TILE, c0 = blockIdx.y * FP8_TILE, t = threadIdx.x;
    if (q_rows != nullptr && t < FP8_TILE && r0 + t < R) {
        const int e = fp8_exponent(row_amax[tensor ? 0 : r0 + t]);
        row_exponent[t] = e;
        if (blockIdx.y == 0) row_scales[r0 + t] = ldexpf(1.0f, e);
    }
    if (q_cols != nullptr && t >= FP8_TILE && t < 2 * FP8_TILE && c0 + t - FP8_TILE < C) {
        const int e = fp8_exponent(col_amax[tensor ? 0 : c0 + t - FP8_TILE]);
        col_exponent[t - FP8_TILE] = e;
        if (blockIdx.x == 0) col_scales[c0 + t - FP8_TILE] = ldexpf(1.0f, e);
    }
    // this thread's 16 columns of one row, zeros outside x
    const int i = t / 4, j = (t % 4) * 16, row = r0 + i, c = c0 + j;
    uint4 lo = {}, hi = {};
    if (row < R && c < C) lo = *reinterpret_cast<const uint4*>(x + (long long)row * C + c);
    if (row < R && c + 8 < C) hi = *reinterpret_cast<const uint4*>(x + (long long)row * C + c + 8);
    __syncthreads();
    if (q_rows != nullptr && row < R && c < C) {
        float v[16];
        unpack_bf16x8(v, lo);
        unpack_bf16x8(v + 8, hi);
        *reinterpret_cast<uint4*>(q_rows + (long long)row * C + c) = pack_fp8x16(v, row_exponent[i]);
    }
    if (q_cols == nullptr) return;
    *reinterpret_cast<uint4*>(tile + tile_index(i, j)) = lo;
    *reinterpret_cast<uint4*>(tile + tile_index(i, j + 8)) = hi;
    __syncthreads();
    // now tile column a, rows b .. b + 15: 16 bytes of q_cols row c0 + a
    const int a = t / 4, b = (t % 4) * 16;
    if (c0 + a >= C || r0 + b >= R) return;
    float v[16];
#pragma unroll
    for (int k = 0; k < 16; k++) v[k] = __bfloat162float(tile[tile_index(b + k, a)]);
    *reinterpret_cast<uint4*>(q_cols + (long long)(c0 + a) * R + r0 + b) = pack_fp8x16(v, col_exponent[a]);
}

template <int VECTORS>
__device__ __forceinline__ void cast_rows(unsigned char* q_rows, float* row_scales, const bf16* x, int C) {
    __shared__ unsigned int warp_max[8];
    const int row = blockIdx.x, t = threadIdx.x;
    const bf16* x_row = x + (long long)row * C;
    uint4 v[VECTORS];       // (row, 8 * (t + 256 k) ..): this thread's vectors of the row, zeros past C
    unsigned int pair = 0;  // the max |x| of its values, as bf16 bits, in both halves of a word (__vmaxu2)
#pragma unroll
    for (int k = 0; k < VECTORS; k++) {
        const int c = (t + 256 * k) * 8;
        v[k] = c < C ? *reinterpret_cast<const uint4*>(x_row + c) : make_uint4(0, 0, 0, 0);
        pair = __vmaxu2(pair, __vmaxu2(__vmaxu2(v[k].x & 0x7FFF7FFFu, v[k].y & 0x7FFF7FFFu),
                                       __vmaxu2(v[k].z & 0x7FFF7FFFu, v[k].w & 0x7FFF7FFFu)));
    }
    const unsigned int m = __reduce_max_sync(0xffffffffu, max(pair & 0xFFFFu, pair >> 16));
    if (t % 32 == 0) warp_max[t / 32] = m;
    __syncthreads();
    unsigned int amax = 0;
#pragma unroll
    for (int w = 0; w < 8; w++) amax = max(amax, warp_max[w]);
    const int e = fp8_exponent(amax << 16);  // bf16 bits -> float bits
    if (t == 0) row_scales[row] = ldexpf(1.0f, e);
#pragma unroll
    for (int k = 0; k < VECTORS; k++) {
        const int c = (t + 256 * k) * 8;
        if (c >= C) break;
        float f[8];
        unpack_bf16x8(f, v[k]);
        *reinterpret_cast<uint2*>(q_rows + (long long)row * C + c) = pack_fp8x8(f, e);
    }
}

// fp8_cast_rows_<V>: rows of up to V * 256 * 8 columns
#define FP8_CAST_ROWS(V)                                                                                      \
    extern "C" __global__ void __launch_bounds__(256) fp8_cast_rows_##V(unsigned char* q_rows, float* row_scales, \
                                                                        const bf16* x, int C) {               \
        cast_rows<V>(q_rows, row_scales, x, C);                                                               \
    }
FP8_CAST_ROWS(1)
FP8_CAST_ROWS(2)
FP8_CAST_ROWS(4)
FP8_CAST_ROWS(8)

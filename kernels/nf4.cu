// NF4 (QLoRA's 4-bit NormalFloat) as bitsandbytes stores it, for --qlora's frozen base: its twin is
// llama/twins/nf4.py (the format, and where bitsandbytes' own kernels may differ), its launchers llama/ops/nf4.py.
// A weight (rows, cols) is read flat, n = rows * cols, in blocks of NF4_BLOCK = 64 (the last may be short):
//   absmax[b]  = max |w| over block b (fp32), 0 if below FLT_MIN (a subnormal w counts as 0);
//   code       = #{ t in the 15 midpoints of adjacent NF4 levels : t < w * (1 / absmax) } (exact fp32
//                reciprocal and product): the nearest level, a midpoint going down; 0 * (1 / 0) = NaN: code 0;
//   codes      (ceil(n / 2),) uint8: byte k = code[2k] << 4 | code[2k + 1]; an odd n pads the low nibble of
//                its last byte with the code of a 0 in the last block;
//   offset     = mean(absmax) (fp32): the float64 sum in nf4_absmax_mean's fixed order, rounded once;
//   absmax_scales[s] = max |absmax - offset| over the s-th NF4_ABSMAX_BLOCK = 256 absmaxes (fp32);
//   absmax_codes[b]  = bitsandbytes' binary search (dynamic_code) of (absmax[b] - offset) * (1 / scale) on
//                its 256-level dynamic map;
//   dequantized w = level[code] * (map[absmax_code] * scale + offset), each product and sum rounded to fp32
//                apart (no FMA: bitsandbytes rounds them apart), then rounded to bf16.
// tables (NF4_TABLE_SIZE,) fp32: the 16 NF4 levels, then the 256 levels of the dynamic map (ops.nf4_tables()).
//
// nf4_quantize_{bf16,f32} (codes, absmax): 8 threads a block of 64, 8 weights a thread (one 16-byte load of
//   bf16, two of fp32), the block's max through 3 shuffles, 4 code bytes stored as one word. Then
//   nf4_absmax_mean (one block of NF4_MEAN_THREADS: thread t sums absmaxes t, t + 256, .. in float64 in order,
//   thread 0 the 256 sums in order) and nf4_quantize_absmax (a thread an absmax, a block 256 of them).
//   Deterministic: no atomics, every sum in a fixed order.
// nf4_dequantize_bf16 (a layer's weights into a bf16 scratch just before its GEMMs): a thread 32 weights,
//   one 16-byte load of 16 code bytes and four 16-byte stores of bf16, its block's absmax from 1 code byte
//   and 1 scale. Bytes moved per weight: 0.5 (codes) + 1/64 (absmax codes) + 4/16384 (scales) + 2 (bf16
//   out) = 2.516; one fp32 multiply a weight (plus 2 a block of 64): 2.5 bytes/FLOP, far below any GPU's
//   ratio, so the floor is bandwidth alone: 8B's w1 (14336 x 4096, 58.7M weights) moves 148 MB, 44 us at
//   an H100's 3.35 TB/s and 31 us at an H200's 4.8 TB/s; one 8B layer's seven matrices (218M weights)
//   549 MB, 164 us and 114 us (arithmetic from the datasheets' bandwidths, not measurements).
#include <float.h>
#include "bf16.cuh"

#define NF4_BLOCK 64          // weights per absmax
#define NF4_ABSMAX_BLOCK 256  // absmaxes per scale (and threads of an nf4_quantize_absmax block)
#define NF4_LEVELS 16
#define NF4_MAP 256           // levels of the dynamic map
#define NF4_TABLE_SIZE 272    // NF4_LEVELS + NF4_MAP
#define NF4_MEAN_THREADS 256  // nf4_absmax_mean's one block
#define NF4_QUANTIZE_PER_THREAD 8
#define NF4_DEQUANTIZE_PER_THREAD 32

// w as the quantizer sees it: a subnormal is 0 (bitsandbytes' kernels flush them)
__device__ __forceinline__ float flushed(float w) { return fabsf(w) < FLT_MIN ? 0.0f : w; }

// the 4-bit code of w * reciprocal: how many thresholds lie strictly below it (NaN: none)
__device__ __forceinline__ unsigned int nf4_code(float w, float reciprocal, const float* thresholds) {
    const float x = __fmul_rn(w, reciprocal);
    unsigned int code = 0;
#pragma unroll
    for (int i = 0; i < NF4_LEVELS - 1; i++) code += x > thresholds[i];
    return code;
}

// the 15 thresholds (fp32 midpoints of adjacent NF4 levels) into shared memory; every thread calls it
__device__ __forceinline__ void load_thresholds(float* thresholds, const float* tables) {
    if (threadIdx.x < NF4_LEVELS - 1)
        thresholds[threadIdx.x] = __fmul_rn(__fadd_rn(tables[threadIdx.x], tables[threadIdx.x + 1]), 0.5f);
    __syncthreads();
}

__device__ __forceinline__ void load_weights(float w[8], const bf16* p) { load_bf16x8(w, p); }
__device__ __forceinline__ void load_weights(float w[8], const float* p) { load_f32x8(w, p); }

// codes ((n + 1) / 2,) and absmax (ceil(n / 64),) of w (n,); blockDim.x a multiple of 32
template <typename T>
__device__ void nf4_quantize(unsigned char* codes, float* absmax, const T* w, const float* tables, long long n) {
    __shared__ float thresholds[NF4_LEVELS - 1];
    load_thresholds(thresholds, tables);
    const long long group = (long long)blockIdx.x * blockDim.x + threadIdx.x;  // weights 8 * group ..
    const long long first = group * NF4_QUANTIZE_PER_THREAD;
    float v[NF4_QUANTIZE_PER_THREAD];
    if (first + NF4_QUANTIZE_PER_THREAD <= n) {
        load_weights(v, w + first);
    } else {
        for (int k = 0; k < NF4_QUANTIZE_PER_THREAD; k++) v[k] = first + k < n ? (float)w[first + k] : 0.0f;
    }
    float m = 0.0f;
    for (int k = 0; k < NF4_QUANTIZE_PER_THREAD; k++) {
        v[k] = flushed(v[k]);
        m = fmaxf(m, fabsf(v[k]));
    }
    for (int offset = 4; offset > 0; offset >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, offset));  // 8 lanes
    if (first >= n) return;
    if (group % 8 == 0) absmax[group / 8] = m;
    const float reciprocal = __frcp_rn(m);  // 1 / 0 = inf
    unsigned int packed = 0;  // byte k (lowest first) = code[2k] << 4 | code[2k + 1]
    for (int k = 0; k < NF4_QUANTIZE_PER_THREAD; k += 2) {
        const unsigned int high = nf4_code(v[k], reciprocal, thresholds);
        const unsigned int low = nf4_code(v[k + 1], reciprocal, thresholds);
        packed |= (high << 4 | low) << (4 * k);  // weights k, k + 1 in byte k / 2
    }
    if (first + NF4_QUANTIZE_PER_THREAD <= n) {
        reinterpret_cast<unsigned int*>(codes)[group] = packed;
    } else {
        for (long long k = 0; 2 * k < n - first; k++) codes[first / 2 + k] = (packed >> (8 * k)) & 0xFFu;
    }
}

extern "C" __global__ void nf4_quantize_bf16(unsigned char* codes, float* absmax, const bf16* w, const float* tables,
                                             long long n) {
    nf4_quantize(codes, absmax, w, tables, n);
}

extern "C" __global__ void nf4_quantize_f32(unsigned char* codes, float* absmax, const float* w, const float* tables,
                                            long long n) {
    nf4_quantize(codes, absmax, w, tables, n);
}

// offset (1,) = the mean of absmax (blocks,): one block of NF4_MEAN_THREADS
extern "C" __global__ void __launch_bounds__(NF4_MEAN_THREADS) nf4_absmax_mean(float* offset, const float* absmax,
                                                                                int blocks) {
    __shared__ double lane_sums[NF4_MEAN_THREADS];
    double sum = 0.0;
    for (int i = threadIdx.x; i < blocks; i += NF4_MEAN_THREADS) sum += (double)absmax[i];
    lane_sums[threadIdx.x] = sum;
    __syncthreads();
    if (threadIdx.x != 0) return;
    double total = 0.0;
    for (int t = 0; t < NF4_MEAN_THREADS; t++) total += lane_sums[t];
    offset[0] = (float)(total / (double)blocks);
}

// bitsandbytes' dQuantize (csrc/kernels.cu): the code of x on the 256 ascending levels
__device__ __forceinline__ unsigned int dynamic_code(float x, const float* levels) {
    int pivot = 127, upper_pivot = 255, lower_pivot = 0;
    float lower = -1.0f, upper = 1.0f, value = levels[pivot];
    for (int step = 64; step > 0; step >>= 1) {
        if (x > value) {
            lower_pivot = pivot, lower = value, pivot += step;
        } else {
            upper_pivot = pivot, upper = value, pivot -= step;
        }
        value = levels[pivot];
    }
    if (upper_pivot == 255) upper = levels[255];
    if (lower_pivot == 0) lower = levels[0];
    if (x > value) return x > __fmul_rn(__fadd_rn(upper, value), 0.5f) ? upper_pivot : pivot;
    return x < __fmul_rn(__fadd_rn(lower, value), 0.5f) ? lower_pivot : pivot;
}

// absmax_codes (blocks,) and absmax_scales (ceil(blocks / 256),); blocks of NF4_ABSMAX_BLOCK threads
extern "C" __global__ void __launch_bounds__(NF4_ABSMAX_BLOCK) nf4_quantize_absmax(
    unsigned char* absmax_codes, float* absmax_scales, const float* absmax, const float* offset, const float* tables,
    int blocks) {
    __shared__ float levels[NF4_MAP];
    levels[threadIdx.x] = tables[NF4_LEVELS + threadIdx.x];
    const int i = blockIdx.x * NF4_ABSMAX_BLOCK + threadIdx.x;
    const float centered = i < blocks ? flushed(__fsub_rn(absmax[i], offset[0])) : 0.0f;
    const float scale = block_max(fabsf(centered));  // synchronizes: levels are loaded after it
    if (threadIdx.x == 0) absmax_scales[blockIdx.x] = scale;
    if (i < blocks) absmax_codes[i] = dynamic_code(__fmul_rn(centered, __frcp_rn(scale)), levels);
}

// block b's absmax from its code and scale
__device__ __forceinline__ float dequantized_absmax(const unsigned char* absmax_codes, const float* absmax_scales,
                                                    float offset, const float* tables, long long b) {
    const float level = __ldg(tables + NF4_LEVELS + absmax_codes[b]);
    return __fadd_rn(__fmul_rn(level, __ldg(absmax_scales + b / NF4_ABSMAX_BLOCK)), offset);
}

// out (n,) bf16 from codes ((n + 1) / 2,), absmax_codes (ceil(n / 64),), absmax_scales, offset (1,)
extern "C" __global__ void nf4_dequantize_bf16(bf16* out, const unsigned char* codes, const unsigned char* absmax_codes,
                                               const float* absmax_scales, const float* offset, const float* tables,
                                               long long n) {
    __shared__ float levels[NF4_LEVELS];
    if (threadIdx.x < NF4_LEVELS) levels[threadIdx.x] = tables[threadIdx.x];
    __syncthreads();
    const long long first = ((long long)blockIdx.x * blockDim.x + threadIdx.x) * NF4_DEQUANTIZE_PER_THREAD;
    if (first >= n) return;
    const float scale = dequantized_absmax(absmax_codes, absmax_scales, __ldg(offset), tables, first / NF4_BLOCK);
    if (first + NF4_DEQUANTIZE_PER_THREAD <= n) {
        const uint4 raw = __ldg(reinterpret_cast<const uint4*>(codes + first / 2));
        const unsigned int words[4] = {raw.x, raw.y, raw.z, raw.w};
        for (int q = 0; q < 4; q++) {  // word q: bytes 4q .. 4q + 3, weights 8q .. 8q + 7
            float w[8];
            for (int k = 0; k < 4; k++) {
                const unsigned int byte = (words[q] >> (8 * k)) & 0xFFu;
                w[2 * k] = __fmul_rn(levels[byte >> 4], scale);
                w[2 * k + 1] = __fmul_rn(levels[byte & 0xFu], scale);
            }
            store_bf16x8(out + first + 8 * q, w);
        }
        return;
    }
    for (long long i = first; i < n; i++) {
        const unsigned int byte = codes[i / 2];
        out[i] = __float2bfloat16_rn(__fmul_rn(levels[i % 2 ? byte & 0xFu : byte >> 4], scale));
    }
}

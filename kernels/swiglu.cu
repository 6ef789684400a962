// SwiGLU: gate_up (N, 2F) holds [gate | up] per row (the fused w1 | w3 projection).
// swiglu_forward:  out (N, F) = silu(gate) * up, silu(g) = g * sigmoid(g).
// swiglu_backward: dgate_up (N, 2F): dgate = dout * up * s * (1 + g * (1 - s)), dup = dout * silu(g).
// bf16 versions (F a multiple of 8): one thread per 8 columns f..f+7 of one row, reading gate and up
// (and dout) and writing out (or dgate and dup) in 16-byte vectors; fp32 math.
// swiglu_backward_amax_bf16 (--dtype fp8, where dgate_up is cast next): swiglu_backward_bf16's bits, and the max
// |dgate_up| of each row into row_amax (N,) and of each of its 2F columns into col_amax (2F,), as fp8_amax
// (kernels/fp8.cu) leaves them for fp8_cast: the uint32 bits of the non-negative floats, combined with
// atomicMax (exact, order-free: deterministic), both zero before the launch. Block (32, SWIGLU_AMAX_WARPS), a
// tile of SWIGLU_AMAX_ROWS rows and 256 columns of F: lane x takes columns f..f+7 of dgate and of dup, warp y
// the rows y, y + SWIGLU_AMAX_WARPS, ..; a row's max through the warp (one atomicMax a warp and row), the
// columns' through shared memory (one atomicMax a block and column).
#include "bf16.cuh"
#include "swiglu.cuh"

#define SWIGLU_AMAX_ROWS 64  // rows of a swiglu_backward_amax_bf16 block
#define SWIGLU_AMAX_WARPS 8  // its blockDim.y

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

// the bf16 bits of |v| for 8 values packed as bf16 pairs: the sign bits cleared, ordered as the magnitudes are
__device__ __forceinline__ uint4 magnitude_bits(uint4 v) {
    return make_uint4(v.x & 0x7FFF7FFFu, v.y & 0x7FFF7FFFu, v.z & 0x7FFF7FFFu, v.w & 0x7FFF7FFFu);
}

__device__ __forceinline__ uint4 max_pairs(uint4 a, uint4 b) {
    return make_uint4(__vmaxu2(a.x, b.x), __vmaxu2(a.y, b.y), __vmaxu2(a.z, b.z), __vmaxu2(a.w, b.w));
}

extern "C" __global__ void __launch_bounds__(32 * SWIGLU_AMAX_WARPS) swiglu_backward_amax_bf16(
    bf16* dgate_up, unsigned int* row_amax, unsigned int* col_amax, const bf16* dout, const bf16* gate_up, int N,
    int F) {
    __shared__ uint4 column_max[SWIGLU_AMAX_WARPS][2][32];  // each warp's maxima of its lanes' dgate, dup columns
    const int f = (blockIdx.y * 32 + threadIdx.x) * 8;
    const int first = blockIdx.x * SWIGLU_AMAX_ROWS, last = min(N, first + SWIGLU_AMAX_ROWS);
    uint4 gate_max = {}, up_max = {};  // this lane's columns f..f+7 of dgate and of dup, bf16 bits in pairs
    for (int n = first + threadIdx.y; n < last; n += SWIGLU_AMAX_WARPS) {  // n is the same across the warp
        uint4 dg_bits = {}, du_bits = {};
        if (f < F) {
            const long long row = (long long)n * 2 * F;
            float g[8], u[8], d[8], dg[8], du[8];
            load_bf16x8(g, gate_up + row + f);
            load_bf16x8(u, gate_up + row + F + f);
            load_bf16x8(d, dout + (long long)n * F + f);
            for (int k = 0; k < 8; k++) swiglu_gradients(g[k], u[k], d[k], dg[k], du[k]);
            dg_bits = pack_bf16x8(dg), du_bits = pack_bf16x8(du);
            *reinterpret_cast<uint4*>(dgate_up + row + f) = dg_bits;
            *reinterpret_cast<uint4*>(dgate_up + row + F + f) = du_bits;
        }
        const uint4 dg_mag = magnitude_bits(dg_bits), du_mag = magnitude_bits(du_bits);
        gate_max = max_pairs(gate_max, dg_mag), up_max = max_pairs(up_max, du_mag);
        const uint4 both = max_pairs(dg_mag, du_mag);
        const unsigned int pair = __vmaxu2(__vmaxu2(both.x, both.y), __vmaxu2(both.z, both.w));
        const unsigned int m = __reduce_max_sync(0xffffffffu, max(pair & 0xFFFFu, pair >> 16));
        if (threadIdx.x == 0 && m != 0) atomicMax(row_amax + n, m << 16);  // bf16 bits -> float bits
    }
    column_max[threadIdx.y][0][threadIdx.x] = gate_max;
    column_max[threadIdx.y][1][threadIdx.x] = up_max;
    __syncthreads();
    // thread t takes word t % 8 of lane t / 8's columns (words 0-3 dgate's, 4-7 dup's), over the warps
    const int t = threadIdx.y * 32 + threadIdx.x, lane = t / 8, word = t % 8, half = word / 4;
    const int column = (blockIdx.y * 32 + lane) * 8 + 2 * (word % 4);
    if (column >= F) return;
    unsigned int m = 0;
    for (int y = 0; y < SWIGLU_AMAX_WARPS; y++)
        m = __vmaxu2(m, reinterpret_cast<const unsigned int*>(&column_max[y][half][lane])[word % 4]);
    unsigned int* out = col_amax + half * F + column;
    if (m & 0xFFFFu) atomicMax(out, (m & 0xFFFFu) << 16);
    if (m >> 16) atomicMax(out + 1, (m >> 16) << 16);
}

// AdamW over the one flat parameter buffer (n,), with global-norm clipping read on the device.
// params, grads, m, v (n,) fp32; decay_mask (ceil(n / 8),) uint8: a bit per weight, 1 where weight decay
// applies (2D weights), weight i's at bit i % 8 of byte i / 8 (ops.pack_decay_mask; 1 GB for 8B weights).
// norm_squared (1,): the squared global grad norm from global_norm.cu; when max_norm > 0 and the
// norm exceeds it, gradients are scaled by max_norm / norm. Bias corrections 1 - beta^step come
// from the host. Same formulas as llama/optim.py:adamw_update.
//
// adamw_update_bf16: the same update (fp32 master params, m, v, grads), and in the same pass the bf16
//   copy params_bf16 (n,) of the new params (round to nearest even), which the matmuls read. The
//   step-dependent values come from the device buffer scalars = {lr, 1 - beta1^step, 1 - beta2^step}
//   (ops.adamw_scalars), so that a captured CUDA graph replays every step. One thread per 8 elements,
//   16-byte loads and stores (the arrays 16-byte aligned) and the mask's one byte of the 8; the last thread
//   also takes the n % 8 tail.
#include "bf16.cuh"

// bit k (0..7) of a mask byte, 0.0f or 1.0f
__device__ __forceinline__ float bit_of(unsigned int mask_byte, int k) {
    return (float)((mask_byte >> k) & 1u);
}

// weight i's decay, 0.0f or 1.0f: bit i % 8 of byte i / 8 of the packed mask
__device__ __forceinline__ float decay_bit(const unsigned char* decay_mask, long long i) {
    return bit_of(decay_mask[i >> 3], (int)(i & 7));  // i >= 0: i / 8, i % 8
}

extern "C" __global__ void adamw_update(float* params, const float* grads, float* m, float* v,
                                        const unsigned char* decay_mask, const float* norm_squared, long long n,
                                        float lr, float beta1, float beta2, float eps, float weight_decay,
                                        float bias_correction1, float bias_correction2, float max_norm) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    float scale = 1.0f;
    if (max_norm > 0.0f) {
        const float norm = sqrtf(norm_squared[0]);
        if (norm > max_norm) scale = max_norm / norm;
    }
    const float g = grads[i] * scale;
    const float mi = beta1 * m[i] + (1.0f - beta1) * g;
    const float vi = beta2 * v[i] + (1.0f - beta2) * g * g;
    m[i] = mi;
    v[i] = vi;
    const float update = (mi / bias_correction1) / (sqrtf(vi / bias_correction2) + eps);
    params[i] -= lr * (update + weight_decay * decay_bit(decay_mask, i) * params[i]);
}

__device__ __forceinline__ void adamw_element(float& p, float& m, float& v, float g, float decay, float lr,
                                              float beta1, float beta2, float eps, float weight_decay,
                                              float bias_correction1, float bias_correction2) {
    // each rounding spelled out, so that the compiler's contraction choices cannot move the bits between builds
    m = __fmaf_rn(1.0f - beta1, g, __fmul_rn(beta1, m));
    v = __fmaf_rn(g, __fmul_rn(1.0f - beta2, g), __fmul_rn(beta2, v));
    const float update = __fdiv_rn(__fdiv_rn(m, bias_correction1),
                                   __fadd_rn(__fsqrt_rn(__fdiv_rn(v, bias_correction2)), eps));
    p = __fsub_rn(p, __fmul_rn(lr, __fmaf_rn(p, __fmul_rn(decay, weight_decay), update)));
}

extern "C" __global__ void adamw_update_bf16(float* params, bf16* params_bf16, const float* grads, float* m, float* v,
                                             const unsigned char* decay_mask, const float* norm_squared,
                                             const float* scalars, long long n, float beta1, float beta2, float eps,
                                             float weight_decay, float max_norm) {
    const long long first = ((long long)blockIdx.x * blockDim.x + threadIdx.x) * 8;
    if (first >= n) return;
    const float lr = scalars[0], bias_correction1 = scalars[1], bias_correction2 = scalars[2];
    float scale = 1.0f;
    if (max_norm > 0.0f) {
        const float norm = sqrtf(norm_squared[0]);
        if (norm > max_norm) scale = max_norm / norm;
    }
    if (first + 8 <= n) {
        float p[8], g[8], mi[8], vi[8];
        load_f32x8(p, params + first);
        load_f32x8(g, grads + first);
        load_f32x8(mi, m + first);
        load_f32x8(vi, v + first);
        const unsigned int mask = decay_mask[first / 8];
        for (int k = 0; k < 8; k++)
            adamw_element(p[k], mi[k], vi[k], __fmul_rn(g[k], scale), bit_of(mask, k), lr, beta1, beta2, eps,
                          weight_decay, bias_correction1, bias_correction2);
        store_f32x8(params + first, p);
        store_f32x8(m + first, mi);
        store_f32x8(v + first, vi);
        store_bf16x8(params_bf16 + first, p);
    } else {
        for (long long i = first; i < n; i++) {
            float p = params[i], mi = m[i], vi = v[i];
            adamw_element(p, mi, vi, __fmul_rn(grads[i], scale), decay_bit(decay_mask, i), lr, beta1, beta2, eps,
                          weight_decay, bias_correction1, bias_correction2);
            params[i] = p;
            m[i] = mi;
            v[i] = vi;
            params_bf16[i] = __float2bfloat16_rn(p);
        }
    }
}

// ---- AdamW with 8-bit moments (llama/optim.py: AdamW8bitState, the twin)
// adamw8bit_update_bf16: adamw_update_bf16 with m and v stored block-wise in 8 bits: for each block of
//   QUANT_BLOCK = 256 values an fp32 scale (the block's largest magnitude) and a uint8 code per value,
//   the index of a level of a dynamic map in [-1, 1] (m) or (0, 1] (v, no zero). One warp per block, 8 values a
//   lane: dequantize (level * scale), the AdamW update, then the new block's scale (a warp max) and each
//   value's code (how many of the map's midpoints lie at or below value / scale, a binary search in
//   shared memory). Every float operation is rounded on its own (no fused multiply-add), in the order
//   numpy computes it, so the codes, scales and weights are the twin's bits. A lane with all 8 values
//   moves them as vectors (16-byte loads and stores of the fp32 and bf16 values, 8-byte ones of the codes,
//   the decay mask's one byte) and runs its 16 searches unrolled, so that they overlap; a short last lane goes
//   value by value.
//   decay_mask packed as adamw_update's; m_codes, v_codes (n,) uint8; m_scales, v_scales (ceil(n / 256),) fp32;
//   maps (4, 256) fp32: m's levels, m's midpoints, v's levels, v's midpoints, each padded (levels with 0,
//   midpoints with +inf); one_minus_beta1/2: 1 - beta rounded to fp32 from double, as numpy has them. The
//   arrays but the mask 16-byte aligned.
constexpr int QUANT_BLOCK = 256;
constexpr int MAP_SIZE = 256;

__device__ __forceinline__ unsigned char nearest_level(const float* midpoints, float x) {
    int count = 0;  // midpoints <= x (they ascend, then +inf)
    for (int step = MAP_SIZE / 2; step > 0; step /= 2)
        if (midpoints[count + step - 1] <= x) count += step;
    return (unsigned char)count;
}

// byte k (0..7) of 8 bytes held as a uint2, and the uint2 with byte k set (it is zero before)
__device__ __forceinline__ unsigned int byte_of(uint2 w, int k) {
    return ((k < 4 ? w.x : w.y) >> (8 * (k % 4))) & 0xFFu;
}

__device__ __forceinline__ void set_byte(uint2& w, int k, unsigned int b) {
    if (k < 4) w.x |= b << (8 * k);
    else w.y |= b << (8 * (k - 4));
}

struct AdamW8bitStep {
    float lr, beta1, beta2, one_minus_beta1, one_minus_beta2, eps, weight_decay, bias_correction1, bias_correction2;
};

// one value's update: m and v (dequantized) in and out, g the clipped gradient; the new parameter
__device__ __forceinline__ float adamw8bit_element(float& m, float& v, float p, float g, float decay,
                                                   const AdamW8bitStep& s) {
    m = __fadd_rn(__fmul_rn(m, s.beta1), __fmul_rn(s.one_minus_beta1, g));
    v = __fadd_rn(__fmul_rn(v, s.beta2), __fmul_rn(__fmul_rn(s.one_minus_beta2, g), g));
    const float m_hat = __fdiv_rn(m, s.bias_correction1), v_hat = __fdiv_rn(v, s.bias_correction2);
    const float update = __fdiv_rn(m_hat, __fadd_rn(__fsqrt_rn(v_hat), s.eps));
    const float decayed = __fmul_rn(__fmul_rn(s.weight_decay, decay), p);
    return __fsub_rn(p, __fmul_rn(s.lr, __fadd_rn(update, decayed)));
}

extern "C" __global__ void adamw8bit_update_bf16(float* params, bf16* params_bf16, const float* grads,
                                                 unsigned char* m_codes, float* m_scales, unsigned char* v_codes,
                                                 float* v_scales, const unsigned char* decay_mask,
                                                 const float* norm_squared, const float* scalars, const float* maps,
                                                 long long n, float beta1, float beta2, float one_minus_beta1,
                                                 float one_minus_beta2, float eps, float weight_decay,
                                                 float max_norm) {
    __shared__ float map[4 * MAP_SIZE];
    for (int i = threadIdx.x; i < 4 * MAP_SIZE; i += blockDim.x) map[i] = maps[i];
    __syncthreads();
    const float *m_levels = map, *m_midpoints = map + MAP_SIZE, *v_levels = map + 2 * MAP_SIZE,
                *v_midpoints = map + 3 * MAP_SIZE;
    const int lane = threadIdx.x % 32;
    const long long block = ((long long)blockIdx.x * blockDim.x + threadIdx.x) / 32;
    const long long first = block * QUANT_BLOCK + lane * 8;
    if (block * QUANT_BLOCK >= n) return;  // whole warps leave together
    const AdamW8bitStep step = {scalars[0], beta1, beta2, one_minus_beta1, one_minus_beta2, eps, weight_decay,
                                scalars[1], scalars[2]};
    float scale = 1.0f;
    if (max_norm > 0.0f) {
        const float norm = __fsqrt_rn(norm_squared[0]);
        if (norm > max_norm) scale = __fdiv_rn(max_norm, norm);
    }
    const int count = first >= n ? 0 : (int)min(8LL, n - first);
    const float m_scale = m_scales[block], v_scale = v_scales[block];
    float m[8], v[8], p[8];  // the new moments (dequantized) and parameters; zeros past n
    if (count == 8) {
        float g[8];
        load_f32x8(p, params + first);
        load_f32x8(g, grads + first);
        const uint2 m_in = *reinterpret_cast<const uint2*>(m_codes + first);
        const uint2 v_in = *reinterpret_cast<const uint2*>(v_codes + first);
        const unsigned int mask = decay_mask[first / 8];
#pragma unroll
        for (int k = 0; k < 8; k++) {
            m[k] = __fmul_rn(m_levels[byte_of(m_in, k)], m_scale);
            v[k] = __fmul_rn(v_levels[byte_of(v_in, k)], v_scale);
            p[k] = adamw8bit_element(m[k], v[k], p[k], __fmul_rn(g[k], scale), bit_of(mask, k), step);
        }
        store_f32x8(params + first, p);
        store_bf16x8(params_bf16 + first, p);
    } else {  // unrolled too, so that m, v and p stay in registers
#pragma unroll
        for (int k = 0; k < 8; k++) {
            m[k] = v[k] = p[k] = 0.0f;
            if (k >= count) continue;
            const long long i = first + k;
            m[k] = __fmul_rn(m_levels[m_codes[i]], m_scale);
            v[k] = __fmul_rn(v_levels[v_codes[i]], v_scale);
            p[k] = adamw8bit_element(m[k], v[k], params[i], __fmul_rn(grads[i], scale), decay_bit(decay_mask, i), step);
            params[i] = p[k];
            params_bf16[i] = __float2bfloat16_rn(p[k]);
        }
    }
    float m_max = 0.0f, v_max = 0.0f;
#pragma unroll
    for (int k = 0; k < 8; k++) {
        m_max = fmaxf(m_max, fabsf(m[k]));
        v_max = fmaxf(v_max, fabsf(v[k]));
    }
    m_max = warp_max(m_max);
    v_max = warp_max(v_max);
    if (count == 8) {
        uint2 m_out = {0, 0}, v_out = {0, 0};
#pragma unroll
        for (int k = 0; k < 8; k++) {
            set_byte(m_out, k, nearest_level(m_midpoints, m_max > 0.0f ? __fdiv_rn(m[k], m_max) : 0.0f));
            set_byte(v_out, k, nearest_level(v_midpoints, v_max > 0.0f ? __fdiv_rn(v[k], v_max) : 0.0f));
        }
        *reinterpret_cast<uint2*>(m_codes + first) = m_out;
        *reinterpret_cast<uint2*>(v_codes + first) = v_out;
    } else {
#pragma unroll
        for (int k = 0; k < 8; k++) {
            if (k >= count) continue;
            const long long i = first + k;
            m_codes[i] = nearest_level(m_midpoints, m_max > 0.0f ? __fdiv_rn(m[k], m_max) : 0.0f);
            v_codes[i] = nearest_level(v_midpoints, v_max > 0.0f ? __fdiv_rn(v[k], v_max) : 0.0f);
        }
    }
    if (lane == 0) {
        m_scales[block] = m_max;
        v_scales[block] = v_max;
    }
}

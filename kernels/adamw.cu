// AdamW over the one flat parameter buffer (n,), with global-norm clipping read on the device.
// params, grads, m, v (n,) fp32; decay_mask (n,) uint8: 1 where weight decay applies (2D weights).
// norm_squared (1,): the squared global grad norm from global_norm.cu; when max_norm > 0 and the
// norm exceeds it, gradients are scaled by max_norm / norm. Bias corrections 1 - beta^step come
// from the host. Same formulas as llama/optim.py:adamw_update.
//
// adamw_update_bf16: the same update (fp32 master params, m, v, grads), and in the same pass the bf16
//   copy params_bf16 (n,) of the new params (round to nearest even), which the matmuls read. The
//   step-dependent values come from the device buffer scalars = {lr, 1 - beta1^step, 1 - beta2^step}
//   (ops.adamw_scalars), so that a captured CUDA graph replays every step. One thread per 8 elements,
//   16-byte loads and stores (the arrays 16-byte aligned); the last thread also takes the n % 8 tail.
#include "bf16.cuh"

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
    params[i] -= lr * (update + weight_decay * decay_mask[i] * params[i]);
}

__device__ __forceinline__ void adamw_element(float& p, float& m, float& v, float g, float decay, float lr,
                                              float beta1, float beta2, float eps, float weight_decay,
                                              float bias_correction1, float bias_correction2) {
    m = beta1 * m + (1.0f - beta1) * g;
    v = beta2 * v + (1.0f - beta2) * g * g;
    const float update = (m / bias_correction1) / (sqrtf(v / bias_correction2) + eps);
    p -= lr * (update + weight_decay * decay * p);
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
        const uint2 mask_bits = *reinterpret_cast<const uint2*>(decay_mask + first);
        const unsigned char* mask = reinterpret_cast<const unsigned char*>(&mask_bits);
        for (int k = 0; k < 8; k++)
            adamw_element(p[k], mi[k], vi[k], g[k] * scale, mask[k], lr, beta1, beta2, eps, weight_decay,
                          bias_correction1, bias_correction2);
        store_f32x8(params + first, p);
        store_f32x8(m + first, mi);
        store_f32x8(v + first, vi);
        store_bf16x8(params_bf16 + first, p);
    } else {
        for (long long i = first; i < n; i++) {
            float p = params[i], mi = m[i], vi = v[i];
            adamw_element(p, mi, vi, grads[i] * scale, decay_mask[i], lr, beta1, beta2, eps, weight_decay,
                          bias_correction1, bias_correction2);
            params[i] = p;
            m[i] = mi;
            v[i] = vi;
            params_bf16[i] = __float2bfloat16_rn(p);
        }
    }
}

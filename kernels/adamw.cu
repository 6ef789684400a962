// AdamW over the one flat parameter buffer (n,), with global-norm clipping read on the device.
// params, grads, m, v (n,) fp32; decay_mask (n,) uint8: 1 where weight decay applies (2D weights).
// norm_squared (1,): the squared global grad norm from global_norm.cu; when max_norm > 0 and the
// norm exceeds it, gradients are scaled by max_norm / norm. Bias corrections 1 - beta^step come
// from the host. Same formulas as llama/optim.py:adamw_update.
#include "common.cuh"

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

// RMSNorm over the last axis: out = x * rstd * weight, rstd = 1 / sqrt(mean(x^2) + eps).
// inp, out (N, C); weight (C,); rstd (N,) saved for the backward.
//
// rmsnorm_forward:               one warp per row.
// rmsnorm_backward_input:        dinp (N, C) += rstd * (g - x * rstd^2 * mean(g * x)), g = dout * weight;
//                                one warp per row.
// rmsnorm_backward_weight_part:  partial (P, C): column sums of dout * x * rstd over P chunks of rows,
//                                grid (ceil(C / blockDim), P).
// column_sum_accumulate:         out (C,) += sum over the P rows of partial (P, C), in a fixed order,
//                                so the weight gradient is deterministic.
#include "common.cuh"

extern "C" __global__ void rmsnorm_forward(float* out, float* rstd, const float* inp, const float* weight,
                                           int N, int C, float eps) {
    const int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32, lane = threadIdx.x % 32;
    if (row >= N) return;
    const float* x = inp + (long long)row * C;
    float sum_sq = 0.0f;
    for (int c = lane; c < C; c += 32) sum_sq += x[c] * x[c];
    const float r = 1.0f / sqrtf(warp_sum(sum_sq) / C + eps);
    float* o = out + (long long)row * C;
    for (int c = lane; c < C; c += 32) o[c] = x[c] * r * weight[c];
    if (lane == 0) rstd[row] = r;
}

extern "C" __global__ void rmsnorm_backward_input(float* dinp, const float* dout, const float* inp,
                                                  const float* weight, const float* rstd, int N, int C) {
    const int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32, lane = threadIdx.x % 32;
    if (row >= N) return;
    const long long base = (long long)row * C;
    const float* x = inp + base;
    const float* d = dout + base;
    float dot = 0.0f;
    for (int c = lane; c < C; c += 32) dot += d[c] * weight[c] * x[c];
    const float r = rstd[row];
    const float k = r * r * warp_sum(dot) / C;
    float* dx = dinp + base;
    for (int c = lane; c < C; c += 32) dx[c] += r * (d[c] * weight[c] - x[c] * k);
}

extern "C" __global__ void rmsnorm_backward_weight_part(float* partial, const float* dout, const float* inp,
                                                        const float* rstd, int N, int C, int rows_per_part) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= C) return;
    const int first = blockIdx.y * rows_per_part, last = min(N, first + rows_per_part);
    float acc = 0.0f;
    for (int row = first; row < last; row++) {
        const long long i = (long long)row * C + c;
        acc += dout[i] * inp[i] * rstd[row];
    }
    partial[(long long)blockIdx.y * C + c] = acc;
}

extern "C" __global__ void column_sum_accumulate(float* out, const float* partial, int P, int C) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= C) return;
    float acc = 0.0f;
    for (int p = 0; p < P; p++) acc += partial[(long long)p * C + c];
    out[c] += acc;
}

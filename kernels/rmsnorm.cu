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
//
// bf16 versions, fused with the residual add (x, branch, h, ln, dln, dresidual bf16; weight, rstd and
// dweight fp32: the norm reads the fp32 master weight, whose small updates a bf16 copy would lose). Blocks are 2D: blockDim.x = C / 8 rounded up to a multiple of 32, one thread per 8
// columns of a row, and blockDim.y rows at a time. C must be a multiple of 8, at most 8192.
// rmsnorm_residual_forward_bf16: h = x + branch (N, C), rounded to bf16 and stored as residual_out (the
//                           new residual stream; may be x itself), then ln = h * rstd * weight of the
//                           rounded h. branch = nullptr: h = x, a plain RMSNorm, residual_out unused.
//                           grid ceil(N / blockDim.y).
// rmsnorm_backward_bf16:    dresidual (N, C) += rstd * (g - h * rstd^2 * mean(g * h)), g = dln * weight
//                           (the residual gradient passes through the add unchanged, so only the
//                           norm's input gradient is added), and dweight (C,) += sum over rows of
//                           dln * h * rstd, deterministic in one launch: block p of the P = gridDim.x
//                           blocks takes rows [p * rows_per_part, (p + 1) * rows_per_part) and writes
//                           its column sums to partial (P, C); the last block of each group of `group`
//                           blocks adds the group's rows in order into group_partial (P / group, C),
//                           and the last group adds those in order into dweight. counters
//                           (P / group + 1,) are zero before the launch and after it.
//                           Dynamic shared memory: blockDim.y * C floats.
#include "bf16.cuh"

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

extern "C" __global__ void rmsnorm_residual_forward_bf16(bf16* residual_out, bf16* ln_out, float* rstd, const bf16* x,
                                                    const bf16* branch, const float* weight, int N, int C,
                                                    float eps) {
    const int row = blockIdx.x * blockDim.y + threadIdx.y, c = threadIdx.x * 8;
    const bool active = row < N && c < C;
    const long long i = (long long)row * C + c;
    float h[8] = {};
    if (active) {
        load_bf16x8(h, x + i);
        if (branch != nullptr) {
            float b[8];
            load_bf16x8(b, branch + i);
            for (int k = 0; k < 8; k++) h[k] += b[k];
            const uint4 rounded = pack_bf16x8(h);
            *reinterpret_cast<uint4*>(residual_out + i) = rounded;
            unpack_bf16x8(h, rounded);  // normalize the stored residual, which the backward will see
        }
    }
    float sum_sq = 0.0f;
    for (int k = 0; k < 8; k++) sum_sq += h[k] * h[k];
    const float r = 1.0f / sqrtf(row_sum(sum_sq) / C + eps);
    if (active) {
        float w[8], out[8];
        load_f32x8(w, weight + c);
        for (int k = 0; k < 8; k++) out[k] = h[k] * r * w[k];
        store_bf16x8(ln_out + i, out);
        if (threadIdx.x == 0) rstd[row] = r;
    }
}

extern "C" __global__ void __launch_bounds__(1024) rmsnorm_backward_bf16(
    bf16* dresidual, float* dweight, float* partial, float* group_partial, unsigned int* counters, const bf16* dln,
    const bf16* h, const float* weight, const float* rstd, int N, int C, int rows_per_part, int group) {
    extern __shared__ __align__(16) float slice_dweight[];  // (blockDim.y, C): each row slice's dweight sums
    const int c = threadIdx.x * 8;
    const bool in_row = c < C;
    float w[8] = {}, dw[8] = {};
    if (in_row) load_f32x8(w, weight + c);
    const int first = blockIdx.x * rows_per_part, last = min(N, first + rows_per_part);
    // this thread's row of each step, its inputs loaded one step ahead so that their latency overlaps the
    // step before (the row sum's barriers)
    uint4 d_raw = {}, x_raw = {}, dres = {};
    float r = 0.0f;
    const auto load_row = [&](int row) {
        if (in_row && row < last) {
            const long long i = (long long)row * C + c;
            d_raw = *reinterpret_cast<const uint4*>(dln + i);
            x_raw = *reinterpret_cast<const uint4*>(h + i);
            dres = *reinterpret_cast<const uint4*>(dresidual + i);
            r = rstd[row];
        }
    };
    load_row(first + threadIdx.y);
    for (int base = first; base < last; base += blockDim.y) {  // the same trip count for the whole block
        const int row = base + threadIdx.y;
        const bool active = in_row && row < last;
        const uint4 d_row = d_raw, x_row = x_raw, dres_row = dres;
        const float r_row = r;
        load_row(row + blockDim.y);
        float d[8], x[8], dot = 0.0f;
        if (active) {
            unpack_bf16x8(d, d_row);
            unpack_bf16x8(x, x_row);
            for (int k = 0; k < 8; k++) dot += d[k] * w[k] * x[k];
        }
        const float scale = r_row * r_row * row_sum(dot) / C;
        if (active) {
            float dx[8];
            unpack_bf16x8(d, d_row);  // again: the packed rows are what stays live across the barriers
            unpack_bf16x8(x, x_row);
            unpack_bf16x8(dx, dres_row);
            for (int k = 0; k < 8; k++) {
                dx[k] += r_row * (d[k] * w[k] - x[k] * scale);
                dw[k] += d[k] * x[k] * r_row;
            }
            store_bf16x8(dresidual + (long long)row * C + c, dx);
        }
    }
    // this block's row of partial: its row slices' sums in order
    if (in_row) store_f32x8(slice_dweight + threadIdx.y * C + c, dw);
    __syncthreads();
    if (in_row && threadIdx.y == 0) {
        for (int y = 1; y < blockDim.y; y++) {
            float v[8];
            load_f32x8(v, slice_dweight + y * C + c);
            for (int k = 0; k < 8; k++) dw[k] += v[k];
        }
        store_f32x8(partial + (long long)blockIdx.x * C + c, dw);
    }
    const int g = blockIdx.x / group, groups = gridDim.x / group;
    if (!arrive_last(&counters[g], group)) return;
    sum_partial_rows(group_partial + (long long)g * C, partial + (long long)g * group * C, group, C, false);
    if (!arrive_last(&counters[groups], groups)) return;
    sum_partial_rows(dweight, group_partial, groups, C, true);
}

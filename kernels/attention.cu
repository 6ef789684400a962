// Causal grouped-query attention, the kernels beside the batched matmuls (llama/ops/attention.py strings them).
// Layouts: q (B, H, T, D), k and v (B, KV, T, D), probabilities probs (B, H, T, T), out (B, T, H * D).
// The H / KV query heads of one kv head are adjacent, so per kv head they form one (H/KV * T, D)
// matrix and every product is a plain strided-batched matmul over B * KV, with no copy of K or V.
//
// causal_softmax_forward:  in place on rows of probs (the scores scaled by 1/sqrt(D)): row r is time
//                          t = r % T of batch row b = r / (H * T); softmax over columns first..t, zeros elsewhere,
//                          first = doc_start[b, t] under the document mask (doc_start (B, T) int32, llama/ops/
//                          document_mask.py), else 0 (doc_start null: plain causal). One warp per row.
// causal_softmax_backward: in place on dprobs: dscores = probs * (dprobs - sum(probs * dprobs)) over the same
//                          columns, zero elsewhere.
// The document mask's doc_end is not needed here: a row's columns end at t.
// merge_heads:             (B, H, T, D) -> (B, T, H * D).
// split_heads:             (B, T, H * D) -> (B, H, T, D).
#include "common.cuh"

// the first column row `row` of (B, H, T, T) scores sees: its document's start, or 0 without a mask
__device__ __forceinline__ int first_column(const int* doc_start, int row, int T, int H) {
    return doc_start == nullptr ? 0 : doc_start[(long long)(row / (H * T)) * T + row % T];
}

extern "C" __global__ void causal_softmax_forward(float* probs, int rows, int T, int H, const int* doc_start) {
    const int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32, lane = threadIdx.x % 32;
    if (row >= rows) return;
    const int t = row % T, first = first_column(doc_start, row, T, H);
    float* x = probs + (long long)row * T;
    float m = -INFINITY;
    for (int j = first + lane; j <= t; j += 32) m = fmaxf(m, x[j]);
    m = warp_max(m);
    float sum = 0.0f;
    for (int j = first + lane; j <= t; j += 32) sum += expf(x[j] - m);
    const float inv = 1.0f / warp_sum(sum);
    for (int j = lane; j < T; j += 32) x[j] = first <= j && j <= t ? expf(x[j] - m) * inv : 0.0f;
}

extern "C" __global__ void causal_softmax_backward(float* dprobs, const float* probs, int rows, int T, int H,
                                                   const int* doc_start) {
    const int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32, lane = threadIdx.x % 32;
    if (row >= rows) return;
    const int t = row % T, first = first_column(doc_start, row, T, H);
    float* d = dprobs + (long long)row * T;
    const float* p = probs + (long long)row * T;
    float dot = 0.0f;
    for (int j = first + lane; j <= t; j += 32) dot += p[j] * d[j];
    dot = warp_sum(dot);
    for (int j = lane; j < T; j += 32) d[j] = first <= j && j <= t ? p[j] * (d[j] - dot) : 0.0f;
}

extern "C" __global__ void merge_heads(float* out, const float* heads, int B, int H, int T, int D) {
    const long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;  // over out (B, T, H, D)
    if (idx >= (long long)B * T * H * D) return;
    const int d = idx % D, h = (idx / D) % H, t = (idx / ((long long)D * H)) % T;
    const long long b = idx / ((long long)D * H * T);
    out[idx] = heads[((b * H + h) * T + t) * D + d];
}

extern "C" __global__ void split_heads(float* heads, const float* inp, int B, int H, int T, int D) {
    const long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;  // over heads (B, H, T, D)
    if (idx >= (long long)B * H * T * D) return;
    const int d = idx % D, t = (idx / D) % T, h = (idx / ((long long)D * T)) % H;
    const long long b = idx / ((long long)D * T * H);
    heads[idx] = inp[((b * T + t) * H + h) * D + d];
}

// Token embedding.
// embedding_forward:  out (N, C) = wte[tokens] with tokens (N,) and wte (V, C); N = B * T.
// embedding_backward: dwte (V, C) += the dout (N, C) rows of the positions that hold each token.
//   Deterministic, without atomics: the host sorts positions by token (stable) once per batch and
//   passes `order` (N,), the positions grouped by token, `starts` (U + 1,), where each group begins,
//   and `unique` (U,), the token of each group. One block per distinct token adds its rows in order.
//
// bf16 versions (wte and out bf16, dwte fp32; C a multiple of 8, one thread per 8 columns):
// embedding_forward_bf16:  out (N, C) = wte[tokens], copied in 16-byte vectors.
// embedding_backward_bf16: dwte (V, C) += dout (N, C) rows grouped by token, deterministic. The host
//   (ops.token_segments) sorts positions by token (stable) into `order` (N,) and cuts each token's
//   group into segments of at most EMBEDDING_SEGMENT rows: `segments` (N, 4) int32 holds per segment
//   {group begin, group end (in order), token, index of the segment in its group}; rows past the
//   last segment are {0, 0, 0, 0}. A token's segments are adjacent, and tokens with several come
//   first. One block per segment sums its rows in order. A one-segment token adds that sum to its
//   dwte row; otherwise each segment writes partial (S, C) row `segment`, and the segment that
//   finishes last (counters (S,), one per token, indexed by its first segment) adds the partials in
//   order. Frequent tokens thus spread over many blocks instead of one long serial loop.
#include "bf16.cuh"

#define EMBEDDING_SEGMENT 16  // rows per segment (llama/ops/embedding.py reads it)
#define EMBEDDING_BATCH 8     // rows loaded at once
#define EMBEDDING_FORWARD_VECTORS 4  // 16-byte vectors per thread (llama/ops/embedding.py reads it)

extern "C" __global__ void embedding_forward(float* out, const int* tokens, const float* wte, int N, int C) {
    const long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (long long)N * C) return;
    const int n = idx / C, c = idx % C;
    out[idx] = wte[(long long)tokens[n] * C + c];
}

extern "C" __global__ void embedding_backward(float* dwte, const float* dout, const int* order, const int* starts,
                                              const int* unique, int C) {
    const int group = blockIdx.x;
    const int begin = starts[group], end = starts[group + 1];
    float* row = dwte + (long long)unique[group] * C;
    for (int c = threadIdx.x; c < C; c += blockDim.x) {
        float acc = 0.0f;
        for (int i = begin; i < end; i++) acc += dout[(long long)order[i] * C + c];
        row[c] += acc;
    }
}

// one thread per 8 columns of one row: grid covers N * C / 8 threads
// each thread copies EMBEDDING_FORWARD_VECTORS vectors, blockDim.x apart: all token loads, then all row
// loads, in flight together
extern "C" __global__ void embedding_forward_bf16(bf16* out, const int* tokens, const bf16* wte, int N, int C) {
    const long long first = (long long)blockIdx.x * blockDim.x * EMBEDDING_FORWARD_VECTORS + threadIdx.x;
    const int vectors_per_row = C / 8;
    const long long vectors = (long long)N * vectors_per_row;
    int token[EMBEDDING_FORWARD_VECTORS];
    uint4 row[EMBEDDING_FORWARD_VECTORS];
#pragma unroll
    for (int u = 0; u < EMBEDDING_FORWARD_VECTORS; u++) {
        const long long idx = first + u * blockDim.x;
        if (idx < vectors) token[u] = tokens[idx / vectors_per_row];
    }
#pragma unroll
    for (int u = 0; u < EMBEDDING_FORWARD_VECTORS; u++) {
        const long long idx = first + u * blockDim.x;
        if (idx < vectors)
            row[u] = *reinterpret_cast<const uint4*>(wte + (long long)token[u] * C + idx % vectors_per_row * 8);
    }
#pragma unroll
    for (int u = 0; u < EMBEDDING_FORWARD_VECTORS; u++) {
        const long long idx = first + u * blockDim.x;
        if (idx < vectors) reinterpret_cast<uint4*>(out)[idx] = row[u];
    }
}

// grid (N,): one block per segment, blockDim.x = C / 8
extern "C" __global__ void __launch_bounds__(1024) embedding_backward_bf16(
    float* dwte, float* partial, unsigned int* counters, const bf16* dout, const int* order, const int4* segments,
    int C) {
    const int4 segment = segments[blockIdx.x];
    const int group_begin = segment.x, group_end = segment.y, token = segment.z, index = segment.w;
    if (group_begin == group_end) return;  // padding
    const int begin = group_begin + index * EMBEDDING_SEGMENT, end = min(group_end, begin + EMBEDDING_SEGMENT);
    const int c = threadIdx.x * 8;
    const int count = (group_end - group_begin + EMBEDDING_SEGMENT - 1) / EMBEDDING_SEGMENT;  // segments of the token
    float* row = dwte + (long long)token * C + c;
    float w[8];
    if (count == 1) load_f32x8(w, row);  // issued now, in flight with the loads of dout
    float sum[8] = {};
    for (int batch = begin; batch < end; batch += EMBEDDING_BATCH) {
        // the batch's loads first, unconditionally (past the end: the last row again), so they are in flight together
        uint4 rows[EMBEDDING_BATCH];
#pragma unroll
        for (int i = 0; i < EMBEDDING_BATCH; i++)
            rows[i] = *reinterpret_cast<const uint4*>(dout + (long long)order[min(batch + i, end - 1)] * C + c);
#pragma unroll
        for (int i = 0; i < EMBEDDING_BATCH; i++) {
            float d[8];
            unpack_bf16x8(d, rows[i]);
            if (batch + i < end)
                for (int k = 0; k < 8; k++) sum[k] += d[k];
        }
    }
    if (count > 1) {  // sum this token's segments in order, in the block that finishes last
        store_f32x8(partial + (long long)blockIdx.x * C + c, sum);
        const int first = blockIdx.x - index;
        if (!arrive_last(&counters[first], count)) return;
        sum_partial_rows(dwte + (long long)token * C, partial + (long long)first * C, count, C, true);
        return;
    }
    for (int k = 0; k < 8; k++) w[k] += sum[k];
    store_f32x8(row, w);
}

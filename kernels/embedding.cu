// Token embedding.
// embedding_forward:  out (N, C) = wte[tokens] with tokens (N,) and wte (V, C); N = B * T.
// embedding_backward: dwte (V, C) += the dout (N, C) rows of the positions that hold each token.
//   Deterministic, without atomics: the host sorts positions by token (stable) once per batch and
//   passes `order` (N,), the positions grouped by token, `starts` (U + 1,), where each group begins,
//   and `unique` (U,), the token of each group. One block per distinct token adds its rows in order.
#include "common.cuh"

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

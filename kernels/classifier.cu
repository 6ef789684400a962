// Fused softmax cross-entropy (llm.c's fused classifier): one block per row of logits (N, V).
// losses (N,) = logsumexp(row) - row[target]; the row is then overwritten by its gradient
// (softmax(row) - onehot(target)) * dloss, so the probabilities never exist in memory.
// Two passes over the row: an online max/sum, then the gradient.
#include "common.cuh"

extern "C" __global__ void fused_classifier(float* logits, float* losses, const int* targets, int V, float dloss) {
    float* x = logits + (long long)blockIdx.x * V;
    const int target = targets[blockIdx.x];
    const float target_logit = x[target];
    float m = -INFINITY, s = 0.0f;  // this thread's running max and sum of exp(x - max)
    for (int j = threadIdx.x; j < V; j += blockDim.x) {
        const float v = x[j];
        if (v > m) {
            s = s * expf(m - v) + 1.0f;
            m = v;
        } else {
            s += expf(v - m);
        }
    }
    const float row_max = block_max(m);
    const float sum = block_sum(s == 0.0f ? 0.0f : s * expf(m - row_max));
    const float lse = row_max + logf(sum);
    if (threadIdx.x == 0) losses[blockIdx.x] = lse - target_logit;
    for (int j = threadIdx.x; j < V; j += blockDim.x) x[j] = (expf(x[j] - lse) - (j == target ? 1.0f : 0.0f)) * dloss;
}

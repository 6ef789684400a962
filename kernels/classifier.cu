// Fused softmax cross-entropy (llm.c's fused classifier): one block per row of logits (N, V).
// losses (N,) = logsumexp(row) - row[target]; the row is then overwritten by its gradient
// (softmax(row) - onehot(target)) * dloss, so the probabilities never exist in memory.
// Two passes over the row: an online max/sum, then the gradient. The sum of exponentials is kept in
// double, and the loss (log(sum) - (target - max)) and the target's gradient are formed in double,
// so that both stay accurate when the loss is near zero.
#include "common.cuh"

extern "C" __global__ void fused_classifier(float* logits, float* losses, const int* targets, int V, float dloss) {
    float* x = logits + (long long)blockIdx.x * V;
    const int target = targets[blockIdx.x];
    const float target_logit = x[target];
    float m = -INFINITY;  // this thread's running max
    double s = 0.0;       // and sum of exp(x - m)
    for (int j = threadIdx.x; j < V; j += blockDim.x) {
        const float v = x[j];
        if (v > m) {
            s = s * expf(m - v) + 1.0;
            m = v;
        } else {
            s += expf(v - m);
        }
    }
    const float row_max = block_max(m);
    const double sum = block_sum(s == 0.0 ? 0.0 : s * expf(m - row_max));
    const float lse = row_max + (float)log(sum);
    if (threadIdx.x == 0) losses[blockIdx.x] = (float)(log(sum) - (double)(target_logit - row_max));
    for (int j = threadIdx.x; j < V; j += blockDim.x) {
        if (j == target)  // p - 1 in double: p is near 1 when the model is confident
            x[j] = (float)(exp((double)(x[j] - row_max)) / sum - 1.0) * dloss;
        else
            x[j] = expf(x[j] - lse) * dloss;
    }
}

// Fused softmax cross-entropy (llm.c's fused classifier): one block per row of logits (N, V).
// losses (N,) = logsumexp(row) - row[target]; the row is then overwritten by its gradient
// (softmax(row) - onehot(target)) * dloss, so the probabilities never exist in memory.
// Two passes over the row: an online max/sum, then the gradient. The sum of exponentials is kept in
// double, and the loss (log(sum) - (target - max)) and the target's gradient are formed in double,
// so that both stay accurate when the loss is near zero.
//
// fused_classifier_bf16: the same for bf16 logits (n, V) of a chunk of n tokens, any V; losses (n,) fp32,
//   dlogits written over the logits in bf16. The row is read in 16-byte vectors (the elements before
//   the row's first 16-byte boundary and after its last one, fewer than 8 each, one per thread). Each
//   thread keeps an online max m and `rest`, the sum of exp(x - m) over its elements except the one
//   at m (whose term is the implicit 1), in fp32. The block adds the threads' terms in double without
//   the implicit 1 of the row's maximum, so rest_total = sum - 1 stays accurate when the model is
//   confident: loss = log1p(rest_total) - (x[target] - max) and the target's gradient
//   (expm1(x[target] - max) - rest_total) / sum lose nothing to cancellation. Per-element exponentials
//   use the fast __expf (relative error ~1e-6 over the logits' range), which keeps the kernel
//   memory-bound. The first pass keeps the row's first `cached_vectors` vectors in dynamic shared
//   memory (cached_vectors * 16 bytes; up to ~90% of a 128256-wide row on Hopper), so the second pass
//   reads only the rest again from global memory, with streaming hints, as it writes the gradient.
// loss_accumulate: total (1,) += scale * sum(losses (n,)), one block, in a fixed order.
#include "bf16.cuh"

#define CLASSIFIER_UNROLL 4  // 16-byte loads in flight per thread

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

// add COUNT values to the online state (m, rest) of one thread
template <int COUNT>
__device__ __forceinline__ void online_softmax_update(float& m, float& rest, const float* v) {
    float v_max = v[0];
    for (int k = 1; k < COUNT; k++) v_max = fmaxf(v_max, v[k]);
    bool skip = false;  // the element at the new max is the implicit 1
    if (v_max > m) {
        rest = (rest + 1.0f) * expf(m - v_max);
        m = v_max;
        skip = true;
    }
    for (int k = 0; k < COUNT; k++) {
        const bool implicit_one = skip && v[k] == m;
        skip = skip && !implicit_one;
        rest += implicit_one ? 0.0f : __expf(v[k] - m);
    }
}

extern "C" __global__ void __launch_bounds__(1024) fused_classifier_bf16(bf16* logits, float* losses,
                                                                         const int* targets, int V, float dloss,
                                                                         int cached_vectors) {
    extern __shared__ uint4 cached[];  // (cached_vectors,): each thread reads back only what it wrote
    bf16* x = logits + (long long)blockIdx.x * V;
    const int target = targets[blockIdx.x];
    const float target_logit = __bfloat162float(x[target]);
    const int head = min(V, (int)((16 - reinterpret_cast<size_t>(x) % 16) % 16 / 2));
    const int vectors = (V - head) / 8, tail = head + vectors * 8;
    uint4* xv = reinterpret_cast<uint4*>(x + head);
    const int stride = blockDim.x;
    // the head and tail elements, at most 7 each: thread j < head takes element j, the next ones the tail
    const bool has_scalar = threadIdx.x < head + V - tail;
    const int scalar = threadIdx.x < head ? threadIdx.x : tail + threadIdx.x - head;

    float m = -INFINITY, rest = 0.0f;
    if (has_scalar) {
        const float v = __bfloat162float(x[scalar]);
        online_softmax_update<1>(m, rest, &v);
    }
    for (int i = threadIdx.x; i < vectors; i += CLASSIFIER_UNROLL * stride) {
        uint4 raw[CLASSIFIER_UNROLL];
#pragma unroll
        for (int u = 0; u < CLASSIFIER_UNROLL; u++)
            if (i + u * stride < vectors) raw[u] = xv[i + u * stride];
#pragma unroll
        for (int u = 0; u < CLASSIFIER_UNROLL; u++) {
            const int vec = i + u * stride;
            if (vec < vectors) {
                if (vec < cached_vectors) cached[vec] = raw[u];
                float v[8];
                unpack_bf16x8(v, raw[u]);
                online_softmax_update<8>(m, rest, v);
            }
        }
    }
    const float row_max = block_max(m);
    // the threads holding the row max contribute rest (and count their implicit 1s), the others all
    const bool at_max = m == row_max;
    const int ones = block_sum(at_max ? 1 : 0);
    const double rest_total =
        block_sum(at_max ? (double)rest : m == -INFINITY ? 0.0 : (1.0 + rest) * (double)expf(m - row_max)) +
        (ones - 1);
    const double sum = 1.0 + rest_total;
    const double target_shift = (double)target_logit - row_max;
    if (threadIdx.x == 0) losses[blockIdx.x] = (float)(log1p(rest_total) - target_shift);
    const float lse = row_max + (float)log(sum);
    const float dtarget = (float)((expm1(target_shift) - rest_total) / sum) * dloss;

    if (has_scalar)
        x[scalar] = __float2bfloat16_rn(scalar == target ? dtarget : __expf(__bfloat162float(x[scalar]) - lse) * dloss);
    for (int i = threadIdx.x; i < vectors; i += CLASSIFIER_UNROLL * stride) {
        uint4 raw[CLASSIFIER_UNROLL];
#pragma unroll
        for (int u = 0; u < CLASSIFIER_UNROLL; u++)
            if (i + u * stride < vectors)
                raw[u] = i + u * stride < cached_vectors ? cached[i + u * stride] : __ldcs(xv + i + u * stride);
#pragma unroll
        for (int u = 0; u < CLASSIFIER_UNROLL; u++) {
            const int vec = i + u * stride;
            if (vec < vectors) {
                float v[8];
                unpack_bf16x8(v, raw[u]);
                for (int k = 0; k < 8; k++) {
                    const int e = head + vec * 8 + k;
                    v[k] = e == target ? dtarget : __expf(v[k] - lse) * dloss;
                }
                __stcs(xv + vec, pack_bf16x8(v));
            }
        }
    }
}

extern "C" __global__ void loss_accumulate(float* total, const float* losses, int n, float scale) {
    double sum = 0.0;
    for (int i = threadIdx.x; i < n; i += blockDim.x) sum += losses[i];
    sum = block_sum(sum);
    if (threadIdx.x == 0) total[0] = (float)((double)total[0] + (double)scale * sum);
}

// Fused softmax cross-entropy (llm.c's fused classifier): one block per row of logits (N, V).
// losses (N,) = logsumexp(row) - row[target]; the row is then overwritten by its gradient
// (softmax(row) - onehot(target)) * dloss, so the probabilities never exist in memory.
// A target < 0 is not counted: its row's loss and gradient are 0 (--sft's prompt tokens; row[target] is not read).
// Two passes over the row: an online max/sum, then the gradient. The sum of exponentials is kept in
// double, and the loss (log(sum) - (target - max)) and the target's gradient are formed in double,
// so that both stay accurate when the loss is near zero.
//
// fused_classifier_bf16: the same for bf16 logits (n, V) of a chunk of n tokens, any V; losses (n,) fp32, dlogits
//   written over the logits in bf16; dloss_scale, if not null, multiplies dloss (a device scalar written per
//   step, which a captured graph reads at replay: --sft's 1 / counted targets). A row whose target is < 0 is read
//   and refilled as the others, its loss 0 and its gradient written as 0. Persistent: one 1024-thread block per
//   multiprocessor (grid <= n) takes rows blockIdx.x, blockIdx.x + gridDim.x, ... A row is read in 16-byte
//   vectors (the elements before its first 16-byte boundary and after its last one, fewer than 8 each, one per
//   thread); thread t owns vectors t + k * blockDim.x. Its first `smem_slots` ones stay in dynamic shared memory
//   between the passes (smem_slots * blockDim.x * 16 bytes; slot k of thread t at k * blockDim.x + t, read back
//   only by t), the next CLASSIFIER_REG_VECTORS in registers, and any beyond those (V above ~131k on Hopper) are
//   read again in the gradient pass. The gradient pass of row r refills each slot, once it has been read, with
//   row r + gridDim.x (cp.async into shared memory in two commit groups, plain loads into registers), so reading
//   the next row overlaps writing this one and the max/sum pass reads on-chip memory only.
//   Each thread keeps an online max m and `rest`, the sum of exp(x - m) over its elements except the
//   one at m (whose term is the implicit 1), in fp32. The block adds the threads' terms in double without
//   the implicit 1 of the row's maximum, so rest_total = sum - 1 stays accurate when the model is
//   confident: loss = log1p(rest_total) - (x[target] - max) and the target's gradient
//   (expm1(x[target] - max) - rest_total) / sum lose nothing to cancellation. Per-element exponentials
//   are ex2.approx of fmaf(x, log2 e, -m log2 e) (relative error ~1e-6 over the logits' range), which
//   keeps the kernel memory-bound; a vector that raises a thread's max takes the exact path, which
//   finds the implicit 1.
// loss_accumulate_bf16: total (1,) += scale * sum(losses (n,)), one block, in a fixed order; scale_at, if not
//   null, multiplies scale (the classifier's dloss_scale).
#include "bf16.cuh"
#include "mma.cuh"

#define CLASSIFIER_UNROLL 2       // 16-byte loads in flight per thread where a row is read past the kept part
#define CLASSIFIER_REG_VECTORS 2  // 16-byte vectors of a row each thread keeps in registers between the passes

extern "C" __global__ void fused_classifier(float* logits, float* losses, const int* targets, int V, float dloss) {
    float* x = logits + (long long)blockIdx.x * V;
    const int target = targets[blockIdx.x];
    if (target < 0) {  // not counted
        if (threadIdx.x == 0) losses[blockIdx.x] = 0.0f;
        for (int j = threadIdx.x; j < V; j += blockDim.x) x[j] = 0.0f;
        return;
    }
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

// add COUNT values to the online state (m, rest) of one thread, finding the implicit 1 of a new max
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

#define LOG2E 1.4426950408889634f

__device__ __forceinline__ float fast_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// add a vector of 8 logits to the online state: one fmaf and one ex2 per element, unless it raises the max
__device__ __forceinline__ void online_softmax_update8(float& m, float& rest, uint4 raw) {
    float v[8];
    unpack_bf16x8(v, raw);
    float v_max = v[0];
#pragma unroll
    for (int k = 1; k < 8; k++) v_max = fmaxf(v_max, v[k]);
    if (v_max > m) {  // rare once a thread has seen a few vectors
        online_softmax_update<8>(m, rest, v);
        return;
    }
    const float shift = m * LOG2E;
    float sum = 0.0f;
#pragma unroll
    for (int k = 0; k < 8; k++) sum += fast_exp2(fmaf(v[k], LOG2E, -shift));
    rest += sum;
}

// dlogits (softmax - onehot) * dloss of a vector of 8 logits; the target is element `target_at` of it
// if 0 <= target_at < 8. lse_log2 = log-sum-exp of the row times log2 e.
__device__ __forceinline__ uint4 softmax_gradient8(uint4 raw, float lse_log2, float dloss, int target_at,
                                                   float dtarget) {
    float v[8];
    unpack_bf16x8(v, raw);
#pragma unroll
    for (int k = 0; k < 8; k++) v[k] = fast_exp2(fmaf(v[k], LOG2E, -lse_log2)) * dloss;
    if ((unsigned)target_at < 8u) {
#pragma unroll
        for (int k = 0; k < 8; k++)
            if (k == target_at) v[k] = dtarget;
    }
    return pack_bf16x8(v);
}

// One row of the logits: its elements before the first 16-byte boundary (head, < 8), its whole 16-byte
// vectors, and the elements after them (from tail on, < 8).
struct LogitsRow {
    bf16* x;
    uint4* vectors_at;
    int head, vectors, tail;
    __device__ LogitsRow(bf16* logits, int row, int V) {
        x = logits + (long long)row * V;
        head = min(V, (int)((16 - reinterpret_cast<size_t>(x) % 16) % 16 / 2));
        vectors = (V - head) / 8;
        tail = head + vectors * 8;
        vectors_at = reinterpret_cast<uint4*>(x + head);
    }
    // this thread's head or tail element, or -1: thread j < head takes element j, the next ones the tail
    __device__ int scalar(int V) const {
        const int j = threadIdx.x;
        return j < head ? j : j < head + V - tail ? tail + j - head : -1;
    }
};

// this thread's shared-memory slots [first, last) of `row` copied in, as one commit group
__device__ __forceinline__ void fetch_slots(uint4* cached, const LogitsRow& row, int first, int last) {
    for (int k = first; k < last; k++) {
        const int vec = k * blockDim.x + threadIdx.x;
        if (vec < row.vectors) cp_async_16(smem_address(cached + vec), row.vectors_at + vec, 16);
    }
    cp_async_commit();
}

// the gradient pass over this thread's slots [first, last) of `row`, refilling each, once read, with the
// vector of the next row (next_vectors of them at next_at; 0 if there is no next row), as one commit group
__device__ __forceinline__ void write_slots(uint4* cached, const LogitsRow& row, const uint4* next_at,
                                            int next_vectors, int first, int last, float lse_log2, float dloss,
                                            int target, float dtarget) {
    for (int k = first; k < last; k++) {
        const int vec = k * blockDim.x + threadIdx.x;
        if (vec < row.vectors)  // the store depends on the read, and the copy is issued after the store
            __stcs(row.vectors_at + vec,
                   softmax_gradient8(cached[vec], lse_log2, dloss, target - row.head - vec * 8, dtarget));
        if (vec < next_vectors) cp_async_16(smem_address(cached + vec), next_at + vec, 16);
    }
    cp_async_commit();
}

extern "C" __global__ void __launch_bounds__(1024, 1) fused_classifier_bf16(bf16* logits, float* losses,
                                                                            const int* targets, int n, int V,
                                                                            float dloss, int smem_slots,
                                                                            const float* dloss_scale) {
    extern __shared__ uint4 cached[];  // (smem_slots, blockDim.x): each thread reads back only its own slots
    const int stride = blockDim.x, half = smem_slots / 2;
    const int held_first = smem_slots * stride, rest_first = held_first + CLASSIFIER_REG_VECTORS * stride;
    uint4 held[CLASSIFIER_REG_VECTORS] = {};  // this thread's vectors held_first + j * stride + threadIdx.x

    if (blockIdx.x >= n) return;
    if (dloss_scale != nullptr) dloss *= *dloss_scale;
    LogitsRow row(logits, blockIdx.x, V);
    fetch_slots(cached, row, 0, half);
    fetch_slots(cached, row, half, smem_slots);
#pragma unroll
    for (int j = 0; j < CLASSIFIER_REG_VECTORS; j++) {
        const int vec = held_first + j * stride + threadIdx.x;
        if (vec < row.vectors) held[j] = __ldcs(row.vectors_at + vec);
    }

    for (int r = blockIdx.x; r < n; r += gridDim.x) {
        const int target = targets[r];
        const float target_logit = target >= 0 ? __bfloat162float(row.x[target]) : 0.0f;  // < 0: not counted
        const float row_dloss = target >= 0 ? dloss : 0.0f;
        const int scalar = row.scalar(V);
        const float scalar_logit = scalar >= 0 ? __bfloat162float(row.x[scalar]) : 0.0f;

        // pass 1: online max and sum, from shared memory and registers (and global memory past them)
        float m = -INFINITY, rest = 0.0f;
        cp_async_wait<1>();
        for (int k = 0; k < half; k++) {
            const int vec = k * stride + threadIdx.x;
            if (vec < row.vectors) online_softmax_update8(m, rest, cached[vec]);
        }
        cp_async_wait<0>();
        for (int k = half; k < smem_slots; k++) {
            const int vec = k * stride + threadIdx.x;
            if (vec < row.vectors) online_softmax_update8(m, rest, cached[vec]);
        }
#pragma unroll
        for (int j = 0; j < CLASSIFIER_REG_VECTORS; j++)
            if (held_first + j * stride + threadIdx.x < row.vectors) online_softmax_update8(m, rest, held[j]);
        for (int i = rest_first + threadIdx.x; i < row.vectors; i += CLASSIFIER_UNROLL * stride) {
            uint4 raw[CLASSIFIER_UNROLL];
#pragma unroll
            for (int u = 0; u < CLASSIFIER_UNROLL; u++)
                if (i + u * stride < row.vectors) raw[u] = row.vectors_at[i + u * stride];
#pragma unroll
            for (int u = 0; u < CLASSIFIER_UNROLL; u++)
                if (i + u * stride < row.vectors) online_softmax_update8(m, rest, raw[u]);
        }
        if (scalar >= 0) online_softmax_update<1>(m, rest, &scalar_logit);

        const float row_max = block_max(m);
        // the threads holding the row max contribute rest (and count their implicit 1s), the others all
        const bool at_max = m == row_max;
        const int ones = block_sum(at_max ? 1 : 0);
        const double rest_total =
            block_sum(at_max ? (double)rest : m == -INFINITY ? 0.0 : (1.0 + rest) * (double)expf(m - row_max)) +
            (ones - 1);
        const double sum = 1.0 + rest_total;
        const double target_shift = (double)target_logit - row_max;
        if (threadIdx.x == 0) losses[r] = target >= 0 ? (float)(log1p(rest_total) - target_shift) : 0.0f;
        const float lse_log2 = (row_max + (float)log(sum)) * LOG2E;
        const float dtarget = (float)((expm1(target_shift) - rest_total) / sum) * row_dloss;

        // pass 2: the gradient, refilling shared memory and registers with the next row
        const bool has_next = r + gridDim.x < n;
        const LogitsRow next(logits, has_next ? r + gridDim.x : r, V);
        const int next_vectors = has_next ? next.vectors : 0;
        write_slots(cached, row, next.vectors_at, next_vectors, 0, half, lse_log2, row_dloss, target, dtarget);
        write_slots(cached, row, next.vectors_at, next_vectors, half, smem_slots, lse_log2, row_dloss, target,
                    dtarget);
#pragma unroll
        for (int j = 0; j < CLASSIFIER_REG_VECTORS; j++) {
            const int vec = held_first + j * stride + threadIdx.x;
            if (vec < row.vectors)
                __stcs(row.vectors_at + vec,
                       softmax_gradient8(held[j], lse_log2, row_dloss, target - row.head - vec * 8, dtarget));
            if (vec < next_vectors) held[j] = __ldcs(next.vectors_at + vec);
        }
        for (int i = rest_first + threadIdx.x; i < row.vectors; i += CLASSIFIER_UNROLL * stride) {
            uint4 raw[CLASSIFIER_UNROLL];
#pragma unroll
            for (int u = 0; u < CLASSIFIER_UNROLL; u++)
                if (i + u * stride < row.vectors) raw[u] = __ldcs(row.vectors_at + i + u * stride);
#pragma unroll
            for (int u = 0; u < CLASSIFIER_UNROLL; u++) {
                const int vec = i + u * stride;
                if (vec < row.vectors)
                    __stcs(row.vectors_at + vec,
                           softmax_gradient8(raw[u], lse_log2, row_dloss, target - row.head - vec * 8, dtarget));
            }
        }
        if (scalar >= 0)
            row.x[scalar] = __float2bfloat16_rn(
                scalar == target ? dtarget : fast_exp2(fmaf(scalar_logit, LOG2E, -lse_log2)) * row_dloss);
        row = next;
    }
}

extern "C" __global__ void loss_accumulate_bf16(float* total, const float* losses, int n, float scale,
                                                const float* scale_at) {
    if (scale_at != nullptr) scale *= *scale_at;
    double sum = 0.0;
    for (int i = threadIdx.x; i < n; i += blockDim.x) sum += losses[i];
    sum = block_sum(sum);
    if (threadIdx.x == 0) total[0] = (float)((double)total[0] + (double)scale * sum);
}

// Token sampling on the GPU: one id per row of logits, with the rules of sample_token in
// llama/model/generate.py (its numpy twin; sampling_probabilities there gives the distribution drawn from).
// Made for a decoder captured in a CUDA graph: no host sync, no allocation, the RNG position read
// from device memory, and deterministic: the id is a pure function of (logits, settings, seed,
// *counter, row), run after run, whatever the scheduling (integer sums only, no float atomics).
//
// sample_tokens:  ids (B,) int32 <- logits (B, V) fp32. One block per row (grid B, 1024 threads).
//   temperature <= 0 or top_p <= 0: greedy, the argmax (ties -> the smallest index, like np.argmax).
//   Otherwise the weights w_i = exp((x_i - max) / temperature), in [0, 1] (1 for the argmax), in fp32:
//   top_k:  0 < top_k < V keeps the ids whose logit >= the k-th largest logit (ties at the cutoff
//           kept, like numpy's `logits >= cutoff`; taken on the raw logits, which a positive
//           temperature does not reorder). The cutoff is exact: a radix select over the
//           order-preserving uint32 image of the floats, 3 passes of 12, 10 and 10 bits, each counting
//           the keys in a shared-memory histogram and descending into the bucket of the k-th key.
//   top_p:  top_p < 1 keeps, of those, the most likely ids whose probabilities first sum to top_p,
//           and always the likeliest: weight t is kept iff the mass of the weights > t is below
//           top_p * (mass of all top-k ids). The threshold is exact too: a radix descent on the bits
//           of the (positive) float weights, each histogram bucket holding the mass of its weights.
//           Ties: every id whose weight equals the threshold is kept (numpy's stable argsort keeps
//           only the tied ids that come first in index order until the mass reaches top_p).
//   draw:   one uniform u in [0, 1) per row, u = r / 2^64, r = x1 * 2^32 + x0 from the output
//           x0..x3 of Philox4x32-10 (key: (seed low word, seed high word), counter: (*counter, row,
//           0, 0)). The kept masses are laid end to end in index order and the id is the one whose
//           interval holds the target floor(u * kept mass), an integer (see below): each warp
//           sums a contiguous chunk of the row, a scan of the 32 chunk masses finds the chunk that
//           holds the target, the block splits that chunk into one short run of ids per thread and
//           scans their masses, and the thread whose run holds the target walks it.
// Masses are exact integers: each weight is rounded to a 64-bit fixed-point q_i = round(w_i * 2^40)
// (ids with w < 2^-41, i.e. probability below about 4.5e-13, get 0 and are never drawn), so every
// sum is exact whatever its order: no float reductions, no rounding that depends on the schedule.
// Needs V < 2^24 (V * 2^40 fits 64 bits). Logits must not be NaN; -inf is a weight of 0.
// Shared memory: static, about 33 KB. Launched with 1024 threads (any power of two from 32 to 1024
// works). Each pass over the row reads it from global memory (L2) again: argmax, 3 per radix select,
// 1 for the draw, and the walk of one chunk.
#include <limits.h>
#include "common.cuh"
#include "philox.cuh"

#define FULL_MASK 0xffffffffu

// 64 random bits for row b at stream position `position`: u = result / 2^64 is uniform in [0, 1).
__device__ __forceinline__ unsigned long long random_bits(unsigned long long seed, unsigned position, unsigned b) {
    const uint4 r = philox4x32_10(make_uint4(position, b, 0u, 0u), make_uint2((unsigned)seed, (unsigned)(seed >> 32)));
    return ((unsigned long long)r.y << 32) | r.x;
}

// ---------------------------------------------------------------------------------------------
// Keys and weights of one logit.

// An unsigned image of a float that orders like the floats (-0 and +0 alike): negative floats get
// every bit flipped, positive ones the sign bit set.
__device__ __forceinline__ unsigned ordered_key(float x) {
    const unsigned bits = __float_as_uint(x == 0.0f ? 0.0f : x);
    return (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
}

// The softmax weight exp((x - max) / temperature) = 2^((x - max) * scale), scale = log2(e) / temperature
// (see weight_scale), in [0, 1]; exactly 1 for the largest logit.
__device__ __forceinline__ float softmax_weight(float x, float max_logit, float scale) {
    return exp2f((x - max_logit) * scale);
}

// log2(e) / temperature, kept finite so that (max - max) * scale is 0 however small the temperature.
__device__ __forceinline__ float weight_scale(float temperature) {
    return fminf(1.44269504088896341f / temperature, 3.4028235e38f);
}

// A weight in 64-bit fixed point, 2^40 = 1: integer masses add up exactly, in any order.
__device__ __forceinline__ unsigned long long fixed_point_mass(float weight) {
    return __float2ull_rn(weight * 0x1p40f);
}

// ---------------------------------------------------------------------------------------------
// Going over the logits with many bytes in flight (one block per row is latency bound otherwise).

constexpr int QUADS = 4;  // 16-byte loads in flight per thread

// visit(i, row[i]) for every i in [begin, end), shared by `count` threads of which this one is
// `rank`: the ids before the first 16-byte boundary and after the last one alone, the rest as float4s,
// QUADS at a time. The order of the calls is unspecified.
template <typename Visit>
__device__ __forceinline__ void for_each_logit(const float* row, int begin, int end, int rank, int count,
                                               Visit visit) {
    const int misalignment = (int)(((unsigned long long)(row + begin) / sizeof(float)) % 4);
    const int head = min(end - begin, (4 - misalignment) % 4);  // ids before the first boundary
    if (rank < head) visit(begin + rank, row[begin + rank]);
    const int first = begin + head, quads = (end - first) / 4;
    const float4* body = reinterpret_cast<const float4*>(row + first);
    for (int tile = 0; tile < quads; tile += count * QUADS) {
        float4 v[QUADS];
#pragma unroll
        for (int j = 0; j < QUADS; j++) {
            const int q = tile + j * count + rank;
            if (q < quads) v[j] = body[q];
        }
#pragma unroll
        for (int j = 0; j < QUADS; j++) {
            const int q = tile + j * count + rank;
            if (q < quads) {
                const int i = first + 4 * q;
                visit(i, v[j].x);
                visit(i + 1, v[j].y);
                visit(i + 2, v[j].z);
                visit(i + 3, v[j].w);
            }
        }
    }
    const int tail = first + 4 * quads;  // fewer than 4 ids
    if (tail + rank < end) visit(tail + rank, row[tail + rank]);
}

// ---------------------------------------------------------------------------------------------
// Block-wide helpers (every thread of the block calls them; each returns to every thread).

struct Candidate {
    float value;
    int index;
};

// The larger value; of equal values the smaller index (a total order: any reduction order agrees).
__device__ __forceinline__ Candidate better(Candidate a, Candidate b) {
    return (b.value > a.value || (b.value == a.value && b.index < a.index)) ? b : a;
}

__device__ __forceinline__ Candidate warp_best(Candidate c) {
    for (int offset = 16; offset > 0; offset >>= 1)
        c = better(c, {__shfl_xor_sync(FULL_MASK, c.value, offset), __shfl_xor_sync(FULL_MASK, c.index, offset)});
    return c;
}

// The largest logit of the row and its smallest index.
__device__ Candidate block_argmax(const float* row, int V) {
    __shared__ Candidate partial[32];
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const Candidate none = {-INFINITY, INT_MAX};
    Candidate best = none;
    for_each_logit(row, 0, V, threadIdx.x, blockDim.x, [&](int i, float x) { best = better(best, {x, i}); });
    best = warp_best(best);
    __syncthreads();  // partial[] may still be read by an earlier call
    if (lane == 0) partial[warp] = best;
    __syncthreads();
    return warp_best(lane < blockDim.x / 32 ? partial[lane] : none);
}

template <typename T>
__device__ __forceinline__ T inclusive_warp_scan(T v) {
    const int lane = threadIdx.x % 32;
    for (int offset = 1; offset < 32; offset <<= 1) {
        const T other = __shfl_up_sync(FULL_MASK, v, offset);
        if (lane >= offset) v += other;
    }
    return v;
}

// ---------------------------------------------------------------------------------------------
// The radix descents: 32-bit keys in 3 passes of 12, 10 and 10 bits. The first digit is wide so that
// the keys, which crowd into a few exponents, spread over many buckets: plain shared atomics then
// rarely collide. The histograms live in the kernel's shared scratch (4096 words, or 8192 for masses).

constexpr int FIRST_DIGIT_BITS = 12, DIGIT_BITS = 10;
constexpr int MAX_BUCKETS = 1 << FIRST_DIGIT_BITS;

// Counts (top-k: every amount is 1).
struct CountHistogram {
    using Amount = unsigned;
    unsigned* count;  // (MAX_BUCKETS,)
    __device__ __forceinline__ void clear(int d) const { count[d] = 0; }
    __device__ __forceinline__ Amount at(int d) const { return count[d]; }
    __device__ __forceinline__ void add(int digit, unsigned) const { atomicAdd(&count[digit], 1u); }
};

// Masses (top-p: fixed-point weights). Each bucket keeps its 64-bit sum as two words updated by
// native 32-bit atomics, the carries out of the low word added to the high one: exact, in any order
// (the number of wraps of the low word is floor(sum of the low parts / 2^32) whatever the order).
struct MassHistogram {
    using Amount = unsigned long long;
    unsigned* low;   // (MAX_BUCKETS,)
    unsigned* high;  // (MAX_BUCKETS,)
    __device__ __forceinline__ void clear(int d) const { low[d] = high[d] = 0; }
    __device__ __forceinline__ Amount at(int d) const { return ((unsigned long long)high[d] << 32) | low[d]; }
    __device__ __forceinline__ void add(int digit, unsigned long long amount) const {
        const unsigned add_low = (unsigned)amount, add_high = (unsigned)(amount >> 32);
        const unsigned old = atomicAdd(&low[digit], add_low);
        const unsigned carry = old + add_low < old ? 1u : 0u;
        if (add_high + carry) atomicAdd(&high[digit], add_high + carry);
    }
};

// Exclusive prefix sum of one value per thread, in thread order; `total` gets the sum of all.
template <typename T>
__device__ T block_exclusive_scan(T v, T& total) {
    __shared__ T warp_totals[32];
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
    const T inclusive = inclusive_warp_scan(v);
    __syncthreads();  // warp_totals[] may still be read by an earlier call
    if (lane == 31) warp_totals[warp] = inclusive;
    __syncthreads();
    T before = 0;
    total = 0;
    for (int w = 0; w < warps; w++) {
        if (w < warp) before += warp_totals[w];
        total += warp_totals[w];
    }
    return before + inclusive - v;
}

// The radix descent shared by top-k and top-p. Each logit x that takes part (key_of(x, key) returns
// true) holds amount_of(x) at a 32-bit `key` (the amount is only computed for the keys that match the
// digits chosen so far); A(k) is the amount held by the keys > k. Returns
// the smallest key k with a positive amount and A(k) < budget, where budget = budget_of(the amount
// of all). With amounts 1 and budget k that is the k-th largest key; with masses and budget
// top_p * total it is the nucleus threshold. Each pass histograms the keys that match the digits
// chosen so far, and the lowest nonempty bucket whose amount above (the keys above the prefix
// included) is below the budget holds the answer. Such a bucket always exists when the budget is
// positive: the highest nonempty one has nothing more above it. Thread t scans the buckets
// t * per .. t * per + per - 1 counted from the top digit down.
template <typename Histogram, typename KeyOf, typename AmountOf, typename BudgetOf>
__device__ unsigned radix_select(const float* row, int V, Histogram hist, KeyOf key_of, AmountOf amount_of,
                                 BudgetOf budget_of) {
    using Amount = typename Histogram::Amount;
    __shared__ int chosen_digit;
    __shared__ Amount chosen_above;
    unsigned prefix = 0;  // the key bits chosen so far
    Amount above = 0;     // the amount of the keys above every key with this prefix
    Amount budget = 0;
    for (int pass = 0, shift = 32; pass < 3; pass++) {
        const int bits = pass == 0 ? FIRST_DIGIT_BITS : DIGIT_BITS, buckets = 1 << bits;
        const unsigned prefix_mask = pass == 0 ? 0u : ~0u << shift;  // the bits above this digit
        shift -= bits;
        for (int d = threadIdx.x; d < buckets; d += blockDim.x) hist.clear(d);
        if (threadIdx.x == 0) chosen_digit = buckets;
        __syncthreads();
        for_each_logit(row, 0, V, threadIdx.x, blockDim.x, [&](int, float x) {
            unsigned key = 0;
            if (key_of(x, key) && (key & prefix_mask) == prefix) {
                const Amount amount = amount_of(x);
                if (amount > 0) hist.add((key >> shift) & (buckets - 1), amount);
            }
        });
        __syncthreads();
        const int per = buckets / blockDim.x, top = buckets - 1 - threadIdx.x * per;  // digits top .. top - per + 1
        Amount mine = 0, total;
        for (int r = 0; r < per; r++) mine += hist.at(top - r);
        Amount running = above + block_exclusive_scan(mine, total);  // the amount above digit `top`
        if (pass == 0) budget = budget_of(total);
        int candidate = buckets;
        Amount candidate_above = 0;
        for (int r = 0; r < per; r++) {  // the lowest of this thread's digits that qualifies
            const Amount own = hist.at(top - r);
            if (own > 0 && running < budget) {
                candidate = top - r;
                candidate_above = running;
            }
            running += own;
        }
        if (candidate < buckets) atomicMin(&chosen_digit, candidate);
        __syncthreads();
        const int digit = chosen_digit;
        if (candidate == digit) chosen_above = candidate_above;
        __syncthreads();
        prefix |= (unsigned)digit << shift;
        above = chosen_above;
    }
    return prefix;
}

// The id whose interval holds the target when the kept masses (mass_of(x), 0 for logits not kept)
// are laid end to end in index order, target = floor(u * total kept mass) with u = uniform_bits / 2^64.
// Warp w sums the contiguous chunk [w * chunk, (w + 1) * chunk) of the row; warp 0 finds the chunk
// that holds the target; the block splits that chunk into one short run of ids per thread, and the
// thread whose run holds the target walks it. Returns the id in that thread, -1 in all the others
// (and in all of them when there is no mass: every logit -inf).
template <typename MassOf>
__device__ int draw_in_index_order(const float* row, int V, MassOf mass_of, unsigned long long uniform_bits) {
    __shared__ unsigned long long chunk_mass[32];
    __shared__ int chosen_chunk;
    __shared__ unsigned long long target_in_chunk;
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
    const int chunk = (V + warps - 1) / warps;
    int begin = min(V, warp * chunk), end = min(V, begin + chunk);
    unsigned long long mass = 0;
    for_each_logit(row, begin, end, lane, 32, [&](int, float x) { mass += mass_of(x); });
    mass = warp_sum(mass);
    if (lane == 0) chunk_mass[warp] = mass;
    __syncthreads();
    if (warp == 0) {  // which chunk holds the target
        const unsigned long long own = lane < warps ? chunk_mass[lane] : 0ull;
        const unsigned long long inclusive = inclusive_warp_scan(own);
        const unsigned long long total = __shfl_sync(FULL_MASK, inclusive, 31);
        const unsigned long long target = __umul64hi(uniform_bits, total);  // in [0, total) if total > 0
        const int first = __ffs(__ballot_sync(FULL_MASK, inclusive > target)) - 1;  // -1: no mass at all
        if (lane == 0) chosen_chunk = first;
        if (lane == first) target_in_chunk = target - (inclusive - own);
    }
    __syncthreads();
    if (chosen_chunk < 0) return -1;
    begin = min(V, chosen_chunk * chunk);
    end = min(V, begin + chunk);
    const int per_thread = (end - begin + blockDim.x - 1) / blockDim.x;
    const int from = min(end, begin + (int)threadIdx.x * per_thread), to = min(end, from + per_thread);
    unsigned long long mine = 0, chunk_total;
    for (int i = from; i < to; i++) mine += mass_of(row[i]);
    unsigned long long before = block_exclusive_scan(mine, chunk_total);
    const unsigned long long target = target_in_chunk;
    if (target < before || target >= before + mine) return -1;
    for (int i = from; i < to; i++) {
        before += mass_of(row[i]);
        if (before > target) return i;
    }
    return -1;  // not reached: the sums are exact
}

// ---------------------------------------------------------------------------------------------

extern "C" __global__ void __launch_bounds__(1024, 1)
sample_tokens(int* ids, const float* __restrict__ logits, int V, float temperature, int top_k, float top_p,
              unsigned long long seed, const int* counter) {
    __shared__ unsigned scratch[2 * MAX_BUCKETS];  // the radix histograms
    wait_for_previous_grid();
    allow_next_grid();
    const int b = blockIdx.x;
    const float* row = logits + (long long)b * V;  // (V,)
    const Candidate best = block_argmax(row, V);
    if (temperature <= 0.0f || top_p <= 0.0f) {
        if (threadIdx.x == 0) ids[b] = best.index;
        return;
    }
    const float max_logit = best.value, scale = weight_scale(temperature);

    // top-k: the keys of the kept logits are >= cutoff (0 keeps every id)
    unsigned cutoff = 0;
    if (top_k > 0 && top_k < V) {
        cutoff = radix_select(
            row, V, CountHistogram{scratch},
            [&](float x, unsigned& key) {
                key = ordered_key(x);
                return true;
            },
            [&](float) { return 1u; }, [&](unsigned) { return (unsigned)top_k; });
    }

    // top-p: the bits of the kept weights are >= threshold (0 keeps every id)
    unsigned threshold = 0;
    if (top_p < 1.0f) {
        threshold = radix_select(
            row, V, MassHistogram{scratch, scratch + MAX_BUCKETS},
            [&](float x, unsigned& key) {
                key = __float_as_uint(softmax_weight(x, max_logit, scale));
                return ordered_key(x) >= cutoff;
            },
            [&](float x) { return fixed_point_mass(softmax_weight(x, max_logit, scale)); },
            [&](unsigned long long total) {  // A < top_p * total  <=>  A < ceil(top_p * total) for integer A
                return (unsigned long long)ceil((double)top_p * (double)total);
            });
    }

    const auto kept_mass = [&](float x) {
        const float weight = softmax_weight(x, max_logit, scale);
        return ordered_key(x) >= cutoff && __float_as_uint(weight) >= threshold ? fixed_point_mass(weight) : 0ull;
    };
    // The argmax is always kept, with mass 2^40, so one thread draws an id. (Only logits all -inf have
    // no mass: the argmax written here stays; the draw's barriers order the two writes.)
    if (threadIdx.x == 0) ids[b] = best.index;
    const unsigned long long uniform_bits = random_bits(seed, (unsigned)*counter, (unsigned)b);
    const int id = draw_in_index_order(row, V, kept_mass, uniform_bits);
    if (id >= 0) ids[b] = id;
}

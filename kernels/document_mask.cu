// The document mask's bounds (twin: llama/twins/attention.py's document_bounds; launcher llama/ops/document_mask.py):
// per token of the (B, T) int32 token rows, doc_start = the last BOS position at or before it (else 0) and
// doc_end = the first BOS position after it (else T), the form the attention kernels take the mask in: query t
// sees key s iff doc_start[b, t] <= s <= t.
//
// document_bounds: one block per row; the row runs through in chunks of blockDim.x tokens, a block-wide max scan
//                  carried forward for doc_start, then a min scan carried backward (chunks from the row's end,
//                  thread i at the chunk's i-th position from the end) for doc_end. Any T.
#include "common.cuh"

constexpr int BOUNDS_THREADS = 1024;  // threads per block (a multiple of 32)

// the inclusive max (MAX) or min scan of v over the block's threads in order; *total gets the whole block's
template <bool MAX>
__device__ __forceinline__ int block_scan(int v, int* total) {
    __shared__ int warp_totals[32];
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    auto combine = [](int a, int b) { return MAX ? max(a, b) : min(a, b); };
#pragma unroll
    for (int offset = 1; offset < 32; offset <<= 1) {
        const int before = __shfl_up_sync(0xffffffffu, v, offset);
        if (lane >= offset) v = combine(v, before);
    }
    __syncthreads();  // warp_totals may still be read by an earlier call
    if (lane == 31) warp_totals[warp] = v;
    __syncthreads();
    int all = warp_totals[0];
    for (int w = 1; w < blockDim.x / 32; ++w) {
        if (w == warp) v = combine(v, all);  // all = the warps before this one
        all = combine(all, warp_totals[w]);
    }
    *total = all;
    return v;
}

extern "C" __global__ void __launch_bounds__(BOUNDS_THREADS)
    document_bounds(int* doc_start, int* doc_end, const int* tokens, int T, int bos_id) {
    const long long row = (long long)blockIdx.x * T;
    int carry = 0, chunk;
    for (int c0 = 0; c0 < T; c0 += blockDim.x) {
        const int t = c0 + threadIdx.x;
        const int start = max(block_scan<true>(t < T && tokens[row + t] == bos_id ? t : 0, &chunk), carry);
        if (t < T) doc_start[row + t] = start;
        carry = max(carry, chunk);
    }
    carry = T;
    for (int c1 = T; c1 > 0; c1 -= blockDim.x) {
        const int t = c1 - 1 - (int)threadIdx.x;
        const int end = min(block_scan<false>(t >= 0 && t + 1 < T && tokens[row + t + 1] == bos_id ? t + 1 : T, &chunk),
                            carry);
        if (t >= 0) doc_end[row + t] = end;
        carry = min(carry, chunk);
    }
}

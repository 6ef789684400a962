// v6 adds, over v5 (v5's file, dev/cuda/flash_attention_v5.cu, included below with the forward's work items defined
// here; the ping-pong and the backward are v5's, that is v3's backward):
// - A persistent forward. The grid is one CTA per SM (the launcher's, from the device's multiprocessor count), and
//   each CTA loops over the (query tile, head, batch) items, CTA i taking items i, i + G, i + 2G, ... (G CTAs), in
//   v3's launch order: heaviest first (the last query tiles, with the most kv tiles), head fastest, then batch.
//   Static striding keeps it deterministic, and every row's operations are v3's in v3's order: the same bits.
// - Q double-buffered (both head dims fit: 97 KB of shared memory at D = 64, 193 KB at D = 128): the producer loads
//   item k + 1's Q and its first K, V tiles as soon as their buffers are free (Q's when the consumers are past item
//   k - 1's last S, K_0's and V_0's when item k's next-to-last tile leaves the ring), so that they arrive under item
//   k's last P V and epilogue instead of after the CTA's exit and the next CTA's launch. The consumers release a Q
//   buffer once both are past the item's last S (q_empty, one arrival per consumer warp).
// - The rings and barriers carry their positions and phases across items (counted in kv tiles and items): nothing is
//   initialized twice. v5's turns run on across items too: consumer 0 takes the CTA's first turn without waiting,
//   consumer 1 skips only the pass of the CTA's last (both consumers take the same turns per item).
// Predicted (H100, against v5; the reasoning in dev/cuda/README.md): forward 1.10-1.25x at (16,12,4,1024,64),
// 1.06-1.14x at (8,32,8,2048,64), 0.99-1.02x at (2,32,8,8192,128), 0.99-1.00x at (1,32,8,32768,64) (there the
// static stride's imbalance eats the gain); backward unchanged.

// CTA blockIdx.x's items of a (B, T, H) problem, ROWS query rows each, G = gridDim.x CTAs (at most the items)
template <int ROWS>
struct PersistentItems {
    static constexpr int Q_BUFFERS = 2;
    static constexpr bool PERSISTENT = true;
    int H, heads_batches, items, item, h, b, q0, count;
    __device__ PersistentItems(int T, int H, int B)
        : H(H), heads_batches(H * B), items(H * B * ((T + ROWS - 1) / ROWS)), item(blockIdx.x), count(0) {
        locate();
    }
    __device__ bool last() const { return item + (int)gridDim.x >= items; }
    __device__ bool next() {
        item += gridDim.x;
        count++;
        if (item >= items) return false;
        locate();
        return true;
    }
    // item k: head k % H, batch k / H % B, the query tile (items / (H B) - 1 - k / (H B)), heaviest first
    __device__ void locate() {
        h = item % H;
        b = item / H % (heads_batches / H);
        q0 = (items / heads_batches - 1 - item / heads_batches) * ROWS;
    }
};
#define FLASH_FORWARD_WORK PersistentItems<fa3::FWD_ROWS>

// v3's forward entry point with the batch count after KV (the grid no longer carries it)
#define FLASH_FORWARD_ENTRY(D)                                                                                    \
    extern "C" __global__ void __launch_bounds__(fa3::THREADS, 1) flash_attention_forward_d##D(                  \
        const CUtensorMap* maps, bf16* out, float* lse, const bf16* qkv, int T, int H, int KV, int B,             \
        const int* doc_start, const int* doc_end) {                                                               \
        FLASH_MASKED_BODY((flash_forward_wgmma<D, MASKED>(maps, out, lse, T, H, KV, doc_start,                    \
                                                          FLASH_FORWARD_WORK(T, H, B))))                          \
    }

#include "flash_attention_v5.cu"

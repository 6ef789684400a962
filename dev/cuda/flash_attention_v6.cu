// v6 adds, over v5 (the kernels are kernels/flash_attention_wgmma.cu, included here with v5's schedule,
// PingPongConsumers, and the work items PersistentItems, both defined there; the backward is v3's; production runs
// this forward at D = 64):
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

#define FLASH_FORWARD_WORK(D) PersistentItems<fa3::FWD_ROWS>
#define FLASH_FORWARD_SCHEDULE(D) PingPongConsumers
#include "flash_attention_wgmma.cu"

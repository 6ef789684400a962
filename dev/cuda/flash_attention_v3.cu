// v3 adds, over v2 (the kernels are kernels/flash_attention_wgmma.cu, included here with v3's forward: a CTA per
// query tile, the consumers independent; its backward is the one the plan runs on Hopper, v2 stays the build for
// every other GPU):
// - Hopper's own instructions: wgmma.m64nNk16 (S-like products from shared memory, P V / P^T dO / dS^T Q / dS K
//   with P or dS from registers) fed by TMA boxes through mbarrier rings, in place of mma.sync + ldmatrix +
//   cp.async; the packed qkv and dout are read through 3D tensor maps, rows past T zero-filled by TMA.
// - Warp specialization in every kernel: one producer warpgroup (a TMA thread; in dK/dV also a warp copying
//   lse and delta into the ring), two consumer warpgroups of 64 rows each, registers moved by setmaxnreg.
// - Forward: 128 x 128 tiles (v2: 128 x 64 / 128 x 32); the next tile's S is issued with this tile's P V, and
//   its softmax runs while P V does (FA3's intra-warpgroup overlap; no inter-warpgroup ping-pong yet).
// - dK/dV: 128 kv rows x 64-row query tiles, a 4-stage (D = 64) or 2-stage ring; at D = 64 the next step's
//   S^T, dP^T are issued before this step's dK, dV finish. dQ: 128 query rows x 128 (D = 64) or 64 kv rows.
// Predicted (H200, against v2; SDPA at 1.4-2.1x v2): forward 1.5-1.8x (from ~250 to ~400 TFLOP/s at T >= 2048,
// D = 64, the exponentials now the co-bottleneck with the MMAs), backward 1.5-2x (7 products of which 2 are
// recomputation: at most 5/7 of the kernels' rate, so ~250-300 TFLOP/s by the 2.5x-forward count).
#define FLASH_FORWARD_WORK(D) OneItemPerCta
#define FLASH_FORWARD_SCHEDULE(D) IndependentConsumers
#include "flash_attention_wgmma.cu"

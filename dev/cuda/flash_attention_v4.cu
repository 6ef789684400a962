// v4 adds, over v3 (the same file, kernels/flash_attention_wgmma.cu, with v3's forward; the launcher runs its
// fused backward):
// - dQ inside the dK/dV kernel, as FA3: each step's dS^T goes to shared memory (both consumer warpgroups' 64 rows),
//   each warpgroup forms D/2 columns of the 64 x D partial dQ = dS K by wgmma (A = dS^T read MN-major), stages it
//   in fp32, and a producer thread adds the tile into an fp32 buffer with one bulk reduce-add; a small kernel
//   turns the buffer into bf16 dQ with the inverse RoPE. The separate dQ kernel and its recomputation of S and
//   dP (2 of v3's 7 products) go.
// - Deterministic: the adds into a query tile come in a fixed order, kv tiles from the last down, through a
//   per-tile count (the CTAs launched shortest first, so a CTA only waits for earlier ones); the opt-in
//   unordered variant (flash_attention_backward(deterministic=False)) drops the waits and launches heaviest first.
// Predicted (H100, against v3): backward 1.25-1.35x at T >= 2048 (5 products instead of 7; the dQ adds cost
// L2 traffic of ~T/256 x the dQ bytes), forward unchanged; determinism costs 0-10% (the shortest-first order's
// tail).
#define FLASH_FORWARD_WORK(D) OneItemPerCta
#define FLASH_FORWARD_SCHEDULE(D) IndependentConsumers
#include "flash_attention_wgmma.cu"

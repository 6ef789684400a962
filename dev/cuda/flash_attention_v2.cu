// v2 adds, over v1 (the kernels are kernels/flash_attention.cu itself, included here: this version is the one in
// the tree):
// - dQ kernel: 32 query rows per warp (two m16 tiles share every K/V B fragment: half v1's shared-memory reads
//   per MMA), 128-row query tiles, 32-row K/V tiles; Q and dO A-fragments stay in registers at D = 64.
// - dK/dV kernel: 4 warps per CTA (2 CTAs per SM instead of one of 8 warps, so one CTA's barriers overlap the
//   other's math); at D = 64 each warp owns 32 kv rows (128-row kv tiles), sharing every Q/dO B fragment
//   between its two m16 tiles; at D = 128 16 kv rows (64-row kv tiles); 32-row query tiles at both.
// - Both backward kernels keep P and dS as bf16 pairs (the precision their products use anyway), which frees
//   the registers for the above; warps skip K/V (or query) tiles wholly masked for their own rows, in the
//   forward too.
// Predicted (H200, against v1): dQ kernel 1.3-1.5x, dK/dV kernel 1.2-1.4x at D = 64 and 1.1-1.2x at D = 128,
// forward about 1.05x (diagonal skips only): forward+backward ~1.2-1.3x at D = 64, ~1.1x at D = 128.
#include "flash_attention.cu"

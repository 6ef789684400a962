// v5 adds, over v3 (the kernels are kernels/flash_attention_wgmma.cu, included here with the forward's schedule
// PingPongConsumers, defined there; a CTA per query tile, as v3; the backward is v3's, unchanged):
// - Forward: FA3's inter-warpgroup ping-pong. The two consumer warpgroups take turns issuing their GEMMs (S_0, then
//   per kv tile S_{j+1} with P_j V_j), ordered by two named barriers: consumer c waits on barrier TURN_BARRIER + c
//   before issuing and arrives on the other's after, so that the tensor cores run one consumer's S and P V, then the
//   other's, and one consumer's softmax (its exponentials) runs while the other's GEMMs hold the tensor cores. v3
//   lets both issue as soon as their operands are in: they run in step, both softmaxes at once, the tensor cores
//   idle meanwhile. The wait for K_{j+1} comes before the turn (V_j's within it, as FA3's); v3's overlap within a
//   warpgroup (the next tile's softmax under this tile's P V) is kept. The same operations in the same order for
//   every row: the same bits.
// - Registers: producer 40, consumers 232 (v3: 24 and 240, the whole 168 x 384 either way). The consumers use at
//   most 200 (D = 128), but the producer's TMA loop spills at 24 registers at D = 128 (v3's forward: 44 bytes
//   stored, 204 loaded); at 40 neither spills.
// Predicted (H100, against v3; the reasoning in dev/cuda/README.md): forward 1.15-1.25x at D = 64 for T >= 2048,
// 1.1-1.2x at (16,12,4,1024,64), 1.0-1.1x at D = 128; backward unchanged.
#define FLASH_FORWARD_WORK(D) OneItemPerCta
#define FLASH_FORWARD_SCHEDULE(D) PingPongConsumers
#include "flash_attention_wgmma.cu"

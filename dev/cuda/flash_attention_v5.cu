// v5 adds, over v3 (the kernels are kernels/flash_attention_wgmma.cu, included here with the forward's schedule
// below; the backward is v3's, unchanged):
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
#include "wgmma.cuh"

#ifdef WGMMA_ENABLED
namespace fa5 {
// named barriers 2 (consumer 0's turn) and 3 (consumer 1's); v3 uses 0 (__syncthreads) and 1 (the fused
// backward's dS^T), so no kernel of this build gives an id two uses
constexpr int TURN_BARRIER = 2, CONSUMER_THREADS = 256;
}  // namespace fa5

// Consumer c's turn is barrier TURN_BARRIER + c. Consumer 0 takes the first turn; then each waits for the other's
// pass. Consumer 1 does not pass its last turn (no turn follows it), so that no arrival is left when the CTA exits.
// The consumer index is broadcast from lane 0 so that ptxas knows it is warp-uniform (uniform predicates, and the
// ids immediates: no general register held, where D = 128 has none to spare).
struct PingPongConsumers {
    static constexpr int PRODUCER_REGISTERS = 40, CONSUMER_REGISTERS = 232;
    int consumer;
    __device__ explicit PingPongConsumers(int c) : consumer(__shfl_sync(0xffffffffu, c, 0)) {}
    __device__ void take(bool first) const {
        if (consumer == 0 && !first) named_barrier_sync(fa5::TURN_BARRIER, fa5::CONSUMER_THREADS);
        if (consumer == 1) named_barrier_sync(fa5::TURN_BARRIER + 1, fa5::CONSUMER_THREADS);
    }
    __device__ void pass(bool last) const {
        if (consumer == 0) named_barrier_arrive(fa5::TURN_BARRIER + 1, fa5::CONSUMER_THREADS);
        if (consumer == 1 && !last) named_barrier_arrive(fa5::TURN_BARRIER, fa5::CONSUMER_THREADS);
    }
};
#define FLASH_FORWARD_SCHEDULE PingPongConsumers
#endif  // WGMMA_ENABLED

#include "flash_attention_wgmma.cu"

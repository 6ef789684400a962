// Hopper (sm_90a) building blocks shared by the wgmma kernels (gemm_wgmma.cu, flash_attention_wgmma.cu):
// mbarriers, TMA loads, shared-memory matrix descriptors and the wgmma instructions they use.
//
// wgmma accumulator layout (m64nNk16, fp32, a warpgroup of 128 threads): warp w owns rows 16w..16w+15;
// lane l holds, for j = 0 .. N/8 - 1, d[4j + {0, 1}] = (row 16w + l/4, columns 8j + 2(l%4) + {0, 1}) and
// d[4j + {2, 3}] = the same columns of row + 8: the layout of mma.sync's m16n8 accumulators, one n8 tile
// after the other. A from registers (the _rs forms) is mma.sync's m16n8k16 A fragment of the warp's 16
// rows: a[0] (row, k 2(l%4)..), a[1] (row + 8, ..), a[2] (row, k + 8..), a[3] (row + 8, k + 8..), bf16 pairs;
// so accumulator tiles 2k and 2k + 1, packed to bf16, are the A operand of k-step k.
#pragma once
#include <cuda.h>
#include <stdint.h>
#include "common.cuh"
#include "mma.cuh"

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define WGMMA_ENABLED 1
#endif

#ifdef WGMMA_ENABLED

__device__ __forceinline__ void mbarrier_init(uint32_t bar, int count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count));
}
__device__ __forceinline__ void mbarrier_expect_tx(uint32_t bar, int bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbarrier_arrive(uint32_t bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void mbarrier_wait(uint32_t bar, int parity) {
    asm volatile(
        "{\n.reg .pred P;\nWAIT_%=:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 P, [%0], %1;\n"
        "@!P bra WAIT_%=;\n}\n" ::"r"(bar), "r"(parity) : "memory");
}

// one box of a 3D tensor map into shared memory, completing on bar
__device__ __forceinline__ void tma_load(uint32_t dst, const CUtensorMap* map, int c0, int c1, int c2, uint32_t bar) {
    asm volatile(
        "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], [%5];\n"
        ::"r"(dst), "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(bar) : "memory");
}

// generic-proxy writes to shared memory made visible to the async proxy (wgmma operands, bulk copies)
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// barrier `id` (1-15; 0 is __syncthreads) among `threads` threads, whole warps: wait for them all, or arrive only
// (counted among the `threads`, without waiting)
__device__ __forceinline__ void named_barrier_sync(int id, int threads) {
    asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void named_barrier_arrive(int id, int threads) {
    asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// global fp32 [dst, dst + bytes) += shared [src, ...), one bulk operation (16-byte aligned, bytes % 16 == 0)
__device__ __forceinline__ void bulk_reduce_add_f32(float* dst, uint32_t src, int bytes) {
    asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n"
                 ::"l"(dst), "r"(src), "r"(bytes) : "memory");
}
__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
// at most N of this thread's bulk groups still pending: complete (their writes done), or _read (their sources read)
template <int N>
__device__ __forceinline__ void bulk_wait() { asm volatile("cp.async.bulk.wait_group %0;\n" ::"n"(N) : "memory"); }
template <int N>
__device__ __forceinline__ void bulk_wait_read() {
    asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(N) : "memory");
}

// shared-memory matrix descriptor of a 128-byte-swizzled operand starting at addr (1 KB-aligned tile, plus
// 32 B per k16 step inside a K-major 64-wide slab): 8-row groups 1024 B apart (SBO); lbo = the distance between
// 64-wide slabs along M or N of an MN-major operand (unused for K-major ones)
__device__ __forceinline__ uint64_t matrix_descriptor(uint32_t addr, uint32_t lbo) {
    return (1ull << 62) | ((1024ull >> 4) << 32) | ((uint64_t)(lbo >> 4) << 16) | ((addr & 0x3FFFF) >> 4);
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory"); }

// keeps the compiler from moving reads of the accumulators above the wgmma wait before it
template <int R>
__device__ __forceinline__ void accumulator_fence(float (&d)[R]) {
    #pragma unroll
    for (int i = 0; i < R; i++) asm volatile("" : "+f"(d[i])::"memory");
}

// The accumulators of a wgmma as asm operands: "%0" .. in the instruction, "+f"(d[0]) .. in the operand list,
// 16, 32, 64 or 128 of them (a 64 x N fp32 tile holds N / 2 a thread)
#define WGMMA_REGS_0_15 "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15"
#define WGMMA_REGS_16_31 "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31"
#define WGMMA_REGS_32_47 "%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47"
#define WGMMA_REGS_48_63 "%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63"
#define WGMMA_REGS_64_79 "%64,%65,%66,%67,%68,%69,%70,%71,%72,%73,%74,%75,%76,%77,%78,%79"
#define WGMMA_REGS_80_95 "%80,%81,%82,%83,%84,%85,%86,%87,%88,%89,%90,%91,%92,%93,%94,%95"
#define WGMMA_REGS_96_111 "%96,%97,%98,%99,%100,%101,%102,%103,%104,%105,%106,%107,%108,%109,%110,%111"
#define WGMMA_REGS_112_127 "%112,%113,%114,%115,%116,%117,%118,%119,%120,%121,%122,%123,%124,%125,%126,%127"
#define WGMMA_REGS_16 WGMMA_REGS_0_15
#define WGMMA_REGS_32 WGMMA_REGS_0_15 "," WGMMA_REGS_16_31
#define WGMMA_REGS_64 WGMMA_REGS_32 "," WGMMA_REGS_32_47 "," WGMMA_REGS_48_63
#define WGMMA_REGS_128 \
    WGMMA_REGS_64 "," WGMMA_REGS_64_79 "," WGMMA_REGS_80_95 "," WGMMA_REGS_96_111 "," WGMMA_REGS_112_127
#define WGMMA_D8(i) "+f"(d[(i)]), "+f"(d[(i) + 1]), "+f"(d[(i) + 2]), "+f"(d[(i) + 3]), "+f"(d[(i) + 4]), \
    "+f"(d[(i) + 5]), "+f"(d[(i) + 6]), "+f"(d[(i) + 7])
#define WGMMA_D16 WGMMA_D8(0), WGMMA_D8(8)
#define WGMMA_D32 WGMMA_D16, WGMMA_D8(16), WGMMA_D8(24)
#define WGMMA_D64 WGMMA_D32, WGMMA_D8(32), WGMMA_D8(40), WGMMA_D8(48), WGMMA_D8(56)
#define WGMMA_D128 WGMMA_D64, WGMMA_D8(64), WGMMA_D8(72), WGMMA_D8(80), WGMMA_D8(88), WGMMA_D8(96), WGMMA_D8(104), \
    WGMMA_D8(112), WGMMA_D8(120)

// wgmma from shared memory (both operands by descriptor; TRANS_* = 1 reads that operand MN-major), then with A
// from registers (_rs: TRANS_B only)
template <int TRANS_A, int TRANS_B>
__device__ __forceinline__ void wgmma_m64n32k16(float (&d)[16], uint64_t desc_a, uint64_t desc_b, int scale_d) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 {" WGMMA_REGS_16 "}, %16, %17, p, 1, 1, %19, %20;\n}\n"
        : WGMMA_D16
        : "l"(desc_a), "l"(desc_b), "r"(scale_d), "n"(TRANS_A), "n"(TRANS_B));
}

template <int TRANS_A, int TRANS_B>
__device__ __forceinline__ void wgmma_m64n64k16(float (&d)[32], uint64_t desc_a, uint64_t desc_b, int scale_d) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {" WGMMA_REGS_32 "}, %32, %33, p, 1, 1, %35, %36;\n}\n"
        : WGMMA_D32
        : "l"(desc_a), "l"(desc_b), "r"(scale_d), "n"(TRANS_A), "n"(TRANS_B));
}

template <int TRANS_A, int TRANS_B>
__device__ __forceinline__ void wgmma_m64n128k16(float (&d)[64], uint64_t desc_a, uint64_t desc_b, int scale_d) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {" WGMMA_REGS_64 "}, %64, %65, p, 1, 1, %67, %68;\n}\n"
        : WGMMA_D64
        : "l"(desc_a), "l"(desc_b), "r"(scale_d), "n"(TRANS_A), "n"(TRANS_B));
}

template <int TRANS_A, int TRANS_B>
__device__ __forceinline__ void wgmma_m64n256k16(float (&d)[128], uint64_t desc_a, uint64_t desc_b, int scale_d) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {" WGMMA_REGS_128
        "}, %128, %129, p, 1, 1, %131, %132;\n}\n"
        : WGMMA_D128
        : "l"(desc_a), "l"(desc_b), "r"(scale_d), "n"(TRANS_A), "n"(TRANS_B));
}

template <int TRANS_B>
__device__ __forceinline__ void wgmma_m64n64k16_rs(float (&d)[32], const uint32_t (&a)[4], uint64_t desc_b,
                                                   int scale_d) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {" WGMMA_REGS_32
        "}, {%32, %33, %34, %35}, %36, p, 1, 1, %38;\n}\n"
        : WGMMA_D32
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(scale_d), "n"(TRANS_B));
}

template <int TRANS_B>
__device__ __forceinline__ void wgmma_m64n128k16_rs(float (&d)[64], const uint32_t (&a)[4], uint64_t desc_b,
                                                    int scale_d) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {" WGMMA_REGS_64
        "}, {%64, %65, %66, %67}, %68, p, 1, 1, %70;\n}\n"
        : WGMMA_D64
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(scale_d), "n"(TRANS_B));
}

// FP8 wgmma (e4m3 x e4m3, fp32 accumulators in the bf16 layout above): both operands K-major from shared memory
// (FP8 has no transposed operand), one k32 step = 32 bytes of each 128-byte row, as bf16's k16
__device__ __forceinline__ void wgmma_m64n128k32_e4m3(float (&d)[64], uint64_t desc_a, uint64_t desc_b, int scale_d) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 {" WGMMA_REGS_64 "}, %64, %65, p, 1, 1;\n}\n"
        : WGMMA_D64
        : "l"(desc_a), "l"(desc_b), "r"(scale_d));
}

__device__ __forceinline__ void wgmma_m64n256k32_e4m3(float (&d)[128], uint64_t desc_a, uint64_t desc_b, int scale_d) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n256k32.f32.e4m3.e4m3 {" WGMMA_REGS_128 "}, %128, %129, p, 1, 1;\n}\n"
        : WGMMA_D128
        : "l"(desc_a), "l"(desc_b), "r"(scale_d));
}

// the wgmma of width N (32, 64, 128, 256) from shared memory, and (64, 128) with A from registers
template <int N, int TRANS_A, int TRANS_B>
__device__ __forceinline__ void wgmma_ss(float (&d)[N / 2], uint64_t desc_a, uint64_t desc_b, int scale_d) {
    if constexpr (N == 32) wgmma_m64n32k16<TRANS_A, TRANS_B>(d, desc_a, desc_b, scale_d);
    else if constexpr (N == 64) wgmma_m64n64k16<TRANS_A, TRANS_B>(d, desc_a, desc_b, scale_d);
    else if constexpr (N == 128) wgmma_m64n128k16<TRANS_A, TRANS_B>(d, desc_a, desc_b, scale_d);
    else wgmma_m64n256k16<TRANS_A, TRANS_B>(d, desc_a, desc_b, scale_d);
}
template <int N, int TRANS_B>
__device__ __forceinline__ void wgmma_rs(float (&d)[N / 2], const uint32_t (&a)[4], uint64_t desc_b, int scale_d) {
    if constexpr (N == 64) wgmma_m64n64k16_rs<TRANS_B>(d, a, desc_b, scale_d);
    else wgmma_m64n128k16_rs<TRANS_B>(d, a, desc_b, scale_d);
}

#endif  // WGMMA_ENABLED

// sm_80 building blocks: a shared-memory pointer as the 32-bit address PTX takes, 16-byte cp.async copies
// into shared memory, ldmatrix, and the tensor cores' mma.sync m16n8k16 in bf16. Shared by the mma.sync
// kernels (gemm_mma.cu, flash_attention.cu, gemv.cu, the attention ladder's v1), the classifier's staged
// loads, and the wgmma kernels (through wgmma.cuh).
//
// mma.sync m16n8k16 (row.col, fp32 accumulators), lane l of a warp, g = l / 4, t = l % 4:
//   A (16x16 bf16): a0 = (row g, k 2t..2t+1), a1 = (row g + 8, same k), a2 = (row g, k 2t + 8..), a3 = (row
//   g + 8, k 2t + 8..), bf16 pairs; B (16x8): b0 = (k 2t..2t+1, column g), b1 = (k 2t + 8.., column g);
//   D (16x8 fp32): d[0, 1] = (row g, columns 2t, 2t + 1), d[2, 3] = (row g + 8, same columns).
#pragma once
#include <stdint.h>

__device__ __forceinline__ uint32_t smem_address(const void* p) {
    return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16 bytes global -> shared, asynchronously; the bytes past `bytes` are zero-filled (0: src is not read)
__device__ __forceinline__ void cp_async_16(uint32_t dst, const void* src, int bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(bytes));
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }

// wait until at most N of this thread's committed groups are still in flight
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory"); }

// four 8x8 bf16 matrices from shared memory, one row address per lane (lanes 8i..8i+7: matrix i)
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t address) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(address));
}

__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t address) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(address));
}

// d (16x8 fp32) += a (16x16 bf16, row) @ b (16x8 bf16, col), the fragments as above
__device__ __forceinline__ void mma_bf16(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                         uint32_t b0, uint32_t b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
                 "{%8, %9}, {%0, %1, %2, %3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ void mma_bf16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    mma_bf16(d, a[0], a[1], a[2], a[3], b0, b1);
}

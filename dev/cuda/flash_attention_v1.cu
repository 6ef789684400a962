// v1 adds: FA2-style causal GQA flash attention on mma.sync m16n8k16 + ldmatrix + cp.async double buffering,
// online softmax in fp32 with exp2, deterministic backward (dK/dV kernel over kv tiles summing the group's
// query heads, separate dQ kernel recomputing S and P). The kernels are kernels/flash_attention.cu itself
// (this version is the one in the tree), included here, plus one dev-only variant to measure determinism:
//
// flash_attention_backward_dkdv_atomic_dq_d{64,128}: the dK/dV kernel that also adds each step's
//   dQ = dS K into dq_accum (B, T, H, D) fp32 with atomicAdd: NONDETERMINISTIC (the order of the float
//   additions varies from run to run). dq_accum must be zeroed first; then
// flash_attention_backward_dq_convert: dq_accum -> the dq slots of dqkv (bf16), scaled by 1/sqrt(D) and,
//   with cos/sin, rotated back by RoPE. Together they replace flash_attention_backward_dq_d{64,128}.
#include "flash_attention.cu"

// the dQ of one dK/dV step: dS^T (this warp's 16 kv rows x BQ queries) goes to shared memory as bf16,
// then dQ (BQ x D) = dS (BQ x BC) K (BC x D) split over the 8 warps (16 query rows x D / GROUPS columns
// each) and added to dq_accum with atomics
template <int D>
struct AtomicDq {
    float* dq_accum;  // (B, T, H, D) fp32
    int T, H;

    template <int NT>
    __device__ __forceinline__ void operator()(const float (&ds)[NT][4], uint32_t k_tile, int h, int q0) const {
        using namespace bwd;
        constexpr int BQ = q_rows<D>(), M_TILES = BQ / 16, GROUPS = KV_WARPS / M_TILES, NT_W = D / 8 / GROUPS;
        constexpr int DS_STRIDE = BQ + 8;  // padded rows of the (BC, BQ) bf16 dS^T tile
        static_assert(NT == BQ / 8 && NT_W % 2 == 0, "dS^T tile shape");
        extern __shared__ __align__(128) unsigned char shared[];
        const uint32_t sdS = smem_address(shared) + dkdv_shared_bytes<D>();
        const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t4 = lane % 4;
#pragma unroll
        for (int n = 0; n < NT; ++n)
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                const uint32_t at = sdS + 2 * ((warp * 16 + g + 8 * half) * DS_STRIDE + n * 8 + 2 * t4);
                const uint32_t pair = pack_bf16(ds[n][2 * half], ds[n][2 * half + 1]);
                asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(at), "r"(pair));
            }
        __syncthreads();

        const int m0 = (warp % M_TILES) * 16, n_first = (warp / M_TILES) * NT_W;
        float acc[NT_W][4] = {};
#pragma unroll
        for (int kk = 0; kk < BC / 16; ++kk) {
            uint32_t a[4];  // dS rows m0.. (queries), columns kk*16.. (keys), from the transposed tile
            ldmatrix_x4_trans(a, sdS + 2 * ((kk * 16 + (lane & 7) + 8 * (lane >> 4)) * DS_STRIDE + m0 +
                                            8 * ((lane >> 3) & 1)));
#pragma unroll
            for (int n = 0; n < NT_W; n += 2) {
                uint32_t b[4];
                load_b_kn<D>(b, k_tile, kk * 16, (n_first + n) * 8, lane);
                mma_bf16(acc[n], a, b[0], b[1]);
                mma_bf16(acc[n + 1], a, b[2], b[3]);
            }
        }
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const int pos = q0 + m0 + g + 8 * half;
            if (pos >= T) continue;
            float* row = dq_accum + (((long long)blockIdx.y * T + pos) * H + h) * D + n_first * 8 + 2 * t4;
#pragma unroll
            for (int n = 0; n < NT_W; ++n) {
                atomicAdd(row + n * 8, acc[n][2 * half]);
                atomicAdd(row + n * 8 + 1, acc[n][2 * half + 1]);
            }
        }
    }
};

// dynamic shared memory of the atomic variant: the dK/dV kernel's, then the (BC, BQ + 8) bf16 dS^T tile
__constant__ int flash_attention_atomic_dq_shared[2] = {
    bwd::dkdv_shared_bytes<64>() + bwd::BC * (bwd::q_rows<64>() + 8) * 2,
    bwd::dkdv_shared_bytes<128>() + bwd::BC * (bwd::q_rows<128>() + 8) * 2,
};

extern "C" __global__ void __launch_bounds__(bwd::KV_THREADS)
    flash_attention_backward_dkdv_atomic_dq_d64(bf16* dqkv, const bf16* dout, const bf16* qkv, const float* lse,
                                                const float* delta, const float* cos_table, const float* sin_table,
                                                float* dq_accum, int T, int H, int KV) {
    flash_backward_dkdv<64>(dqkv, dout, qkv, lse, delta, cos_table, sin_table, T, H, KV, AtomicDq<64>{dq_accum, T, H});
}

extern "C" __global__ void __launch_bounds__(bwd::KV_THREADS)
    flash_attention_backward_dkdv_atomic_dq_d128(bf16* dqkv, const bf16* dout, const bf16* qkv, const float* lse,
                                                 const float* delta, const float* cos_table, const float* sin_table,
                                                 float* dq_accum, int T, int H, int KV) {
    flash_backward_dkdv<128>(dqkv, dout, qkv, lse, delta, cos_table, sin_table, T, H, KV,
                             AtomicDq<128>{dq_accum, T, H});
}

// one thread per pair (2i, 2i+1) of dq_accum (B, T, H, D): scale, rotate back (with cos/sin), store as bf16
extern "C" __global__ void flash_attention_backward_dq_convert(bf16* dqkv, const float* dq_accum,
                                                               const float* cos_table, const float* sin_table, int B,
                                                               int T, int H, int KV, int D) {
    const long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const int half = D / 2;
    if (idx >= (long long)B * T * H * half) return;
    const int pair = idx % half, h = (idx / half) % H;
    const long long token = idx / ((long long)half * H);  // b * T + t
    const int t = token % T;
    const float scale = rsqrtf((float)D);
    float d0 = dq_accum[2 * idx] * scale, d1 = dq_accum[2 * idx + 1] * scale;
    if (cos_table != nullptr) {
        const float c = cos_table[t * half + pair], s = sin_table[t * half + pair];
        const float r0 = d0 * c + d1 * s, r1 = d1 * c - d0 * s;
        d0 = r0;
        d1 = r1;
    }
    *reinterpret_cast<__nv_bfloat162*>(dqkv + token * (H + 2 * KV) * D + h * D + 2 * pair) =
        __floats2bfloat162_rn(d0, d1);
}

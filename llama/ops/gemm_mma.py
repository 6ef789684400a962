"""Version 1 of the bf16 GEMM (kernels/gemm_mma.cu: mma.sync, any GPU from sm_80), the power-of-two
split-K count of versions 1 and 2, and the deterministic reduce of split-K partials that every version uses."""

from __future__ import annotations

import math

import numpy as np

from ..runtime.cuda import DeviceArray
from .common import BLOCK, blocks, kernel, kernel_constant, kernel_entries, multiprocessors
from .gemm_problem import GemmProblem

# the tiles (BM, BN) and pipeline stages of each entry point gemm_mma_nt_<BM>x<BN>, by tile name
TILES = {name.split("_")[-1]: (int(bm), int(bn), int(stages))
         for name, bm, bn, stages, *_ in kernel_entries("gemm_mma", "GEMM_MMA_ENTRY")
         if name.startswith("gemm_mma_nt_")}
BK, THREADS = kernel_constant("gemm_mma", "BK"), 256  # 2 x 4 warps (kernels/gemm_mma.cu's WARPS_M, WARPS_N)


def gemm_mma(p: GemmProblem, tile: str | None = None) -> None:
    """Version 1 (mma.sync, any GPU from sm_80). tile: '128x128' or '128x256' (TILES)."""
    if tile is None:  # the wide tile once there are enough of them to fill the GPU twice over
        wide_m, wide_n, _ = TILES["128x256"]
        wide_tiles = math.ceil(p.M / wide_m) * math.ceil(p.N / wide_n) * p.batch
        tile = "128x256" if wide_tiles >= 2 * multiprocessors() else "128x128"
    bm, bn, stages = TILES[tile]
    grid = (math.ceil(p.M / bm) * math.ceil(p.N / bn), 1, p.batch)
    kernel("gemm_mma", f"gemm_mma_{p.layout}_{tile}", "PPPPPqqqiiiiiiiiiif")(
        grid, THREADS, p.c, p.a, p.b, p.cos, p.sin, p.stride_a, p.stride_b, p.stride_c, p.M, p.N, p.K, p.lda, p.ldb,
        *p.epilogue_args(), shared=stages * (bm + bn) * BK * 2)


def splitk_splits(p: GemmProblem) -> int:
    """The versions that split K as a batch (1, 6 and 7; the ladder's 2 and 4): how many K splits (a power of two
    dividing K) a weight-gradient GEMM (tn, fp32 out, one batch) needs to fill the GPU."""
    if p.layout != "tn" or p.batch != 1 or p.mode not in ("f32", "acc_f32"):
        return 1
    tiles, sms, splits = math.ceil(p.M / 128) * math.ceil(p.N / 128), multiprocessors(), 1
    while tiles * splits < sms and p.K % (2 * splits) == 0 and p.K // (2 * splits) >= 1024:
        splits *= 2
    return splits


def splitk_reduce(c: DeviceArray, partial: DeviceArray, splits: int, accumulate: bool, alpha: float) -> None:
    """c (M, N) fp32 = alpha * the sum over splits of partial (splits, M, N), in a fixed order (+= with
    accumulate); deterministic, no atomics."""
    n = c.size
    kernel("gemm_mma", "gemm_splitk_reduce", "PPqiif")(blocks(n), BLOCK, c.ptr, partial.ptr, n, splits,
                                                        int(accumulate), np.float32(alpha))

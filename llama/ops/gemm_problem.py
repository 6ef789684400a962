"""GemmProblem: one GEMM as every version of the GEMM ladder receives it (llama/ops/gemm.py's gemm and
llama/ops/fp8.py's gemm_fp8 build it from device arrays; llama/ops/gemm_mma.py and llama/ops/gemm_wgmma.py
launch it)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

GEMM_EPILOGUES = {"bf16": 0, "f32": 1, "acc_f32": 2, "rope_bf16": 3}  # kernels/gemm_epilogue.cuh


@dataclass(frozen=True)
class GemmProblem:
    """One strided-batched GEMM as the kernels see it: pointers, sizes, leading dimensions (elements),
    batch strides, the epilogue. layout: 'nt' (A (M, K), B (N, K)), 'nn' (B (K, N)), 'tn' (A (K, M)).
    bf16 operands, or FP8 e4m3 ones (fp8, 'nt' only) whose rows were divided by row_scales (M,) and
    col_scales (N,) (device pointers), which the epilogue multiplies back."""
    layout: str
    batch: int
    M: int
    N: int
    K: int
    a: int
    lda: int
    stride_a: int
    b: int
    ldb: int
    stride_b: int
    c: int
    stride_c: int
    mode: str
    alpha: float
    cos: int = 0
    sin: int = 0
    rope_T: int = 1
    rope_cols: int = 0
    head_dim: int = 2
    fp8: bool = False
    row_scales: int = 0
    col_scales: int = 0

    @property
    def k_block(self) -> int:
        """The values of K one pipeline stage holds: 128 bytes of each row."""
        return 128 if self.fp8 else 64

    def epilogue_args(self) -> tuple:
        """The kernels' trailing arguments: ldc, mode, rope_T, rope_cols, head_dim, alpha."""
        return (self.N, GEMM_EPILOGUES[self.mode], self.rope_T, self.rope_cols, self.head_dim,
                np.float32(self.alpha))

"""The fp32 path's matmul (kernels/matmul.cu; twin llama/twins/matmul.py): 128 x 128 tiles of fp32 FMA, any
layout but both operands transposed, and the linear layer on it. The bf16 path's GEMM: llama/ops/gemm.py."""

from __future__ import annotations

import math

import numpy as np

from ..runtime.cuda import DeviceArray
from .common import check, kernel, kernel_constant

TILE_M, TILE_N = kernel_constant("matmul", "BM"), kernel_constant("matmul", "BN")  # c's tile of a block
THREADS = kernel_constant("matmul", "THREADS")


def matmul(c: DeviceArray, a: DeviceArray, b: DeviceArray, trans_a: bool = False, trans_b: bool = False,
           alpha: float = 1.0, beta: float = 0.0) -> None:
    """c = alpha * op(a) @ op(b) + beta * c over 2D arrays or 3D batches of equal count.
    op(a) is (M, K): a is (M, K), or (K, M) with trans_a; op(b) is (K, N): b is (K, N), or (N, K) with trans_b."""
    batch = c.shape[0] if len(c.shape) == 3 else 1
    M, N = c.shape[-2:]
    K = a.shape[-2] if trans_a else a.shape[-1]
    check("a", a, ((batch,) if len(c.shape) == 3 else ()) + ((K, M) if trans_a else (M, K)))
    check("b", b, ((batch,) if len(c.shape) == 3 else ()) + ((N, K) if trans_b else (K, N)))
    check("c", c, c.shape)
    if trans_a and trans_b:
        raise ValueError("matmul: both operands transposed is not needed by the model and not implemented")
    name = "matmul_tn" if trans_a else "matmul_nt" if trans_b else "matmul_nn"
    grid = (math.ceil(N / TILE_N), math.ceil(M / TILE_M), batch)
    kernel("matmul", name, "PPPiiiiiiqqqff")(grid, THREADS, c.ptr, a.ptr, b.ptr, M, N, K, a.shape[-1], b.shape[-1], N,
                                             M * K, K * N, M * N, np.float32(alpha), np.float32(beta))


def matmul_forward(out: DeviceArray, inp: DeviceArray, weight: DeviceArray) -> None:
    """out (N, OC) = inp (N, IC) @ weight (OC, IC)^T."""
    matmul(out, inp, weight, trans_b=True)


def matmul_backward(dinp: DeviceArray, dweight: DeviceArray, dout: DeviceArray, inp: DeviceArray,
                    weight: DeviceArray, alpha: float = 1.0) -> None:
    """dinp = alpha * dout @ weight; dweight += alpha * dout^T @ inp."""
    matmul(dinp, dout, weight, alpha=alpha)
    matmul(dweight, dout, inp, trans_a=True, alpha=alpha, beta=1.0)

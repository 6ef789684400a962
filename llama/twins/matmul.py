"""The bias-free linear layer's twin (kernels/matmul.cu and the bf16 GEMM: llama/ops/matmul.py, llama/ops/gemm.py)."""

from __future__ import annotations

import numpy as np


def matmul_forward(x: np.ndarray, weight: np.ndarray) -> np.ndarray:
    """(..., IC) @ (OC, IC)^T -> (..., OC), a bias-free linear layer."""
    return x @ weight.T


def matmul_input_backward(dout: np.ndarray, weight: np.ndarray) -> np.ndarray:
    """dx = dout @ weight (..., IC): the whole backward of a frozen weight."""
    return dout @ weight


def matmul_backward(dout: np.ndarray, x: np.ndarray, weight: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """dx = dout @ weight (..., IC); dweight = dout^T @ x (OC, IC)."""
    dweight = dout.reshape(-1, dout.shape[-1]).T @ x.reshape(-1, x.shape[-1])
    return matmul_input_backward(dout, weight), dweight

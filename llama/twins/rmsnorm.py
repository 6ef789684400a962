"""RMSNorm's twins, plain and fused with the residual add before it (kernels/rmsnorm.cu, llama/ops/rmsnorm.py)."""

from __future__ import annotations

import numpy as np

from .residual import residual_forward


def rmsnorm_forward(x: np.ndarray, weight: np.ndarray, eps: float) -> tuple[np.ndarray, np.ndarray]:
    """x * rsqrt(mean(x^2) + eps) * weight over the last axis; also returns rstd (...,)."""
    rstd = 1.0 / np.sqrt(np.mean(x * x, axis=-1) + x.dtype.type(eps))
    return x * rstd[..., None] * weight, rstd


def rmsnorm_backward(dout: np.ndarray, x: np.ndarray, weight: np.ndarray,
                     rstd: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """dx = rstd * (g - x * rstd^2 * mean(g * x)) with g = dout * weight; dweight summed over rows."""
    r = rstd[..., None]
    g = dout * weight
    dx = r * (g - x * (r * r) * np.mean(g * x, axis=-1, keepdims=True))
    dweight = np.sum((dout * x * r).reshape(-1, x.shape[-1]), axis=0)
    return dx, dweight


def rmsnorm_residual_forward(x: np.ndarray, branch: np.ndarray, weight: np.ndarray,
                             eps: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The residual add fused with the next RMSNorm: h = x + branch, then rmsnorm_forward(h);
    returns h (the new residual stream), the normalized output and rstd."""
    h = residual_forward(x, branch)
    return (h, *rmsnorm_forward(h, weight, eps))


def rmsnorm_residual_backward(dresidual: np.ndarray, dout: np.ndarray, h: np.ndarray, weight: np.ndarray,
                              rstd: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Its backward: the residual-stream gradient passes the add unchanged, so it gains the norm's
    input gradient; also returns dweight."""
    dh, dweight = rmsnorm_backward(dout, h, weight, rstd)
    return dresidual + dh, dweight

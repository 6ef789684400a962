"""--dtype fp8's twins: the FP8 casts (kernels/fp8.cu) and the linear layer on them (the FP8 GEMM, llama/ops/fp8.py)."""

from __future__ import annotations

import ml_dtypes
import numpy as np

from ..options import FP8_SCALINGS
from .matmul import matmul_forward


# FP8 linear layers (--dtype fp8's twins): each GEMM operand is cast to float8 e4m3 with one power-of-two
# scale per slice along the GEMM's K axis (row-wise scaling: a token's row of activations, an output row of
# the weight; for dW, whose K is the tokens, a column of each), so the kernel multiplies the FP8 values,
# accumulates in fp32 and applies the two scales in its epilogue. A power of two keeps x / scale exact;
# the largest |x| / scale of a slice is in (224, 448]. Tensor-wise scaling, the comparison, gives every
# slice of a tensor the scale of the whole tensor's amax.
E4M3_MAX = 448.0  # the largest finite float8 e4m3fn


def quantize_fp8(x: np.ndarray, axis: int = -1, scaling: str = "row") -> tuple[np.ndarray, np.ndarray]:
    """x -> (float8 e4m3fn values, float32 scales): scale = 2^ceil(log2(amax / 448)) of each slice along axis
    (1 for a slice of zeros), values = x / scale rounded to nearest even, saturating at +-448. The scales
    have x's shape without axis; scaling "tensor" gives each slice the scale of the whole x's amax."""
    if scaling not in FP8_SCALINGS:
        raise ValueError(f"scaling {scaling!r}: choose from {', '.join(FP8_SCALINGS)}")
    amax = np.max(np.abs(x), axis=axis, keepdims=True).astype(np.float64)
    if scaling == "tensor":
        amax = np.full_like(amax, amax.max(initial=0.0))
    exponent = np.ceil(np.log2(np.where(amax > 0, amax, E4M3_MAX) / E4M3_MAX))
    exponent += amax > np.ldexp(E4M3_MAX, exponent.astype(int))  # exactly the least e with amax <= 448 * 2^e,
    exponent -= (amax > 0) & (amax <= np.ldexp(E4M3_MAX, exponent.astype(int) - 1))  # whatever log2's last bit did
    scale = np.exp2(exponent).astype(np.float32)
    scaled = np.clip(x.astype(np.float32) / scale, -E4M3_MAX, E4M3_MAX)
    return scaled.astype(ml_dtypes.float8_e4m3fn), np.squeeze(scale, axis=axis)


def dequantize_fp8(q: np.ndarray, scale: np.ndarray, axis: int = -1) -> np.ndarray:
    """The float32 values that quantize_fp8's output stands for."""
    return q.astype(np.float32) * np.expand_dims(scale, axis)


def _fp8_cast(a: np.ndarray, axis: int, scaling: str) -> np.ndarray:
    """The float64 values of a's FP8 cast with scales along axis."""
    return dequantize_fp8(*quantize_fp8(a, axis, scaling), axis).astype(np.float64)


def matmul_fp8_forward(x: np.ndarray, weight: np.ndarray, scaling: str = "row") -> np.ndarray:
    """matmul_forward on the FP8 casts of x (per token) and weight (per output row), in float64."""
    return matmul_forward(_fp8_cast(x, -1, scaling), _fp8_cast(weight, -1, scaling))


def matmul_fp8_backward(dout: np.ndarray, x: np.ndarray, weight: np.ndarray,
                        scaling: str = "row") -> tuple[np.ndarray, np.ndarray]:
    """matmul_backward with each GEMM's operands cast along its own K: dx = dout (per token) @ weight (per
    input column); dweight = dout^T (per output column over the tokens) @ x (per input column), in float64."""
    dout2, x2 = dout.reshape(-1, dout.shape[-1]), x.reshape(-1, x.shape[-1])
    dx = _fp8_cast(dout2, -1, scaling) @ _fp8_cast(weight, 0, scaling)
    dweight = _fp8_cast(dout2, 0, scaling).T @ _fp8_cast(x2, 0, scaling)
    return dx.reshape(*dout.shape[:-1], -1), dweight

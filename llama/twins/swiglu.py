"""SwiGLU's twins (kernels/swiglu.cu, kernels/swiglu.cuh, llama/ops/swiglu.py)."""

from __future__ import annotations

import numpy as np


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 1 / (1 + np.exp(-x))


def swiglu_forward(gate_up: np.ndarray) -> np.ndarray:
    """(..., 2F) = [gate | up] -> silu(gate) * up (..., F)."""
    gate, up = np.split(gate_up, 2, axis=-1)
    return gate * _sigmoid(gate) * up


def swiglu_backward(dout: np.ndarray, gate_up: np.ndarray) -> np.ndarray:
    """Gradient of [gate | up] (..., 2F)."""
    gate, up = np.split(gate_up, 2, axis=-1)
    s = _sigmoid(gate)
    return np.concatenate([dout * up * s * (1 + gate * (1 - s)), dout * gate * s], axis=-1)

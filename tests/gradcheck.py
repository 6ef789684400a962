"""Finite differences in float64, shared by the gradient tests."""

import numpy as np


def numerical_grad(loss_fn, array: np.ndarray, eps: float = 1e-6, indices=None) -> np.ndarray:
    """Central-difference gradient of loss_fn() with respect to array (perturbed in place).
    With indices, only those flat positions are computed (the rest stay 0)."""
    grad = np.zeros(array.size)
    flat = array.reshape(-1)
    for i in range(array.size) if indices is None else indices:
        saved = flat[i]
        flat[i] = saved + eps
        plus = loss_fn()
        flat[i] = saved - eps
        minus = loss_fn()
        flat[i] = saved
        grad[i] = (plus - minus) / (2 * eps)
    return grad.reshape(array.shape)


def rel_error(a: np.ndarray, b: np.ndarray) -> float:
    """||a - b|| / ||b||."""
    return float(np.linalg.norm(np.asarray(a, np.float64) - b) / np.linalg.norm(b))

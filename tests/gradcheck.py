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


def model_gradient_errors(model, tokens: np.ndarray, targets: np.ndarray, rng, picks_per_tensor: int = 24) -> dict:
    """A model's backward against finite differences of its loss on (tokens, targets): the relative error of each
    trained tensor's gradient (the adapters' with LoRA) over up to picks_per_tensor random elements of it, by name."""
    model.forward(tokens, targets)
    model.backward()
    loss = lambda: model.forward(tokens, targets)  # noqa: E731
    errors = {}
    for tensor in model.trainable_layout.tensors.values():
        picks = rng.choice(tensor.size, size=min(tensor.size, picks_per_tensor), replace=False) + tensor.offset
        errors[tensor.name] = rel_error(model.grads[picks], numerical_grad(loss, model.trainable, indices=picks)[picks])
    return errors

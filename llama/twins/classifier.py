"""The softmax cross-entropy's twin (kernels/classifier.cu, llama/ops/classifier.py)."""

from __future__ import annotations

import numpy as np


def fused_classifier(logits: np.ndarray, targets: np.ndarray, dloss: float) -> tuple[np.ndarray, np.ndarray]:
    """Softmax cross-entropy of (N, V) logits: per-row losses (N,) and
    dlogits = (softmax - onehot(target)) * dloss, the gradient of dloss * sum(losses)."""
    rows = np.arange(logits.shape[0])
    shifted = logits - logits.max(axis=-1, keepdims=True)
    exps = np.exp(shifted)
    sums = exps.sum(axis=-1)
    losses = np.log(sums) - shifted[rows, targets]
    dlogits = exps / sums[:, None]
    dlogits[rows, targets] -= 1
    return losses, dlogits * logits.dtype.type(dloss)

"""The softmax cross-entropy's twin (kernels/classifier.cu, llama/ops/classifier.py)."""

from __future__ import annotations

import numpy as np


def fused_classifier(logits: np.ndarray, targets: np.ndarray, dloss: float) -> tuple[np.ndarray, np.ndarray]:
    """Softmax cross-entropy of (N, V) logits: per-row losses (N,) and
    dlogits = (softmax - onehot(target)) * dloss, the gradient of dloss * sum(losses). A target < 0 is not
    counted: its row's loss and gradient are 0."""
    rows = np.arange(logits.shape[0])
    counted = targets >= 0
    picked = np.where(counted, targets, 0)
    shifted = logits - logits.max(axis=-1, keepdims=True)
    exps = np.exp(shifted)
    sums = exps.sum(axis=-1)
    losses = np.log(sums) - shifted[rows, picked]
    dlogits = exps / sums[:, None]
    dlogits[rows, picked] -= 1
    if not counted.all():
        losses[~counted] = 0
        dlogits[~counted] = 0
    return losses, dlogits * logits.dtype.type(dloss)

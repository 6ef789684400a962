"""Causal grouped-query attention's twins (kernels/attention.cu, llama/ops/attention.py)."""

from __future__ import annotations

import numpy as np


def _attention_scores(q: np.ndarray, k: np.ndarray) -> np.ndarray:
    """Causal scaled scores (B, H, T, T), -inf above the diagonal."""
    B, H, T, D = q.shape
    KV = k.shape[1]
    q_stacked = q.reshape(B, KV, H // KV * T, D)  # the query heads that share one kv head
    scores = (q_stacked @ k.swapaxes(-1, -2)).reshape(B, H, T, T) * q.dtype.type(1 / np.sqrt(D))
    return np.where(np.triu(np.ones((T, T), dtype=bool), 1), -np.inf, scores)


def attention_probabilities(q: np.ndarray, k: np.ndarray, lse: np.ndarray) -> np.ndarray:
    """The softmax probabilities (B, H, T, T) recomputed from the saved log-sum-exp (B, H, T)."""
    return np.exp(_attention_scores(q, k) - lse[..., None])


def attention_forward(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Causal grouped-query attention. q (B, H, T, D), k, v (B, KV, T, D) ->
    out (B, T, H * D) and the log-sum-exp of each row of scaled scores (B, H, T)."""
    B, H, T, D = q.shape
    KV = k.shape[1]
    scores = _attention_scores(q, k)
    row_max = scores.max(axis=-1, keepdims=True)
    exps = np.exp(scores - row_max)
    sums = exps.sum(axis=-1, keepdims=True)
    out = ((exps / sums).reshape(B, KV, H // KV * T, T) @ v).reshape(B, H, T, D)
    lse = (row_max + np.log(sums))[..., 0]
    return out.transpose(0, 2, 1, 3).reshape(B, T, H * D), lse


def attention_backward(dout: np.ndarray, q: np.ndarray, k: np.ndarray, v: np.ndarray, out: np.ndarray,
                       lse: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Gradients of q (B, H, T, D), k and v (B, KV, T, D) from dout (B, T, H * D), recomputing the
    probabilities from lse; delta = rowsum(dout * out) stands for rowsum(dprobs * probs)."""
    B, H, T, D = q.shape
    KV = k.shape[1]
    rows = H // KV * T
    dout_heads = dout.reshape(B, T, H, D).transpose(0, 2, 1, 3)
    delta = np.sum(dout_heads * out.reshape(B, T, H, D).transpose(0, 2, 1, 3), axis=-1)  # (B, H, T)
    dout_stacked = dout_heads.reshape(B, KV, rows, D)
    probs_stacked = attention_probabilities(q, k, lse).reshape(B, KV, rows, T)
    dv = probs_stacked.swapaxes(-1, -2) @ dout_stacked
    dprobs = dout_stacked @ v.swapaxes(-1, -2)
    dscores = probs_stacked * (dprobs - delta.reshape(B, KV, rows, 1))
    dscores *= q.dtype.type(1 / np.sqrt(D))
    dq = (dscores @ k).reshape(B, H, T, D)
    dk = dscores.swapaxes(-1, -2) @ q.reshape(B, KV, rows, D)
    return dq, dk, dv

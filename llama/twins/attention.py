"""Causal grouped-query attention's twins (kernels/attention.cu, llama/ops/attention.py), and the
document-masked causal attention: each token attends to the earlier-or-same tokens of its own document,
documents given by per-row ids (document_ids), or, as the GPU kernels take them, by each token's document
bounds (document_bounds).

RoPE positions under the document mask stay the row's, 0 .. T-1, not restarted at each document: as
torchtitan's Llama 3 (pytorch/torchtitan, torchtitan/models/llama3/model/model.py: `positions` defaults to
None, the row's positions, and the block_causal mask of torchtitan/models/attention.py's
get_document_mask_mod changes only which keys a query sees). So the model's rope tables are unchanged."""

from __future__ import annotations

import numpy as np


def document_ids(tokens: np.ndarray, bos_id: int) -> np.ndarray:
    """Per-token document ids (B, T) int32 of token rows (B, T): a new document starts at each BOS. The tokens
    before a row's first BOS (the end of a document that began in an earlier row) are a document of their own
    (id 0)."""
    return np.cumsum(np.asarray(tokens) == bos_id, axis=1, dtype=np.int32)


def document_bounds(tokens: np.ndarray, bos_id: int) -> tuple[np.ndarray, np.ndarray]:
    """The GPU kernels' form of the document mask (kernels/document_mask.cu): per token of rows (B, T), doc_start,
    its document's first position (the last BOS at or before it, else 0), and doc_end, one past its last (the
    first BOS after it, else T), both (B, T) int32. Query t sees key s iff doc_start[b, t] <= s <= t."""
    is_bos = np.asarray(tokens) == bos_id
    B, T = is_bos.shape
    positions = np.arange(T, dtype=np.int32)
    doc_start = np.maximum.accumulate(np.where(is_bos, positions, 0), axis=1)
    later_bos = np.where(is_bos[:, 1:], positions[1:], T)  # the BOS positions after each t, T where none
    doc_end = np.minimum.accumulate(np.concatenate([later_bos, np.full((B, 1), T)], axis=1)[:, ::-1], axis=1)[:, ::-1]
    return doc_start.astype(np.int32), np.ascontiguousarray(doc_end, dtype=np.int32)


def _causal_hidden(T: int) -> np.ndarray:
    """(T, T) True where a query (row) may not see a key (column): the keys after it."""
    return np.triu(np.ones((T, T), dtype=bool), 1)


def _document_hidden(doc_ids: np.ndarray) -> np.ndarray:
    """(B, 1, T, T) True where a query may not see a key: the keys after it or in another document."""
    T = doc_ids.shape[1]
    return _causal_hidden(T) | (doc_ids[:, None, :, None] != doc_ids[:, None, None, :])


def _attention_scores(q: np.ndarray, k: np.ndarray, hidden: np.ndarray) -> np.ndarray:
    """Scaled scores (B, H, T, T), -inf where hidden (broadcast to (B, H, T, T))."""
    B, H, T, D = q.shape
    KV = k.shape[1]
    q_stacked = q.reshape(B, KV, H // KV * T, D)  # the query heads that share one kv head
    scores = (q_stacked @ k.swapaxes(-1, -2)).reshape(B, H, T, T) * q.dtype.type(1 / np.sqrt(D))
    return np.where(hidden, -np.inf, scores)


def attention_probabilities(q: np.ndarray, k: np.ndarray, lse: np.ndarray,
                            doc_ids: np.ndarray | None = None) -> np.ndarray:
    """The softmax probabilities (B, H, T, T) recomputed from the saved log-sum-exp (B, H, T), causal, or
    document-masked with doc_ids (B, T)."""
    hidden = _causal_hidden(q.shape[2]) if doc_ids is None else _document_hidden(doc_ids)
    return np.exp(_attention_scores(q, k, hidden) - lse[..., None])


def attention_forward(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Causal grouped-query attention. q (B, H, T, D), k, v (B, KV, T, D) ->
    out (B, T, H * D) and the log-sum-exp of each row of scaled scores (B, H, T)."""
    return _masked_forward(q, k, v, _causal_hidden(q.shape[2]))


def document_attention_forward(q: np.ndarray, k: np.ndarray, v: np.ndarray,
                               doc_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """attention_forward with the document mask: query t sees the keys s <= t with doc_ids[b, s] ==
    doc_ids[b, t] (doc_ids (B, T), document_ids)."""
    return _masked_forward(q, k, v, _document_hidden(doc_ids))


def _masked_forward(q: np.ndarray, k: np.ndarray, v: np.ndarray, hidden: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Grouped-query attention with the keys that hidden marks left out (every query sees itself)."""
    B, H, T, D = q.shape
    KV = k.shape[1]
    scores = _attention_scores(q, k, hidden)
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
    return _masked_backward(dout, q, k, v, out, attention_probabilities(q, k, lse))


def document_attention_backward(dout: np.ndarray, q: np.ndarray, k: np.ndarray, v: np.ndarray, out: np.ndarray,
                                lse: np.ndarray, doc_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """attention_backward of document_attention_forward with the same doc_ids."""
    return _masked_backward(dout, q, k, v, out, attention_probabilities(q, k, lse, doc_ids))


def _masked_backward(dout: np.ndarray, q: np.ndarray, k: np.ndarray, v: np.ndarray, out: np.ndarray,
                     probs: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The attention backward from its recomputed probabilities (B, H, T, T), zero at the hidden keys."""
    B, H, T, D = q.shape
    KV = k.shape[1]
    rows = H // KV * T
    dout_heads = dout.reshape(B, T, H, D).transpose(0, 2, 1, 3)
    delta = np.sum(dout_heads * out.reshape(B, T, H, D).transpose(0, 2, 1, 3), axis=-1)  # (B, H, T)
    dout_stacked = dout_heads.reshape(B, KV, rows, D)
    probs_stacked = probs.reshape(B, KV, rows, T)
    dv = probs_stacked.swapaxes(-1, -2) @ dout_stacked
    dprobs = dout_stacked @ v.swapaxes(-1, -2)
    dscores = probs_stacked * (dprobs - delta.reshape(B, KV, rows, 1))
    dscores *= q.dtype.type(1 / np.sqrt(D))
    dq = (dscores @ k).reshape(B, H, T, D)
    dk = dscores.swapaxes(-1, -2) @ q.reshape(B, KV, rows, D)
    return dq, dk, dv

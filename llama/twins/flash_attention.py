"""Flash attention's twins: attention read from the packed projection (kernels/flash_attention*.cu,
llama/ops/flash_attention.py)."""

from __future__ import annotations

import numpy as np

from .attention import attention_backward, attention_forward, document_attention_backward, document_attention_forward
from .rope import pack_qkv, rope_backward, unpack_qkv


def flash_attention_forward(qkv: np.ndarray, n_heads: int, n_kv_heads: int,
                            doc_ids: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The flash kernels' view of attention_forward: q, k, v read from the packed (B, T, (H + 2KV) * D)
    projection (q and k already rotated) -> out (B, T, H * D), lse (B, H, T); with doc_ids (B, T)
    (document_ids), document_attention_forward's document mask."""
    q, k, v = unpack_qkv(qkv, n_heads, n_kv_heads)
    return attention_forward(q, k, v) if doc_ids is None else document_attention_forward(q, k, v, doc_ids)


def flash_attention_backward(dout: np.ndarray, out: np.ndarray, lse: np.ndarray, qkv: np.ndarray, n_heads: int,
                             n_kv_heads: int, cos: np.ndarray | None = None,
                             sin: np.ndarray | None = None, doc_ids: np.ndarray | None = None) -> np.ndarray:
    """dqkv (B, T, (H + 2KV) * D) packed like qkv; with cos/sin, dq and dk rotated back by RoPE
    (rope_backward fused, as the kernels can do); with doc_ids, the backward of the document-masked forward."""
    q, k, v = unpack_qkv(qkv, n_heads, n_kv_heads)
    if doc_ids is None:
        dq, dk, dv = attention_backward(dout, q, k, v, out, lse)
    else:
        dq, dk, dv = document_attention_backward(dout, q, k, v, out, lse, doc_ids)
    return pack_qkv(dq, dk, dv) if cos is None else rope_backward(dq, dk, dv, cos, sin)

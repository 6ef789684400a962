"""RoPE's twins and the packed projection's layout (kernels/rope.cu, kernels/rope.cuh, llama/ops/rope.py)."""

from __future__ import annotations

import numpy as np


def rotate_pairs(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Rotate each pair (2i, 2i+1) of the last axis by the angle whose cos/sin are given (T, D/2)."""
    x0, x1 = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2] = x0 * cos - x1 * sin
    out[..., 1::2] = x0 * sin + x1 * cos
    return out


def unpack_qkv(qkv: np.ndarray, n_heads: int, n_kv_heads: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(B, T, (H + 2KV) * D) -> head-major views q (B, H, T, D), k and v (B, KV, T, D)."""
    B, T, _ = qkv.shape
    heads = qkv.reshape(B, T, n_heads + 2 * n_kv_heads, -1).transpose(0, 2, 1, 3)
    return heads[:, :n_heads], heads[:, n_heads:n_heads + n_kv_heads], heads[:, n_heads + n_kv_heads:]


def pack_qkv(dq: np.ndarray, dk: np.ndarray, dv: np.ndarray) -> np.ndarray:
    """The inverse of unpack_qkv: head-major dq, dk, dv (or q, k, v) packed into (B, T, (H + 2KV) * D)."""
    B, _, T, _ = dq.shape
    return np.concatenate([dq, dk, dv], axis=1).transpose(0, 2, 1, 3).reshape(B, T, -1)


def rope_forward(qkv: np.ndarray, cos: np.ndarray, sin: np.ndarray, n_heads: int,
                 n_kv_heads: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Split the fused (B, T, (H + 2KV) * D) projection into head-major q (B, H, T, D),
    k and v (B, KV, T, D), rotating q and k by RoPE (Meta's interleaved pairs)."""
    T = qkv.shape[1]
    q, k, v = unpack_qkv(qkv, n_heads, n_kv_heads)
    cos, sin = cos[:T].astype(qkv.dtype), sin[:T].astype(qkv.dtype)
    return rotate_pairs(q, cos, sin), rotate_pairs(k, cos, sin), np.ascontiguousarray(v)


def rope_backward(dq: np.ndarray, dk: np.ndarray, dv: np.ndarray, cos: np.ndarray,
                  sin: np.ndarray) -> np.ndarray:
    """Rotate dq, dk back by the negative angle and interleave into (B, T, (H + 2KV) * D)."""
    T = dq.shape[2]
    cos, sin = cos[:T].astype(dq.dtype), sin[:T].astype(dq.dtype)
    return pack_qkv(rotate_pairs(dq, cos, -sin), rotate_pairs(dk, cos, -sin), dv)

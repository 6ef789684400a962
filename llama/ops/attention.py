"""The fp32 path's attention (kernels/attention.cu; twin llama/twins/attention.py): causal grouped-query
attention as matmuls (llama/ops/matmul.py) around a causal softmax, keeping the probabilities, optionally
document-masked (doc_start, doc_end from llama/ops/document_mask.py). The bf16 path's: llama/ops/flash_attention.py."""

from __future__ import annotations

import math

from ..runtime.cuda import DeviceArray
from .common import BLOCK, ROWS_PER_BLOCK, blocks, check, kernel
from .document_mask import check_document_bounds
from .matmul import matmul


def _attention_shapes(q: DeviceArray, k: DeviceArray, v: DeviceArray, probs: DeviceArray, heads: DeviceArray):
    B, H, T, D = q.shape
    KV = k.shape[1]
    if KV == 0 or H % KV:
        raise ValueError(f"attention: {H} query heads cannot share {KV} kv heads")
    check("k", k, (B, KV, T, D))
    check("v", v, (B, KV, T, D))
    check("probs", probs, (B, H, T, T))
    check("heads scratch", heads, (B, H, T, D))
    return B, H, KV, T, D


def attention_forward(out: DeviceArray, probs: DeviceArray, heads: DeviceArray, q: DeviceArray, k: DeviceArray,
                      v: DeviceArray, *, doc_start: DeviceArray | None = None,
                      doc_end: DeviceArray | None = None) -> None:
    """out (B, T, H * D) and the probabilities probs (B, H, T, T); heads (B, H, T, D) is scratch. With doc_start,
    doc_end (B, T) int32 (ops.document_bounds), query t sees only the keys doc_start[b, t] .. t."""
    B, H, KV, T, D = _attention_shapes(q, k, v, probs, heads)
    check("out", out, (B, T, H * D))
    doc_start_ptr, _ = check_document_bounds(doc_start, doc_end, B, T)
    rows = H // KV * T  # the query rows that share one kv head
    probs_g, q_g, heads_g = probs.reshape(B * KV, rows, T), q.reshape(B * KV, rows, D), heads.reshape(B * KV, rows, D)
    k_g, v_g = k.reshape(B * KV, T, D), v.reshape(B * KV, T, D)
    matmul(probs_g, q_g, k_g, trans_b=True, alpha=1 / math.sqrt(D))
    kernel("attention", "causal_softmax_forward", "PiiiP")(blocks(B * H * T, ROWS_PER_BLOCK), BLOCK, probs.ptr,
                                                           B * H * T, T, H, doc_start_ptr)
    matmul(heads_g, probs_g, v_g)
    kernel("attention", "merge_heads", "PPiiii")(blocks(out.size), BLOCK, out.ptr, heads.ptr, B, H, T, D)


def attention_backward(dq: DeviceArray, dk: DeviceArray, dv: DeviceArray, dprobs: DeviceArray, dheads: DeviceArray,
                       dout: DeviceArray, q: DeviceArray, k: DeviceArray, v: DeviceArray, probs: DeviceArray, *,
                       doc_start: DeviceArray | None = None, doc_end: DeviceArray | None = None) -> None:
    """dq (B, H, T, D), dk, dv (B, KV, T, D) from dout (B, T, H * D); dprobs and dheads are scratch; doc_start,
    doc_end: the forward's document mask."""
    B, H, KV, T, D = _attention_shapes(q, k, v, probs, dheads)
    check("dq", dq, q.shape)
    check("dk", dk, k.shape)
    check("dv", dv, v.shape)
    check("dprobs", dprobs, probs.shape)
    check("dout", dout, (B, T, H * D))
    doc_start_ptr, _ = check_document_bounds(doc_start, doc_end, B, T)
    rows, scale = H // KV * T, 1 / math.sqrt(D)
    kernel("attention", "split_heads", "PPiiii")(blocks(dout.size), BLOCK, dheads.ptr, dout.ptr, B, H, T, D)
    probs_g, dprobs_g = probs.reshape(B * KV, rows, T), dprobs.reshape(B * KV, rows, T)
    dheads_g = dheads.reshape(B * KV, rows, D)
    q_g, dq_g = q.reshape(B * KV, rows, D), dq.reshape(B * KV, rows, D)
    k_g, v_g, dk_g, dv_g = (x.reshape(B * KV, T, D) for x in (k, v, dk, dv))
    matmul(dprobs_g, dheads_g, v_g, trans_b=True)  # dprobs = dout @ v^T
    kernel("attention", "causal_softmax_backward", "PPiiiP")(blocks(B * H * T, ROWS_PER_BLOCK), BLOCK, dprobs.ptr,
                                                             probs.ptr, B * H * T, T, H, doc_start_ptr)
    matmul(dq_g, dprobs_g, k_g, alpha=scale)  # dq = dscores @ k
    matmul(dk_g, dprobs_g, q_g, trans_a=True, alpha=scale)  # dk = dscores^T @ q, summed over the group
    matmul(dv_g, probs_g, dheads_g, trans_a=True)  # dv = probs^T @ dout, summed over the group

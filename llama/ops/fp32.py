"""Launchers of the exact fp32 path (llama/model/gpu_fp32.py), one per kernel, named like the numpy
reference's layer functions (llama/model/reference.py)."""

from __future__ import annotations

import math

import numpy as np

from ..cuda import DeviceArray
from ..optim import AdamWConfig
from .common import BLOCK, CLASSIFIER_BLOCK, F32, I32, NORM_BLOCKS, ROWS_PER_BLOCK, U8, blocks, check, kernel

RMSNORM_PARTS = 128


# ---- embedding


def embedding_forward(out: DeviceArray, tokens: DeviceArray, wte: DeviceArray) -> None:
    """out (N, C) = wte[tokens]."""
    N, (V, C) = tokens.size, wte.shape
    check("tokens", tokens, tokens.shape, I32)
    check("out", out, (N, C))
    kernel("embedding", "embedding_forward", "PPPii")(blocks(N * C), BLOCK, out.ptr, tokens.ptr, wte.ptr, N, C)


def embedding_backward(dwte: DeviceArray, dout: DeviceArray, order: DeviceArray, starts: DeviceArray,
                       unique: DeviceArray, num_unique: int) -> None:
    """dwte (V, C) += dout rows grouped by token; order/starts/unique from sort_tokens()."""
    N, C = dout.shape
    check("dwte", dwte, (dwte.shape[0], C))
    check("order", order, (N,), I32)
    if starts.dtype != I32 or unique.dtype != I32 or starts.size < num_unique + 1 or unique.size < num_unique:
        raise ValueError("embedding_backward: starts/unique must be int32 with room for num_unique groups")
    kernel("embedding", "embedding_backward", "PPPPPi")((num_unique,), BLOCK, dwte.ptr, dout.ptr, order.ptr,
                                                          starts.ptr, unique.ptr, C)


def sort_tokens(tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Host side of embedding_backward: positions grouped by token (stable), group starts, tokens."""
    flat = tokens.ravel()
    order = np.argsort(flat, kind="stable").astype(np.int32)
    unique, counts = np.unique(flat, return_counts=True)
    starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    return order, starts, unique.astype(np.int32)


# ---- rmsnorm


def rmsnorm_forward(out: DeviceArray, rstd: DeviceArray, inp: DeviceArray, weight: DeviceArray, eps: float) -> None:
    N, C = inp.shape
    check("out", out, (N, C))
    check("rstd", rstd, (N,))
    check("weight", weight, (C,))
    kernel("rmsnorm", "rmsnorm_forward", "PPPPiif")(blocks(N, ROWS_PER_BLOCK), BLOCK, out.ptr, rstd.ptr, inp.ptr,
                                                     weight.ptr, N, C, np.float32(eps))


def rmsnorm_backward(dinp: DeviceArray, dweight: DeviceArray, scratch: DeviceArray, dout: DeviceArray,
                     inp: DeviceArray, weight: DeviceArray, rstd: DeviceArray) -> None:
    """dinp (N, C) += and dweight (C,) += ; scratch holds (RMSNORM_PARTS, C) partial sums."""
    N, C = inp.shape
    for name, array in (("dinp", dinp), ("dout", dout)):
        check(name, array, (N, C))
    check("dweight", dweight, (C,))
    check("weight", weight, (C,))
    check("rstd", rstd, (N,))
    if scratch.size < RMSNORM_PARTS * C or scratch.dtype != F32:
        raise ValueError(f"scratch: needs {RMSNORM_PARTS * C} float32, has {scratch.size}")
    kernel("rmsnorm", "rmsnorm_backward_input", "PPPPPii")(blocks(N, ROWS_PER_BLOCK), BLOCK, dinp.ptr, dout.ptr,
                                                            inp.ptr, weight.ptr, rstd.ptr, N, C)
    rows_per_part = math.ceil(N / RMSNORM_PARTS)
    parts = math.ceil(N / rows_per_part)
    kernel("rmsnorm", "rmsnorm_backward_weight_part", "PPPPiii")(
        (math.ceil(C / BLOCK), parts), BLOCK, scratch.ptr, dout.ptr, inp.ptr, rstd.ptr, N, C, rows_per_part)
    kernel("rmsnorm", "column_sum_accumulate", "PPii")(blocks(C), BLOCK, dweight.ptr, scratch.ptr, parts, C)


# ---- matmul


def matmul(c: DeviceArray, a: DeviceArray, b: DeviceArray, trans_a: bool = False, trans_b: bool = False,
           alpha: float = 1.0, beta: float = 0.0) -> None:
    """c = alpha * op(a) @ op(b) + beta * c over 2D arrays or 3D batches of equal count.
    op(a) is (M, K): a is (M, K), or (K, M) with trans_a; op(b) is (K, N): b is (K, N), or (N, K) with trans_b."""
    batch = c.shape[0] if len(c.shape) == 3 else 1
    M, N = c.shape[-2:]
    K = a.shape[-2] if trans_a else a.shape[-1]
    check("a", a, ((batch,) if len(c.shape) == 3 else ()) + ((K, M) if trans_a else (M, K)))
    check("b", b, ((batch,) if len(c.shape) == 3 else ()) + ((N, K) if trans_b else (K, N)))
    check("c", c, c.shape)
    if trans_a and trans_b:
        raise ValueError("matmul: both operands transposed is not needed by the model and not implemented")
    name = "matmul_tn" if trans_a else "matmul_nt" if trans_b else "matmul_nn"
    grid = (math.ceil(N / 128), math.ceil(M / 128), batch)
    kernel("matmul", name, "PPPiiiiiiqqqff")(grid, 256, c.ptr, a.ptr, b.ptr, M, N, K, a.shape[-1], b.shape[-1], N,
                                             M * K, K * N, M * N, np.float32(alpha), np.float32(beta))


def matmul_forward(out: DeviceArray, inp: DeviceArray, weight: DeviceArray) -> None:
    """out (N, OC) = inp (N, IC) @ weight (OC, IC)^T."""
    matmul(out, inp, weight, trans_b=True)


def matmul_backward(dinp: DeviceArray, dweight: DeviceArray, dout: DeviceArray, inp: DeviceArray,
                    weight: DeviceArray, alpha: float = 1.0) -> None:
    """dinp = alpha * dout @ weight; dweight += alpha * dout^T @ inp."""
    matmul(dinp, dout, weight, alpha=alpha)
    matmul(dweight, dout, inp, trans_a=True, alpha=alpha, beta=1.0)


# ---- rope


def _rope_shapes(q: DeviceArray, k: DeviceArray, v: DeviceArray, qkv: DeviceArray, cos: DeviceArray, sin: DeviceArray):
    B, H, T, D = q.shape
    KV = k.shape[1]
    check("k", k, (B, KV, T, D))
    check("v", v, (B, KV, T, D))
    check("qkv", qkv, (B, T, (H + 2 * KV) * D))
    if cos.shape[0] < T or cos.shape[1:] != (D // 2,) or sin.shape != cos.shape:
        raise ValueError(f"cos/sin: expected (>= {T}, {D // 2}), got {cos.shape} and {sin.shape}")
    return B, T, H, KV, D


def rope_forward(q: DeviceArray, k: DeviceArray, v: DeviceArray, qkv: DeviceArray, cos: DeviceArray,
                 sin: DeviceArray) -> None:
    """qkv (B, T, (H + 2KV) * D) -> head-major q (B, H, T, D), k, v (B, KV, T, D), q and k rotated."""
    B, T, H, KV, D = _rope_shapes(q, k, v, qkv, cos, sin)
    kernel("rope", "rope_forward", "PPPPPPiiiii")(blocks(qkv.size // 2), BLOCK, q.ptr, k.ptr, v.ptr, qkv.ptr,
                                                   cos.ptr, sin.ptr, B, T, H, KV, D)


def rope_backward(dqkv: DeviceArray, dq: DeviceArray, dk: DeviceArray, dv: DeviceArray, cos: DeviceArray,
                  sin: DeviceArray) -> None:
    B, T, H, KV, D = _rope_shapes(dq, dk, dv, dqkv, cos, sin)
    kernel("rope", "rope_backward", "PPPPPPiiiii")(blocks(dqkv.size // 2), BLOCK, dqkv.ptr, dq.ptr, dk.ptr, dv.ptr,
                                                    cos.ptr, sin.ptr, B, T, H, KV, D)


# ---- attention


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
                      v: DeviceArray) -> None:
    """out (B, T, H * D) and the probabilities probs (B, H, T, T); heads (B, H, T, D) is scratch."""
    B, H, KV, T, D = _attention_shapes(q, k, v, probs, heads)
    check("out", out, (B, T, H * D))
    rows = H // KV * T  # the query rows that share one kv head
    probs_g, q_g, heads_g = probs.reshape(B * KV, rows, T), q.reshape(B * KV, rows, D), heads.reshape(B * KV, rows, D)
    k_g, v_g = k.reshape(B * KV, T, D), v.reshape(B * KV, T, D)
    matmul(probs_g, q_g, k_g, trans_b=True, alpha=1 / math.sqrt(D))
    kernel("attention", "causal_softmax_forward", "Pii")(blocks(B * H * T, ROWS_PER_BLOCK), BLOCK, probs.ptr,
                                                         B * H * T, T)
    matmul(heads_g, probs_g, v_g)
    kernel("attention", "merge_heads", "PPiiii")(blocks(out.size), BLOCK, out.ptr, heads.ptr, B, H, T, D)


def attention_backward(dq: DeviceArray, dk: DeviceArray, dv: DeviceArray, dprobs: DeviceArray, dheads: DeviceArray,
                       dout: DeviceArray, q: DeviceArray, k: DeviceArray, v: DeviceArray, probs: DeviceArray) -> None:
    """dq (B, H, T, D), dk, dv (B, KV, T, D) from dout (B, T, H * D); dprobs and dheads are scratch."""
    B, H, KV, T, D = _attention_shapes(q, k, v, probs, dheads)
    check("dq", dq, q.shape)
    check("dk", dk, k.shape)
    check("dv", dv, v.shape)
    check("dprobs", dprobs, probs.shape)
    check("dout", dout, (B, T, H * D))
    rows, scale = H // KV * T, 1 / math.sqrt(D)
    kernel("attention", "split_heads", "PPiiii")(blocks(dout.size), BLOCK, dheads.ptr, dout.ptr, B, H, T, D)
    probs_g, dprobs_g = probs.reshape(B * KV, rows, T), dprobs.reshape(B * KV, rows, T)
    dheads_g = dheads.reshape(B * KV, rows, D)
    q_g, dq_g = q.reshape(B * KV, rows, D), dq.reshape(B * KV, rows, D)
    k_g, v_g, dk_g, dv_g = (x.reshape(B * KV, T, D) for x in (k, v, dk, dv))
    matmul(dprobs_g, dheads_g, v_g, trans_b=True)  # dprobs = dout @ v^T
    kernel("attention", "causal_softmax_backward", "PPii")(blocks(B * H * T, ROWS_PER_BLOCK), BLOCK, dprobs.ptr,
                                                           probs.ptr, B * H * T, T)
    matmul(dq_g, dprobs_g, k_g, alpha=scale)  # dq = dscores @ k
    matmul(dk_g, dprobs_g, q_g, trans_a=True, alpha=scale)  # dk = dscores^T @ q, summed over the group
    matmul(dv_g, probs_g, dheads_g, trans_a=True)  # dv = probs^T @ dout, summed over the group


# ---- swiglu, residual


def swiglu_forward(out: DeviceArray, gate_up: DeviceArray) -> None:
    """out (N, F) = silu(gate) * up, gate_up (N, 2F)."""
    N, F = out.shape
    check("gate_up", gate_up, (N, 2 * F))
    kernel("swiglu", "swiglu_forward", "PPii")(blocks(N * F), BLOCK, out.ptr, gate_up.ptr, N, F)


def swiglu_backward(dgate_up: DeviceArray, dout: DeviceArray, gate_up: DeviceArray) -> None:
    N, F = dout.shape
    check("gate_up", gate_up, (N, 2 * F))
    check("dgate_up", dgate_up, (N, 2 * F))
    kernel("swiglu", "swiglu_backward", "PPPii")(blocks(N * F), BLOCK, dgate_up.ptr, dout.ptr, gate_up.ptr, N, F)


def residual_forward(out: DeviceArray, x: DeviceArray, branch: DeviceArray) -> None:
    check("x", x, out.shape)
    check("branch", branch, out.shape)
    kernel("residual", "residual_forward", "PPPq")(blocks(out.size), BLOCK, out.ptr, x.ptr, branch.ptr, out.size)


# ---- loss, grad norm, optimizer


def fused_classifier(logits: DeviceArray, losses: DeviceArray, targets: DeviceArray, dloss: float) -> None:
    """losses (N,) of the (N, V) logits; the logits are overwritten by dlogits = (softmax - onehot) * dloss."""
    N, V = logits.shape
    check("losses", losses, (N,))
    check("targets", targets, (N,), I32)
    kernel("classifier", "fused_classifier", "PPPif")((N,), CLASSIFIER_BLOCK, logits.ptr, losses.ptr, targets.ptr,
                                                       V, np.float32(dloss))


def global_norm_squared(out: DeviceArray, partial: DeviceArray, x: DeviceArray) -> None:
    """out (1,) = sum(x^2), deterministic; partial (NORM_BLOCKS,) is scratch."""
    check("out", out, (1,))
    check("partial", partial, (NORM_BLOCKS,))
    kernel("global_norm", "global_norm_partial", "PPq")((NORM_BLOCKS,), BLOCK, partial.ptr, x.ptr, x.size)
    kernel("global_norm", "global_norm_finish", "PPi")((1,), 1024, out.ptr, partial.ptr, NORM_BLOCKS)


def adamw_update(params: DeviceArray, grads: DeviceArray, m: DeviceArray, v: DeviceArray, decay_mask: DeviceArray,
                 norm_squared: DeviceArray, step: int, lr: float, opt: AdamWConfig) -> None:
    """One AdamW step (step counts from 1), gradients clipped to opt.grad_clip by the device-side norm."""
    n = params.size
    for name, array in (("grads", grads), ("m", m), ("v", v)):
        check(name, array, params.shape)
    check("decay_mask", decay_mask, params.shape, U8)
    check("norm_squared", norm_squared, (1,))
    kernel("adamw", "adamw_update", "PPPPPPqffffffff")(
        blocks(n), BLOCK, params.ptr, grads.ptr, m.ptr, v.ptr, decay_mask.ptr, norm_squared.ptr, n,
        *(np.float32(x) for x in (lr, opt.beta1, opt.beta2, opt.eps, opt.weight_decay, 1 - opt.beta1 ** step,
                                  1 - opt.beta2 ** step, opt.grad_clip)))



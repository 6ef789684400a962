"""One Python launcher per CUDA kernel, named like the numpy reference's layer functions.

Each launcher checks the shapes and dtypes of its device arrays, raises ValueError on a mismatch,
and launches asynchronously. Outputs come first in the argument list, as in llm.c.
Gradient outputs of parameters (dweight) are accumulated (+=), activations' gradients are
overwritten except where the docstring says `+=`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .cuda import BF16, DeviceArray, runtime
from .optim import AdamWConfig

F32, I32, U8 = np.dtype(np.float32), np.dtype(np.int32), np.dtype(np.uint8)
BLOCK = 256
ROWS_PER_BLOCK = BLOCK // 32  # kernels with one warp per row
CLASSIFIER_BLOCK = 1024
NORM_BLOCKS = 512  # fixed, so that the grad norm is the same on every GPU
RMSNORM_PARTS = 128
_KERNELS = {}


def _kernel(module: str, name: str, signature: str, directory: Path | None = None):
    key = (directory, module, name)
    if key not in _KERNELS:
        _KERNELS[key] = runtime().kernel(module, name, signature, directory)
    return _KERNELS[key]


def _check(name: str, array: DeviceArray, shape, dtype=F32) -> None:
    if not isinstance(array, DeviceArray):
        raise ValueError(f"{name}: expected a DeviceArray, got {type(array).__name__}")
    if array.shape != tuple(shape) or array.dtype != dtype:
        raise ValueError(f"{name}: expected {dtype} {tuple(shape)}, got {array.dtype} {array.shape}")


def _blocks(n: int, per_block: int = BLOCK) -> tuple[int]:
    return (max(1, math.ceil(n / per_block)),)


# ---- embedding


def embedding_forward(out: DeviceArray, tokens: DeviceArray, wte: DeviceArray) -> None:
    """out (N, C) = wte[tokens]."""
    N, (V, C) = tokens.size, wte.shape
    _check("tokens", tokens, tokens.shape, I32)
    _check("out", out, (N, C))
    _kernel("embedding", "embedding_forward", "PPPii")(_blocks(N * C), BLOCK, out.ptr, tokens.ptr, wte.ptr, N, C)


def embedding_backward(dwte: DeviceArray, dout: DeviceArray, order: DeviceArray, starts: DeviceArray,
                       unique: DeviceArray, num_unique: int) -> None:
    """dwte (V, C) += dout rows grouped by token; order/starts/unique from sort_tokens()."""
    N, C = dout.shape
    _check("dwte", dwte, (dwte.shape[0], C))
    _check("order", order, (N,), I32)
    if starts.dtype != I32 or unique.dtype != I32 or starts.size < num_unique + 1 or unique.size < num_unique:
        raise ValueError("embedding_backward: starts/unique must be int32 with room for num_unique groups")
    _kernel("embedding", "embedding_backward", "PPPPPi")((num_unique,), BLOCK, dwte.ptr, dout.ptr, order.ptr,
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
    _check("out", out, (N, C))
    _check("rstd", rstd, (N,))
    _check("weight", weight, (C,))
    _kernel("rmsnorm", "rmsnorm_forward", "PPPPiif")(_blocks(N, ROWS_PER_BLOCK), BLOCK, out.ptr, rstd.ptr, inp.ptr,
                                                     weight.ptr, N, C, np.float32(eps))


def rmsnorm_backward(dinp: DeviceArray, dweight: DeviceArray, scratch: DeviceArray, dout: DeviceArray,
                     inp: DeviceArray, weight: DeviceArray, rstd: DeviceArray) -> None:
    """dinp (N, C) += and dweight (C,) += ; scratch holds (RMSNORM_PARTS, C) partial sums."""
    N, C = inp.shape
    for name, array in (("dinp", dinp), ("dout", dout)):
        _check(name, array, (N, C))
    _check("dweight", dweight, (C,))
    _check("weight", weight, (C,))
    _check("rstd", rstd, (N,))
    if scratch.size < RMSNORM_PARTS * C or scratch.dtype != F32:
        raise ValueError(f"scratch: needs {RMSNORM_PARTS * C} float32, has {scratch.size}")
    _kernel("rmsnorm", "rmsnorm_backward_input", "PPPPPii")(_blocks(N, ROWS_PER_BLOCK), BLOCK, dinp.ptr, dout.ptr,
                                                            inp.ptr, weight.ptr, rstd.ptr, N, C)
    rows_per_part = math.ceil(N / RMSNORM_PARTS)
    parts = math.ceil(N / rows_per_part)
    _kernel("rmsnorm", "rmsnorm_backward_weight_part", "PPPPiii")(
        (math.ceil(C / BLOCK), parts), BLOCK, scratch.ptr, dout.ptr, inp.ptr, rstd.ptr, N, C, rows_per_part)
    _kernel("rmsnorm", "column_sum_accumulate", "PPii")(_blocks(C), BLOCK, dweight.ptr, scratch.ptr, parts, C)


# ---- matmul


def matmul(c: DeviceArray, a: DeviceArray, b: DeviceArray, trans_a: bool = False, trans_b: bool = False,
           alpha: float = 1.0, beta: float = 0.0) -> None:
    """c = alpha * op(a) @ op(b) + beta * c over 2D arrays or 3D batches of equal count.
    op(a) is (M, K): a is (M, K), or (K, M) with trans_a; op(b) is (K, N): b is (K, N), or (N, K) with trans_b."""
    batch = c.shape[0] if len(c.shape) == 3 else 1
    M, N = c.shape[-2:]
    K = a.shape[-2] if trans_a else a.shape[-1]
    _check("a", a, ((batch,) if len(c.shape) == 3 else ()) + ((K, M) if trans_a else (M, K)))
    _check("b", b, ((batch,) if len(c.shape) == 3 else ()) + ((N, K) if trans_b else (K, N)))
    _check("c", c, c.shape)
    if trans_a and trans_b:
        raise ValueError("matmul: both operands transposed is not needed by the model and not implemented")
    name = "matmul_tn" if trans_a else "matmul_nt" if trans_b else "matmul_nn"
    grid = (math.ceil(N / 128), math.ceil(M / 128), batch)
    _kernel("matmul", name, "PPPiiiiiiqqqff")(grid, 256, c.ptr, a.ptr, b.ptr, M, N, K, a.shape[-1], b.shape[-1], N,
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
    _check("k", k, (B, KV, T, D))
    _check("v", v, (B, KV, T, D))
    _check("qkv", qkv, (B, T, (H + 2 * KV) * D))
    if cos.shape[0] < T or cos.shape[1:] != (D // 2,) or sin.shape != cos.shape:
        raise ValueError(f"cos/sin: expected (>= {T}, {D // 2}), got {cos.shape} and {sin.shape}")
    return B, T, H, KV, D


def rope_forward(q: DeviceArray, k: DeviceArray, v: DeviceArray, qkv: DeviceArray, cos: DeviceArray,
                 sin: DeviceArray) -> None:
    """qkv (B, T, (H + 2KV) * D) -> head-major q (B, H, T, D), k, v (B, KV, T, D), q and k rotated."""
    B, T, H, KV, D = _rope_shapes(q, k, v, qkv, cos, sin)
    _kernel("rope", "rope_forward", "PPPPPPiiiii")(_blocks(qkv.size // 2), BLOCK, q.ptr, k.ptr, v.ptr, qkv.ptr,
                                                   cos.ptr, sin.ptr, B, T, H, KV, D)


def rope_backward(dqkv: DeviceArray, dq: DeviceArray, dk: DeviceArray, dv: DeviceArray, cos: DeviceArray,
                  sin: DeviceArray) -> None:
    B, T, H, KV, D = _rope_shapes(dq, dk, dv, dqkv, cos, sin)
    _kernel("rope", "rope_backward", "PPPPPPiiiii")(_blocks(dqkv.size // 2), BLOCK, dqkv.ptr, dq.ptr, dk.ptr, dv.ptr,
                                                    cos.ptr, sin.ptr, B, T, H, KV, D)


# ---- attention


def _attention_shapes(q: DeviceArray, k: DeviceArray, v: DeviceArray, att: DeviceArray, heads: DeviceArray):
    B, H, T, D = q.shape
    KV = k.shape[1]
    if KV == 0 or H % KV:
        raise ValueError(f"attention: {H} query heads cannot share {KV} kv heads")
    _check("k", k, (B, KV, T, D))
    _check("v", v, (B, KV, T, D))
    _check("att", att, (B, H, T, T))
    _check("heads scratch", heads, (B, H, T, D))
    return B, H, KV, T, D


def attention_forward(out: DeviceArray, att: DeviceArray, heads: DeviceArray, q: DeviceArray, k: DeviceArray,
                      v: DeviceArray) -> None:
    """out (B, T, H * D) and probabilities att (B, H, T, T); heads (B, H, T, D) is scratch."""
    B, H, KV, T, D = _attention_shapes(q, k, v, att, heads)
    _check("out", out, (B, T, H * D))
    rows = H // KV * T  # the query rows that share one kv head
    att_g, q_g, heads_g = att.reshape(B * KV, rows, T), q.reshape(B * KV, rows, D), heads.reshape(B * KV, rows, D)
    k_g, v_g = k.reshape(B * KV, T, D), v.reshape(B * KV, T, D)
    matmul(att_g, q_g, k_g, trans_b=True, alpha=1 / math.sqrt(D))
    _kernel("attention", "causal_softmax_forward", "Pii")(_blocks(B * H * T, ROWS_PER_BLOCK), BLOCK, att.ptr,
                                                         B * H * T, T)
    matmul(heads_g, att_g, v_g)
    _kernel("attention", "merge_heads", "PPiiii")(_blocks(out.size), BLOCK, out.ptr, heads.ptr, B, H, T, D)


def attention_backward(dq: DeviceArray, dk: DeviceArray, dv: DeviceArray, datt: DeviceArray, dheads: DeviceArray,
                       dout: DeviceArray, q: DeviceArray, k: DeviceArray, v: DeviceArray, att: DeviceArray) -> None:
    """dq (B, H, T, D), dk, dv (B, KV, T, D) from dout (B, T, H * D); datt and dheads are scratch."""
    B, H, KV, T, D = _attention_shapes(q, k, v, att, dheads)
    _check("dq", dq, q.shape)
    _check("dk", dk, k.shape)
    _check("dv", dv, v.shape)
    _check("datt", datt, att.shape)
    _check("dout", dout, (B, T, H * D))
    rows, scale = H // KV * T, 1 / math.sqrt(D)
    _kernel("attention", "split_heads", "PPiiii")(_blocks(dout.size), BLOCK, dheads.ptr, dout.ptr, B, H, T, D)
    att_g, datt_g, dheads_g = att.reshape(B * KV, rows, T), datt.reshape(B * KV, rows, T), dheads.reshape(B * KV, rows, D)
    q_g, dq_g = q.reshape(B * KV, rows, D), dq.reshape(B * KV, rows, D)
    k_g, v_g, dk_g, dv_g = (x.reshape(B * KV, T, D) for x in (k, v, dk, dv))
    matmul(datt_g, dheads_g, v_g, trans_b=True)  # dprobs = dout @ v^T
    _kernel("attention", "causal_softmax_backward", "PPii")(_blocks(B * H * T, ROWS_PER_BLOCK), BLOCK, datt.ptr,
                                                           att.ptr, B * H * T, T)
    matmul(dq_g, datt_g, k_g, alpha=scale)  # dq = dscores @ k
    matmul(dk_g, datt_g, q_g, trans_a=True, alpha=scale)  # dk = dscores^T @ q, summed over the group
    matmul(dv_g, att_g, dheads_g, trans_a=True)  # dv = probs^T @ dout, summed over the group


# ---- flash attention (bf16)


@dataclass(frozen=True)
class FlashSource:
    """Which flash attention build to launch: kernels/flash_attention.cu, or a dev/cuda ladder version."""
    module: str = "flash_attention"
    directory: Path | None = None


@dataclass(frozen=True)
class _FlashLaunch:
    threads: int
    rows: int  # rows of T per CTA
    shared: int  # dynamic shared memory, bytes


_FLASH_CONFIGS = {}


def _flash_config(source: FlashSource, D: int, kernel: str) -> _FlashLaunch:
    """The launch shape of one kernel ('forward', 'dkdv' or 'dq'), from the module's own
    flash_attention_config table, so that tile sizes are defined once, in the .cu file."""
    if source not in _FLASH_CONFIGS:
        rt = runtime()
        pointer, _ = rt.module(source.module, source.directory).get_global("flash_attention_config")
        table = np.empty((2, 9), dtype=np.int32)
        rt.drv.memcpy_dtoh(table, pointer)
        _FLASH_CONFIGS[source] = table
    row = _FLASH_CONFIGS[source][{64: 0, 128: 1}[D]]
    at = 3 * ("forward", "dkdv", "dq").index(kernel)
    return _FlashLaunch(*(int(x) for x in row[at:at + 3]))


def _flash_shapes(qkv: DeviceArray, n_heads: int, n_kv_heads: int) -> tuple[int, int, int, int, int]:
    """B, T, H, KV, D of a packed (B, T, (H + 2KV) * D) bf16 qkv; D must be 64 or 128."""
    H, KV = n_heads, n_kv_heads
    if KV < 1 or H < 1 or H % KV:
        raise ValueError(f"flash attention: {H} query heads cannot share {KV} kv heads")
    if not isinstance(qkv, DeviceArray) or len(qkv.shape) != 3 or qkv.dtype != BF16:
        raise ValueError(f"qkv: expected a bf16 DeviceArray (B, T, (H + 2KV) * D), got {qkv!r}")
    B, T, C = qkv.shape
    if B < 1 or T < 1 or C % (H + 2 * KV) or C // (H + 2 * KV) not in (64, 128):
        raise ValueError(f"qkv: expected (B >= 1, T >= 1, {H + 2 * KV} heads * D) with D 64 or 128, got {qkv.shape}")
    return B, T, H, KV, C // (H + 2 * KV)


def _check_aligned(**arrays: DeviceArray) -> None:
    for name, array in arrays.items():
        if array.ptr % 16:
            raise ValueError(f"{name}: the kernels read 16-byte vectors; the address must be 16-byte aligned")


def flash_attention_forward(out: DeviceArray, lse: DeviceArray, qkv: DeviceArray, n_heads: int, n_kv_heads: int,
                            source: FlashSource = FlashSource()) -> None:
    """Causal grouped-query attention of the packed projection qkv (B, T, (H + 2KV) * D) bf16, q and k
    already rotated: out (B, T, H * D) bf16 and the log-sum-exp of each row of scaled scores lse (B, H, T)."""
    B, T, H, KV, D = _flash_shapes(qkv, n_heads, n_kv_heads)
    _check("out", out, (B, T, H * D), BF16)
    _check("lse", lse, (B, H, T))
    _check_aligned(out=out, qkv=qkv)
    launch = _flash_config(source, D, "forward")
    _kernel(source.module, f"flash_attention_forward_d{D}", "PPPiii", source.directory)(
        (H, B, math.ceil(T / launch.rows)), launch.threads, out.ptr, lse.ptr, qkv.ptr, T, H, KV, shared=launch.shared)


def flash_attention_backward(dqkv: DeviceArray, delta: DeviceArray, dout: DeviceArray, out: DeviceArray,
                             lse: DeviceArray, qkv: DeviceArray, n_heads: int, n_kv_heads: int,
                             cos: DeviceArray | None = None, sin: DeviceArray | None = None,
                             source: FlashSource = FlashSource()) -> None:
    """dqkv (B, T, (H + 2KV) * D) bf16, packed like qkv, from dout (B, T, H * D) and the forward's out and
    lse; delta (B, H, T) float32 is scratch. Deterministic. With cos/sin (>= T, D/2) float32, dq and dk
    are rotated back by RoPE (dqkv is then the gradient of the projection before RoPE)."""
    B, T, H, KV, D = _flash_shapes(qkv, n_heads, n_kv_heads)
    _check("dqkv", dqkv, qkv.shape, BF16)
    _check("dout", dout, (B, T, H * D), BF16)
    _check("out", out, (B, T, H * D), BF16)
    _check("lse", lse, (B, H, T))
    _check("delta", delta, (B, H, T))
    _check_aligned(dqkv=dqkv, dout=dout, out=out, qkv=qkv)
    if (cos is None) != (sin is None):
        raise ValueError("cos and sin: pass both (fused inverse RoPE) or neither")
    if cos is not None:
        rows = cos.shape[0] if isinstance(cos, DeviceArray) and len(cos.shape) == 2 else 0
        if rows < T:
            raise ValueError(f"cos: expected float32 (>= {T}, {D // 2}), got {cos!r}")
        _check("cos", cos, (rows, D // 2))
        _check("sin", sin, (rows, D // 2))
    cos_ptr, sin_ptr = (0, 0) if cos is None else (cos.ptr, sin.ptr)
    _kernel(source.module, "flash_attention_backward_delta", "PPPiiii", source.directory)(
        _blocks(B * T * H, ROWS_PER_BLOCK), BLOCK, delta.ptr, dout.ptr, out.ptr, B * T * H, T, H, D)
    args = (dqkv.ptr, dout.ptr, qkv.ptr, lse.ptr, delta.ptr, cos_ptr, sin_ptr, T, H, KV)
    dkdv = _flash_config(source, D, "dkdv")
    _kernel(source.module, f"flash_attention_backward_dkdv_d{D}", "PPPPPPPiii", source.directory)(
        (KV, B, math.ceil(T / dkdv.rows)), dkdv.threads, *args, shared=dkdv.shared)
    dq = _flash_config(source, D, "dq")
    _kernel(source.module, f"flash_attention_backward_dq_d{D}", "PPPPPPPiii", source.directory)(
        (H, B, math.ceil(T / dq.rows)), dq.threads, *args, shared=dq.shared)


# ---- swiglu, residual


def swiglu_forward(out: DeviceArray, gate_up: DeviceArray) -> None:
    """out (N, F) = silu(gate) * up, gate_up (N, 2F)."""
    N, F = out.shape
    _check("gate_up", gate_up, (N, 2 * F))
    _kernel("swiglu", "swiglu_forward", "PPii")(_blocks(N * F), BLOCK, out.ptr, gate_up.ptr, N, F)


def swiglu_backward(dgate_up: DeviceArray, dout: DeviceArray, gate_up: DeviceArray) -> None:
    N, F = dout.shape
    _check("gate_up", gate_up, (N, 2 * F))
    _check("dgate_up", dgate_up, (N, 2 * F))
    _kernel("swiglu", "swiglu_backward", "PPPii")(_blocks(N * F), BLOCK, dgate_up.ptr, dout.ptr, gate_up.ptr, N, F)


def residual_forward(out: DeviceArray, x: DeviceArray, branch: DeviceArray) -> None:
    _check("x", x, out.shape)
    _check("branch", branch, out.shape)
    _kernel("residual", "residual_forward", "PPPq")(_blocks(out.size), BLOCK, out.ptr, x.ptr, branch.ptr, out.size)


# ---- loss, grad norm, optimizer


def fused_classifier(logits: DeviceArray, losses: DeviceArray, targets: DeviceArray, dloss: float) -> None:
    """losses (N,) of the (N, V) logits; the logits are overwritten by dlogits = (softmax - onehot) * dloss."""
    N, V = logits.shape
    _check("losses", losses, (N,))
    _check("targets", targets, (N,), I32)
    _kernel("classifier", "fused_classifier", "PPPif")((N,), CLASSIFIER_BLOCK, logits.ptr, losses.ptr, targets.ptr,
                                                       V, np.float32(dloss))


def global_norm_squared(out: DeviceArray, partial: DeviceArray, x: DeviceArray) -> None:
    """out (1,) = sum(x^2), deterministic; partial (NORM_BLOCKS,) is scratch."""
    _check("out", out, (1,))
    _check("partial", partial, (NORM_BLOCKS,))
    _kernel("global_norm", "global_norm_partial", "PPq")((NORM_BLOCKS,), BLOCK, partial.ptr, x.ptr, x.size)
    _kernel("global_norm", "global_norm_finish", "PPi")((1,), 1024, out.ptr, partial.ptr, NORM_BLOCKS)


def adamw_update(params: DeviceArray, grads: DeviceArray, m: DeviceArray, v: DeviceArray, decay_mask: DeviceArray,
                 norm_squared: DeviceArray, step: int, lr: float, opt: AdamWConfig) -> None:
    """One AdamW step (step counts from 1), gradients clipped to opt.grad_clip by the device-side norm."""
    n = params.size
    for name, array in (("grads", grads), ("m", m), ("v", v)):
        _check(name, array, params.shape)
    _check("decay_mask", decay_mask, params.shape, U8)
    _check("norm_squared", norm_squared, (1,))
    _kernel("adamw", "adamw_update", "PPPPPPqffffffff")(
        _blocks(n), BLOCK, params.ptr, grads.ptr, m.ptr, v.ptr, decay_mask.ptr, norm_squared.ptr, n,
        *(np.float32(x) for x in (lr, opt.beta1, opt.beta2, opt.eps, opt.weight_decay, 1 - opt.beta1 ** step,
                                  1 - opt.beta2 ** step, opt.grad_clip)))

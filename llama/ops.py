"""One Python launcher per CUDA kernel, named like the numpy reference's layer functions.

Each launcher checks the shapes and dtypes of its device arrays, raises ValueError on a mismatch,
and launches asynchronously. Outputs come first in the argument list, as in llm.c.
Gradient outputs of parameters (dweight) are accumulated (+=), activations' gradients are
overwritten except where the docstring says `+=`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from .cuda import BF16, DeviceArray, runtime
from .optim import AdamWConfig

F32, F64, I32, U8 = np.dtype(np.float32), np.dtype(np.float64), np.dtype(np.int32), np.dtype(np.uint8)
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


# ---- matmul in bf16 on tensor cores (kernels/gemm_*.cu)

GEMM_EPILOGUES = {"bf16": 0, "f32": 1, "acc_f32": 2, "rope_bf16": 3}  # kernels/gemm_epilogue.cuh


@dataclass(frozen=True)
class GemmProblem:
    """One strided-batched GEMM as the kernels see it: pointers, sizes, leading dimensions (elements),
    batch strides, the epilogue. layout: 'nt' (A (M, K), B (N, K)), 'nn' (B (K, N)), 'tn' (A (K, M))."""
    layout: str
    batch: int
    M: int
    N: int
    K: int
    a: int
    lda: int
    stride_a: int
    b: int
    ldb: int
    stride_b: int
    c: int
    stride_c: int
    mode: str
    alpha: float
    cos: int = 0
    sin: int = 0
    rope_T: int = 1
    rope_cols: int = 0
    head_dim: int = 2

    def epilogue_args(self) -> tuple:
        """The kernels' trailing arguments: ldc, mode, rope_T, rope_cols, head_dim, alpha."""
        return (self.N, GEMM_EPILOGUES[self.mode], self.rope_T, self.rope_cols, self.head_dim,
                np.float32(self.alpha))


def gemm(c: DeviceArray, a: DeviceArray, b: DeviceArray, trans_a: bool = False, trans_b: bool = False,
         alpha: float = 1.0, accumulate: bool = False, rope: tuple | None = None, version: str | None = None) -> None:
    """c = alpha * op(a) @ op(b) with bf16 a, b and fp32 accumulation, over 2D arrays or 3D batches.
    op(a) is (M, K): a is (M, K), or (K, M) with trans_a; op(b) is (K, N): b is (K, N), or (N, K) with trans_b.
    c is bf16 or fp32; accumulate (fp32 c only) adds onto c instead of overwriting it, and alpha = 0
    then leaves c untouched. rope = (cos, sin, T, rotated_columns) rotates the first columns of a
    (tokens, heads * D) bf16 output by RoPE at position row % T (the QKV projection).
    version: 'mma', 'wgmma' or 'wgmma3'; None takes the device's best (llama.device.gemm_version)."""
    batched = len(c.shape) == 3
    batch = c.shape[0] if batched else 1
    M, N = c.shape[-2:]
    K = a.shape[-2] if trans_a else a.shape[-1]
    lead = (batch,) if batched else ()
    _check("a", a, lead + ((K, M) if trans_a else (M, K)), BF16)
    _check("b", b, lead + ((N, K) if trans_b else (K, N)), BF16)
    if trans_a and trans_b:
        raise ValueError("gemm: op(a)^T with op(b)^T is not a layout the model needs")
    if c.dtype not in (BF16, F32) or (accumulate and c.dtype != F32) or (rope is not None and c.dtype != BF16):
        raise ValueError(f"gemm: c must be bf16 or fp32, fp32 to accumulate, bf16 with rope; got {c.dtype}")
    if min(M, N, K) < 1:
        raise ValueError(f"gemm: empty problem M={M} N={N} K={K}")
    for name, array in (("a", a), ("b", b), ("c", c)):
        if array.ptr % 16 or array.shape[-1] % 8:
            raise ValueError(f"gemm: {name} {array.shape} needs a 16-byte aligned start and rows of a multiple of "
                             f"8 elements (16 bytes); got row length {array.shape[-1]}")
    if accumulate and alpha == 0:
        return
    mode = "acc_f32" if accumulate else "rope_bf16" if rope is not None else "bf16" if c.dtype == BF16 else "f32"
    rope_args = {}
    if rope is not None:
        cos, sin, rope_T, rope_cols = rope
        head_dim = 2 * cos.shape[1]
        if cos.shape[0] < rope_T or sin.shape != cos.shape or cos.dtype != F32 or rope_cols % head_dim or M % rope_T:
            raise ValueError("gemm: rope needs fp32 cos/sin (>= T, D/2), rows = batches of T tokens, whole heads")
        rope_args = dict(cos=cos.ptr, sin=sin.ptr, rope_T=rope_T, rope_cols=rope_cols, head_dim=head_dim)
    layout = "tn" if trans_a else "nt" if trans_b else "nn"
    problem = GemmProblem(layout, batch, M, N, K, a.ptr, a.shape[-1], M * K, b.ptr, b.shape[-1], K * N, c.ptr, M * N,
                          mode, alpha, **rope_args)
    if version is None:
        from .device import gemm_version
        version = gemm_version(M, N, K)
    launch = _gemm_launcher(version)
    if version == "wgmma3":
        from .gemm_wgmma import splitk_splits3
        splits = splitk_splits3(problem, multiprocessors())
    else:
        splits = _splitk_splits(problem)
    if splits == 1:
        launch(problem)
        return
    # Split-K for weight gradients with few output tiles: partial products over ranges of K, summed in
    # a fixed order (deterministic, no atomics). Version 3 splits K inside the kernel (any count);
    # the others run the splits as a batch over K / splits rows each.
    partial = _workspace(splits * M * N)
    partials = replace(problem, c=partial.ptr, mode="f32", alpha=1.0)
    if version == "wgmma3":
        launch(partials, splits=splits)
    else:
        part_k = K // splits
        launch(replace(partials, batch=splits, K=part_k, stride_a=part_k * M, stride_b=part_k * N))
    _kernel("gemm_mma", "gemm_splitk_reduce", "PPqiif")(_blocks(M * N), BLOCK, c.ptr, partial.ptr, M * N, splits,
                                                        int(accumulate), np.float32(alpha))


def _gemm_launcher(version: str):
    if version == "mma":
        return gemm_mma
    if version == "wgmma":
        from .gemm_wgmma import gemm_wgmma
        return gemm_wgmma
    if version == "wgmma3":
        from .gemm_wgmma import gemm_wgmma3
        return gemm_wgmma3
    raise ValueError(f"gemm: unknown version {version!r} (mma, wgmma, wgmma3)")


def _splitk_splits(p: GemmProblem) -> int:
    """How many K splits a weight-gradient GEMM (tn, fp32 out, one batch) needs to fill the GPU."""
    if p.layout != "tn" or p.batch != 1 or p.mode not in ("f32", "acc_f32"):
        return 1
    tiles, sms, splits = math.ceil(p.M / 128) * math.ceil(p.N / 128), multiprocessors(), 1
    while tiles * splits < sms and p.K % (2 * splits) == 0 and p.K // (2 * splits) >= 1024:
        splits *= 2
    return splits


_WORKSPACE = {}


def _workspace(size: int) -> DeviceArray:
    """Scratch for split-K partials, grown on demand (the first step allocates it, not later ones)."""
    if _WORKSPACE.get("array") is None or _WORKSPACE["array"].size < size:
        from .cuda import empty
        _WORKSPACE["array"] = empty(size)
    return _WORKSPACE["array"]


def multiprocessors() -> int:
    from pycuda.driver import device_attribute
    return runtime().device.get_attribute(device_attribute.MULTIPROCESSOR_COUNT)


def gemm_mma(p: GemmProblem, tile: str | None = None) -> None:
    """Version 1 (mma.sync, any GPU from sm_80)."""
    if tile is None:  # the wide tile once there are enough of them to fill the GPU twice over
        tile = "128x256" if math.ceil(p.M / 128) * math.ceil(p.N / 256) * p.batch >= 2 * multiprocessors() else "128x128"
    bn, stages = (256, 3) if tile == "128x256" else (128, 4)
    grid = (math.ceil(p.M / 128) * math.ceil(p.N / bn), 1, p.batch)
    _kernel("gemm_mma", f"gemm_mma_{p.layout}_{tile}", "PPPPPqqqiiiiiiiiiif")(
        grid, 256, p.c, p.a, p.b, p.cos, p.sin, p.stride_a, p.stride_b, p.stride_c, p.M, p.N, p.K, p.lda, p.ldb,
        *p.epilogue_args(), shared=stages * (128 + bn) * 64 * 2)


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


# ---- bf16 mixed precision
#
# Activations are bf16 (llama.cuda.BF16); weights are read from the bf16 copy that adamw_update_bf16
# writes next to the fp32 master weights; weight gradients, rstd, losses and the optimizer state are
# fp32. The kernels move 16-byte vectors (8 bf16 or 4 fp32), so rows hold a multiple of 8 elements
# and arrays start 16-byte aligned (allocations do, and views at offsets that are multiples of 8
# elements). Scratch buffers that hold completion counters are allocated zeroed once
# (llama.cuda.zeros); every launch leaves the counters at zero again.

EMBEDDING_SEGMENT = 16  # positions per segment, as in kernels/embedding.cu
EMBEDDING_FORWARD_VECTORS = 4  # 16-byte vectors per thread of embedding_forward_bf16, as in kernels/embedding.cu
RMSNORM_BF16_PARTS, RMSNORM_BF16_GROUP = 256, 16  # fixed row partition of the dweight sums, and its grouping
GRAD_NORM_BLOCKS = 512  # fixed, so that the grad norm is the same on every GPU
ADAMW_SCALARS = 3  # lr, 1 - beta1^step, 1 - beta2^step


def _check_vectors(row: int, **arrays: DeviceArray) -> None:
    """Rows of a multiple of 8 elements and 16-byte aligned arrays, for 16-byte vector accesses."""
    if row % 8:
        raise ValueError(f"bf16 kernels need rows of a multiple of 8 elements, got {row}")
    for name, array in arrays.items():
        if array.ptr % 16:
            raise ValueError(f"{name}: must start 16-byte aligned, starts at {array.ptr:#x}")


def _row_block(C: int, threads: int) -> tuple[int, int]:
    """A 2D block (threads per row, rows): one thread per 8 columns, in whole warps, about `threads` in all."""
    if not 0 < C <= 8192:
        raise ValueError(f"bf16 row kernels take 0 < C <= 8192 columns, got {C}")
    per_row = 32 * math.ceil(C / 256)
    return per_row, max(1, threads // per_row)


def embedding_forward_bf16(out: DeviceArray, tokens: DeviceArray, wte: DeviceArray) -> None:
    """out (N, C) = wte[tokens], bf16 (wte is the bf16 copy of the table)."""
    N, (V, C) = tokens.size, wte.shape
    _check("tokens", tokens, tokens.shape, I32)
    _check("wte", wte, (V, C), BF16)
    _check("out", out, (N, C), BF16)
    _check_vectors(C, out=out, wte=wte)
    _kernel("embedding", "embedding_forward_bf16", "PPPii")(_blocks(N * C // 8, BLOCK * EMBEDDING_FORWARD_VECTORS),
                                                             BLOCK, out.ptr, tokens.ptr, wte.ptr, N, C)


def token_segments(tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Host side of embedding_backward_bf16, for N positions: `order` (N,) int32, the positions grouped
    by token (stable), and `segments` (N, 4) int32, one row per segment of at most EMBEDDING_SEGMENT
    positions of one token: {group begin, group end (indices into order), token, index of the segment
    in its group}. Tokens with several segments come first (most first); unused rows are zero. The
    shapes depend on N only, so the uploads fit a captured graph."""
    flat = tokens.ravel().astype(np.int64)
    N = flat.size
    order = np.sort(flat * N + np.arange(N)) % N  # a stable argsort by one sort of unique keys (faster)
    ids = flat[order]
    begins = np.flatnonzero(np.concatenate([[True], ids[1:] != ids[:-1]]))  # one sort serves the groups too
    unique, counts = ids[begins], np.diff(np.append(begins, flat.size))
    per_group = -(-counts // EMBEDDING_SEGMENT)
    several = np.flatnonzero(per_group > 1)  # most segments first, then the one-segment groups in order
    groups = np.concatenate([several[np.argsort(-per_group[several], kind="stable")], np.flatnonzero(per_group == 1)])
    per_group = per_group[groups]
    order = order.astype(np.int32)
    group = np.repeat(groups, per_group)
    index = np.arange(len(group)) - np.repeat(np.cumsum(per_group) - per_group, per_group)
    segments = np.zeros((N, 4), dtype=np.int32)
    for column, values in enumerate((begins[group], begins[group] + counts[group], unique[group], index)):
        segments[:len(group), column] = values
    return order, segments


def _embedding_partial_rows(N: int) -> int:
    """A bound on the segments of tokens with more than one (each has > EMBEDDING_SEGMENT positions)."""
    return 2 * N // EMBEDDING_SEGMENT + 1


def embedding_bf16_scratch_size(N: int, C: int) -> int:
    """float32 elements of embedding_backward_bf16's scratch: partial rows, then counters."""
    rows = _embedding_partial_rows(N)
    return rows * C + rows


def embedding_backward_bf16(dwte: DeviceArray, dout: DeviceArray, order: DeviceArray, segments: DeviceArray,
                            scratch: DeviceArray) -> None:
    """dwte (V, C) fp32 += the bf16 dout (N, C) rows grouped by token, deterministic; order and segments
    from token_segments(); scratch float32 (embedding_bf16_scratch_size(N, C),), zeroed once."""
    N, C = dout.shape
    _check("dout", dout, (N, C), BF16)
    _check("dwte", dwte, (dwte.shape[0], C))
    _check("order", order, (N,), I32)
    _check("segments", segments, (N, 4), I32)
    size = embedding_bf16_scratch_size(N, C)
    if scratch.dtype != F32 or scratch.size < size:
        raise ValueError(f"scratch: needs {size} float32, has {scratch.size} {scratch.dtype}")
    if C > 8192:
        raise ValueError(f"embedding_backward_bf16 takes C <= 8192, got {C}")
    _check_vectors(C, dwte=dwte, dout=dout, segments=segments, scratch=scratch)
    counters = scratch.ptr + _embedding_partial_rows(N) * C * 4
    _kernel("embedding", "embedding_backward_bf16", "PPPPPPi")((N,), C // 8, dwte.ptr, scratch.ptr, counters, dout.ptr,
                                                                order.ptr, segments.ptr, C)


def rmsnorm_residual_forward(residual_out: DeviceArray | None, ln_out: DeviceArray, rstd: DeviceArray,
                             x: DeviceArray, branch: DeviceArray | None, weight: DeviceArray, eps: float) -> None:
    """residual_out (N, C) = x + branch, and ln_out = rmsnorm(residual_out) * weight, all bf16, with
    rstd (N,) fp32; weight is the fp32 master weight. branch=None with residual_out=None: a plain RMSNorm
    of x. residual_out may be x."""
    N, C = x.shape
    if (branch is None) != (residual_out is None):
        raise ValueError("rmsnorm_residual_forward: give both branch and residual_out, or neither")
    named = {"x": x, "ln_out": ln_out} | ({} if branch is None else {"branch": branch, "residual_out": residual_out})
    for name, array in named.items():
        _check(name, array, (N, C), BF16)
    _check("rstd", rstd, (N,))
    _check("weight", weight, (C,))
    _check_vectors(C, weight=weight, **named)
    per_row, rows = _row_block(C, BLOCK)
    _kernel("rmsnorm", "rmsnorm_residual_forward", "PPPPPPiif")(
        (math.ceil(N / rows),), (per_row, rows), 0 if residual_out is None else residual_out.ptr, ln_out.ptr, rstd.ptr,
        x.ptr, 0 if branch is None else branch.ptr, weight.ptr, N, C, np.float32(eps))


def rmsnorm_forward_bf16(out: DeviceArray, rstd: DeviceArray, inp: DeviceArray, weight: DeviceArray,
                         eps: float) -> None:
    """out (N, C) = rmsnorm(inp) * weight, bf16; rstd (N,) fp32 (the first norm, with no residual add)."""
    rmsnorm_residual_forward(None, out, rstd, inp, None, weight, eps)


def rmsnorm_bf16_scratch_size(C: int) -> int:
    """float32 elements of rmsnorm_backward_bf16's scratch: partial and group sums, then counters."""
    groups = RMSNORM_BF16_PARTS // RMSNORM_BF16_GROUP
    return (RMSNORM_BF16_PARTS + groups) * C + groups + 1


def rmsnorm_backward_bf16(dresidual: DeviceArray, dweight: DeviceArray, scratch: DeviceArray, dln: DeviceArray,
                          h: DeviceArray, weight: DeviceArray, rstd: DeviceArray) -> None:
    """dresidual (N, C) bf16 += the norm's input gradient (the residual gradient passes the add
    unchanged), dweight (C,) fp32 += its gradient, deterministic, in one launch; h is the norm's bf16
    input, weight its fp32 master weight. scratch float32 (rmsnorm_bf16_scratch_size(C),), zeroed once."""
    N, C = h.shape
    for name, array in (("dresidual", dresidual), ("dln", dln), ("h", h)):
        _check(name, array, (N, C), BF16)
    _check("dweight", dweight, (C,))
    _check("weight", weight, (C,))
    _check("rstd", rstd, (N,))
    size = rmsnorm_bf16_scratch_size(C)
    if scratch.dtype != F32 or scratch.size < size:
        raise ValueError(f"scratch: needs {size} float32, has {scratch.size} {scratch.dtype}")
    _check_vectors(C, dresidual=dresidual, dweight=dweight, dln=dln, h=h, weight=weight, scratch=scratch)
    per_row, rows = _row_block(C, 512)
    parts, groups = RMSNORM_BF16_PARTS, RMSNORM_BF16_PARTS // RMSNORM_BF16_GROUP
    group_partial, counters = scratch.ptr + parts * C * 4, scratch.ptr + (parts + groups) * C * 4
    _kernel("rmsnorm", "rmsnorm_backward_bf16", "PPPPPPPPPiiii")(
        (parts,), (per_row, rows), dresidual.ptr, dweight.ptr, scratch.ptr, group_partial, counters, dln.ptr, h.ptr,
        weight.ptr, rstd.ptr, N, C, max(1, math.ceil(N / parts)), RMSNORM_BF16_GROUP, shared=rows * C * 4)


def swiglu_forward_bf16(out: DeviceArray, gate_up: DeviceArray) -> None:
    """out (N, F) = silu(gate) * up of gate_up (N, 2F) = [gate | up], bf16."""
    N, F = out.shape
    _check("out", out, (N, F), BF16)
    _check("gate_up", gate_up, (N, 2 * F), BF16)
    _check_vectors(F, out=out, gate_up=gate_up)
    _kernel("swiglu", "swiglu_forward_bf16", "PPii")(_blocks(N * F // 8), BLOCK, out.ptr, gate_up.ptr, N, F)


def swiglu_backward_bf16(dgate_up: DeviceArray, dout: DeviceArray, gate_up: DeviceArray) -> None:
    """dgate_up (N, 2F) bf16 from dout (N, F); dgate_up may be gate_up itself (in place)."""
    N, F = dout.shape
    _check("dout", dout, (N, F), BF16)
    _check("gate_up", gate_up, (N, 2 * F), BF16)
    _check("dgate_up", dgate_up, (N, 2 * F), BF16)
    _check_vectors(F, dout=dout, gate_up=gate_up, dgate_up=dgate_up)
    _kernel("swiglu", "swiglu_backward_bf16", "PPPii")(_blocks(N * F // 8), BLOCK, dgate_up.ptr, dout.ptr, gate_up.ptr,
                                                       N, F)


def _max_shared_bytes() -> int:
    """Dynamic shared memory one block may opt in to on this GPU, less room for static shared memory."""
    drv = runtime().drv
    return runtime().device.get_attribute(drv.device_attribute.MAX_SHARED_MEMORY_PER_BLOCK_OPTIN) - 1024


def fused_classifier_bf16(logits: DeviceArray, losses: DeviceArray, targets: DeviceArray, dloss: float) -> None:
    """For a chunk of n tokens: losses (n,) fp32 of the bf16 logits (n, V), any V; the logits are
    overwritten by dlogits = (softmax - onehot) * dloss in bf16."""
    n, V = logits.shape
    _check("logits", logits, (n, V), BF16)
    _check("losses", losses, (n,))
    _check("targets", targets, (n,), I32)
    # thread t keeps vectors t + k * CLASSIFIER_BLOCK of a row: as many slots as shared memory holds,
    # then CLASSIFIER_REG_VECTORS in registers (kernels/classifier.cu); one block per multiprocessor
    smem_slots = min(math.ceil(V // 8 / CLASSIFIER_BLOCK), _max_shared_bytes() // (16 * CLASSIFIER_BLOCK))
    _kernel("classifier", "fused_classifier_bf16", "PPPiifi")(
        (max(1, min(n, multiprocessors())),), CLASSIFIER_BLOCK, logits.ptr, losses.ptr, targets.ptr, n, V,
        np.float32(dloss), smem_slots, shared=smem_slots * CLASSIFIER_BLOCK * 16)


def loss_accumulate(total: DeviceArray, losses: DeviceArray, scale: float) -> None:
    """total (1,) += scale * sum(losses (n,)), fp32, in a fixed order."""
    _check("total", total, (1,))
    _check("losses", losses, (losses.size,))
    _kernel("classifier", "loss_accumulate", "PPif")((1,), 1024, total.ptr, losses.ptr, losses.size, np.float32(scale))


def grad_norm_squared(out: DeviceArray, scratch: DeviceArray, grads: DeviceArray) -> None:
    """out (1,) = sum(grads^2) of the flat fp32 gradients, deterministic, in one launch; scratch
    float64 (GRAD_NORM_BLOCKS + 1,), zeroed once (its last word holds the completion counter)."""
    _check("out", out, (1,))
    _check("scratch", scratch, (GRAD_NORM_BLOCKS + 1,), F64)
    _check("grads", grads, grads.shape)
    _check_vectors(8, grads=grads, scratch=scratch)
    _kernel("global_norm", "grad_norm_squared", "PPPPq")((GRAD_NORM_BLOCKS,), BLOCK, out.ptr, scratch.ptr,
                                                         scratch.ptr + GRAD_NORM_BLOCKS * 8, grads.ptr, grads.size)


def adamw_scalars(step: int, lr: float, opt: AdamWConfig) -> np.ndarray:
    """The step-dependent values adamw_update_bf16 reads on the device (step counts from 1)."""
    return np.array([lr, 1 - opt.beta1 ** step, 1 - opt.beta2 ** step], dtype=np.float32)


def adamw_update_bf16(params: DeviceArray, params_bf16: DeviceArray, grads: DeviceArray, m: DeviceArray,
                      v: DeviceArray, decay_mask: DeviceArray, norm_squared: DeviceArray, scalars: DeviceArray,
                      opt: AdamWConfig) -> None:
    """adamw_update on the fp32 flat buffers, clipped to opt.grad_clip by the device-side norm, writing
    the bf16 copy params_bf16 of the new params in the same pass; scalars (ADAMW_SCALARS,) fp32 on the
    device holds adamw_scalars(step, lr, opt)."""
    n = params.size
    _check("params", params, (n,))
    _check("params_bf16", params_bf16, (n,), BF16)
    for name, array in (("grads", grads), ("m", m), ("v", v)):
        _check(name, array, (n,))
    _check("decay_mask", decay_mask, (n,), U8)
    _check("norm_squared", norm_squared, (1,))
    _check("scalars", scalars, (ADAMW_SCALARS,))
    _check_vectors(8, params=params, params_bf16=params_bf16, grads=grads, m=m, v=v, decay_mask=decay_mask)
    _kernel("adamw", "adamw_update_bf16", "PPPPPPPPqfffff")(
        _blocks(n, BLOCK * 8), BLOCK, params.ptr, params_bf16.ptr, grads.ptr, m.ptr, v.ptr, decay_mask.ptr,
        norm_squared.ptr, scalars.ptr, n, *(np.float32(x) for x in (opt.beta1, opt.beta2, opt.eps, opt.weight_decay,
                                                                     opt.grad_clip)))

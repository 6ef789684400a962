"""Launchers of the decoder's skinny GEMMs (kernels/gemv.cu): out (B, N) = x (B, K) @ W^T for 1 to 16
sequences, W (N, K) bf16, with the epilogue of the layer that follows fused in: the head's logits,
a residual add (and the stream's sums of squares for the next RMSNorm), SwiGLU of gate+up, RoPE with
the KV-cache write.

The GEMVs that read the fp32 residual stream normalize it on the way in (StreamNorm): its RMSNorm
weight and the partial sums of squares that the kernel that wrote the stream left (embed_tokens and
last_residual one per sequence, gemv_residual one per block). Every launch takes one DecodeScratch."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..runtime.cuda import BF16, DeviceArray, runtime, zeros
from .common import F32, I32, U32, check, check_aligned, kernel, kernel_constant, multiprocessors

GEMV_ROWS = kernel_constant("gemv", "GEMV_ROWS")  # rows of W per tile (SwiGLU: 16 gate rows and their 16 up rows)
GEMV_THREADS = kernel_constant("gemv", "GEMV_THREADS")
MAX_BATCH = kernel_constant("gemv", "GEMV_MAX_BATCH")
MAX_SPLITS = kernel_constant("gemv", "GEMV_MAX_SPLITS")  # blocks of a tile: a cluster (8 is the portable size)
SPLIT_K = 512  # the K a block's warps load in one round (4 warps x 4 k-steps of 32)

# kernels/gemv.cu's GemvArgs, field for field (align=True lays it out as the C compiler does)
GEMV_ARGS = np.dtype([
    ("w", "u8"), ("x", "u8"), ("norm_weight", "u8"), ("squares", "u8"), ("slots", "i4"), ("eps", "f4"),
    ("B", "i4"), ("N", "i4"), ("K", "i4"), ("second", "i4"), ("splits", "i4"),
    ("out_f32", "u8"), ("out_bf16", "u8"), ("squares_out", "u8"), ("q_out", "u8"), ("k_cache", "u8"),
    ("v_cache", "u8"), ("cos_table", "u8"), ("sin_table", "u8"), ("position", "u8"), ("H", "i4"), ("KV", "i4"),
    ("D", "i4"), ("T_max", "i4")], align=True)


@dataclass(frozen=True)
class StreamNorm:
    """The RMSNorm a GEMV applies to the fp32 residual stream (B, K) on the way in: weight (K,) fp32, and
    the stream's sums of squares as `slots` partial sums per sequence, the first slots * B values of
    squares ((slots, B) fp32), from the kernel that wrote the stream."""
    weight: DeviceArray
    squares: DeviceArray
    slots: int
    eps: float


class DecodeScratch:
    """What the decode step's launches share: the residual stream's partial sums of squares (written
    by one launch, read by the next), and the attention's partial results and counters (zeroed once;
    each launch leaves them zeroed)."""

    def __init__(self, max_rows: int, attention_records: int):
        """max_rows: the most rows of a residual GEMV (the model dim); attention_records: fp32 values
        of the attention's partial results (ops.decode.attention_scratch_size)."""
        self.partial = zeros(max(1, attention_records), F32)
        self.counters = zeros(multiprocessors(), U32)  # one per (sequence, head) of a split attention: fewer
        # than the multiprocessors, or it is not split (ops.decode.attention_splits)
        self.squares = zeros(math.ceil(max_rows / GEMV_ROWS) * MAX_BATCH, F32)


def gemv_splits(tiles: int, K: int) -> int:
    """Blocks per tile (1, 2, 4 or 8, a cluster; 1 before sm_90). A grid of two tiles per multiprocessor
    or more is not split; else each block takes at most SPLIT_K of K (one round of loads per warp),
    while the grid stays within what the GPU holds at once (4 blocks per multiprocessor)."""
    if runtime().device.compute_capability() < (9, 0) or tiles >= 2 * multiprocessors():
        return 1
    splits = 1
    while splits < MAX_SPLITS and K > splits * SPLIT_K and tiles * 2 * splits <= 4 * multiprocessors():
        splits *= 2
    return splits


def _launch(entry: str, x: DeviceArray, w: DeviceArray, N: int, tiles: int, second: int, norm: StreamNorm | None,
            **fields) -> None:
    B, K = x.shape
    if not 1 <= B <= MAX_BATCH:
        raise ValueError(f"gemv: batch {B} outside 1..{MAX_BATCH}")
    if K % 8 or w.shape[1] != K or w.dtype != BF16:
        raise ValueError(f"gemv: W must be bf16 (rows, K={K}) with K a multiple of 8, got {w.dtype} {w.shape}")
    check_aligned(w=w, x=x)
    args = np.zeros((), GEMV_ARGS)
    if norm is not None:
        check("x", x, (B, K), F32)
        check("norm_weight", norm.weight, (K,), F32)
        if norm.slots < 1 or norm.slots * B > norm.squares.size or norm.squares.dtype != F32:
            raise ValueError(f"gemv: squares must hold {norm.slots} x {B} float32 sums, got {norm.squares!r}")
        args["norm_weight"], args["squares"], args["slots"], args["eps"] = (norm.weight.ptr, norm.squares.ptr,
                                                                            norm.slots, norm.eps)
    else:
        check("x", x, (B, K), BF16)
    splits = gemv_splits(tiles, K)
    args["w"], args["x"], args["B"], args["N"], args["K"], args["second"] = w.ptr, x.ptr, B, N, K, second
    args["splits"] = splits
    for name, value in fields.items():
        args[name] = value
    suffix = "b8" if B <= 8 else "b16"
    kernel("gemv", f"{entry}_{suffix}", f"{GEMV_ARGS.itemsize}s")(
        (tiles, splits), GEMV_THREADS, args.tobytes(), dependent=True, cluster=(1, splits, 1) if splits > 1 else None)


def gemv_logits(out: DeviceArray, x: DeviceArray, w: DeviceArray, norm: StreamNorm) -> None:
    """out (B, N) fp32 = rmsnorm(x) @ W^T: x (B, K) the fp32 residual stream."""
    N = w.shape[0]
    check("out", out, (x.shape[0], N), F32)
    _launch("gemv_store_norm", x, w, N, math.ceil(N / GEMV_ROWS), 16, norm, out_f32=out.ptr)


def gemv_residual(stream: DeviceArray, squares: DeviceArray, x: DeviceArray, w: DeviceArray) -> int:
    """stream (B, N) fp32 += x @ W^T (x (B, K) bf16), and squares (slots, B) fp32: partial sums of the new
    stream's squares, for the next RMSNorm (StreamNorm). Returns slots."""
    B, N = x.shape[0], w.shape[0]
    check("stream", stream, (B, N), F32)
    tiles = math.ceil(N / GEMV_ROWS)
    if tiles * B > squares.size or squares.dtype != F32:
        raise ValueError(f"gemv_residual: squares must hold {tiles} x {B} float32 sums, got {squares!r}")
    _launch("gemv_residual", x, w, N, tiles, 16, None, out_f32=stream.ptr, squares_out=squares.ptr)
    return tiles


def gemv_swiglu(out: DeviceArray, x: DeviceArray, w13: DeviceArray, norm: StreamNorm) -> None:
    """out (B, F) bf16 = silu(gate) * up, [gate | up] = rmsnorm(x) @ w13^T, w13 (2F, K)."""
    B, F = x.shape[0], w13.shape[0] // 2
    if w13.shape[0] != 2 * F:
        raise ValueError(f"gemv_swiglu: w13 must have an even number of rows, got {w13.shape}")
    check("out", out, (B, F), BF16)
    _launch("gemv_swiglu_norm", x, w13, F, math.ceil(F / 16), F, norm, out_bf16=out.ptr)


def gemv_qkv_rope(q: DeviceArray, k_cache: DeviceArray, v_cache: DeviceArray, x: DeviceArray, wqkv: DeviceArray,
                  norm: StreamNorm, cos: DeviceArray, sin: DeviceArray, position: DeviceArray) -> None:
    """[q | k | v] = rmsnorm(x) @ wqkv^T; q, k rotated at position p = position[0] (RoPE, cos/sin
    (T_max, D/2)); q -> q (B, H, D) fp32, k and v -> the caches (B, KV, T_max, D) bf16 at p."""
    B, H, D = q.shape
    check("q", q, (B, H, D), F32)
    if len(k_cache.shape) != 4 or k_cache.shape[0] != B or k_cache.shape[3] != D or v_cache.shape != k_cache.shape \
            or k_cache.dtype != BF16 or v_cache.dtype != BF16:
        raise ValueError(f"caches must be bf16 (B={B}, KV, T_max, D={D}), got {k_cache.shape} and {v_cache.shape}")
    KV, T_max = k_cache.shape[1], k_cache.shape[2]
    N = (H + 2 * KV) * D
    if wqkv.shape[0] != N or D % 2:
        raise ValueError(f"gemv_qkv_rope: wqkv must have (H + 2KV) * D = {N} rows and D be even, got {wqkv.shape}")
    check("cos", cos, (T_max, D // 2), F32)
    check("sin", sin, (T_max, D // 2), F32)
    check("position", position, (1,), I32)
    _launch("gemv_qkv_rope_norm", x, wqkv, N, math.ceil(N / GEMV_ROWS), 16, norm,
            q_out=q.ptr, k_cache=k_cache.ptr, v_cache=v_cache.ptr, cos_table=cos.ptr, sin_table=sin.ptr,
            position=position.ptr, H=H, KV=KV, D=D, T_max=T_max)

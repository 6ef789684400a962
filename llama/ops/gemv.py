"""Launchers of the decoder's skinny GEMMs (kernels/gemv.cu): out (B, N) = x (B, K) @ W^T for 1 to 16
sequences, W (N, K) bf16, with the epilogue of the layer that follows fused in: the head's logits,
a residual add (and the next RMSNorm's rstd), SwiGLU of gate+up, RoPE with the KV-cache write.

Every launch takes one DecodeScratch: fp32 partial tiles for split-K and zeroed counters, which every
launch leaves zeroed again, so one scratch serves a whole decode step (the launches run in order)."""

from __future__ import annotations

import math

import numpy as np

from ..cuda import BF16, DeviceArray, zeros
from .common import F32, I32, check, check_aligned, kernel, multiprocessors

GEMV_ROWS = 32  # rows of W per tile (a SwiGLU tile: 16 gate rows and their 16 up rows)
GEMV_THREADS = 128
MAX_BATCH = 16
TILE_ELEMENTS = GEMV_ROWS * MAX_BATCH
MIN_SPLIT_K = 1024  # the least K a split takes: a split's extra round trips cost more than a short K gains
U32 = np.dtype(np.uint32)

# kernels/gemv.cu's GemvArgs, field for field (align=True lays it out as the C compiler does)
GEMV_ARGS = np.dtype([
    ("w", "u8"), ("x", "u8"), ("norm_weight", "u8"), ("rstd", "u8"),
    ("B", "i4"), ("N", "i4"), ("K", "i4"), ("second", "i4"), ("splits", "i4"),
    ("partial", "u8"), ("counters", "u8"), ("out_f32", "u8"), ("out_bf16", "u8"), ("rstd_out", "u8"),
    ("squares", "u8"), ("eps", "f4"), ("q_out", "u8"), ("k_cache", "u8"), ("v_cache", "u8"),
    ("cos_table", "u8"), ("sin_table", "u8"), ("position", "u8"), ("H", "i4"), ("KV", "i4"), ("D", "i4"),
    ("T_max", "i4")], align=True)


def target_blocks() -> int:
    """Blocks a launch aims at: two per multiprocessor (each keeps 16 KB of weight loads in flight)."""
    return 2 * multiprocessors()


class DecodeScratch:
    """Scratch of the decode step's launches that split their work (GEMVs over K, attention over the
    keys): fp32 partial results, and counters (zeroed once; each launch leaves them zeroed)."""

    def __init__(self, max_rows: int, attention_records: int):
        """max_rows: the most rows of a residual GEMV (the model dim); attention_records: fp32 values
        of the attention's partial results (ops.decode.attention_scratch_size)."""
        target = target_blocks()
        self.partial = zeros(max(2 * target * TILE_ELEMENTS, attention_records), F32)
        tiles = math.ceil(max_rows / GEMV_ROWS)
        self.counters = zeros(max(2 * target, tiles + 1) + 1, U32)
        self.squares = zeros(tiles * MAX_BATCH, F32)  # a residual GEMV's sums of squares per (tile, sequence)


def gemv_splits(tiles: int, K: int) -> int:
    """Ranges of K per tile, so that tiles * splits fills the GPU, each at least MIN_SPLIT_K long."""
    return max(1, min(math.ceil(target_blocks() / tiles), K // MIN_SPLIT_K))


def _launch(entry: str, scratch: DecodeScratch, x: DeviceArray, w: DeviceArray, N: int, tiles: int, second: int,
            norm: tuple | None, **fields) -> None:
    B, K = x.shape
    if not 1 <= B <= MAX_BATCH:
        raise ValueError(f"gemv: batch {B} outside 1..{MAX_BATCH}")
    if K % 8 or w.shape[1] != K or w.dtype != BF16:
        raise ValueError(f"gemv: W must be bf16 (rows, K={K}) with K a multiple of 8, got {w.dtype} {w.shape}")
    check_aligned(w=w, x=x)
    args = np.zeros((), GEMV_ARGS)
    if norm is not None:
        weight, rstd = norm
        check("x", x, (B, K), F32)
        check("norm_weight", weight, (K,), F32)
        check("rstd", rstd, (B,), F32)
        args["norm_weight"], args["rstd"] = weight.ptr, rstd.ptr
    else:
        check("x", x, (B, K), BF16)
    splits = gemv_splits(tiles, K)
    counters = max(tiles if splits > 1 else 0, tiles + 1 if entry == "gemv_residual" else 0)
    if (splits > 1 and tiles * splits * TILE_ELEMENTS > scratch.partial.size) or counters > scratch.counters.size:
        raise ValueError(f"gemv: the scratch is too small for {tiles} tiles x {splits} splits")
    args["w"], args["x"], args["B"], args["N"], args["K"], args["second"] = w.ptr, x.ptr, B, N, K, second
    args["splits"], args["partial"], args["counters"] = splits, scratch.partial.ptr, scratch.counters.ptr
    for name, value in fields.items():
        args[name] = value
    suffix = "b8" if B <= 8 else "b16"
    kernel("gemv", f"{entry}_{suffix}", f"{GEMV_ARGS.itemsize}s")((tiles, splits), GEMV_THREADS, args.tobytes())


def gemv_logits(out: DeviceArray, x: DeviceArray, w: DeviceArray, norm_weight: DeviceArray, rstd: DeviceArray,
                scratch: DecodeScratch) -> None:
    """out (B, N) fp32 = rmsnorm(x) @ W^T: x (B, K) the fp32 residual stream, rstd (B,) its RMSNorm's."""
    N = w.shape[0]
    check("out", out, (x.shape[0], N), F32)
    _launch("gemv_store_norm", scratch, x, w, N, math.ceil(N / GEMV_ROWS), 16, (norm_weight, rstd), out_f32=out.ptr)


def gemv_residual(stream: DeviceArray, rstd_out: DeviceArray, x: DeviceArray, w: DeviceArray, eps: float,
                  scratch: DecodeScratch) -> None:
    """stream (B, N) fp32 += x @ W^T (x (B, K) bf16), then rstd_out (B,) = 1 / sqrt(mean(stream^2) + eps)."""
    B, N = x.shape[0], w.shape[0]
    check("stream", stream, (B, N), F32)
    check("rstd_out", rstd_out, (B,), F32)
    tiles = math.ceil(N / GEMV_ROWS)
    if tiles * B > scratch.squares.size:
        raise ValueError(f"gemv_residual: the scratch holds {scratch.squares.size // MAX_BATCH} tiles, not {tiles}")
    _launch("gemv_residual", scratch, x, w, N, tiles, 16, None, out_f32=stream.ptr, rstd_out=rstd_out.ptr,
            squares=scratch.squares.ptr, eps=eps)


def gemv_swiglu(out: DeviceArray, x: DeviceArray, w13: DeviceArray, norm_weight: DeviceArray, rstd: DeviceArray,
                scratch: DecodeScratch) -> None:
    """out (B, F) bf16 = silu(gate) * up, [gate | up] = rmsnorm(x) @ w13^T, w13 (2F, K)."""
    B, F = x.shape[0], w13.shape[0] // 2
    if w13.shape[0] != 2 * F:
        raise ValueError(f"gemv_swiglu: w13 must have an even number of rows, got {w13.shape}")
    check("out", out, (B, F), BF16)
    _launch("gemv_swiglu_norm", scratch, x, w13, F, math.ceil(F / 16), F, (norm_weight, rstd), out_bf16=out.ptr)


def gemv_qkv_rope(q: DeviceArray, k_cache: DeviceArray, v_cache: DeviceArray, x: DeviceArray, wqkv: DeviceArray,
                  norm_weight: DeviceArray, rstd: DeviceArray, cos: DeviceArray, sin: DeviceArray,
                  position: DeviceArray, scratch: DecodeScratch) -> None:
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
    _launch("gemv_qkv_rope_norm", scratch, x, wqkv, N, math.ceil(N / GEMV_ROWS), 16, (norm_weight, rstd),
            q_out=q.ptr, k_cache=k_cache.ptr, v_cache=v_cache.ptr, cos_table=cos.ptr, sin_table=sin.ptr,
            position=position.ptr, H=H, KV=KV, D=D, T_max=T_max)

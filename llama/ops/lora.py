"""LoRA's launchers (kernels/lora.cu; the layer's twin llama/twins/lora.py): the update of a GEMM's output by its
stacked adapters, the block-diagonal spread of a stacked B, and the block-diagonal part of a whole product."""

from __future__ import annotations

import math

import numpy as np

from ..runtime.cuda import BF16, DeviceArray
from .common import BLOCK, F32, blocks, check, check_aligned, kernel, kernel_constant

THREADS, COLUMNS, ROWS = (kernel_constant("lora", name) for name in ("LORA_THREADS", "LORA_COLUMNS", "LORA_ROWS"))
MAX_K = kernel_constant("lora", "LORA_MAX_K")


def segment_starts(rows: list[int]) -> tuple[int, int]:
    """(s1, s2) of kernels/lora.cu: the first rows of the second and third targets of a stacked B whose targets
    hold these rows each (OC where there is none)."""
    ends = [int(x) for x in np.cumsum(rows)]
    return tuple((ends[:-1] + [ends[-1]] * 2)[:2])


def lora_add_bf16(out: DeviceArray, xa: DeviceArray, w: DeviceArray, scale: float, rows: list[int], k: int,
                  transposed: bool = False, rope: tuple | None = None) -> None:
    """out (N, OC) bf16 += scale * (xa's segment of each row's target) @ w^T: rows, the output rows of each
    target (summing to OC), each reading its k columns of xa (N, len(rows) * k). w: B (OC, k), or with transposed
    A (k, OC) read as its transpose (the backward's dx, one target). rope: (cos, sin, T, rotated_columns) as
    ops.gemm's, the update rotated as the QKV projection's output is."""
    N, OC = out.shape
    segments = len(rows)
    check("out", out, (N, OC), BF16)
    check("xa", xa, (N, segments * k), BF16)
    check("w", w, (k, OC) if transposed else (OC, k), BF16)
    if sum(rows) != OC or any(r % 2 for r in rows) or OC % 2 or not 1 <= segments <= 3 or (transposed and segments > 1):
        raise ValueError(f"lora_add_bf16: rows {rows} must be 1 to 3 even counts summing to OC = {OC} (one transposed)")
    if not 1 <= k <= MAX_K:
        raise ValueError(f"lora_add_bf16: K = {k} columns of w a row, at most {MAX_K}")
    check_aligned(out=out)
    s1, s2 = segment_starts(rows)
    cos = sin = 0
    rope_T, rope_cols, head_dim = 1, 0, 2
    if rope is not None:
        cos_a, sin_a, rope_T, rope_cols = rope
        head_dim = 2 * cos_a.shape[1]
        check("sin", sin_a, cos_a.shape, F32)
        if cos_a.dtype != F32 or N % rope_T or rope_cols % head_dim or rope_cols > OC:
            raise ValueError("lora_add_bf16: rope needs fp32 cos/sin (>= T, D/2), rows of whole batches of T tokens, "
                             "whole heads")
        cos, sin = cos_a.ptr, sin_a.ptr
    w_row, w_k = (1, OC) if transposed else (k, 1)
    shared = 4 * (k * COLUMNS + ROWS * segments * k)
    kernel("lora", "lora_add_bf16", "PPPfiiiiiiqqPPiii")(
        (math.ceil(OC / COLUMNS), math.ceil(N / ROWS)), THREADS, out.ptr, xa.ptr, w.ptr, np.float32(scale), N, OC, k,
        segments, s1, s2, w_row, w_k, cos, sin, rope_T, rope_cols, head_dim, shared=shared)


def lora_block_diagonal_bf16(out: DeviceArray, b: DeviceArray, rows: list[int]) -> None:
    """out (OC, m r) bf16: B (OC, r)'s rows spread block-diagonally, target j's at columns j r .. j r + r - 1."""
    _blocks("lora_block_diagonal_bf16", out, BF16, b, BF16, rows, out.size)


def lora_take_blocks_f32(db: DeviceArray, c: DeviceArray, rows: list[int]) -> None:
    """db (OC, r) fp32 += the block-diagonal part of c (OC, m r) fp32: row o's columns of its target."""
    _blocks("lora_take_blocks_f32", db, F32, c, F32, rows, db.size)


def _blocks(name: str, out: DeviceArray, out_dtype, source: DeviceArray, source_dtype, rows: list[int],
            threads: int) -> None:
    """A kernel between an (OC, r) array and its (OC, m r) block-diagonal spread, the narrow one out or in."""
    narrow, wide = (source, out) if out.shape[1] > source.shape[1] else (out, source)
    OC, r = narrow.shape
    check("out", out, (OC, out.shape[1]), out_dtype)
    check("source", source, (OC, source.shape[1]), source_dtype)
    if wide.shape != (OC, len(rows) * r) or sum(rows) != OC:
        raise ValueError(f"{name}: rows {rows} must sum to OC = {OC}, the wide array being (OC, {len(rows)} r)")
    kernel("lora", name, "PPiiiii")(blocks(threads), BLOCK, out.ptr, source.ptr, OC, r, len(rows), *segment_starts(rows))

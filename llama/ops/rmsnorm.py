"""RMSNorm's launchers (kernels/rmsnorm.cu; twin llama/twins/rmsnorm.py): the fp32 path's, and the bf16
path's, fused with the residual add before it, whose dweight sums over a fixed row partition
(deterministic, one launch)."""

from __future__ import annotations

import math

import numpy as np

from ..runtime.cuda import BF16, DeviceArray
from .common import BLOCK, F32, ROWS_PER_BLOCK, blocks, check, check_vectors, kernel

RMSNORM_PARTS = 128  # the fp32 backward's row partition of the dweight sums
RMSNORM_BF16_PARTS, RMSNORM_BF16_GROUP = 256, 16  # the bf16 backward's fixed row partition, and its grouping


def _row_block(C: int, threads: int) -> tuple[int, int]:
    """A 2D block (threads per row, rows): one thread per 8 columns, in whole warps, about `threads` in all."""
    if not 0 < C <= 8192:
        raise ValueError(f"bf16 row kernels take 0 < C <= 8192 columns, got {C}")
    per_row = 32 * math.ceil(C / 256)
    return per_row, max(1, threads // per_row)


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


def rmsnorm_residual_forward_bf16(residual_out: DeviceArray | None, ln_out: DeviceArray, rstd: DeviceArray,
                             x: DeviceArray, branch: DeviceArray | None, weight: DeviceArray, eps: float) -> None:
    """residual_out (N, C) = x + branch, and ln_out = rmsnorm(residual_out) * weight, all bf16, with
    rstd (N,) fp32; weight is the fp32 master weight. branch=None with residual_out=None: a plain RMSNorm
    of x. residual_out may be x."""
    N, C = x.shape
    if (branch is None) != (residual_out is None):
        raise ValueError("rmsnorm_residual_forward_bf16: give both branch and residual_out, or neither")
    named = {"x": x, "ln_out": ln_out} | ({} if branch is None else {"branch": branch, "residual_out": residual_out})
    for name, array in named.items():
        check(name, array, (N, C), BF16)
    check("rstd", rstd, (N,))
    check("weight", weight, (C,))
    check_vectors(C, weight=weight, **named)
    per_row, rows = _row_block(C, BLOCK)
    kernel("rmsnorm", "rmsnorm_residual_forward_bf16", "PPPPPPiif")(
        (math.ceil(N / rows),), (per_row, rows), 0 if residual_out is None else residual_out.ptr, ln_out.ptr, rstd.ptr,
        x.ptr, 0 if branch is None else branch.ptr, weight.ptr, N, C, np.float32(eps))


def rmsnorm_forward_bf16(out: DeviceArray, rstd: DeviceArray, inp: DeviceArray, weight: DeviceArray,
                         eps: float) -> None:
    """out (N, C) = rmsnorm(inp) * weight, bf16; rstd (N,) fp32 (the first norm, with no residual add)."""
    rmsnorm_residual_forward_bf16(None, out, rstd, inp, None, weight, eps)


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
        check(name, array, (N, C), BF16)
    check("dweight", dweight, (C,))
    check("weight", weight, (C,))
    check("rstd", rstd, (N,))
    size = rmsnorm_bf16_scratch_size(C)
    if scratch.dtype != F32 or scratch.size < size:
        raise ValueError(f"scratch: needs {size} float32, has {scratch.size} {scratch.dtype}")
    check_vectors(C, dresidual=dresidual, dweight=dweight, dln=dln, h=h, weight=weight, scratch=scratch)
    per_row, rows = _row_block(C, 512)
    parts, groups = RMSNORM_BF16_PARTS, RMSNORM_BF16_PARTS // RMSNORM_BF16_GROUP
    group_partial, counters = scratch.ptr + parts * C * 4, scratch.ptr + (parts + groups) * C * 4
    kernel("rmsnorm", "rmsnorm_backward_bf16", "PPPPPPPPPiiii")(
        (parts,), (per_row, rows), dresidual.ptr, dweight.ptr, scratch.ptr, group_partial, counters, dln.ptr, h.ptr,
        weight.ptr, rstd.ptr, N, C, max(1, math.ceil(N / parts)), RMSNORM_BF16_GROUP, shared=rows * C * 4)

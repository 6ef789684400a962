"""SwiGLU's launchers (kernels/swiglu.cu, its arithmetic kernels/swiglu.cuh; twin llama/twins/swiglu.py):
fp32 and bf16, out = silu(gate) * up of the packed [gate | up] projection."""

from __future__ import annotations

import math

from ..runtime.cuda import BF16, DeviceArray
from .common import BLOCK, U32, blocks, check, check_vectors, kernel, kernel_constant

AMAX_ROWS, AMAX_WARPS = kernel_constant("swiglu", "SWIGLU_AMAX_ROWS"), kernel_constant("swiglu", "SWIGLU_AMAX_WARPS")


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


def swiglu_forward_bf16(out: DeviceArray, gate_up: DeviceArray) -> None:
    """out (N, F) = silu(gate) * up of gate_up (N, 2F) = [gate | up], bf16."""
    N, F = out.shape
    check("out", out, (N, F), BF16)
    check("gate_up", gate_up, (N, 2 * F), BF16)
    check_vectors(F, out=out, gate_up=gate_up)
    kernel("swiglu", "swiglu_forward_bf16", "PPii")(blocks(N * F // 8), BLOCK, out.ptr, gate_up.ptr, N, F)


def swiglu_backward_bf16(dgate_up: DeviceArray, dout: DeviceArray, gate_up: DeviceArray,
                         amax: DeviceArray | None = None) -> None:
    """dgate_up (N, 2F) bf16 from dout (N, F); dgate_up may be gate_up itself (in place). With amax (uint32, at
    least N + 2F; --dtype fp8) also the max |dgate_up| of each row, then of each column, as ops.cast_fp8 takes
    them with amax_ready (the same dgate_up bits)."""
    N, F = dout.shape
    check("dout", dout, (N, F), BF16)
    check("gate_up", gate_up, (N, 2 * F), BF16)
    check("dgate_up", dgate_up, (N, 2 * F), BF16)
    check_vectors(F, dout=dout, gate_up=gate_up, dgate_up=dgate_up)
    if amax is None:
        kernel("swiglu", "swiglu_backward_bf16", "PPPii")(blocks(N * F // 8), BLOCK, dgate_up.ptr, dout.ptr,
                                                           gate_up.ptr, N, F)
        return
    if amax.dtype != U32 or amax.size < N + 2 * F:
        raise ValueError(f"amax: needs {N + 2 * F} uint32, has {amax.size} {amax.dtype}")
    amax = amax.view(0, (N + 2 * F,))
    amax.fill_zero()
    kernel("swiglu", "swiglu_backward_amax_bf16", "PPPPPii")(
        (math.ceil(N / AMAX_ROWS), math.ceil(F / 256)), (32, AMAX_WARPS), dgate_up.ptr, amax.ptr,
        amax.ptr + N * U32.itemsize, dout.ptr, gate_up.ptr, N, F)

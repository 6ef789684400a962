"""Precision conversions (kernels/convert.cu): fp32 to bf16, rounded to nearest even, and back."""

from __future__ import annotations

from ..runtime.cuda import BF16, DeviceArray
from .common import BLOCK, blocks, check, kernel


def round_to_bf16(out: DeviceArray, x: DeviceArray) -> None:
    """out (n,) bf16 = x (n,) fp32, rounded to nearest even."""
    check("x", x, out.shape)
    check("out", out, x.shape, BF16)
    kernel("convert", "round_to_bf16", "PPq")(blocks(x.size), BLOCK, out.ptr, x.ptr, x.size)


def widen_bf16(out: DeviceArray, x: DeviceArray, accumulate: bool = False) -> None:
    """out (n,) fp32 = x (n,) bf16, or out += x with accumulate."""
    check("x", x, out.shape, BF16)
    check("out", out, x.shape)
    kernel("convert", "widen_bf16", "PPqi")(blocks(x.size), BLOCK, out.ptr, x.ptr, x.size, int(accumulate))

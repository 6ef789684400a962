"""NF4's launchers (kernels/nf4.cu; twin llama/twins/nf4.py): --qlora's frozen base quantized on the GPU (bf16 or
fp32 weights to bitsandbytes' codes, double-quantized absmaxes and offset) and dequantized into a bf16 scratch
a layer at a time, just before its GEMMs."""

from __future__ import annotations

import math

import numpy as np

from ..runtime.cuda import BF16, DeviceArray
from ..twins.nf4 import ABSMAX_BLOCK, BLOCK, DYNAMIC_MAP, NF4_LEVELS
from .common import BLOCK as THREADS
from .common import F32, U8, blocks, check, check_aligned, kernel, kernel_constant

TABLE_SIZE = kernel_constant("nf4", "NF4_TABLE_SIZE")
QUANTIZE_PER_THREAD = kernel_constant("nf4", "NF4_QUANTIZE_PER_THREAD")
DEQUANTIZE_PER_THREAD = kernel_constant("nf4", "NF4_DEQUANTIZE_PER_THREAD")
MEAN_THREADS = kernel_constant("nf4", "NF4_MEAN_THREADS")
if (kernel_constant("nf4", "NF4_BLOCK"), kernel_constant("nf4", "NF4_ABSMAX_BLOCK")) != (BLOCK, ABSMAX_BLOCK):
    raise ImportError("kernels/nf4.cu's blocks are not llama/twins/nf4.py's")


def nf4_tables() -> np.ndarray:
    """(TABLE_SIZE,) fp32, the tables the kernels read (upload once): the 16 NF4 levels, then the dynamic map."""
    return np.concatenate([NF4_LEVELS, DYNAMIC_MAP]).astype(np.float32)


def nf4_sizes(shape) -> dict[str, tuple[int]]:
    """The shapes of a quantized weight of this shape: codes, absmax (and absmax_codes), absmax_scales."""
    n = math.prod(shape)
    absmaxes = math.ceil(n / BLOCK)
    return {"codes": ((n + 1) // 2,), "absmax": (absmaxes,), "absmax_scales": (math.ceil(absmaxes / ABSMAX_BLOCK),)}


def _check_state(shape, codes: DeviceArray, absmax_codes: DeviceArray, absmax_scales: DeviceArray,
                 offset: DeviceArray, tables: DeviceArray) -> None:
    sizes = nf4_sizes(shape)
    check("codes", codes, sizes["codes"], U8)
    check("absmax_codes", absmax_codes, sizes["absmax"], U8)
    check("absmax_scales", absmax_scales, sizes["absmax_scales"], F32)
    check("offset", offset, (1,), F32)
    check("tables", tables, (TABLE_SIZE,), F32)
    check_aligned(codes=codes)


def nf4_quantize(codes: DeviceArray, absmax: DeviceArray, absmax_codes: DeviceArray, absmax_scales: DeviceArray,
                 offset: DeviceArray, weights: DeviceArray, tables: DeviceArray) -> None:
    """weights (any shape, bf16 or fp32) -> codes (uint8, packed), absmax (fp32, each block's: an output the
    double quantization reads), absmax_codes (uint8), absmax_scales (fp32) and offset (fp32 (1,)), as
    twins.nf4.quantize: three launches. tables: nf4_tables() on the device. Deterministic."""
    if weights.dtype not in (BF16, F32):
        raise ValueError(f"weights: expected bfloat16 or float32, got {weights.dtype}")
    _check_state(weights.shape, codes, absmax_codes, absmax_scales, offset, tables)
    check("absmax", absmax, nf4_sizes(weights.shape)["absmax"], F32)
    check_aligned(weights=weights)
    n, count = weights.size, absmax.size
    name = "nf4_quantize_bf16" if weights.dtype == BF16 else "nf4_quantize_f32"
    kernel("nf4", name, "PPPPq")(blocks(math.ceil(n / QUANTIZE_PER_THREAD)), THREADS, codes.ptr, absmax.ptr,
                                 weights.ptr, tables.ptr, n)
    kernel("nf4", "nf4_absmax_mean", "PPi")((1,), MEAN_THREADS, offset.ptr, absmax.ptr, count)
    kernel("nf4", "nf4_quantize_absmax", "PPPPPi")(blocks(count, ABSMAX_BLOCK), ABSMAX_BLOCK, absmax_codes.ptr,
                                                    absmax_scales.ptr, absmax.ptr, offset.ptr, tables.ptr, count)


def nf4_dequantize_bf16(out: DeviceArray, codes: DeviceArray, absmax_codes: DeviceArray, absmax_scales: DeviceArray,
                        offset: DeviceArray, tables: DeviceArray) -> None:
    """out (any shape, bf16) = the weights an NF4 state of that shape stands for, rounded to bf16."""
    check("out", out, out.shape, BF16)
    _check_state(out.shape, codes, absmax_codes, absmax_scales, offset, tables)
    check_aligned(out=out)
    n = out.size
    kernel("nf4", "nf4_dequantize_bf16", "PPPPPPq")(blocks(math.ceil(n / DEQUANTIZE_PER_THREAD)), THREADS, out.ptr,
                                                     codes.ptr, absmax_codes.ptr, absmax_scales.ptr, offset.ptr,
                                                     tables.ptr, n)

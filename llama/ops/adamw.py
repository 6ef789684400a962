"""AdamW's launchers (kernels/adamw.cu; twin llama/optim.py): the fp32 path's update, the bf16 path's,
which writes the bf16 copy of the weights in the same pass, and the 8-bit moments' (dequantize, update,
quantize in one pass). Gradients are clipped by the device-side norm. Each reads the weight-decay mask packed
a bit per weight (pack_decay_mask), where the twin takes llama/params.py's byte per weight."""

from __future__ import annotations

import numpy as np

from ..runtime.cuda import BF16, DeviceArray
from ..optim import DYNAMIC_SIGNED, DYNAMIC_UNSIGNED, MIDPOINTS, QUANT_BLOCK, AdamWConfig
from .common import BLOCK, U8, blocks, check, check_aligned, check_vectors, kernel, kernel_constant

ADAMW_SCALARS = 3  # lr, 1 - beta1^step, 1 - beta2^step
MAP_SIZE = kernel_constant("adamw", "MAP_SIZE")  # entries of each table of quantization_maps()
MASK_BITS = 8  # weights per byte of the packed decay mask


def pack_decay_mask(mask: np.ndarray) -> np.ndarray:
    """The decay mask as the kernels read it, from the byte mask of llama/params.py (0 or 1 per weight):
    uint8 (packed_mask_size(n),), weight i at bit i % 8 of byte i // 8, the last byte's unused bits 0."""
    return np.packbits(mask, bitorder="little")


def packed_mask_size(n: int) -> int:
    """Bytes of the packed decay mask of n weights."""
    return -(-n // MASK_BITS)


def decay_mask_range(mask: DeviceArray, start: int, n: int) -> DeviceArray:
    """The packed mask of weights [start, start + n) of a packed mask, as the launchers take it; start a multiple
    of 8 (where a byte begins)."""
    if start % MASK_BITS:
        raise ValueError(f"the packed decay mask is cut at multiples of {MASK_BITS} weights, not at {start}")
    return mask.view(start // MASK_BITS, (packed_mask_size(n),))


def adamw_update(params: DeviceArray, grads: DeviceArray, m: DeviceArray, v: DeviceArray, decay_mask: DeviceArray,
                 norm_squared: DeviceArray, step: int, lr: float, opt: AdamWConfig) -> None:
    """One AdamW step (step counts from 1), gradients clipped to opt.grad_clip by the device-side norm;
    decay_mask packed (pack_decay_mask)."""
    n = params.size
    for name, array in (("grads", grads), ("m", m), ("v", v)):
        check(name, array, params.shape)
    check("decay_mask", decay_mask, (packed_mask_size(n),), U8)
    check("norm_squared", norm_squared, (1,))
    kernel("adamw", "adamw_update", "PPPPPPqffffffff")(
        blocks(n), BLOCK, params.ptr, grads.ptr, m.ptr, v.ptr, decay_mask.ptr, norm_squared.ptr, n,
        *(np.float32(x) for x in (lr, opt.beta1, opt.beta2, opt.eps, opt.weight_decay, 1 - opt.beta1 ** step,
                                  1 - opt.beta2 ** step, opt.grad_clip)))


def adamw_scalars(step: int, lr: float, opt: AdamWConfig) -> np.ndarray:
    """The step-dependent values adamw_update_bf16 reads on the device (step counts from 1)."""
    return np.array([lr, 1 - opt.beta1 ** step, 1 - opt.beta2 ** step], dtype=np.float32)


def adamw_update_bf16(params: DeviceArray, params_bf16: DeviceArray, grads: DeviceArray, m: DeviceArray,
                      v: DeviceArray, decay_mask: DeviceArray, norm_squared: DeviceArray, scalars: DeviceArray,
                      opt: AdamWConfig) -> None:
    """adamw_update on the fp32 flat buffers, clipped to opt.grad_clip by the device-side norm, writing
    the bf16 copy params_bf16 of the new params in the same pass; scalars (ADAMW_SCALARS,) fp32 on the
    device holds adamw_scalars(step, lr, opt); decay_mask packed (pack_decay_mask), read a byte at a time."""
    n = params.size
    check("params", params, (n,))
    check("params_bf16", params_bf16, (n,), BF16)
    for name, array in (("grads", grads), ("m", m), ("v", v)):
        check(name, array, (n,))
    check("decay_mask", decay_mask, (packed_mask_size(n),), U8)
    check("norm_squared", norm_squared, (1,))
    check("scalars", scalars, (ADAMW_SCALARS,))
    check_vectors(8, params=params, params_bf16=params_bf16, grads=grads, m=m, v=v)
    kernel("adamw", "adamw_update_bf16", "PPPPPPPPqfffff")(
        blocks(n, BLOCK * 8), BLOCK, params.ptr, params_bf16.ptr, grads.ptr, m.ptr, v.ptr, decay_mask.ptr,
        norm_squared.ptr, scalars.ptr, n, *(np.float32(x) for x in (opt.beta1, opt.beta2, opt.eps, opt.weight_decay,
                                                                     opt.grad_clip)))


def quantization_maps() -> np.ndarray:
    """(4, MAP_SIZE) fp32, the tables adamw8bit_update_bf16 reads: the levels and midpoints of m's map
    (DYNAMIC_SIGNED), then of v's (DYNAMIC_UNSIGNED), levels padded with 0 and midpoints with +inf."""
    tables = np.zeros((4, MAP_SIZE), np.float32)
    for row, levels in ((0, DYNAMIC_SIGNED), (2, DYNAMIC_UNSIGNED)):
        midpoints = MIDPOINTS[id(levels)]
        tables[row, :levels.size] = levels
        tables[row + 1] = np.inf
        tables[row + 1, :midpoints.size] = midpoints
    return tables


def adamw8bit_update_bf16(params: DeviceArray, params_bf16: DeviceArray, grads: DeviceArray, m_codes: DeviceArray,
                          m_scales: DeviceArray, v_codes: DeviceArray, v_scales: DeviceArray, decay_mask: DeviceArray,
                          norm_squared: DeviceArray, scalars: DeviceArray, maps: DeviceArray, opt: AdamWConfig) -> None:
    """adamw_update_bf16 with 8-bit moments, as llama/optim.py's AdamW8bitState stores them: codes (n,) uint8
    and one fp32 scale per QUANT_BLOCK values (m_scales, v_scales), dequantized, updated and quantized
    back in one pass; maps: quantization_maps() on the device; decay_mask packed (pack_decay_mask). The arrays
    but the mask 16-byte aligned (vector loads)."""
    n, blocks_n = params.size, -(-params.size // QUANT_BLOCK)
    check("params", params, (n,))
    check("params_bf16", params_bf16, (n,), BF16)
    check("grads", grads, (n,))
    for name, array in (("m_codes", m_codes), ("v_codes", v_codes)):
        check(name, array, (n,), U8)
    check("decay_mask", decay_mask, (packed_mask_size(n),), U8)
    for name, array in (("m_scales", m_scales), ("v_scales", v_scales)):
        check(name, array, (blocks_n,))
    check("norm_squared", norm_squared, (1,))
    check("scalars", scalars, (ADAMW_SCALARS,))
    check("maps", maps, (4, MAP_SIZE))
    check_aligned(params=params, params_bf16=params_bf16, grads=grads, m_codes=m_codes, v_codes=v_codes)
    one_minus = (np.float32(1 - opt.beta1), np.float32(1 - opt.beta2))  # rounded from double, as numpy has them
    kernel("adamw", "adamw8bit_update_bf16", "PPPPPPPPPPPqfffffff")(
        blocks(blocks_n * 32, BLOCK), BLOCK, params.ptr, params_bf16.ptr, grads.ptr, m_codes.ptr, m_scales.ptr,
        v_codes.ptr, v_scales.ptr, decay_mask.ptr, norm_squared.ptr, scalars.ptr, maps.ptr, n,
        np.float32(opt.beta1), np.float32(opt.beta2), *one_minus,
        *(np.float32(x) for x in (opt.eps, opt.weight_decay, opt.grad_clip)))

"""NF4 (QLoRA's 4-bit NormalFloat, Dettmers et al. 2023) as bitsandbytes stores it: the twin of kernels/nf4.cu
(llama/ops/nf4.py), and bit for bit what bitsandbytes' CUDA kernels give for
quantize_4bit(w, blocksize=64, quant_type="nf4", compress_statistics=True) (tests/unit/test_nf4.py checks a
fixture recorded with bitsandbytes: scripts/record_nf4_golden.py).

A tensor of n weights is read flat (row-major) and cut into blocks of BLOCK = 64; the last block may be short.
- absmax: each block's largest |w| in float32 (one below FLT_MIN counts as 0: bitsandbytes' kernels are built
  with --use_fast_math, whose flush-to-zero makes a subnormal maximum 0, and a subnormal weight 0).
- codes: each weight's 4-bit code, the number of NF4_THRESHOLDS strictly below w * (1 / absmax) (float32
  reciprocal, then a float32 product): the nearest of the 16 NF4_LEVELS, a value on a midpoint going to the
  lower level. A block whose absmax is 0 has 1 / 0 = inf and 0 * inf = NaN, which no threshold is below:
  code 0 (level -1, times 0). Two codes a byte, the even weight in the high nibble:
  byte k = code[2k] << 4 | code[2k + 1]; an odd n pads its last low nibble with the code of a 0 in the last
  block (7, or 0 in a block of zeros).
- double quantization of the absmaxes (the "compress_statistics" of bitsandbytes): offset = their mean in
  float32; absmax - offset (float32) cut into blocks of ABSMAX_BLOCK = 256, each with a float32 scale (its
  largest magnitude) and an 8-bit code per value on DYNAMIC_MAP, chosen by bitsandbytes' binary search
  (dynamic_codes). bitsandbytes computes the mean with torch (float32 accumulation in a reduction order of
  its own); ours is the float64 sum in the fixed order of kernels/nf4.cu's nf4_absmax_mean (absmax_mean),
  rounded once, so both offsets are within an ulp or two of the exact mean and ours is deterministic.
- dequantize: absmax = DYNAMIC_MAP[code] * scale + offset, w = NF4_LEVELS[code] * absmax, each product and
  sum rounded to float32 (bitsandbytes' dequantize_4bit: its bf16 output is this rounded to bf16).

The one place where ours and bitsandbytes' CUDA kernels may part: they take 1 / absmax with the GPU's
approximate reciprocal (rcp.approx, within an ulp), we and kernels/nf4.cu with the exact one. For bf16
weights no code depends on it (every pair of bf16 mantissas, with the reciprocal moved up to 3 ulps either
way: tests/unit/test_nf4.py); for float32 weights and for the 8-bit codes of the absmaxes, a value within an
ulp or so of a decision boundary may land on the other side (the golden test counts them).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

BLOCK = 64  # weights that share one absmax
ABSMAX_BLOCK = 256  # absmaxes that share one scale in the double quantization

# bitsandbytes' NF4 levels (functional.get_4bit_type("nf4")), ascending: code i is level i
NF4_LEVELS = np.float32([
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
    -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
    0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0])
# the float32 midpoints of adjacent levels: the constants of bitsandbytes' dQuantizeNF4 decision tree
NF4_THRESHOLDS = ((NF4_LEVELS[:-1] + NF4_LEVELS[1:]) / np.float32(2)).astype(np.float32)
FLT_MIN = np.finfo(np.float32).tiny


def _linspace_float32(start: float, end: float, steps: int) -> np.ndarray:
    """torch.linspace(start, end, steps, dtype=torch.float32) as torch 2.x computes it on an x86 CPU with AVX2
    or AVX-512: step = (end - start) / (steps - 1) in float32, the first half start + i * step and the rest
    end - (steps - 1 - i) * step, each one fused multiply-add (float64 holds the product exactly, so one
    rounding to float32 is the FMA's). A CPU without either (ATEN_CPU_CAPABILITY=default) rounds the product
    apart and differs in 42 of DYNAMIC_MAP's levels."""
    start32, end32 = np.float32(start), np.float32(end)
    step = np.float64(np.float32((end32 - start32) / np.float32(steps - 1)))
    i = np.arange(steps, dtype=np.float64)
    first = start32 + step * i
    second = end32 - step * (steps - 1 - i)
    return np.where(i < steps // 2, first, second).astype(np.float32)


def dynamic_map() -> np.ndarray:
    """bitsandbytes' create_dynamic_map(signed=True): 256 ascending float32 levels in [-1, 1], for decade
    e = 6, 5, .., 0 the 2^(6 - e) midpoints of linspace(0.1, 1, 2^(6 - e) + 1) times 10^-e on either side of
    zero, and 0 and 1. (Not llama/optim.py's dynamic_map, the 8-bit optimizer's own variant: bitsandbytes'
    has 1 but not -1, and these exact floats, which its stored states index.)"""
    levels = [np.float32([0.0, 1.0])]
    for i in range(7):
        bounds = _linspace_float32(0.1, 1.0, 2 ** i + 1)
        means = ((bounds[:-1] + bounds[1:]) / np.float32(2)).astype(np.float32)
        scaled = (means * np.float32(10.0 ** (i - 6))).astype(np.float32)
        levels += [scaled, -scaled]
    return np.sort(np.concatenate(levels))


DYNAMIC_MAP = dynamic_map()


@dataclass(frozen=True)
class NF4Tensor:
    """A quantized tensor as bitsandbytes' QuantState holds it with compress_statistics (names as there):
    codes (its packed weight), absmax_codes (QuantState.absmax), absmax_scales (state2.absmax), offset."""
    codes: np.ndarray  # uint8 ((n + 1) // 2,): two 4-bit codes a byte, the even weight's high
    absmax_codes: np.ndarray  # uint8 (blocks,): each block's absmax - offset on DYNAMIC_MAP
    absmax_scales: np.ndarray  # float32 (ceil(blocks / 256),)
    offset: np.float32  # the absmaxes' mean
    shape: tuple[int, ...]

    @property
    def size(self) -> int:
        return math.prod(self.shape)


def blocks_of(n: int) -> int:
    """How many absmaxes a tensor of n weights has."""
    return -(-n // BLOCK)


def _flat_float32(w: np.ndarray) -> np.ndarray:
    w = np.asarray(w)
    if w.dtype.kind != "f" and w.dtype.name != "bfloat16":
        raise ValueError(f"NF4 quantizes floating-point weights, got {w.dtype}")
    return w.astype(np.float32).reshape(-1)


def _padded_blocks(x: np.ndarray, block: int) -> np.ndarray:
    """x (flat) with zeros up to whole blocks, as (blocks, block)."""
    padded = np.zeros(-(-x.size // block) * block, x.dtype)
    padded[:x.size] = x
    return padded.reshape(-1, block)


def block_absmax(w: np.ndarray) -> np.ndarray:
    """float32 (blocks,): each block's largest |w|, 0 below FLT_MIN."""
    absmax = np.abs(_padded_blocks(_flat_float32(w), BLOCK)).max(axis=1)
    return np.where(absmax < FLT_MIN, np.float32(0), absmax).astype(np.float32)


def _scaled(values: np.ndarray, scales: np.ndarray, block: int) -> np.ndarray:
    """values (flat float32) * (1 / their block's scale) in float32, subnormal values flushed to 0 first as
    bitsandbytes' fast-math product does (so a block of them, whose scale is 0, gives 0 * inf = NaN)."""
    values = np.where(np.abs(values) < FLT_MIN, np.float32(0), values).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        reciprocal = (np.float32(1) / scales).astype(np.float32)
        return (_padded_blocks(values, block) * reciprocal[:, None]).astype(np.float32).reshape(-1)


def nf4_codes(w: np.ndarray, absmax: np.ndarray) -> np.ndarray:
    """The unpacked 4-bit codes (uint8, n + n % 2: an odd n's padding code last) of w on its blocks' absmax."""
    flat = _flat_float32(w)
    scaled = _scaled(flat, absmax, BLOCK)[:flat.size + flat.size % 2]
    codes = np.searchsorted(NF4_THRESHOLDS, scaled, side="left")  # thresholds strictly below
    return np.where(np.isnan(scaled), 0, codes).astype(np.uint8)


def pack(codes: np.ndarray) -> np.ndarray:
    """Codes (even count) two a byte, the first in the high nibble."""
    return (codes[0::2] << 4 | codes[1::2]).astype(np.uint8)


def unpack(packed: np.ndarray, n: int) -> np.ndarray:
    """The first n codes of packed bytes."""
    return np.stack([packed >> 4, packed & 0xF], axis=1).reshape(-1)[:n]


def absmax_mean(absmax: np.ndarray) -> np.float32:
    """The absmaxes' mean as kernels/nf4.cu's nf4_absmax_mean takes it: lane t of 256 sums values t, t + 256,
    .. in float64 in order, the 256 lane sums are added in order, and sum / n is rounded to float32."""
    lanes = np.cumsum(_padded_blocks(absmax.astype(np.float64), ABSMAX_BLOCK), axis=0)[-1]
    return np.float32(np.cumsum(lanes)[-1] / absmax.size)


def dynamic_codes(x: np.ndarray, levels: np.ndarray = DYNAMIC_MAP) -> np.ndarray:
    """uint8 codes of float32 x in [-1, 1] on 256 ascending levels, by bitsandbytes' dQuantize (kernels.cu):
    a binary search from level 127 in steps of 64 .. 1 to an even level p, then whichever of p and the last
    levels the search stepped down from (upper) or up from (lower) is nearer, judged against their float32
    midpoint: a value above p on the midpoint stays at p, one below p on it too. NaN gives 0."""
    x = np.asarray(x, np.float32)
    pivot = np.full(x.shape, 127)
    lower_pivot, upper_pivot = np.zeros(x.shape, int), np.full(x.shape, 255)
    lower, upper = np.full(x.shape, np.float32(-1)), np.full(x.shape, np.float32(1))
    value = levels[pivot]
    for step in (64, 32, 16, 8, 4, 2, 1):
        above = x > value
        lower_pivot, lower = np.where(above, pivot, lower_pivot), np.where(above, value, lower)
        upper_pivot, upper = np.where(above, upper_pivot, pivot), np.where(above, upper, value)
        pivot = np.where(above, pivot + step, pivot - step)
        value = levels[pivot]
    upper = np.where(upper_pivot == 255, levels[255], upper)
    lower = np.where(lower_pivot == 0, levels[0], lower)
    half = np.float32(0.5)
    up_midpoint, down_midpoint = ((upper + value) * half).astype(np.float32), ((lower + value) * half).astype(np.float32)
    codes = np.where(x > value, np.where(x > up_midpoint, upper_pivot, pivot),
                     np.where(x < down_midpoint, lower_pivot, pivot))
    return codes.astype(np.uint8)


def quantize_absmax(absmax: np.ndarray, offset: np.float32) -> tuple[np.ndarray, np.ndarray]:
    """bitsandbytes' quantize_blockwise(absmax - offset, blocksize=256): (codes uint8 (blocks,), scales
    float32 (ceil(blocks / 256),)), each scale the largest |absmax - offset| of its 256 (0 below FLT_MIN)."""
    centered = (absmax.astype(np.float32) - np.float32(offset)).astype(np.float32)
    scales = np.abs(_padded_blocks(centered, ABSMAX_BLOCK)).max(axis=1)
    scales = np.where(scales < FLT_MIN, np.float32(0), scales).astype(np.float32)
    return dynamic_codes(_scaled(centered, scales, ABSMAX_BLOCK)[:centered.size]), scales


def dequantize_absmax(codes: np.ndarray, scales: np.ndarray, offset: np.float32) -> np.ndarray:
    """float32 (blocks,): DYNAMIC_MAP[code] * scale, then + offset, each rounded to float32."""
    products = (DYNAMIC_MAP[codes] * np.repeat(scales, ABSMAX_BLOCK)[:codes.size]).astype(np.float32)
    return (products + np.float32(offset)).astype(np.float32)


def quantize(w: np.ndarray) -> NF4Tensor:
    """NF4 with double-quantized absmaxes of a float32 or bf16 tensor (finite values)."""
    absmax = block_absmax(w)
    offset = absmax_mean(absmax)
    absmax_codes, absmax_scales = quantize_absmax(absmax, offset)
    return NF4Tensor(pack(nf4_codes(w, absmax)), absmax_codes, absmax_scales, offset, tuple(np.shape(w)))


def dequantize(q: NF4Tensor) -> np.ndarray:
    """The float32 tensor (q.shape) that q stands for: round it to bf16 for bitsandbytes' bf16 output."""
    absmax = dequantize_absmax(q.absmax_codes, q.absmax_scales, q.offset)
    levels = NF4_LEVELS[unpack(q.codes, q.size)]
    return (levels * np.repeat(absmax, BLOCK)[:q.size]).astype(np.float32).reshape(q.shape)

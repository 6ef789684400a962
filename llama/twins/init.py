"""The random initialization's numpy twin (kernels/init.cu, launched by llama/ops/init.py): normal values from
a counter-based generator, the same bits on the CPU and the GPU.

The value of the flat parameter at offset g is a pure function of (seed, g): Philox4x32-10 (Salmon et al.,
SC'11, Random123's constants) keyed by the seed, at counter (g // 4 low word, high word, INIT_STREAM, 0),
gives 4 words; Box-Muller turns words (0, 1) into the normals of lanes 0, 1 and words (2, 3) into those of
lanes 2, 3, and lane g % 4 is g's. So any slice of the parameters (a tensor, a ZeRO shard) is drawn on its
own, whatever the batch or the number of GPUs. The transform is float64 arithmetic made only of correctly
rounded +, -, *, / and sqrt (polynomials instead of libm's log and sincos, no fused multiply-adds), and the
scaled value is rounded to float32 once: kernels/init.cu computes the very same bits. llama/params.py scales
these per tensor (initial_std).
"""

from __future__ import annotations

import numpy as np

PHILOX_MULTIPLIERS = (0xD2511F53, 0xCD9E8D57)
PHILOX_WEYL = (0x9E3779B9, 0xBB67AE85)  # the key's increments between rounds
WORD = 0xFFFFFFFF
INIT_STREAM = 0x696E6974  # "init": the counter's third word, so that no other use of Philox draws the same words
LN2 = 0.6931471805599453
SQRT_HALF = 0.7071067811865476
ANGLE_UNIT = 1.4629180792671596e-09  # pi / 2**31: the angle of one step of the 32-bit word
LOG_SERIES = (0.3333333333333333, 0.2, 0.14285714285714285, 0.1111111111111111, 0.09090909090909091,
              0.07692307692307693, 0.06666666666666667, 0.058823529411764705)  # 1/3, 1/5, ..., 1/17
SIN_SERIES = (-0.16666666666666666, 0.008333333333333333, -0.0001984126984126984, 2.7557319223985893e-06,
              -2.505210838544172e-08, 1.6059043836821613e-10, -7.647163731819816e-13)  # -1/3!, 1/5!, ..., -1/15!
COS_SERIES = (-0.5, 0.041666666666666664, -0.001388888888888889, 2.48015873015873e-05, -2.755731922398589e-07,
              2.08767569878681e-09, -1.1470745597729725e-11, 4.779477332387385e-14)  # -1/2!, 1/4!, ..., 1/16!


def philox4x32_10(counter, key) -> tuple[np.ndarray, ...]:
    """Philox4x32-10 over arrays: counter is four arrays (or ints) of 32-bit words, key two ints; returns
    the four output words as uint64 arrays (products of two words fit 64 bits)."""
    c0, c1, c2, c3 = (np.asarray(c, dtype=np.uint64) for c in counter)
    k0, k1 = key
    multipliers, low, shift = [np.uint64(m) for m in PHILOX_MULTIPLIERS], np.uint64(WORD), np.uint64(32)
    for round_ in range(10):
        if round_:
            k0, k1 = (k0 + PHILOX_WEYL[0]) & WORD, (k1 + PHILOX_WEYL[1]) & WORD
        p0, p1 = c0 * multipliers[0], c2 * multipliers[1]
        high1, high0 = p1 >> shift, p0 >> shift  # in place from here: a third fewer passes over memory
        high1 ^= c1
        high1 ^= np.uint64(k0)
        high0 ^= c3
        high0 ^= np.uint64(k1)
        p1 &= low
        p0 &= low
        c0, c1, c2, c3 = high1, p1, high0, p0
    return c0, c1, c2, c3


def _horner(x: np.ndarray, coefficients) -> np.ndarray:
    """1 + c0 x + c1 x^2 + ..., innermost first, one rounding per operation."""
    p = np.full_like(x, coefficients[-1])
    for c in reversed(coefficients[:-1]):
        p *= x
        p += c
    p *= x
    p += 1.0
    return p


def _log_of_uniform(word: np.ndarray) -> np.ndarray:
    """ln u for u = (word + 0.5) / 2^32 in (0, 1): u = m 2^(e - 33) with m in [sqrt(1/2), sqrt(2)), and
    ln m = 2 s (1 + s^2/3 + ... + s^16/17), s = (m - 1) / (m + 1), |s| < 0.172 (error below 1e-15)."""
    mantissa, exponent = np.frexp((word * np.uint64(2) + np.uint64(1)).astype(np.float64))
    low = mantissa < SQRT_HALF
    m = np.where(low, mantissa * 2.0, mantissa)
    e = (exponent - low - 33).astype(np.float64)
    s = (m - 1.0) / (m + 1.0)
    return e * LN2 + (s + s) * _horner(s * s, LOG_SERIES)


def _cos_sin_of_uniform(word: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin of 2 pi word / 2^32: the quadrant from the top bits, the rest an angle within pi/4 of 0
    (Taylor series to the 16th and 15th power: errors below 1e-15)."""
    shifted = word + np.uint64(1 << 29)
    quadrant = (shifted >> np.uint64(30)) & np.uint64(3)
    theta = ((shifted & np.uint64((1 << 30) - 1)).astype(np.int64) - (1 << 29)).astype(np.float64) * ANGLE_UNIT
    theta2 = theta * theta
    c, s = _horner(theta2, COS_SERIES), theta * _horner(theta2, SIN_SERIES)
    odd = (quadrant & np.uint64(1)).astype(bool)  # quadrants 1 and 3 swap them, 1 and 2 negate cos, 2 and 3 sin
    cos, sin = np.where(odd, s, c), np.where(odd, c, s)
    np.negative(cos, out=cos, where=((quadrant + np.uint64(1)) & np.uint64(2)).astype(bool))
    np.negative(sin, out=sin, where=(quadrant & np.uint64(2)).astype(bool))
    return cos, sin


def standard_normals(seed: int, start: int, n: int) -> np.ndarray:
    """The float64 standard normals of flat offsets start..start+n-1 (the twin of kernels/init.cu)."""
    first, last = start // 4, (start + n + 3) // 4
    block = np.arange(first, last, dtype=np.uint64)
    words = philox4x32_10((block & np.uint64(WORD), block >> np.uint64(32), INIT_STREAM, 0),
                          (seed & WORD, (seed >> 32) & WORD))
    values = np.empty((last - first, 4))
    for lane, (radius_word, angle_word) in enumerate(((words[0], words[1]), (words[2], words[3]))):
        radius = np.sqrt(-2.0 * _log_of_uniform(radius_word))
        cos, sin = _cos_sin_of_uniform(angle_word)
        values[:, 2 * lane], values[:, 2 * lane + 1] = radius * cos, radius * sin
    return values.reshape(-1)[start - 4 * first:start - 4 * first + n]

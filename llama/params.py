"""Where each parameter lives in the one flat parameter buffer, and how it is initialized.

Both backends keep all parameters in one contiguous buffer (and the gradients in another of the
same layout), so that AdamW, the grad norm and checkpoints see one array. Tensors carry Meta's
names. Inside a layer wq, wk, wv are adjacent, so together they form one (q+k+v, dim) matrix that
a single matmul applies (`wqkv`); w1 (gate) and w3 (up) are adjacent in the same way (`w13`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .config import LlamaConfig


@dataclass(frozen=True)
class Tensor:
    name: str
    shape: tuple[int, ...]
    offset: int

    @property
    def size(self) -> int:
        return int(np.prod(self.shape))


def parameter_shapes(config: LlamaConfig) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every parameter, in layer order. Linear weights are (out, in)."""
    c, hd, f = config.dim, config.head_dim, config.ffn_hidden_dim
    shapes = [("tok_embeddings.weight", (config.vocab_size, c))]
    for i in range(config.n_layers):
        p = f"layers.{i}."
        shapes += [
            (p + "attention_norm.weight", (c,)),
            (p + "attention.wq.weight", (config.n_heads * hd, c)),
            (p + "attention.wk.weight", (config.n_kv_heads * hd, c)),
            (p + "attention.wv.weight", (config.n_kv_heads * hd, c)),
            (p + "attention.wo.weight", (c, config.n_heads * hd)),
            (p + "ffn_norm.weight", (c,)),
            (p + "feed_forward.w1.weight", (f, c)),
            (p + "feed_forward.w3.weight", (f, c)),
            (p + "feed_forward.w2.weight", (c, f)),
        ]
    shapes.append(("norm.weight", (c,)))
    if not config.tie_embeddings:
        shapes.append(("output.weight", (config.vocab_size, c)))
    return shapes


class ParameterLayout:
    """Offsets of the named tensors inside the flat buffer."""

    def __init__(self, config: LlamaConfig):
        self.config = config
        self.tensors: dict[str, Tensor] = {}
        offset = 0
        for name, shape in parameter_shapes(config):
            self.tensors[name] = Tensor(name, shape, offset)
            offset += self.tensors[name].size
        self.size = offset

    def views(self, flat: np.ndarray) -> dict[str, np.ndarray]:
        """Named numpy views into a flat host array."""
        return {t.name: flat[t.offset:t.offset + t.size].reshape(t.shape) for t in self.tensors.values()}

    def fused(self, layer: int, first: str, last: str) -> Tensor:
        """The adjacent tensors first..last of one layer as one matrix (e.g. wq..wv -> wqkv)."""
        a = self.tensors[f"layers.{layer}.{first}.weight"]
        b = self.tensors[f"layers.{layer}.{last}.weight"]
        cols = a.shape[1]
        return Tensor(f"layers.{layer}.{first}..{last}", ((b.offset + b.size - a.offset) // cols, cols), a.offset)

    def wqkv(self, layer: int) -> Tensor:
        return self.fused(layer, "attention.wq", "attention.wv")

    def w13(self, layer: int) -> Tensor:
        return self.fused(layer, "feed_forward.w1", "feed_forward.w3")

    def output(self) -> Tensor:
        """The output head: its own matrix, or the token embeddings when tied."""
        return self.tensors["tok_embeddings.weight" if self.config.tie_embeddings else "output.weight"]

    def layer_starts(self) -> list[int]:
        """Offsets where each layer's parameters begin, and the final norm's: the bucket boundaries of
        the gradients' reduce-scatter (llama/parallel/zero.py)."""
        names = [f"layers.{i}.attention_norm.weight" for i in range(self.config.n_layers)] + ["norm.weight"]
        return [self.tensors[name].offset for name in names]

    def gradient_groups(self) -> list[tuple[int, int]]:
        """[start, end) of the groups whose gradients the backward finishes one after another, as the
        optimizer in the backward updates them: the embedding table, each layer, the final norm and head."""
        starts = self.layer_starts()
        return list(zip([0, *starts], [*starts, self.size]))

    def norm_names(self) -> list[str]:
        """The RMSNorm weights, in layout order."""
        return [t.name for t in self.tensors.values() if len(t.shape) == 1]

    def decay_mask(self) -> np.ndarray:
        """uint8 per parameter: 1 where AdamW applies weight decay (2D weights), 0 for norms."""
        mask = np.zeros(self.size, dtype=np.uint8)
        for t in self.tensors.values():
            if len(t.shape) == 2:
                mask[t.offset:t.offset + t.size] = 1
        return mask


def count_parameters(config: LlamaConfig) -> int:
    return sum(int(np.prod(shape)) for _, shape in parameter_shapes(config))


# ---- the initialization: normal values from a counter-based generator, the same on the CPU and the GPU
#
# The value of the flat parameter at offset g is a pure function of (seed, g): Philox4x32-10 (Salmon et al.,
# SC'11, Random123's constants) keyed by the seed, at counter (g // 4 low word, high word, INIT_STREAM, 0),
# gives 4 words; Box-Muller turns words (0, 1) into the normals of lanes 0, 1 and words (2, 3) into those of
# lanes 2, 3, and lane g % 4 is g's. So any slice of the parameters (a tensor, a ZeRO shard) is drawn on its
# own, whatever the batch or the number of GPUs. The transform is float64 arithmetic made only of correctly
# rounded +, -, *, / and sqrt (polynomials instead of libm's log and sincos, no fused multiply-adds), and the
# scaled value is rounded to float32 once: kernels/init.cu computes the very same bits.

PHILOX_MULTIPLIERS = (0xD2511F53, 0xCD9E8D57)
PHILOX_WEYL = (0x9E3779B9, 0xBB67AE85)  # the key's increments between rounds
WORD = 0xFFFFFFFF
INIT_STREAM = 0x696E6974  # "init": the counter's third word, so that no other use of Philox draws the same words
INIT_STD = 0.02
LN2 = 0.6931471805599453
SQRT_HALF = 0.7071067811865476
ANGLE_UNIT = 1.4629180792671596e-09  # pi / 2**31: the angle of one step of the 32-bit word
LOG_SERIES = (0.3333333333333333, 0.2, 0.14285714285714285, 0.1111111111111111, 0.09090909090909091,
              0.07692307692307693, 0.06666666666666667, 0.058823529411764705)  # 1/3, 1/5, ..., 1/17
SIN_SERIES = (-0.16666666666666666, 0.008333333333333333, -0.0001984126984126984, 2.7557319223985893e-06,
              -2.505210838544172e-08, 1.6059043836821613e-10, -7.647163731819816e-13)  # -1/3!, 1/5!, ..., -1/15!
COS_SERIES = (-0.5, 0.041666666666666664, -0.001388888888888889, 2.48015873015873e-05, -2.755731922398589e-07,
              2.08767569878681e-09, -1.1470745597729725e-11, 4.779477332387385e-14)  # -1/2!, 1/4!, ..., 1/16!
CHUNK = 1 << 13  # Philox blocks drawn at a time on the host (their arrays stay in the L2 cache)


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


def initial_std(config: LlamaConfig, name: str, shape) -> float | None:
    """The standard deviation a tensor is drawn with, None for the RMSNorm weights (all 1). Matrices are
    N(0, 0.02), and the two projections that write into the residual stream (wo, w2) are scaled down by
    1/sqrt(2 * n_layers), as in GPT-2 and llm.c."""
    if len(shape) == 1:
        return None
    if name.endswith(("wo.weight", "w2.weight")):
        return INIT_STD / math.sqrt(2 * config.n_layers)
    return INIT_STD


def init_parameters(config: LlamaConfig, seed: int = 0, dtype=np.float32, on_tensor=None) -> np.ndarray:
    """A flat array of freshly initialized parameters (see initial_std), on the host; on_tensor(n), when
    given, is called after each tensor with its number of values (a progress bar's update)."""
    layout = ParameterLayout(config)
    flat = np.empty(layout.size, dtype=dtype)
    for t in layout.tensors.values():
        std = initial_std(config, t.name, t.shape)
        if std is None:
            flat[t.offset:t.offset + t.size] = 1.0
        else:
            for at in range(t.offset, t.offset + t.size, 4 * CHUNK):
                n = min(4 * CHUNK, t.offset + t.size - at)
                flat[at:at + n] = (standard_normals(seed, at, n) * std).astype(np.float32)
        if on_tensor is not None:
            on_tensor(t.size)
    return flat


def model_parameters(layout: ParameterLayout, params: np.ndarray | None, seed: int) -> np.ndarray:
    """A model's starting parameters: params, checked to be one flat array of the layout, or a fresh
    initialization from seed when None."""
    if params is None:
        return init_parameters(layout.config, seed)
    if params.shape != (layout.size,):
        raise ValueError(f"params must be a flat array of {layout.size} values, got shape {params.shape}")
    return params

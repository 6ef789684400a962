"""AdamW, global-norm gradient clipping and learning-rate schedules, in numpy.

The reference for kernels/adamw.cu and kernels/global_norm.cu: the same formulas on the same flat
buffers (parameters, gradients, first and second moments, a uint8 weight-decay mask).

AdamW with 8-bit moments (`--optimizer adamw8bit`, after Dettmers et al. 2021, as bitsandbytes and
torchao do it): the flat moment buffers are cut into blocks of QUANT_BLOCK values, each stored as one
fp32 scale (the block's largest magnitude) and a uint8 code per value, the index of the nearest level
of a dynamic map (DYNAMIC_SIGNED for the first moment, DYNAMIC_UNSIGNED, without zero, for the second:
see dynamic_map). A step
dequantizes a chunk of blocks, runs the same AdamW formulas on it and quantizes the new moments back.
Checkpoints keep the codes and scales as they are (Quantized); a dequantized state also quantizes back to
the same codes and scales, so a checkpoint with fp32 moments resumes an 8-bit run bit-exact too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from .options import SCHEDULES



@dataclass(frozen=True)
class AdamWConfig:
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1
    grad_clip: float = 1.0  # max global norm; 0 turns clipping off


def squared_norm(grads: np.ndarray) -> float:
    """sum(g^2) over a flat gradient buffer, accumulated in float64."""
    g = grads.astype(np.float64, copy=False)
    return float(np.dot(g, g))


def global_norm(grads: np.ndarray) -> float:
    """sqrt(sum(g^2)) over the whole flat gradient buffer, accumulated in float64."""
    return float(np.sqrt(squared_norm(grads)))


def clip_scale(norm: float, max_norm: float) -> float:
    """The factor that brings a gradient of this norm down to max_norm (1 when under it or off)."""
    return max_norm / norm if max_norm > 0 and norm > max_norm else 1.0


def clip_norm_estimate(current: np.ndarray, previous: np.ndarray, group: int) -> float:
    """The squared norm by which the optimizer in the backward clips a group's update, before the groups
    0..group-1 have their gradients: the finished groups' squared norms of this step (current[group:])
    plus the unfinished groups' of the last step (previous[:group]; zeros before the first step). For
    the last group (0) it is this step's squared norm."""
    return float(np.sum(current[group:])) + float(np.sum(previous[:group]))


def adamw_update(params: np.ndarray, grads: np.ndarray, m: np.ndarray, v: np.ndarray,
                 decay_mask: np.ndarray, step: int, lr: float, opt: AdamWConfig,
                 grad_scale: float = 1.0) -> None:
    """One AdamW step in place, with bias correction (step counts from 1) and weight decay,
    decoupled from the gradient, on the parameters where decay_mask is 1."""
    dt = params.dtype.type
    g = grads * dt(grad_scale)
    m *= dt(opt.beta1)
    m += dt(1 - opt.beta1) * g
    v *= dt(opt.beta2)
    v += dt(1 - opt.beta2) * g * g
    m_hat = m / dt(1 - opt.beta1 ** step)
    v_hat = v / dt(1 - opt.beta2 ** step)
    params -= dt(lr) * (m_hat / (np.sqrt(v_hat) + dt(opt.eps)) + dt(opt.weight_decay) * decay_mask * params)


# ---- 8-bit moments

QUANT_BLOCK = 256  # values that share one scale


def dynamic_map(signed: bool) -> np.ndarray:
    """The ascending float32 levels of 8-bit dynamic quantization in [-1, 1] (signed) or (0, 1]: per decade
    (0.1, 1] * 10^-e a linear run of levels, 2^(6 - e) for e = 0..6 on each side of zero (signed: 255
    levels with zero) or 2^(7 - e) for e = 0..7 (unsigned: 255 levels from 1e-7, without zero); code 255
    unused. Large values of a block keep about 2 significant digits, its small ones a rough magnitude down
    to 1e-6 (1e-7) of its largest. The second moment's map has no zero: a v that small in its block reads
    back as 1e-7 of the block's largest, never as 0 beside an m that is not (m / (sqrt(0) + eps): a step of
    900 lr for an m of 1e-5, tests/unit/test_optim.py; the zero-point problem of Li et al., 2023, which
    cost 0.33 nats at 300 steps on the built-in corpus, where rare tokens' embedding rows hold such values)."""
    decades = 7 if signed else 8
    positive = np.concatenate([10.0 ** -e * (0.1 + 0.9 * np.arange(1, n + 1) / n)
                               for e, n in ((e, 2 ** (decades - 1 - e)) for e in reversed(range(decades)))])
    levels = np.concatenate([-positive[::-1], [0.0], positive]) if signed else positive
    return levels.astype(np.float32)


DYNAMIC_SIGNED, DYNAMIC_UNSIGNED = dynamic_map(True), dynamic_map(False)
ZERO_CODES = tuple(int(np.searchsorted(levels, 0)) for levels in (DYNAMIC_SIGNED, DYNAMIC_UNSIGNED))  # m's, v's


def _midpoints(levels: np.ndarray) -> np.ndarray:
    return ((levels[:-1].astype(np.float64) + levels[1:]) / 2).astype(np.float32)


MIDPOINTS = {id(DYNAMIC_SIGNED): _midpoints(DYNAMIC_SIGNED), id(DYNAMIC_UNSIGNED): _midpoints(DYNAMIC_UNSIGNED)}


def _order_keys(x: np.ndarray) -> np.ndarray:
    """uint32 keys in the order of the float32 values x (negatives flipped below the positives)."""
    bits = np.ascontiguousarray(x, np.float32).view(np.uint32)
    return np.where(bits >> 31, ~bits, bits | np.uint32(0x80000000))


def _code_table(midpoints: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For each of the 65536 buckets of float32 order keys (their top 16 bits): how many midpoints lie
    below the bucket, and the key of the one midpoint inside it (the last key when none is): the nearest
    level of x is then table[0][b] + (key(x) >= table[1][b]), a lookup instead of a binary search. The
    levels are far enough apart (1.4% of a value at least) that no bucket (under 0.8%) holds two."""
    keys = _order_keys(midpoints)
    buckets = keys >> 16
    if np.any(np.diff(buckets) == 0):
        raise AssertionError("two midpoints share a bucket")
    below = np.searchsorted(buckets, np.arange(65536, dtype=np.uint32), side="left").astype(np.int32)
    inside = np.full(65536, np.iinfo(np.uint32).max, np.uint32)
    inside[buckets] = keys
    return below, inside


CODE_TABLES = {id(levels): _code_table(MIDPOINTS[id(levels)]) for levels in (DYNAMIC_SIGNED, DYNAMIC_UNSIGNED)}


def quantize_blocks(x: np.ndarray, levels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(codes uint8 (n,), scales float32 (ceil(n / QUANT_BLOCK),)) of a flat float32 array: per block the
    largest magnitude, and per value the nearest level of x / scale (ties go to the higher level); an
    all-zero block has scale 0 (and reads back as zeros whatever its codes)."""
    n = x.size
    blocks = -(-n // QUANT_BLOCK)
    padded = np.zeros(blocks * QUANT_BLOCK, np.float32)
    padded[:n] = x
    padded = padded.reshape(blocks, QUANT_BLOCK)
    scales = np.abs(padded).max(axis=1)
    with np.errstate(invalid="ignore", divide="ignore"):
        normalized = np.where(scales[:, None] > 0, padded / scales[:, None], np.float32(0))
    below, inside = CODE_TABLES[id(levels)]
    keys = _order_keys(normalized.ravel())
    bucket = keys >> 16  # the number of midpoints <= each value, as numpy.searchsorted(side="right") counts
    codes = (below[bucket] + (keys >= inside[bucket])).astype(np.uint8)
    return codes[:n], scales


class Quantized(NamedTuple):
    """One 8-bit moment as AdamW8bitState holds it: uint8 codes (one per value) and float32 scales (one per
    QUANT_BLOCK values), flat in the parameter layout."""
    codes: np.ndarray
    scales: np.ndarray


def fp32_moments(m, v) -> tuple:
    """(m, v) as float32 arrays: Quantized moments dequantized (m on the signed map, v on the unsigned one),
    arrays and None as they are."""
    return tuple(dequantize_blocks(x.codes, x.scales, levels) if isinstance(x, Quantized) else x
                 for x, levels in ((m, DYNAMIC_SIGNED), (v, DYNAMIC_UNSIGNED)))


def dequantize_blocks(codes: np.ndarray, scales: np.ndarray, levels: np.ndarray) -> np.ndarray:
    """float32 (n,): each code's level times its block's scale."""
    return levels[codes] * np.repeat(scales, QUANT_BLOCK)[:codes.size]


class AdamWState:
    """AdamW's moments over a flat parameter buffer, in the parameters' dtype (the plain optimizer)."""
    name = "adamw"

    def __init__(self, size: int, dtype=np.float32):
        self.m, self.v = np.zeros(size, dtype), np.zeros(size, dtype)

    def update(self, params: np.ndarray, grads: np.ndarray, decay_mask: np.ndarray, step: int, lr: float,
               opt: AdamWConfig, grad_scale: float = 1.0, start: int = 0) -> None:
        """AdamW on the values [start, start + n) of the flat buffers, given as params, grads, decay_mask;
        the same bits as one update of the whole buffers (start a multiple of QUANT_BLOCK for 8 bits)."""
        end = start + params.size
        adamw_update(params, grads, self.m[start:end], self.v[start:end], decay_mask, step, lr, opt, grad_scale)

    def moments(self) -> tuple[np.ndarray, np.ndarray]:
        """Copies of (m, v), as checkpoints hold them (in fp32)."""
        return self.m.copy(), self.v.copy()

    def load(self, m, v) -> None:
        """Moments from a checkpoint: float32 arrays, Quantized (dequantized) or None (zeros)."""
        m, v = fp32_moments(m, v)
        self.m[:] = 0 if m is None else m
        self.v[:] = 0 if v is None else v


class AdamW8bitState(AdamWState):
    """AdamW's moments in 8 bits: codes and block scales of m (signed map) and v (unsigned map), computed
    in fp32 whatever the parameters' dtype. update() works through chunks of CHUNK values, so its fp32
    temporaries stay small."""
    name = "adamw8bit"
    CHUNK = 256 * QUANT_BLOCK

    def __init__(self, size: int, dtype=np.float32):
        self.size, blocks = size, -(-size // QUANT_BLOCK)
        self.m_codes, self.v_codes = (np.full(size, code, np.uint8) for code in ZERO_CODES)
        self.m_scales, self.v_scales = np.zeros(blocks, np.float32), np.zeros(blocks, np.float32)

    def _chunk(self, start: int, end: int) -> tuple[np.ndarray, np.ndarray]:
        b0, b1 = start // QUANT_BLOCK, -(-end // QUANT_BLOCK)
        return (dequantize_blocks(self.m_codes[start:end], self.m_scales[b0:b1], DYNAMIC_SIGNED),
                dequantize_blocks(self.v_codes[start:end], self.v_scales[b0:b1], DYNAMIC_UNSIGNED))

    def _store(self, start: int, m: np.ndarray, v: np.ndarray) -> None:
        end, b0 = start + m.size, start // QUANT_BLOCK
        self.m_codes[start:end], m_scales = quantize_blocks(m, DYNAMIC_SIGNED)
        self.v_codes[start:end], v_scales = quantize_blocks(v, DYNAMIC_UNSIGNED)
        self.m_scales[b0:b0 + m_scales.size], self.v_scales[b0:b0 + v_scales.size] = m_scales, v_scales

    def update(self, params: np.ndarray, grads: np.ndarray, decay_mask: np.ndarray, step: int, lr: float,
               opt: AdamWConfig, grad_scale: float = 1.0, start: int = 0) -> None:
        """Dequantize, adamw_update, quantize back, chunk by chunk (chunks are whole blocks)."""
        end = start + params.size
        if start % QUANT_BLOCK or (end % QUANT_BLOCK and end != self.size):
            raise ValueError(f"8-bit moments update whole blocks of {QUANT_BLOCK}: [{start}, {end}) cuts one")
        for offset in range(0, params.size, self.CHUNK):
            n = min(self.CHUNK, params.size - offset)
            m, v = self._chunk(start + offset, start + offset + n)
            part = slice(offset, offset + n)
            adamw_update(params[part], grads[part], m, v, decay_mask[part], step, lr, opt, grad_scale)
            self._store(start + offset, m, v)

    def moments(self) -> tuple[np.ndarray, np.ndarray]:
        return self._chunk(0, self.size)

    def quantized(self) -> tuple[Quantized, Quantized]:
        """Copies of the codes and scales of (m, v), as checkpoints hold them."""
        return (Quantized(self.m_codes.copy(), self.m_scales.copy()),
                Quantized(self.v_codes.copy(), self.v_scales.copy()))

    def load(self, m, v) -> None:
        """Quantized moments as they are, float32 ones quantized, None as zeros."""
        if isinstance(m, Quantized) and isinstance(v, Quantized):
            for mine, theirs in ((self.m_codes, m.codes), (self.m_scales, m.scales), (self.v_codes, v.codes),
                                 (self.v_scales, v.scales)):
                mine[:] = theirs
            return
        m, v = fp32_moments(m, v)
        self._store(0, np.zeros(self.size, np.float32) if m is None else np.asarray(m, np.float32),
                    np.zeros(self.size, np.float32) if v is None else np.asarray(v, np.float32))


OPTIMIZER_STATES = {state.name: state for state in (AdamWState, AdamW8bitState)}  # by options.OPTIMIZERS


def learning_rate(step: int, max_steps: int, lr: float, warmup_steps: int = 0,
                  schedule: str = "cosine", final_lr_frac: float = 0.0, cooldown_frac: float = 0.2) -> float:
    """Learning rate at step (0-based): linear warmup, then the schedule down to lr * final_lr_frac.

    wsd (warmup-stable-decay) holds lr and cools down over the last cooldown_frac of the steps
    with a 1 - sqrt shape.
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}; choose from {', '.join(SCHEDULES)}")
    final = lr * final_lr_frac
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    if schedule == "constant":
        return lr
    if schedule == "wsd":
        cooldown_start = max(warmup_steps, int(max_steps * (1 - cooldown_frac)))
        if step < cooldown_start:
            return lr
        frac = (step - cooldown_start) / max(1, max_steps - cooldown_start)
        return final + (lr - final) * (1 - math.sqrt(min(frac, 1.0)))
    frac = min(1.0, (step - warmup_steps) / max(1, max_steps - warmup_steps))
    if schedule == "linear":
        return lr + (final - lr) * frac
    return final + 0.5 * (lr - final) * (1 + math.cos(math.pi * frac))


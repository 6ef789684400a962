"""AdamW, global-norm gradient clipping and learning-rate schedules, in numpy.

The reference for kernels/adamw.cu and kernels/global_norm.cu: the same formulas on the same flat
buffers (parameters, gradients, first and second moments, a uint8 weight-decay mask).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

SCHEDULES = ("cosine", "linear", "constant", "wsd")


@dataclass(frozen=True)
class AdamWConfig:
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1
    grad_clip: float = 1.0  # max global norm; 0 turns clipping off


def global_norm(grads: np.ndarray) -> float:
    """sqrt(sum(g^2)) over the whole flat gradient buffer, accumulated in float64."""
    g = grads.astype(np.float64, copy=False)
    return float(np.sqrt(np.dot(g, g)))


def clip_scale(norm: float, max_norm: float) -> float:
    """The factor that brings a gradient of this norm down to max_norm (1 when under it or off)."""
    return max_norm / norm if max_norm > 0 and norm > max_norm else 1.0


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


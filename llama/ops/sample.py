"""Launcher of the token sampler (kernels/sample.cu): one id per row of logits, drawn on the GPU with the
rules of sample_token in llama/model/generate.py, from a counter-based generator (Philox4x32-10) keyed by the
seed at the stream position read from device memory, so that a CUDA graph can replay it: the ids are a
pure function of (logits, settings, seed, counter, row)."""

from __future__ import annotations

import numbers

import numpy as np

from ..runtime.cuda import DeviceArray
from .common import I32, check, kernel

SAMPLE_BLOCK = 1024  # threads per row
MAX_VOCAB = 2 ** 24 - 1  # the kernel's fixed-point masses (2^40 = probability 1 of a row) must sum within 64 bits
FLOAT32_MAX = float(np.finfo(np.float32).max)
SIGNATURE = "PPififQP"  # ids, logits, V, temperature, top_k, top_p, seed, counter


def sample_tokens(ids: DeviceArray, logits: DeviceArray, temperature: float, top_k: int, top_p: float, seed: int,
                  counter: DeviceArray) -> None:
    """ids (B,) int32 <- one id drawn from each row of logits (B, V) fp32. temperature 0 (or top_p 0) is
    greedy, the argmax; top_k > 0 keeps the ids whose logit is at least the k-th largest; top_p < 1 keeps
    the most likely ids whose probabilities first sum to top_p, and always the likeliest; all the ids
    tied with the last one kept stay too. counter (1,) int32 on the device is the random stream's offset
    (e.g. the decoder's position): the same (seed, counter) draws the same ids."""
    if not isinstance(logits, DeviceArray) or len(logits.shape) != 2:
        raise ValueError(f"logits: expected a float32 (B, V) DeviceArray, got {logits!r}")
    B, V = logits.shape
    check("logits", logits, (B, V))
    check("ids", ids, (B,), I32)
    check("counter", counter, (1,), I32)
    if B < 1 or not 1 <= V <= MAX_VOCAB:
        raise ValueError(f"logits: need 1 or more rows of 1 to {MAX_VOCAB} ids, got {logits.shape}")
    if not _real(temperature) or not 0 <= temperature <= FLOAT32_MAX:
        raise ValueError(f"temperature must be a number from 0 to {FLOAT32_MAX:.4g} (float32), got {temperature!r}")
    if not _integer(top_k) or top_k < 0:
        raise ValueError(f"top_k must be an integer >= 0, got {top_k!r}")
    if not _real(top_p) or not 0 <= top_p <= 1:
        raise ValueError(f"top_p must be a number in [0, 1], got {top_p!r}")
    if not _integer(seed) or not 0 <= seed < 2 ** 64:
        raise ValueError(f"seed must be an integer in [0, 2**64), got {seed!r}")
    top_k = int(top_k) if top_k < V else 0  # keeping V or more ids keeps them all
    kernel("sample", "sample_tokens", SIGNATURE)(
        (B,), SAMPLE_BLOCK, ids.ptr, logits.ptr, V, float(temperature), top_k, float(top_p), int(seed), counter.ptr, dependent=True)


def _real(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def _integer(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)

"""The LoRA linear layer's twin (Hu et al. 2021, as PEFT's lora.Linear computes it), for --lora and --qlora:

    out = x @ W^T + scale * (dropout(x) @ A^T) @ B^T,   A (r, IC), B (OC, r), W (OC, IC) frozen,
    scale = alpha / r, or alpha / sqrt(r) with use_rslora (Kalajdzievski 2023, PEFT's option of that name);
    dropout(x) = x * keep / (1 - p) for a 0/1 keep mask (PEFT's nn.Dropout on the adapter's input only).

The backward gives dx (through W and through the adapter), dA and dB, never dW: the base is frozen.
The saved state is xa = dropout(x) @ A^T (..., r), as a kernel would keep it beside the base GEMM.

Initialization as PEFT's default (init_lora_weights=True): A from kaiming_uniform_(a=sqrt(5)), which is
uniform on (-1/sqrt(IC), 1/sqrt(IC)), and B = 0, so that a fresh adapter leaves the model as it was. Our
uniforms are drawn from a seed like the weights' normals (llama/twins/init.py): value g of the adapters' flat
buffer is a pure function of (seed, g), from Philox4x32-10 word g % 4 at counter (g // 4, LORA_STREAM), the
uniform (word + 0.5) / 2^32 in float64, times the bound, rounded once to float32: the same bits wherever it
is computed, and in any slice of the buffer on its own.
"""

from __future__ import annotations

import math

import numpy as np

from .init import WORD, philox4x32_10
from .matmul import matmul_backward, matmul_forward, matmul_input_backward

LORA_STREAM = 0x6C6F7261  # "lora": the counter's third word, apart from the weights' INIT_STREAM


def lora_scale(rank: int, alpha: float, use_rslora: bool = False) -> float:
    """PEFT's scaling of the adapter's output: alpha / r, or alpha / sqrt(r) (rsLoRA)."""
    return alpha / math.sqrt(rank) if use_rslora else alpha / rank


def dropout_multiplier(keep: np.ndarray, p: float) -> np.ndarray:
    """What dropout multiplies x by, from its keep mask (1 kept, 0 dropped): keep / (1 - p)."""
    return keep / (1.0 - p)


def uniforms(seed: int, start: int, n: int) -> np.ndarray:
    """float64 (n,) uniform on (-1, 1): 2 (word + 0.5) / 2^32 - 1 for flat offsets start .. start + n - 1."""
    first, last = start // 4, (start + n + 3) // 4
    block = np.arange(first, last, dtype=np.uint64)
    words = philox4x32_10((block & np.uint64(WORD), block >> np.uint64(32), LORA_STREAM, 0),
                          (seed & WORD, (seed >> 32) & WORD))
    lanes = np.stack(words, axis=1).reshape(-1)[start - 4 * first:start - 4 * first + n]
    return (lanes.astype(np.float64) + 0.5) / 2.0 ** 31 - 1.0


def lora_init(seed: int, start: int, rank: int, in_features: int, out_features: int) -> tuple[np.ndarray, np.ndarray]:
    """(A (rank, in) float32, B (out, rank) float32 zeros) as PEFT initializes them, A's values those of flat
    offsets start .. start + rank * in - 1 of the adapters' buffer."""
    bound = 1.0 / math.sqrt(in_features)
    a = (uniforms(seed, start, rank * in_features) * bound).astype(np.float32).reshape(rank, in_features)
    return a, np.zeros((out_features, rank), np.float32)


def adapter_forward(x: np.ndarray, a: np.ndarray, b: np.ndarray, scale: float,
                    dropout: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The adapter's part of the layer's output, beside the frozen product: (scale * (dropout(x) A^T) B^T (..., OC),
    xa (..., r)) of x (..., IC)."""
    xa = matmul_forward(x if dropout is None else x * dropout, a)
    return scale * matmul_forward(xa, b), xa


def adapter_backward(dout: np.ndarray, x: np.ndarray, xa: np.ndarray, a: np.ndarray, b: np.ndarray, scale: float,
                     dropout: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(the adapter's part of dx, dA, dB) from dout (..., OC): dB = scale dout^T xa, d(xa) = scale dout B,
    dA = d(xa)^T dropout(x), dx's part (d(xa) A) * dropout."""
    dxa, db = matmul_backward(dout, xa, b)
    dxa, db = scale * dxa, scale * db
    dx, da = matmul_backward(dxa, x if dropout is None else x * dropout, a)
    return (dx if dropout is None else dx * dropout), da, db


def lora_forward(x: np.ndarray, weight: np.ndarray, a: np.ndarray, b: np.ndarray, scale: float,
                 dropout: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(out (..., OC), xa (..., r)) of x (..., IC); dropout: dropout_multiplier's array of x's shape, or None."""
    delta, xa = adapter_forward(x, a, b, scale, dropout)
    return matmul_forward(x, weight) + delta, xa


def lora_backward(dout: np.ndarray, x: np.ndarray, xa: np.ndarray, weight: np.ndarray, a: np.ndarray,
                  b: np.ndarray, scale: float, dropout: np.ndarray | None = None
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(dx, dA, dB) from dout (..., OC): the adapter's (adapter_backward), and dx = dout W + its part. No dW."""
    dx_adapter, da, db = adapter_backward(dout, x, xa, a, b, scale, dropout)
    return matmul_input_backward(dout, weight) + dx_adapter, da, db


def lora_delta(a: np.ndarray, b: np.ndarray, scale: float) -> np.ndarray:
    """The adapter as a change of the weight (OC, IC): scale * B @ A (what --merge adds)."""
    return scale * (b @ a)

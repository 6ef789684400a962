"""The embedding table's twin (kernels/embedding.cu, llama/ops/embedding.py)."""

from __future__ import annotations

import numpy as np


def embedding_forward(tokens: np.ndarray, wte: np.ndarray) -> np.ndarray:
    """(B, T) token ids -> (B, T, C) rows of the embedding table."""
    return wte[tokens]


def embedding_backward(dout: np.ndarray, tokens: np.ndarray, vocab_size: int) -> np.ndarray:
    """Gradient of the (V, C) table: each position's dout added to its token's row."""
    dwte = np.zeros((vocab_size, dout.shape[-1]), dtype=dout.dtype)
    np.add.at(dwte, tokens.ravel(), dout.reshape(-1, dout.shape[-1]))
    return dwte

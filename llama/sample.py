"""Text generation from a model (either backend): temperature and top-k sampling, seeded."""

from __future__ import annotations

import numpy as np


def sample_token(logits: np.ndarray, rng: np.random.Generator, temperature: float = 1.0, top_k: int = 0) -> int:
    """Draw one id from (V,) logits; temperature 0 is greedy, top_k 0 keeps the whole vocabulary."""
    logits = logits.astype(np.float64)
    if temperature <= 0:
        return int(np.argmax(logits))
    logits = logits / temperature
    if 0 < top_k < logits.size:
        cutoff = np.partition(logits, -top_k)[-top_k]
        logits = np.where(logits >= cutoff, logits, -np.inf)
    probs = np.exp(logits - logits.max())
    return int(rng.choice(logits.size, p=probs / probs.sum()))


def generate(model, bos_id: int, max_new_tokens: int, max_len: int, rng: np.random.Generator,
             temperature: float = 1.0, top_k: int = 0) -> list[int]:
    """Ids sampled after <|begin_of_text|>, each from a forward over the last max_len tokens."""
    ids = [bos_id]
    for _ in range(max_new_tokens):
        window = np.array([ids[-max_len:]])
        model.forward(window)
        ids.append(sample_token(model.read_logits(position=window.shape[1] - 1)[0], rng, temperature, top_k))
    return ids[1:]

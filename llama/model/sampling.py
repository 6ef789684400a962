"""The host's sampling rules: the distribution a draw takes (sampling_probabilities, the GPU sampler's
reference), one draw (sample_token), the settings (Sampling), and the prefill/decode of a decoder that draws
on the host (HostSampling: llama/model/reference.py's ReferenceDecoder). llama/model/generate.py drives decoders."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


def sampling_probabilities(logits: np.ndarray, temperature: float = 1.0, top_k: int = 0,
                           top_p: float = 1.0) -> np.ndarray:
    """The (V,) float64 probabilities that sample_token draws from: logits / temperature, top_k > 0
    keeps the ids whose logit is at least the k-th largest, softmax, top_p < 1 keeps the most likely
    ids whose probabilities first sum to top_p (nucleus) and always the likeliest one, renormalized.
    temperature <= 0 is greedy: a one-hot of the argmax."""
    logits = np.asarray(logits, dtype=np.float64)
    if temperature <= 0:
        probs = np.zeros(logits.size)
        probs[np.argmax(logits)] = 1.0
        return probs
    logits = logits / temperature
    if 0 < top_k < logits.size:
        cutoff = np.partition(logits, -top_k)[-top_k]
        logits = np.where(logits >= cutoff, logits, -np.inf)
    probs = np.exp(logits - logits.max())
    probs /= probs.sum()
    if top_p < 1.0:
        order = np.argsort(-probs, kind="stable")
        keep = np.cumsum(probs[order]) - probs[order] < top_p  # ids before which the mass is still short
        keep[0] = True
        probs[order[~keep]] = 0.0
        probs /= probs.sum()
    return probs


def sample_token(logits: np.ndarray, rng: np.random.Generator, temperature: float = 1.0, top_k: int = 0,
                 top_p: float = 1.0) -> int:
    """Draw one id from (V,) logits. temperature 0 is greedy; top_k > 0 keeps the k most likely ids;
    top_p < 1 keeps the most likely ids whose probabilities first sum to top_p (nucleus), and always
    the likeliest one (top_p 0 is greedy)."""
    if temperature <= 0:
        return int(np.argmax(np.asarray(logits, dtype=np.float64)))
    probs = sampling_probabilities(logits, temperature, top_k, top_p)
    return int(rng.choice(probs.size, p=probs))


@dataclass(frozen=True)
class Sampling:
    """How ids are drawn: temperature 0 is greedy; top_k > 0 keeps the k most likely ids; top_p < 1 the
    nucleus; seed makes the draws reproducible (the same seed, prompt and model give the same ids)."""
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0


class HostSampling:
    """prefill() and decode() of a decoder that has forward() only: the ids are drawn on the host by
    sample_token, from a numpy generator that prefill() seeds with the Sampling's seed."""

    def prefill(self, tokens: np.ndarray, sampling: Sampling) -> np.ndarray:
        self._rng = np.random.default_rng(sampling.seed)
        self._drawn = self._draw(self.forward(tokens), sampling)
        return self._drawn

    def decode(self, count: int, sampling: Sampling) -> np.ndarray:
        if count < 1 or self.position + count > self.max_len:
            raise ValueError(f"{count} decode steps do not fit: {self.position} of {self.max_len} positions used")
        if getattr(self, "_drawn", None) is None:
            raise ValueError("decode() continues from prefill() or decode(), which draw the ids it feeds")
        steps = []
        for _ in range(count):
            self._drawn = self._draw(self.forward(self._drawn[:, None]), sampling)
            steps.append(self._drawn)
        return np.stack(steps, axis=1)

    def _draw(self, logits: np.ndarray, sampling: Sampling) -> np.ndarray:
        return np.array([sample_token(row, self._rng, sampling.temperature, sampling.top_k, sampling.top_p)
                         for row in logits])

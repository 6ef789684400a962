"""Text generation with a KV cache: the sampling loop over a decoder, and the decoder of a training model.

A decoder runs the model on new tokens while keeping every earlier position's keys and values, so
each generated token costs one position instead of the whole window:
  decoder.prefill(tokens, sampling)  tokens (B, n), the next n positions of each sequence -> (B,) the
                                     next id of each, drawn by the Sampling's rules
  decoder.decode(count, sampling)    count steps, each feeding the ids drawn last -> (B, count) ids
  decoder.forward(tokens)            (B, V) logits of the last of n new positions (no draw)
  decoder.reset()                    forget the cache (position 0)
  decoder.position, decoder.max_len, decoder.batch
ReferenceDecoder (llama/model/reference.py, numpy; it draws on the host through HostSampling) and
GPUDecoder (llama/model/gpu_decoder.py, our kernels; it draws on the GPU) have this interface;
generate() drives either.
"""

from __future__ import annotations

import codecs
import sys
import time
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


@dataclass
class Generation:
    tokens: list[int]  # the new ids, the stop id included when one ended the generation
    prompt_tokens: int
    prefill_seconds: float  # the prompt and the first id
    decode_seconds: float

    def speeds(self) -> str:
        decoded = max(len(self.tokens) - 1, 0)  # the first new id comes from the prefill's logits
        prefill = self.prompt_tokens / self.prefill_seconds if self.prefill_seconds else float("inf")
        decode = decoded / self.decode_seconds if self.decode_seconds else float("nan")
        return (f"prefill {self.prompt_tokens} tokens: {prefill:,.1f} tokens/s | "
                f"decode {decoded} tokens: {decode:,.1f} tokens/s")


def generate(decoder, prompt: list[int], max_new_tokens: int, sampling: Sampling, stop_ids=(), on_token=None,
             burst: int = 16) -> Generation:
    """Draw up to max_new_tokens ids after prompt (batch 1), stopping after a stop id or when the cache
    is full; on_token(id) is called as each id comes. The decoder runs `burst` steps between reads of
    the ids (the steps drawn after a stop id are dropped)."""
    if not 0 < len(prompt) <= decoder.max_len:
        raise ValueError(f"the prompt must hold 1 to {decoder.max_len} tokens, got {len(prompt)}")
    decoder.reset()
    t0 = time.perf_counter()
    drawn = [int(decoder.prefill(np.asarray([prompt]), sampling)[0])]
    t1 = time.perf_counter()
    tokens = []
    while drawn:
        for token in drawn:
            tokens.append(token)
            if on_token is not None:
                on_token(token)
            if token in stop_ids or len(tokens) == max_new_tokens:
                drawn = []
                break
        else:
            room = decoder.max_len - decoder.position
            count = min(burst, max_new_tokens - len(tokens), room)
            drawn = [int(t) for t in decoder.decode(count, sampling)[0]] if count > 0 else []
    return Generation(tokens, len(prompt), t1 - t0, time.perf_counter() - t1)


class TextStream:
    """on_token callback that writes the text as it is produced; the bytes of a character split
    across tokens are held back until the character is complete."""

    def __init__(self, tokenizer, file=None):
        self.tokenizer, self.file = tokenizer, file or sys.stdout
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def __call__(self, token: int) -> None:
        self.file.write(self.decoder.decode(self.tokenizer.token_bytes(token)))
        self.file.flush()

    def finish(self) -> None:
        """The end of the text: bytes of an incomplete last character come out as U+FFFD, as decode() gives."""
        self.file.write(self.decoder.decode(b"", final=True))
        self.file.flush()


def decoder_for(model, plan, max_len: int, batch: int = 1):
    """The decoder of a training model's current weights: a ReferenceModel's on the CPU; on the GPU a
    bf16 model's own bf16 weights, read in place on one GPU, else a bf16 copy of the fp32 weights (on
    several GPUs a snapshot gathered from every rank: all ranks call this)."""
    from .model.reference import ReferenceDecoder
    if isinstance(getattr(model, "params", None), np.ndarray):
        return ReferenceDecoder(model.config, model.params, batch, max_len)
    from .model.gpu_decoder import GPUDecoder
    weights = getattr(model, "params_bf16", None) if getattr(model, "comm", None) is None else None
    return GPUDecoder(model.config, model.master_weights(), batch, max_len, weights=weights, plan=plan)

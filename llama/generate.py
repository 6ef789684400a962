"""Text generation with a KV cache: the sampling loop over a decoder, and the decoder of a training model.

A decoder runs the model on new tokens while keeping every earlier position's keys and values, so
each generated token costs one position instead of the whole window:
  decoder.forward(tokens)  tokens (B, n), the next n positions of each sequence -> (B, V) logits of
                           the last one; prefill is forward(prompt), decode is forward(token)
  decoder.reset()          forget the cache (position 0)
  decoder.position, decoder.max_len, decoder.batch
ReferenceDecoder (llama/model/reference.py, numpy) and GPUDecoder (llama/model/gpu_decoder.py, our
kernels) have this interface; generate() drives either.
"""

from __future__ import annotations

import codecs
import sys
import time
from dataclasses import dataclass

import numpy as np

from .model.reference import ReferenceDecoder


def sample_token(logits: np.ndarray, rng: np.random.Generator, temperature: float = 1.0, top_k: int = 0,
                 top_p: float = 1.0) -> int:
    """Draw one id from (V,) logits. temperature 0 is greedy; top_k > 0 keeps the k most likely ids;
    top_p < 1 keeps the most likely ids whose probabilities first sum to top_p (nucleus), and always
    the likeliest one (top_p 0 is greedy)."""
    logits = np.asarray(logits, dtype=np.float64)
    if temperature <= 0:
        return int(np.argmax(logits))
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
    return int(rng.choice(probs.size, p=probs))


@dataclass
class Generation:
    tokens: list[int]  # the new ids, the stop id included when one ended the generation
    prompt_tokens: int
    prefill_seconds: float
    decode_seconds: float

    def speeds(self) -> str:
        decoded = max(len(self.tokens) - 1, 0)  # the first new id comes from the prefill's logits
        prefill = self.prompt_tokens / self.prefill_seconds if self.prefill_seconds else float("inf")
        decode = decoded / self.decode_seconds if self.decode_seconds else float("nan")
        return (f"prefill {self.prompt_tokens} tokens: {prefill:,.1f} tokens/s | "
                f"decode {decoded} tokens: {decode:,.1f} tokens/s")


def generate(decoder, prompt: list[int], max_new_tokens: int, rng: np.random.Generator, temperature: float = 1.0,
             top_k: int = 0, top_p: float = 1.0, stop_ids=(), on_token=None) -> Generation:
    """Sample up to max_new_tokens ids after prompt (batch 1), stopping after a stop id or when the
    cache is full; on_token(id) is called as each id is drawn."""
    if not 0 < len(prompt) <= decoder.max_len:
        raise ValueError(f"the prompt must hold 1 to {decoder.max_len} tokens, got {len(prompt)}")
    decoder.reset()
    t0 = time.perf_counter()
    logits = decoder.forward(np.asarray([prompt]))
    t1 = time.perf_counter()
    tokens = []
    for step in range(max_new_tokens):
        if step:
            logits = decoder.forward(np.asarray([[tokens[-1]]]))
        tokens.append(sample_token(logits[0], rng, temperature, top_k, top_p))
        if on_token is not None:
            on_token(tokens[-1])
        if tokens[-1] in stop_ids or decoder.position >= decoder.max_len:
            break
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


def decoder_for(model, plan, max_len: int, batch: int = 1):
    """The decoder of a training model's current weights: a ReferenceModel's on the CPU, a GPU
    model's fp32 master weights on the GPU (read in place on one GPU; on several, a snapshot
    gathered from every rank: all ranks call this), with the run plan's KV-cache dtype."""
    if isinstance(getattr(model, "params", None), np.ndarray):
        return ReferenceDecoder(model.config, model.params, batch, max_len)
    from .model.gpu_decoder import GPUDecoder
    return GPUDecoder(model.config, model.master_weights(), plan.decode_cache_dtype, batch, max_len)

"""Text generation with a KV cache: the sampling loop over a decoder, and the decoder of a training model.

A decoder runs the model on new tokens while keeping every earlier position's keys and values, so
each generated token costs one position instead of the whole window:
  decoder.prefill(tokens, sampling)  tokens (B, n), the next n positions of each sequence -> (B,) the
                                     next id of each, drawn by the Sampling's rules
  decoder.decode(count, sampling)    count steps, each feeding the ids drawn last -> (B, count) ids
  decoder.forward(tokens)            (B, V) logits of the last of n new positions (no draw)
  decoder.reset()                    forget the cache (position 0)
  decoder.position, decoder.max_len, decoder.batch
ReferenceDecoder (llama/model/reference.py, numpy; it draws on the host through HostSampling, with the
sampling rules in llama/model/sampling.py) and GPUDecoder (llama/model/gpu_decoder.py, our kernels; it draws
on the GPU) have this interface; generate() drives either.
"""

from __future__ import annotations

import codecs
import sys
import time
from dataclasses import dataclass

import numpy as np

from .gpu_decoder import GPUDecoder
from .reference import ReferenceDecoder
from .sampling import Sampling


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
    """The decoder of a training model's current weights: a ReferenceModel's on the CPU (with its adapters, shared);
    on the GPU a bf16 model's own bf16 weights, read in place on one GPU, else a bf16 copy of the fp32 weights (on
    several GPUs a snapshot gathered from every rank: all ranks call this)."""
    if isinstance(getattr(model, "params", None), np.ndarray):
        return ReferenceDecoder(model.config, model.params, batch, max_len, model.adapter_layout, model.adapters)
    weights = getattr(model, "params_bf16", None) if getattr(model, "comm", None) is None else None
    return GPUDecoder(model.config, plan, model.master_weights(), batch, max_len, weights=weights)

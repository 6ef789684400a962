"""Text generation with a KV cache: the sampling loop, and the CPU decoder.

A decoder runs the model on new tokens while keeping every earlier position's keys and values, so
each generated token costs one position instead of the whole window:
  decoder.forward(tokens)  tokens (B, n), the next n positions of each sequence -> (B, V) logits of
                           the last one; prefill is forward(prompt), decode is forward(token)
  decoder.reset()          forget the cache (position 0)
  decoder.position, decoder.max_len, decoder.batch
ReferenceDecoder (here, numpy, with the layer functions of llama/model/reference.py) and GPUDecoder
(llama/model/gpu_decoder.py, our kernels) have this interface; generate() drives either.
"""

from __future__ import annotations

import codecs
import sys
import time
from dataclasses import dataclass

import numpy as np

from .config import LlamaConfig
from .params import ParameterLayout
from .model.reference import (embedding_forward, matmul_forward, residual_forward, rmsnorm_forward, rope_cos_sin,
                        rope_forward, swiglu_forward)


def sample_token(logits: np.ndarray, rng: np.random.Generator, temperature: float = 1.0, top_k: int = 0,
                 top_p: float = 1.0) -> int:
    """Draw one id from (V,) logits. temperature 0 is greedy; top_k > 0 keeps the k most likely ids;
    top_p < 1 keeps the most likely ids whose probabilities first sum to top_p (nucleus)."""
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


def cached_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, p0: int) -> np.ndarray:
    """Causal grouped-query attention of new queries over a KV cache, the twin of decode_attention in
    kernels/decode.cu. q (B, H, n, D) at positions p0 .. p0 + n - 1; k, v (B, KV, p0 + n, D), the
    cached positions 0 .. p0 + n - 1 -> (B, n, H * D). Query i sees keys 0 .. p0 + i."""
    B, H, n, D = q.shape
    KV, L = k.shape[1], k.shape[2]
    q_stacked = q.reshape(B, KV, H // KV * n, D)  # the query heads that share one kv head
    scores = (q_stacked @ k.swapaxes(-1, -2)).reshape(B, H, n, L) * q.dtype.type(1 / np.sqrt(D))
    future = np.arange(L)[None, :] > p0 + np.arange(n)[:, None]
    scores = np.where(future, -np.inf, scores)
    probs = np.exp(scores - scores.max(axis=-1, keepdims=True))
    probs /= probs.sum(axis=-1, keepdims=True)
    out = (probs.reshape(B, KV, H // KV * n, L) @ v).reshape(B, H, n, D)
    return out.transpose(0, 2, 1, 3).reshape(B, n, H * D)


class ReferenceDecoder:
    """The model on the CPU with a KV cache: reference.py's layers on the new positions only.
    params is a flat array in the parameter layout (a ReferenceModel's .params: shared, not copied)."""

    def __init__(self, config: LlamaConfig, params: np.ndarray, batch: int = 1, max_len: int | None = None):
        self.config, self.batch = config, batch
        self.max_len = min(max_len or config.max_seq_len, config.max_seq_len)
        self.layout = ParameterLayout(config)
        if params.shape != (self.layout.size,):
            raise ValueError(f"params must be a flat array of {self.layout.size} values, got shape {params.shape}")
        self.params, self.dtype = params, params.dtype
        self.p = self.layout.views(params)
        self.rope_cos, self.rope_sin = rope_cos_sin(config, self.max_len)
        shape = (batch, config.n_kv_heads, self.max_len, config.head_dim)
        self.k_cache = [np.zeros(shape, self.dtype) for _ in range(config.n_layers)]
        self.v_cache = [np.zeros(shape, self.dtype) for _ in range(config.n_layers)]
        self.position = 0

    def reset(self) -> None:
        self.position = 0

    def _matrix(self, tensor) -> np.ndarray:
        return self.params[tensor.offset:tensor.offset + tensor.size].reshape(tensor.shape)

    def forward(self, tokens: np.ndarray) -> np.ndarray:
        c, p, L = self.config, self.p, self.layout
        tokens = np.asarray(tokens)
        B, n = tokens.shape
        p0 = self.position
        if B != self.batch or p0 + n > self.max_len:
            raise ValueError(f"tokens {tokens.shape} do not fit: batch {self.batch}, {p0} of {self.max_len} "
                             "positions used")
        x = embedding_forward(tokens, p["tok_embeddings.weight"]).astype(self.dtype)
        for i in range(c.n_layers):
            pre = f"layers.{i}."
            ln, _ = rmsnorm_forward(x, p[pre + "attention_norm.weight"], c.norm_eps)
            qkv = matmul_forward(ln, self._matrix(L.wqkv(i)))
            q, k, v = rope_forward(qkv, self.rope_cos[p0:], self.rope_sin[p0:], c.n_heads, c.n_kv_heads)
            self.k_cache[i][:, :, p0:p0 + n] = k
            self.v_cache[i][:, :, p0:p0 + n] = v
            att = cached_attention(q, self.k_cache[i][:, :, :p0 + n], self.v_cache[i][:, :, :p0 + n], p0)
            h = residual_forward(x, matmul_forward(att, p[pre + "attention.wo.weight"]))
            ln, _ = rmsnorm_forward(h, p[pre + "ffn_norm.weight"], c.norm_eps)
            ffn = swiglu_forward(matmul_forward(ln, self._matrix(L.w13(i))))
            x = residual_forward(h, matmul_forward(ffn, p[pre + "feed_forward.w2.weight"]))
        self.position += n
        lnf, _ = rmsnorm_forward(x[:, -1], p["norm.weight"], c.norm_eps)
        return matmul_forward(lnf, self._matrix(L.output()))


def decoder_for(model, max_len: int, batch: int = 1):
    """The decoder of a training model's current weights: a ReferenceModel's on the CPU, a GPU
    model's fp32 master weights on the GPU (read in place on one GPU; on several, a snapshot
    gathered from every rank: all ranks call this)."""
    if isinstance(getattr(model, "params", None), np.ndarray):
        return ReferenceDecoder(model.config, model.params, batch, max_len)
    from .model.gpu_decoder import GPUDecoder
    return GPUDecoder(model.config, model.master_weights(), batch, max_len)

"""Generation on the GPU with a KV cache: the decoder interface of llama/model/generate.py on our kernels.

Weights: the bf16 copy of every matrix (a bf16 training model's own, read in place, or one made here
from fp32 weights and remade by reset()); the RMSNorm weights are read in fp32 from the flat fp32
parameters (llama/params.py layout). The caches, (B, KV, max_len, D) bf16 per layer for k and v.

Prefill (the prompt, or any new positions) runs the bf16 training model's block (llama/model/bf16_block.py, its
linear layers bf16's, its attention this decoder's) over them: the GEMMs with RoPE in the QKV epilogue, the k, v
to the cache, flash attention when the chunk starts the sequence (else attention over the cache), fused
residual+RMSNorm, SwiGLU.
A decode step is one token per sequence through kernels/gemv.cu and kernels/decode.cu, which read
the position from device memory; with the sampler (kernels/sample.cu) and the step's end it is
captured once as a CUDA graph (per batch and sampling settings) and replayed per token:
  embed_tokens -> per layer: gemv_qkv_rope (RMSNorm in, RoPE and the cache write out) ->
  decode_attention (flash-decoding) -> gemv_residual (wo, + residual, the stream's sums of squares) ->
  gemv_swiglu (RMSNorm in, w13, SwiGLU out) -> gemv_residual (w2) -> gemv_logits (final RMSNorm, head)
  -> sample_tokens -> advance (the id into the history, position + 1).
Only token ids cross to the host, once per burst of steps. The step keeps its own path rather than the
block's: one position per sequence is a GEMV, not a GEMM, and its kernels fuse what the block runs as kernels
of their own (the RMSNorms into the GEMVs' loads; RoPE, the cache write and the residual adds with the
stream's sums of squares into their epilogues), so the block would launch more kernels and read the stream
more often for every token.
"""

from __future__ import annotations

import numpy as np

from .. import ops
from ..config import LlamaConfig
from ..runtime.cuda import BF16, DeviceArray, Graph, empty, to_device, zeros
from ..ops.flash_attention import HEAD_DIMS
from ..ops.decode import MAX_HEAD_DIM
from ..ops.gemv import MAX_BATCH, DecodeScratch
from ..params import ParameterLayout
from .base import rope_cos_sin, weakly
from .bf16_block import BF16Block
from .linears import BF16Linears

PREFILL_TOKENS = 4096  # positions of all sequences that one prefill chunk takes


class GPUDecoder:
    """The decoder interface of llama/model/generate.py with our kernels; see the module docstring."""

    def __init__(self, config: LlamaConfig, plan, params: DeviceArray, batch: int = 1, max_len: int | None = None,
                 weights: DeviceArray | None = None):
        """plan: which GEMM and flash attention builds the prefill runs (llama/run/plan.py, the caller's);
        params: the flat fp32 weights; weights: their bf16 copy to read in place (None: made here)."""
        c = config
        self.config, self.batch = config, batch
        self.max_len = min(max_len or c.max_seq_len, c.max_seq_len)
        self.layout = ParameterLayout(config)
        if not isinstance(params, DeviceArray) or params.dtype != np.float32 or params.size < self.layout.size:
            raise ValueError(f"params must be a float32 device array of {self.layout.size} values")
        if weights is not None and (weights.dtype != BF16 or weights.size < self.layout.size):
            raise ValueError(f"weights must be a bfloat16 device array of {self.layout.size} values")
        if not 1 <= batch <= MAX_BATCH:
            raise ValueError(f"the GPU decoder takes 1 to {MAX_BATCH} sequences, not {batch}")
        if c.dim % 8 or c.head_dim % 8 or c.ffn_hidden_dim % 8 or c.head_dim > MAX_HEAD_DIM:
            raise ValueError(f"the GPU decoder needs dim, head_dim and the FFN width in multiples of 8 and head_dim "
                             f"<= {MAX_HEAD_DIM}: {c}")
        self.plan = plan
        self.params = params
        self.owns_weights = weights is None
        self.weights = empty(self.layout.size, BF16) if weights is None else weights
        self.chunk = max(1, min(self.max_len, PREFILL_TOKENS // batch))
        B, H, KV, D, C, F = batch, c.n_heads, c.n_kv_heads, c.head_dim, c.dim, c.ffn_hidden_dim
        cache = (B, KV, self.max_len, D)
        self.k_cache = [zeros(cache, BF16) for _ in range(c.n_layers)]
        self.v_cache = [zeros(cache, BF16) for _ in range(c.n_layers)]
        cos, sin = rope_cos_sin(config, self.max_len)
        self.rope_cos, self.rope_sin = to_device(cos.astype(np.float32)), to_device(sin.astype(np.float32))
        N = B * self.chunk
        attention_records = max(ops.attention_scratch_size(s, H, D, self.max_len) for s in range(1, N + 1))
        self.scratch = DecodeScratch(C, attention_records)
        # a decode step's state: the fed ids, their position, the sampled ids so far, the fp32 stream
        self.tokens, self.position_d = zeros(B, np.int32), zeros(1, np.int32)
        self.history = zeros((B, self.max_len), np.int32)
        self.step = {"x": empty((B, C)), "q": empty((B, 1, H, D)), "att": empty((B, 1, H * D), BF16),
                     "ffn": empty((B, F), BF16), "logits": empty((B, c.vocab_size))}
        # a prefill chunk's activations (bf16, as in training), for up to `chunk` positions per sequence
        self.prefill_buffers = {"tokens": empty(N, np.int32), "x": empty((N, C), BF16), "ln1": empty((N, C), BF16),
                                "rstd1": empty(N), "qkv": empty(N * (H + 2 * KV) * D, BF16),
                                "att": empty(N * H * D, BF16), "lse": empty(B * H * self.chunk),
                                "h": empty((N, C), BF16), "branch": empty((N, C), BF16),
                                "gate_up": empty((N, 2 * F), BF16), "ffn": empty((N, F), BF16)}
        self.stream_slots = 1  # partial sums of squares of the stream x in scratch.squares (per sequence)
        self.graph = None  # (sampling settings, the captured decode step): the last settings' only
        self.chunk_start = 0  # the first position of the prefill chunk running (_attention)
        self.drawn = False  # whether self.tokens holds ids drawn by prefill() or decode(), for decode() to feed
        self.position = 0
        self.block = BF16Block(config, self.layout, plan, BF16Linears(plan, weakly(self.weight), None),
                               weakly(self.master))
        self.block.attention = weakly(self._attention)
        self.reset()

    # ---- weights

    def weight(self, tensor) -> DeviceArray:
        """A matrix's bf16 copy (a Tensor of the layout or its name)."""
        tensor = self.layout.tensors[tensor] if isinstance(tensor, str) else tensor
        return self.weights.view(tensor.offset, tensor.shape)

    def master(self, name: str) -> DeviceArray:
        """A norm's fp32 weights."""
        tensor = self.layout.tensors[name]
        return self.params.view(tensor.offset, tensor.shape)

    def reset(self) -> None:
        """Forget the cache (position 0); a decoder with its own bf16 copy remakes it from params."""
        if self.owns_weights:
            ops.round_to_bf16(self.weights.prefix(self.layout.size), self.params.prefix(self.layout.size))
        self.position, self.drawn = 0, False

    # ---- the decoder interface

    def forward(self, tokens: np.ndarray) -> np.ndarray:
        """(B, V) fp32 logits of the last of n new positions (tokens (B, n)); one position after the
        first runs the decode step's kernels, more run the prefill's."""
        n = self._check(tokens)
        if n == 1 and self.position > 0:
            self.tokens.upload(np.asarray(tokens, np.int32).ravel())
            self.position_d.upload(np.array([self.position], np.int32))
            self._decode_layers()
        else:
            self._prefill(tokens)
        self._logits()
        self.position += n
        self.drawn = False
        return self.step["logits"].download()

    def prefill(self, tokens: np.ndarray, sampling) -> np.ndarray:
        """Run tokens (B, n), the next n positions, and draw each sequence's next id (B,)."""
        n = self._check(tokens)
        self._prefill(tokens)
        self.position_d.upload(np.array([self.position + n - 1], np.int32))
        self._logits()
        self._sample(sampling)
        self.position += n
        self.drawn = True
        return self.tokens.download()

    def decode(self, count: int, sampling) -> np.ndarray:
        """count decode steps, each feeding the last drawn ids: (B, count) the ids drawn."""
        if count < 1 or self.position + count > self.max_len:
            raise ValueError(f"{count} decode steps do not fit: {self.position} of {self.max_len} positions used")
        if not self.drawn:
            raise ValueError("decode() continues from prefill() or decode(), which draw the ids it feeds")
        start, key = self.position, (sampling.temperature, sampling.top_k, sampling.top_p, sampling.seed)
        for _ in range(count):
            if self.graph is not None and self.graph[0] == key:
                self.graph[1].replay()
            else:  # the first step runs eagerly (the kernels compile and load), the graph is captured after
                self._decode_step(sampling)
                self.graph = None  # the old graph's memory goes before the new one is made
                self.graph = (key, Graph(lambda: self._decode_step(sampling)))
        self.position += count
        return self.history.download()[:, start + 1:start + count + 1]

    def _check(self, tokens: np.ndarray) -> int:
        tokens = np.asarray(tokens)
        if tokens.ndim != 2 or tokens.shape[0] != self.batch or tokens.shape[1] == 0 \
                or self.position + tokens.shape[1] > self.max_len:
            raise ValueError(f"tokens {tokens.shape} do not fit: batch {self.batch}, {self.position} of "
                             f"{self.max_len} positions used")
        if tokens.min() < 0 or tokens.max() >= self.config.vocab_size:
            raise ValueError(f"tokens hold ids outside [0, {self.config.vocab_size})")
        return tokens.shape[1]

    # ---- the launches

    def _decode_step(self, sampling) -> None:
        self._decode_layers()
        self._logits()
        self._sample(sampling)

    def _stream_norm(self, name: str) -> ops.StreamNorm:
        """The RMSNorm `name` of the stream x, with the sums of squares its last writer left."""
        return ops.StreamNorm(self.master(name), self.scratch.squares, self.stream_slots, self.config.norm_eps)

    def _decode_layers(self) -> None:
        """One position per sequence (ids in self.tokens, at position_d) through every layer."""
        c, L, s, squares = self.config, self.layout, self.step, self.scratch.squares
        ops.embed_tokens(s["x"], squares.prefix(self.batch), self.tokens, self.weight("tok_embeddings.weight"))
        self.stream_slots = 1
        for i in range(c.n_layers):
            pre = f"layers.{i}."
            ops.gemv_qkv_rope(s["q"].reshape(self.batch, c.n_heads, c.head_dim), self.k_cache[i], self.v_cache[i],
                              s["x"], self.weight(L.wqkv(i)), self._stream_norm(pre + "attention_norm.weight"),
                              self.rope_cos, self.rope_sin, self.position_d)
            ops.decode_attention(s["att"], s["q"], self.k_cache[i], self.v_cache[i], self.position_d, self.scratch)
            self.stream_slots = ops.gemv_residual(s["x"], squares, s["att"].reshape(self.batch, -1),
                                                  self.weight(pre + "attention.wo.weight"))
            ops.gemv_swiglu(s["ffn"], s["x"], self.weight(L.w13(i)), self._stream_norm(pre + "ffn_norm.weight"))
            self.stream_slots = ops.gemv_residual(s["x"], squares, s["ffn"],
                                                  self.weight(pre + "feed_forward.w2.weight"))

    def _logits(self) -> None:
        ops.gemv_logits(self.step["logits"], self.step["x"], self.weight(self.layout.output()),
                        self._stream_norm("norm.weight"))

    def _sample(self, sampling) -> None:
        """Draw the next ids into self.tokens (the RNG counter: the position of the last fed token),
        write them to the history and advance the position."""
        ops.sample_tokens(self.tokens, self.step["logits"], sampling.temperature, sampling.top_k, sampling.top_p,
                          sampling.seed, self.position_d)
        ops.advance(self.history, self.position_d, self.tokens)

    def _prefill(self, tokens: np.ndarray) -> None:
        """tokens (B, n) at positions self.position.. through every layer, in chunks: their k and v go
        to the caches, and the stream of the last position to the step's x (its sums of squares to the
        scratch, for the final RMSNorm); position_d is left at the last chunk's first position."""
        tokens = np.asarray(tokens)
        for start in range(0, tokens.shape[1], self.chunk):
            self._prefill_chunk(tokens[:, start:start + self.chunk], self.position + start)

    def _prefill_chunk(self, tokens: np.ndarray, p0: int) -> None:
        """A chunk of n positions from p0 through the block, its activations as in training (one norm buffer
        serving both norms of a layer, the layer's x and h reused by the next)."""
        c, B = self.config, self.batch
        n = tokens.shape[1]
        N, H, KV, D, C, F = B * n, c.n_heads, c.n_kv_heads, c.head_dim, c.dim, c.ffn_hidden_dim
        buffers = self.prefill_buffers
        shapes = {"tokens": (N,), "x": (N, C), "ln1": (N, C), "rstd1": (N,), "qkv": (B, n, (H + 2 * KV) * D),
                  "att": (B, n, H * D), "lse": (B, H, n), "h": (N, C), "branch": (N, C), "gate_up": (N, 2 * F),
                  "ffn": (N, F)}
        a = {name: buffers[name].prefix(*shape) for name, shape in shapes.items()}
        a["ln2"], a["rstd2"] = a["ln1"], a["rstd1"]
        a["tokens"].upload(tokens.astype(np.int32).ravel())
        self.position_d.upload(np.array([p0], np.int32))
        self.chunk_start = p0
        rope = (self.rope_cos.view(p0 * (D // 2), (self.max_len - p0, D // 2)),
                self.rope_sin.view(p0 * (D // 2), (self.max_len - p0, D // 2)), n, (H + KV) * D)
        ops.embedding_forward_bf16(a["x"], a["tokens"], self.weight("tok_embeddings.weight"))
        for i in range(c.n_layers):
            self.block.attention_norm(i, a, a["h"], a["branch"])
            self.block.forward(i, a, a, N, rope)
        ops.last_residual(self.step["x"], self.scratch.squares.prefix(B), a["h"].reshape(B, n, C),
                          a["branch"].reshape(B, n, C))
        self.stream_slots = 1

    def _attention(self, i: int, a: dict) -> None:
        """The block's attention in a prefill chunk: its k, v into layer i's cache, then flash attention when
        the chunk starts the sequence, else its queries over the cache."""
        c = self.config
        ops.cache_write(self.k_cache[i], self.v_cache[i], a["qkv"], c.n_heads, self.position_d)
        if self.chunk_start == 0 and c.head_dim in HEAD_DIMS:
            self.block.flash_attention(i, a)
        else:
            ops.decode_attention(a["att"], a["qkv"], self.k_cache[i], self.v_cache[i], self.position_d, self.scratch)

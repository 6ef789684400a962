"""Generation on the GPU with a KV cache: the decoder interface of llama/generate.py on our kernels.

The weights are the fp32 master weights in a model's flat parameter buffer (GPUModelFP32.params, or
any device array in the llama/params.py layout), read in place. Each forward step runs the
training kernels of llama/ops/fp32.py (embedding, RMSNorm, matmuls, SwiGLU, residual) on the new
positions only, and kernels/decode.cu (llama/ops/decode.py) for RoPE at the absolute positions with the cache write and
for attention over the cache. The caches, (B, KV, max_len, D) per layer and for k and v, are bf16
(the plan's decode_cache_dtype) or fp32. Prefill is the same step over the prompt, in chunks of `chunk`
positions; decode is a step of one position.
"""

from __future__ import annotations

import numpy as np

from .. import ops
from ..config import LlamaConfig
from ..cuda import DeviceArray, empty, to_device, zeros
from ..params import ParameterLayout
from .base import rope_cos_sin


class GPUDecoder:
    """The decoder interface of llama/generate.py with our kernels; see the module docstring."""

    def __init__(self, config: LlamaConfig, params: DeviceArray, cache_dtype, batch: int = 1,
                 max_len: int | None = None, chunk: int = 256):
        """cache_dtype: the KV caches' (llama.cuda.BF16, the plan's choice, or np.float32)."""
        self.config, self.batch = config, batch
        self.max_len = min(max_len or config.max_seq_len, config.max_seq_len)
        self.layout = ParameterLayout(config)
        if not isinstance(params, DeviceArray) or params.dtype != np.float32 or params.size != self.layout.size:
            raise ValueError(f"params must be a float32 device array of {self.layout.size} values")
        self.params = params
        self.chunk = min(chunk, self.max_len)
        c, B = config, batch
        cache = (B, c.n_kv_heads, self.max_len, c.head_dim)
        self.k_cache = [zeros(cache, cache_dtype) for _ in range(c.n_layers)]
        self.v_cache = [zeros(cache, cache_dtype) for _ in range(c.n_layers)]
        cos, sin = rope_cos_sin(config, self.max_len)
        self.rope_cos, self.rope_sin = to_device(cos.astype(np.float32)), to_device(sin.astype(np.float32))
        self.buffers = {name: empty(shape) for name, shape in self._shapes(self.chunk).items()}
        self.tokens = empty(B * self.chunk, np.int32)
        self.position = 0

    def _shapes(self, n: int) -> dict:
        """Activation shapes of a step of n positions per sequence (allocated for n = chunk; a shorter
        step uses a prefix of each buffer)."""
        c, B = self.config, self.batch
        N, H, KV, D, F = B * n, c.n_heads, c.n_kv_heads, c.head_dim, c.ffn_hidden_dim
        return {"x": (N, c.dim), "ln": (N, c.dim), "rstd": (N,), "qkv": (N, (H + 2 * KV) * D), "q": (B, H, n, D),
                "att": (N, H * D), "h": (N, c.dim), "branch": (N, c.dim), "gate_up": (N, 2 * F), "ffn": (N, F),
                "last": (B, c.dim), "lnf": (B, c.dim), "rstdf": (B,), "logits": (B, c.vocab_size)}

    def reset(self) -> None:
        self.position = 0

    def _matrix(self, tensor) -> DeviceArray:
        return self.params.view(tensor.offset, tensor.shape)

    def _param(self, name: str) -> DeviceArray:
        return self._matrix(self.layout.tensors[name])

    def forward(self, tokens: np.ndarray) -> np.ndarray:
        tokens = np.asarray(tokens)
        B, n = tokens.shape
        if B != self.batch or n == 0 or self.position + n > self.max_len:
            raise ValueError(f"tokens {tokens.shape} do not fit: batch {self.batch}, {self.position} of "
                             f"{self.max_len} positions used")
        if tokens.min() < 0 or tokens.max() >= self.config.vocab_size:
            raise ValueError(f"tokens hold ids outside [0, {self.config.vocab_size})")
        for start in range(0, n, self.chunk):
            self._step(tokens[:, start:start + self.chunk])
        s, c = self.buffers, self.config
        ops.rmsnorm_forward(s["lnf"], s["rstdf"], s["last"], self._param("norm.weight"), c.norm_eps)
        ops.matmul_forward(s["logits"], s["lnf"], self._matrix(self.layout.output()))
        return s["logits"].download()

    def _step(self, tokens: np.ndarray) -> None:
        """n <= chunk new positions through every layer; leaves their last hidden state in 'last'."""
        c, L, B, p0 = self.config, self.layout, self.batch, self.position
        n = tokens.shape[1]
        N, H, D = B * n, c.n_heads, c.head_dim
        s = {name: self.buffers[name].prefix(*shape) for name, shape in self._shapes(n).items()}
        tokens_d = self.tokens.prefix(N)
        tokens_d.upload(tokens.astype(np.int32).ravel())
        x = s["x"]
        ops.embedding_forward(x, tokens_d, self._param("tok_embeddings.weight"))
        for i in range(c.n_layers):
            pre = f"layers.{i}."
            ops.rmsnorm_forward(s["ln"], s["rstd"], x, self._param(pre + "attention_norm.weight"), c.norm_eps)
            ops.matmul_forward(s["qkv"], s["ln"], self._matrix(L.wqkv(i)))
            ops.rope_kv_write(s["q"], self.k_cache[i], self.v_cache[i], s["qkv"].reshape(B, n, -1), self.rope_cos,
                          self.rope_sin, p0)
            ops.decode_attention(s["att"].reshape(B, n, H * D), s["q"], self.k_cache[i], self.v_cache[i], p0)
            ops.matmul_forward(s["h"], s["att"], self._param(pre + "attention.wo.weight"))
            ops.residual_forward(s["h"], x, s["h"])
            ops.rmsnorm_forward(s["ln"], s["rstd"], s["h"], self._param(pre + "ffn_norm.weight"), c.norm_eps)
            ops.matmul_forward(s["gate_up"], s["ln"], self._matrix(L.w13(i)))
            ops.swiglu_forward(s["ffn"], s["gate_up"])
            ops.matmul_forward(s["branch"], s["ffn"], self._param(pre + "feed_forward.w2.weight"))
            ops.residual_forward(x, s["h"], s["branch"])
        ops.last_positions(s["last"], x.reshape(B, n, c.dim))
        self.position += n
